"""The CUDA backend on a real GPU: invariance, counters, budget and OOM errors. Skips without a GPU."""

from __future__ import annotations

import itertools

import pytest
import torch

from kestrel_core.config import KestrelConfig
from kestrel_core.engine.run import Model
from kestrel_core.errors import BudgetError
from kestrel_core.tools.presets import preset_config, write_checkpoint

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GEN = dict(max_new_tokens=6, stop_at_eos=False)
PROMPT = [3, 14, 15, 92, 65]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_checkpoint(preset_config("tiny"), tmp_path_factory.mktemp("cuda") / "tiny", seed=1)
    with Model(path) as m:
        yield m


def run(model, **flags):
    cfg = KestrelConfig().override(backend__name="cuda", **flags)
    with model.open(cfg) as r:
        return r.generate(prompt_ids=PROMPT, **GEN)


def test_ids_identical_with_prefetch_across_keep_and_policy(model):
    """test_invariance.py covers keep x policy x allocator per backend; this adds the side stream."""
    L = model.n_layers
    ref = run(model, residency__keep="off").token_ids
    keeps = sorted({1, 2, 4, L // 2, L - 1, L})
    for keep, policy, prefetch in itertools.product(keeps, ["asymmetric", "future_evicting", "pinned_set"], [1, 2]):
        got = run(model, residency__keep=keep, residency__policy=policy, backend__prefetch=prefetch).token_ids
        assert got == ref, (keep, policy, prefetch)
    for keep in (1, L // 2):
        assert run(model, residency__keep=keep, residency__allocator="free", backend__prefetch=1).token_ids == ref


def test_uploads_per_token_follow_the_policy(model):
    L = model.n_layers
    for keep in (1, 2, L - 1):
        r = run(model, residency__keep=keep, residency__policy="asymmetric")
        assert [p["layer_uploads"] for p in r.per_token] == [L - keep] * len(r.per_token)
        r = run(model, residency__keep=keep, residency__policy="future_evicting")
        assert [p["layer_uploads"] for p in r.per_token] == [L] * len(r.per_token)


def test_four_device_entries_per_layer(model):
    r = run(model, residency__keep=1, residency__policy="future_evicting")
    assert r.counters["uploads"] == 4 * r.counters["layer_uploads"]


def test_pool_allocates_nothing_after_warmup_and_free_every_token(model):
    pool = run(model, residency__keep=1, residency__allocator="pool", backend__prefetch=1)
    assert [p["allocations"] for p in pool.per_token[1:]] == [0] * (len(pool.per_token) - 1)
    assert pool.counters["pool_hits"] > 0
    free = run(model, residency__keep=1, residency__allocator="free")
    L = model.n_layers
    assert all(p["allocations"] == 4 * (L - 1) for p in free.per_token)
    assert all(p["frees"] == 4 * (L - 1) for p in free.per_token)
    assert free.memory["raw_peak_bytes"] > 0


def test_budget_below_one_layer_is_rejected_with_the_number_needed(model, monkeypatch):
    import backends.cuda.backend as backend_mod

    monkeypatch.setattr(backend_mod, "resolve_budget", lambda mb, free: (10_000, "test"))
    with pytest.raises(BudgetError) as exc:
        run(model, residency__keep=1)
    assert "below one layer's working set" in str(exc.value) and "need at least" in str(exc.value)


def test_window_off_over_budget_suggests_a_keep(model, monkeypatch):
    import backends.cuda.backend as backend_mod

    # keep=1 peaks at 2 layers + globals (229 KB) and fits; all six layers (557 KB) do not.
    monkeypatch.setattr(backend_mod, "resolve_budget", lambda mb, free: (250_000, "test"))
    with pytest.raises(BudgetError) as exc:
        run(model, residency__keep="off")
    assert "use keep = auto, or keep <= 1 (2 layers resident at most)" in str(exc.value)
    run(model, residency__keep=1)  # the same budget holds a keep=1 window


def test_real_out_of_memory_becomes_a_budget_error(model):
    """Cap the caching allocator just above what is in use: the next real allocation fails with CUDA OOM."""
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    in_use = torch.cuda.memory_reserved()
    torch.cuda.set_per_process_memory_fraction((in_use + 16 * 1024) / total)
    try:
        with pytest.raises(BudgetError) as exc:
            run(model, residency__keep="off", residency__budget_mb=1024)
        assert "CUDA out of memory" in str(exc.value) and "budget" in str(exc.value)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
