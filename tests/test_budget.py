"""The weight-cache budget rule (pure arithmetic: runs without a GPU)."""

import pytest

import backends.cuda.backend
from backends.cuda import budget
from backends.cuda.budget import RESERVE, fit_room, resolve_budget
from kestrel_core.errors import ConfigError

GiB, MiB = 2**30, 2**20


def test_the_cuda_backend_uses_the_one_rule():
    assert backends.cuda.backend.resolve_budget is budget.resolve_budget  # one rule, not a copy
    assert not hasattr(budget, "fit_budget") and not hasattr(budget, "default_budget")  # no second default


def test_default_is_free_memory_less_the_reserve():
    assert RESERVE == 2 * GiB
    assert fit_room(10 * GiB) == 8 * GiB
    assert fit_room(141 * GiB) == 139 * GiB  # no cap: a resident model the card holds is not refused
    assert fit_room(GiB) == 0  # under the reserve: nothing, and a run is refused naming the budget it needs


def test_env_beats_config_beats_default(monkeypatch):
    monkeypatch.delenv("KESTREL_WCACHE_MB", raising=False)
    assert resolve_budget(0, 10 * GiB) == (8 * GiB, "default (free device memory less a 2 GiB reserve)")
    assert resolve_budget(300, 10 * GiB) == (300 * MiB, "config")
    monkeypatch.setenv("KESTREL_WCACHE_MB", "700")
    assert resolve_budget(300, 10 * GiB) == (700 * MiB, "KESTREL_WCACHE_MB")


def test_keep_auto_starts_from_the_budget_a_given_keep_gets(tiny_ckpt, monkeypatch):
    """The fit (keep = auto) and a given keep read the one entry point: at the same free memory, the same budget."""
    from kestrel_core import load
    from kestrel_core.config import KestrelConfig
    from kestrel_core.engine.backend import BackendContext
    from kestrel_core.engine.plan import Counters
    import torch

    monkeypatch.delenv("KESTREL_WCACHE_MB", raising=False)
    with load(tiny_ckpt) as model:
        cfg = KestrelConfig()
        ctx = BackendContext(model.checkpoint, model.config, cfg.backend, cfg.residency, Counters(), model.n_layers,
                             model.host, model.units, model.quant)
        facts = backends.cuda.backend.CudaBackend.fit_facts_at(ctx, torch.bfloat16, torch.device("cuda", 0), 10 * GiB)
    assert (facts.budget, facts.source) == resolve_budget(0, 10 * GiB) and facts.room == fit_room(10 * GiB)


@pytest.mark.parametrize("value", ["abc", "0", "-5"])
def test_bad_env_is_an_error(monkeypatch, value):
    monkeypatch.setenv("KESTREL_WCACHE_MB", value)
    with pytest.raises(ConfigError, match="KESTREL_WCACHE_MB"):
        resolve_budget(0, GiB)


def test_negative_config_budget_is_an_error(monkeypatch):
    monkeypatch.delenv("KESTREL_WCACHE_MB", raising=False)
    with pytest.raises(ConfigError, match="budget_mb"):
        resolve_budget(-1, GiB)
