"""The host tier on the cuda backend: a ring of pinned slots where the host budget cannot hold every unit.

Greedy ids are identical to the all-pinned path for every policy, keep, prefetch and allocator,
on dense and MoE checkpoints, from the page cache and from disk; pinned host bytes stay within
the budget; a budget below one unit plus the prefetch depth is refused up front, with the bytes
it needs; the environment beats the config.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kestrel_core import load
from kestrel_core.errors import BudgetError, ConfigError
from kestrel_core.tools.presets import preset_config, write_checkpoint
from kestrel_core.tools.quantize import quantize_checkpoint
from backends.cuda.host.diskread import ALIGN, round_up
from backends.cuda.host.pagecache import drop_checkpoint
from backends.cuda.host.pinned_arena import arena_bytes, release_cached_pinned
from backends.cuda.host.tier import HOST_ENV

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPT = [5, 17, 42, 99, 3]
MiB = 2**20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_checkpoint(preset_config("tiny"), tmp_path_factory.mktemp("host-tier") / "tiny", seed=5)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return write_checkpoint(preset_config("tiny-moe"), tmp_path_factory.mktemp("host-tier") / "tiny-moe", seed=3)


def slot(model_dir) -> int:
    """The ring's slot: the largest unit's bfloat16 entries, each on a page."""
    with load(model_dir) as model, model.open(backend="cuda", keep=1) as run:
        units = run.backend.units.units.values()
        return max(sum(round_up(e.geometry.nbytes) for e in u.entries) for u in units)


def generate(model_dir, tokens=10, drop=False, **settings):
    settings.setdefault("backend", "cuda")
    with load(model_dir) as model, model.open(**settings) as run:
        if drop:
            drop_checkpoint(run.backend.ckpt, sync=True)
        r = run.generate(prompt_ids=PROMPT, max_new_tokens=tokens, stop_at_eos=False)
        return r, run.backend.host_budget


def test_ids_identical_to_all_pinned_across_policy_keep_prefetch_allocator(tiny, monkeypatch):
    monkeypatch.delenv(HOST_ENV, raising=False)
    ref, tier = generate(tiny, keep="off")
    assert tier.mode == "all" and "host_ring_hot_bytes" not in ref.memory
    size = slot(tiny)
    for slots, (policy, keep), prefetch, allocator in itertools.product(
            (2, 3, 5), (("asymmetric", 1), ("asymmetric", 3), ("future_evicting", 2)), (0, 1), ("pool", "free")):
        budget = (slots * size + ALIGN // 2) / MiB  # room for `slots` slots and not one more
        r, tier = generate(tiny, keep=keep, policy=policy, prefetch=prefetch, allocator=allocator, host_budget_mb=budget)
        where = (slots, policy, keep, prefetch, allocator)
        assert tier.mode == "ring", where
        assert r.token_ids == ref.token_ids, where
        assert 0 < r.memory["host_pinned_bytes"] == slots * size <= tier.bytes, where
        assert r.memory["host_ring_hot_bytes"] + r.memory["host_ring_cold_bytes"] >= r.counters["bytes_uploaded"], where
        assert r.steps["eager"] == len(r.per_token), where  # a ring's step is not captured


def entry_sizes(model_dir) -> list[int]:
    with load(model_dir) as model, model.open(backend="cuda", keep=1) as run:
        return [e.geometry.nbytes for u in run.backend.units.units.values() for e in u.entries]


def test_all_pinned_counts_the_arenas_blocks_and_is_captured(tiny, monkeypatch):
    monkeypatch.delenv(HOST_ENV, raising=False)
    with load(tiny) as model, model.open(backend="cuda", keep=1) as run:
        host = run.backend._host
        assert run.backend.host_budget.mode == "all"
        assert all(t.is_pinned() and (t.data_ptr() - t.untyped_storage().data_ptr()) % ALIGN == 0 for t in host.values())
        blocks = {t.untyped_storage().data_ptr() for t in host.values()}
        assert len(blocks) < len(host)  # entries share the arena's blocks, not one block each
        r = run.generate(prompt_ids=PROMPT, max_new_tokens=10, stop_at_eos=False)
    pinned = arena_bytes(entry_sizes(tiny))
    assert r.memory["host_pinned_bytes"] == pinned
    assert r.steps["captured"] + r.steps["replayed"] > 0  # torch's pinned blocks: the step is captured


def test_torch_counts_the_arenas_blocks_and_takes_them_back_when_a_ring_replaces_the_staging(tiny, monkeypatch):
    monkeypatch.delenv(HOST_ENV, raising=False)

    def torch_pinned() -> int:  # every pinned block torch's allocator owns, in use or cached, as it rounded them
        return torch.cuda.memory.host_memory_stats().get("allocated_bytes.current", 0)

    assert release_cached_pinned()
    bare = sum(round_up(n) for n in entry_sizes(tiny))
    with load(tiny) as model:
        before = torch_pinned()
        with model.open(backend="cuda", keep=1) as run:
            assert run.backend.host_budget.mode == "all"
            pinned = run.backend.host_pinned_bytes
            grown = torch_pinned() - before
        assert pinned <= grown < pinned + MiB  # what torch locked is what the counter says
        with model.open(backend="cuda", keep=1, host_budget_mb=bare / MiB) as run:
            assert run.backend.host_budget.mode == "ring"
            assert torch_pinned() - before < MiB  # the staging's blocks were handed back, not kept cached


def test_a_budget_that_holds_the_entries_but_not_the_arenas_blocks_takes_the_ring(tiny, monkeypatch):
    monkeypatch.delenv(HOST_ENV, raising=False)
    sizes = entry_sizes(tiny)
    bare = sum(round_up(n) for n in sizes)
    assert bare < arena_bytes(sizes)  # the tiny model's blocks round up past its entries
    ref, _ = generate(tiny, keep=1)
    r, tier = generate(tiny, keep=1, host_budget_mb=bare / MiB)
    assert tier.mode == "ring" and r.memory["host_pinned_bytes"] <= tier.bytes
    assert r.token_ids == ref.token_ids


def test_pages_dropped_come_from_disk_with_the_same_ids(tiny, monkeypatch):
    monkeypatch.delenv(HOST_ENV, raising=False)
    ref, _ = generate(tiny, keep=1, prefetch=1)
    r, tier = generate(tiny, keep=1, prefetch=1, host_budget_mb=3 * slot(tiny) / MiB, drop=True)
    assert tier.mode == "ring" and r.token_ids == ref.token_ids
    assert r.memory["host_ring_cold_bytes"] > 0 and r.memory["host_ring_disk_read_bytes"] >= r.memory["host_ring_cold_bytes"]


def test_moe_through_the_ring(tiny_moe, monkeypatch):
    monkeypatch.delenv(HOST_ENV, raising=False)
    size = slot(tiny_moe)
    expert = 3 * 32 * 64 * 2
    for settings in (dict(keep="off", expert_policy="expert_lru", expert_budget_mb=4 * expert / MiB, expert_prefetch=True),
                     dict(keep=1, prefetch=1), dict(keep=2, expert_fetch="layer")):
        ref, _ = generate(tiny_moe, **settings)
        r, tier = generate(tiny_moe, host_budget_mb=3 * size / MiB, **settings)
        assert tier.mode == "ring" and r.token_ids == ref.token_ids, settings


def test_a_budget_below_one_unit_and_the_prefetch_is_refused(tiny, monkeypatch):
    monkeypatch.delenv(HOST_ENV, raising=False)
    size = slot(tiny)
    with pytest.raises(BudgetError, match=r"host budget .* below one streamed unit plus the prefetch depth: need at least"):
        generate(tiny, keep=1, prefetch=2, host_budget_mb=2.5 * size / MiB)
    r, _ = generate(tiny, keep=1, prefetch=2, host_budget_mb=3 * size / MiB)  # three slots: the least it runs with
    assert r.memory["host_pinned_bytes"] == 3 * size


def test_the_environment_beats_the_config(tiny, monkeypatch):
    monkeypatch.setenv(HOST_ENV, "4096")
    r, tier = generate(tiny, keep=1, host_budget_mb=0.01)
    assert tier.mode == "all" and tier.source == HOST_ENV


def test_a_q8_checkpoint_over_the_budget_is_refused(tiny, tmp_path, monkeypatch):
    monkeypatch.delenv(HOST_ENV, raising=False)
    q = tmp_path / "tiny-q8"
    quantize_checkpoint(tiny, q, 32)
    with pytest.raises(ConfigError, match="the host ring stages float checkpoints"):
        generate(q, keep=1, host_budget_mb=0.05)


def test_a_second_run_counts_the_staging_it_reuses_as_available(tiny, monkeypatch):
    """A sweep's later run finds the host's available memory lower by the staging an earlier run pinned; that
    staging is this run's to reuse (or free), so it counts as available and the run is not refused for it."""
    monkeypatch.delenv(HOST_ENV, raising=False)
    import backends.cuda.backend as cuda_backend

    staged = arena_bytes(entry_sizes(tiny))
    held = {"bytes": 0}  # what the model's staging pins now, as the host would see it
    total = staged + staged // 2  # the host: room for the staging once, not twice
    monkeypatch.setattr(cuda_backend, "meminfo", lambda: {"MemAvailable": total - held["bytes"]})
    budget_mb = (staged + MiB) / MiB  # explicit: everything fits in it
    with load(tiny) as model:
        with model.open(backend="cuda", keep=1, host_budget_mb=budget_mb) as run:
            assert run.backend.host_budget.mode == "all"
            held["bytes"] = run.backend.host_pinned_bytes
            first = run.generate(prompt_ids=PROMPT, max_new_tokens=6, stop_at_eos=False).token_ids
        assert held["bytes"] == staged
        with model.open(backend="cuda", keep=1, host_budget_mb=budget_mb) as run:  # reuses the staging
            assert run.backend.host_budget.mode == "all"
            assert run.generate(prompt_ids=PROMPT, max_new_tokens=6, stop_at_eos=False).token_ids == first
        held["bytes"] = 0
    with load(tiny) as model:  # a fresh model on a host short of room for its staging is refused up front
        monkeypatch.setattr(cuda_backend, "meminfo", lambda: {"MemAvailable": staged // 2})
        with pytest.raises(BudgetError, match="would page-lock .* more than the .* MiB of host memory available"):
            model.open(backend="cuda", keep=1, host_budget_mb=budget_mb)
