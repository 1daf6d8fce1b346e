"""A KV cache on a device holds the positions its sequences reach, not every slot x max_seq: it opens at the fewest a
bounded step reads and grows, as the sequences reach further, to the next key bound, its written keys and values
copied over and every captured step captured again (``slots.Slots.reach``). In host memory the cache holds every
position from the start (zero pages: its memory follows the writes by itself), so here cpu_ref is made to grow as a
device does: a grown cache that lost a key, kept a stale graph or misplaced a slot would change the ids or logits."""

from __future__ import annotations

import pytest
import torch

from kestrel_core import load
from kestrel_core.engine import model as model_math
from kestrel_core.engine import slots as slots_mod
from kestrel_core.engine.kvcache import kv_bytes
from kestrel_core.errors import BudgetError
from test_graphs import replaying  # noqa: F401  (the fixture: cpu_ref whose steps are captured and replayed)
from test_key_bound import batch  # the same batch job, over this file's prompts

PROMPTS = [[5, 17, 42, 99, 3], [1, 2, 3], [7, 8, 9, 10, 11, 12, 13, 14, 15] * 3, [100, 200]]


def growing(monkeypatch, floor: int) -> list[int]:
    """Every KV cache opens at the key bound of one position with ``BOUND_FLOOR`` ``floor`` and grows from there, as
    on a device; the capacities each batch's cache held, in order."""
    held: list[int] = []
    real = slots_mod.Slots.reach

    def reach(self, need):
        real(self, need)
        if not held or held[-1] != self.capacity:
            held.append(self.capacity)

    monkeypatch.setattr(model_math, "BOUND_FLOOR", floor)
    monkeypatch.setattr(slots_mod, "first_capacity", lambda max_seq, device: model_math.key_bound(1, max_seq))
    monkeypatch.setattr(slots_mod.Slots, "reach", reach)
    return held


@pytest.mark.parametrize("steps", ["cpu_ref", "replaying"])
def test_a_cache_that_grows_gives_the_ids_and_logits_of_one_that_held_every_position(tiny_ckpt, replaying,
                                                                                     monkeypatch, steps):
    """Four sequences, two slots, prompts chunked: a long prompt joins while a short sequence decodes, so the cache
    grows under a decode row whose bound did not move (its captured step must be captured again)."""
    with load(tiny_ckpt) as model, model.open(backend=steps, dtype="float32") as run:
        want = batch(run, PROMPTS, max_batch=2, prefill_chunk=4)
        with monkeypatch.context() as m:
            held = growing(m, 4)
            got = batch(run, PROMPTS, max_batch=2, prefill_chunk=4)
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    reach = max(len(p) + 9 + 7 * i for i, p in enumerate(PROMPTS))  # the longest sequence's last position + 1
    max_seq = reach  # generate_batch opens the cache for the longest request
    assert held[0] == 4 and held[-1] == model_math.key_bound(reach, max_seq)
    assert len(held) >= 4 and all(b > a for a, b in zip(held, held[1:]))  # 4, 8, 16, 32, ...: a few times a run


def late_joiner(run, modes: list | None = None) -> list[list[int]]:
    """A decodes alone (its steps captured, then replayed at its bound, 16); after 7 steps C joins with a 17-token
    prompt in two chunks and ends at its prefill, growing the cache past A's bound: A goes on at the bound it had."""
    from kestrel_core.engine.batch import Batch

    a = run.request(prompt_ids=PROMPTS[0], max_new_tokens=24, stop_at_eos=False)
    c = run.request(prompt_ids=list(range(1, 18)), max_new_tokens=1, stop_at_eos=False)
    with Batch(run.runner, 2, 5 + 24, prefill_chunk=16) as b:
        seqs, steps = [b.add(a)], 0
        while b.busy:
            if steps == 7:
                seqs.append(b.add(c))
            b.step()
            steps += 1
    if modes is not None:
        modes += seqs[0].result.step_modes
    return [q.result.token_ids for q in seqs]


def test_a_grown_cache_drops_its_captured_steps(tiny_ckpt, replaying, monkeypatch):
    """Kept across a growth, a captured step reads and writes the old buffers: A's step at its unchanged bound is
    captured again after C grew the cache (and, with the growth's drop undone, replays the old graph and its ids
    change)."""
    with load(tiny_ckpt) as model, model.open(backend="replaying", dtype="float32") as run:
        want = late_joiner(run)
        with monkeypatch.context() as m:
            held, modes = growing(m, 4), []
            got = late_joiner(run, modes)
        with monkeypatch.context() as m:
            growing(m, 4)
            m.setattr(slots_mod.Slots, "drop_graphs", lambda self: None)
            stale = late_joiner(run)
    assert got == want and held == [8, 16, 29]
    assert stale[0] != want[0]
    assert modes.count("captured") >= 3, modes  # bound 8, bound 16, bound 16 again after C grew the cache


def test_a_cache_that_cannot_grow_names_the_callers_fix(tiny_ckpt, monkeypatch):
    real = slots_mod.allocate_cache

    def allocate(cfg, positions, dtype, device, slots=1, spare=0):
        if positions > 8:
            raise BudgetError(f"the KV cache for {slots} x {positions:,} positions needs 1 MiB, more than cpu can give")
        return real(cfg, positions, dtype, device, slots, spare)

    with load(tiny_ckpt) as model, model.open(dtype="float32") as run:
        growing(monkeypatch, 4)
        monkeypatch.setattr(slots_mod, "allocate_cache", allocate)
        with pytest.raises(BudgetError) as err:
            run.generate(prompt_ids=PROMPTS[0], max_new_tokens=12, stop_at_eos=False)
    line = str(err.value)
    assert "\n" not in line and "1 x 16 positions" in line and "grows as its sequences reach further" in line
    assert "--max-new-tokens" in line  # a solo run's fix


def test_the_cache_opens_whole_in_host_memory_and_at_the_floor_on_a_device():
    assert slots_mod.first_capacity(4096, torch.device("cpu")) == 4096
    assert slots_mod.first_capacity(4096, torch.device("cuda")) == model_math.BOUND_FLOOR
    assert slots_mod.first_capacity(100, torch.device("cuda")) == 100


@pytest.mark.cuda
def test_a_cuda_cache_opens_at_the_floor_and_grows_under_captured_steps(tiny_ckpt):
    """On cuda a batch opened for 8 x 4,096 positions takes the KV memory of 8 x 256; a sequence that runs past 256
    positions grows it (its captured steps captured again) and keeps cpu_ref's ids."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from kestrel_core.engine.batch import Batch

    held = []
    real = slots_mod.Slots.reach

    def reach(self, need):
        real(self, need)
        if not held or held[-1] != self.capacity:
            held.append(self.capacity)

    with load(tiny_ckpt) as model, model.open(backend="cuda", dtype="float32", keep="off") as run:
        cfg = model.config
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with Batch(run.runner, 8, 4096) as opened:
            taken = torch.cuda.memory_allocated() - before
            assert opened.dev.capacity == 256 and opened.dev.cache[0].k.shape[1] == 256 + 1  # and the park
        assert kv_bytes(cfg, 256, torch.float32, 8) <= taken < kv_bytes(cfg, 4096, torch.float32, 8) / 4
        with pytest.MonkeyPatch.context() as m:
            m.setattr(slots_mod.Slots, "reach", reach)
            got = run.generate(prompt_ids=PROMPTS[0], max_new_tokens=300, stop_at_eos=False)
    with load(tiny_ckpt) as model, model.open(dtype="float32") as run:
        want = run.generate(prompt_ids=PROMPTS[0], max_new_tokens=300, stop_at_eos=False)
    assert held == [256, 305]
    assert got.token_ids == want.token_ids and got.steps["captured"] >= 2, got.steps


def test_the_cache_bytes_follow_its_growth(tiny_ckpt, monkeypatch):
    """What the server's /metrics reports as the KV cache's bytes (``Slots.cache_bytes``): every slot's positions and
    the park row, keys and values, as the cache grows."""
    with load(tiny_ckpt) as model, model.open(backend="cpu_ref", dtype="float32") as run:
        growing(monkeypatch, 4)
        s = run.runner.open_slots(3, 64)
        try:
            sizes = []
            for need in (1, 5, 9, 40):
                s.reach(need)
                sizes.append((s.capacity, s.cache_bytes))
        finally:
            s.close()
        cfg = run.runner.cfg
    assert sizes == [(c, kv_bytes(cfg, c + 1, torch.float32, 3)) for c in (4, 8, 16, 64)]
