"""The ``pool`` allocator: exact-geometry reuse, a slot limit, no allocation after warm-up; ``free`` for contrast."""

from __future__ import annotations

import itertools

import attrs
import pytest

from kestrel_core.engine.plan import Counters, Entry
from kestrel_core.formats.units import Geometry
from plugins.allocators import Free, Pool

BASE = Geometry(shape=(64, 160), dtype="torch.float32", nbytes=64 * 160 * 4, device="cpu", layout=())


class FakeFactory:
    """Stands in for a backend: numbered buffers, and a record of real frees."""

    def __init__(self):
        self.made: list[int] = []
        self.freed: list[int] = []
        self._ids = itertools.count()

    def new_buffer(self, geometry, raw=False):
        self.raw = raw
        buf = ("buffer", next(self._ids), geometry)
        self.made.append(buf)
        return buf

    def free_buffer(self, buffer):
        self.freed.append(buffer)


def entry(factory, geometry=BASE, layer=0, name="q"):
    return Entry(layer, name, geometry, factory)


def test_same_geometry_is_reused_from_another_layer():
    f, c = FakeFactory(), Counters()
    pool = Pool(c, slots=4)
    buf = pool.alloc(entry=entry(f, layer=0))
    pool.release(entry=entry(f, layer=0), buffer=buf)
    assert pool.alloc(entry=entry(f, layer=3, name="q")) is buf
    assert (c.allocations, c.pool_hits, len(f.made)) == (1, 1, 1)


@pytest.mark.parametrize(
    "change",
    [dict(shape=(160, 64)), dict(dtype="torch.bfloat16"), dict(nbytes=BASE.nbytes + 64),
     dict(device="cuda:0"), dict(layout=(256, 3))],
    ids=["shape", "dtype", "nbytes", "device", "layout"],
)
def test_a_geometry_mismatch_never_reuses_a_buffer(change):
    f, c = FakeFactory(), Counters()
    pool = Pool(c, slots=8)
    other = attrs.evolve(BASE, **change)
    pooled = pool.alloc(entry=entry(f))
    pool.release(entry=entry(f), buffer=pooled)
    fresh = pool.alloc(entry=entry(f, other))
    assert fresh is not pooled and fresh[2] == other
    assert (c.allocations, c.pool_hits) == (2, 0)
    assert pool.alloc(entry=entry(f)) is pooled  # still waiting for its own geometry
    assert c.pool_hits == 1


def test_slot_limit_falls_back_to_real_frees():
    f, c = FakeFactory(), Counters()
    pool = Pool(c, slots=2)
    bufs = [pool.alloc(entry=entry(f, layer=i)) for i in range(5)]
    for i, b in enumerate(bufs):
        pool.release(entry=entry(f, layer=i), buffer=b)
    assert f.freed == bufs[2:] and c.frees == 3
    again = [pool.alloc(entry=entry(f)) for _ in range(3)]
    assert set(map(id, again[:2])) == set(map(id, bufs[:2])) and again[2] not in bufs
    pool.drain()
    assert c.frees == 3  # nothing was left in the pool: the two were taken again


def test_drain_frees_every_pooled_buffer():
    f, c = FakeFactory(), Counters()
    pool = Pool(c, slots=8)
    bufs = [pool.alloc(entry=entry(f, g)) for g in (BASE, attrs.evolve(BASE, layout=(1,)))]
    for b, g in zip(bufs, (BASE, attrs.evolve(BASE, layout=(1,)))):
        pool.release(entry=entry(f, g), buffer=b)
    assert f.freed == []
    pool.drain()
    assert sorted(f.freed) == sorted(bufs) and c.frees == 2


def test_free_allocator_is_always_real():
    f, c = FakeFactory(), Counters()
    free = Free(c)
    a = free.alloc(entry=entry(f))
    free.release(entry=entry(f), buffer=a)
    b = free.alloc(entry=entry(f))
    assert a is not b and f.freed == [a] and (c.allocations, c.frees, c.pool_hits) == (2, 1, 0)
    assert f.raw is True and not free.deterministic  # raw buffers: the synchronising free shows


def test_the_pool_hands_out_its_lowest_numbered_buffer_first():
    """Deterministic: the same requests get the same buffers, whatever order they came back in."""
    f, c = FakeFactory(), Counters()
    pool = Pool(c, slots=8)
    bufs = [pool.alloc(entry=entry(f, layer=i)) for i in range(3)]
    for order in ([2, 0, 1], [1, 2, 0], [0, 1, 2]):
        for i in order:
            pool.release(entry=entry(f, layer=i), buffer=bufs[i])
        assert [pool.alloc(entry=entry(f)) for _ in range(3)] == bufs, order
    assert pool.deterministic and c.allocations == 3


# --- in a real run ---------------------------------------------------------------------

@pytest.mark.parametrize("policy, keep", [("asymmetric", 1), ("asymmetric", 3), ("future_evicting", 2), ("pinned_set", 2)])
def test_pool_allocates_nothing_from_the_second_decoded_token_on(tiny_ckpt, run_model, backend, policy, keep):
    r, final = run_model(tiny_ckpt, backend, residency__policy=policy, residency__keep=keep, residency__allocator="pool",
                         generation__max_new_tokens=8)
    steady = r.per_token[1:]
    assert len(steady) == 6 and all(p["layer_uploads"] > 0 for p in steady)
    assert [p["allocations"] for p in steady] == [0] * 6
    assert all(p["pool_hits"] == p["uploads"] for p in steady)
    assert [p["frees"] for p in r.per_token] == [0] * 7


def test_free_allocates_and_frees_every_upload(tiny_ckpt, run_model, backend):
    r, _ = run_model(tiny_ckpt, backend, residency__keep=1, residency__allocator="free", generation__max_new_tokens=8)
    assert all(p["allocations"] == p["uploads"] > 0 for p in r.per_token)
    assert all(p["frees"] == p["evictions"] > 0 for p in r.per_token)
    assert r.counters["pool_hits"] == 0


def test_a_small_pool_falls_back_to_real_frees_in_a_run(tiny_ckpt, run_model, backend):
    big, _ = run_model(tiny_ckpt, backend, residency__keep=1, residency__pool_slots=128)
    small, _ = run_model(tiny_ckpt, backend, residency__keep=1, residency__pool_slots=2)
    assert sum(p["frees"] for p in big.per_token) == 0
    steady = small.per_token[1:]
    assert all(p["frees"] > 0 and p["allocations"] > 0 for p in steady)
    assert all(p["pool_hits"] + p["allocations"] == p["uploads"] for p in steady)
    assert all(p["pool_hits"] <= 2 * p["layer_uploads"] for p in steady)  # at most 2 wait per boundary
    assert small.token_ids == big.token_ids
