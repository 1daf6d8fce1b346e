"""The weight-cache budget rule (pure arithmetic: runs without a GPU)."""

import pytest

import backends.cuda.backend
from backends.cuda import budget
from backends.cuda.budget import CAP, FLOOR, default_budget, resolve_budget
from kestrel_core.errors import ConfigError

GiB, MiB = 2**30, 2**20


def test_the_cuda_backend_uses_the_core_rule():
    assert backends.cuda.backend.resolve_budget is budget.resolve_budget  # one rule, not a copy


def test_default_is_half_of_free_with_cap_and_floor():
    assert default_budget(10 * GiB) == 5 * GiB
    assert default_budget(141 * GiB) == CAP == 24 * GiB
    assert default_budget(100 * MiB) == FLOOR == 256 * MiB


def test_env_beats_config_beats_default(monkeypatch):
    monkeypatch.delenv("KESTREL_WCACHE_MB", raising=False)
    assert resolve_budget(0, 10 * GiB) == (5 * GiB, "default (half of free device memory, 256 MiB..24 GiB)")
    assert resolve_budget(300, 10 * GiB) == (300 * MiB, "config")
    monkeypatch.setenv("KESTREL_WCACHE_MB", "700")
    assert resolve_budget(300, 10 * GiB) == (700 * MiB, "KESTREL_WCACHE_MB")


@pytest.mark.parametrize("value", ["abc", "0", "-5"])
def test_bad_env_is_an_error(monkeypatch, value):
    monkeypatch.setenv("KESTREL_WCACHE_MB", value)
    with pytest.raises(ConfigError, match="KESTREL_WCACHE_MB"):
        resolve_budget(0, GiB)


def test_negative_config_budget_is_an_error(monkeypatch):
    monkeypatch.delenv("KESTREL_WCACHE_MB", raising=False)
    with pytest.raises(ConfigError, match="budget_mb"):
        resolve_budget(-1, GiB)
