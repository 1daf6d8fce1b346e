"""The device weight-cache budget rule: half of free memory, capped at 24 GiB, floor 256 MiB; overridable. For
``keep = "auto"`` (``fit_budget``): free memory less a reserve, the KV cache counted by the fit.

Pure arithmetic, shared by whatever sizes a device cache (the cuda backend) and whatever
reasons about one (a plugin): ``KESTREL_WCACHE_MB`` beats the config's ``budget_mb``, which
beats the default.
"""

from __future__ import annotations

from kestrel_core.engine.fit import given_budget

CAP = 24 * 2**30
FLOOR = 256 * 2**20
RESERVE = 2 * 2**30  # what keep = "auto" leaves beside the weights and the KV cache: activations, logits, workspaces


def default_budget(free_bytes: int) -> int:
    return max(FLOOR, min(CAP, free_bytes // 2))


def fit_room(free_bytes: int) -> int:
    """What keep = "auto" lets the weights and the KV cache share: free memory less ``RESERVE``."""
    return max(0, free_bytes - RESERVE)


def _resolved(config_mb: int, default: tuple[int, str]) -> tuple[int, str, bool]:
    """(budget bytes, where it came from, whether it is ``default``): KESTREL_WCACHE_MB beats the config, which beats
    the default (``fit.given_budget``, the rule cpu_ref reads too)."""
    given = given_budget(config_mb)
    return (*given, False) if given is not None else (*default, True)


def resolve_budget(config_mb: int, free_bytes: int) -> tuple[int, str]:
    """(budget bytes, where it came from), the default half of free memory (256 MiB..24 GiB)."""
    default = default_budget(free_bytes), "default (half of free device memory, 256 MiB..24 GiB)"
    return _resolved(config_mb, default)[:2]


def fit_budget(config_mb: int, free_bytes: int) -> tuple[int, str, bool]:
    """keep = "auto"'s (budget bytes, where it came from, whether it is the default): the default is ``fit_room``,
    the KV cache then cut from it by the fit."""
    default = fit_room(free_bytes), f"default (free device memory less a {RESERVE >> 30} GiB reserve)"
    return _resolved(config_mb, default)
