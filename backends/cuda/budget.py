"""The device weight-cache budget: one rule, for ``keep = "auto"`` and a given keep alike (``resolve_budget``).

KESTREL_WCACHE_MB beats the config's ``budget_mb`` (``--budget-mb``), which beats the default: free device memory less
``RESERVE``. ``keep = "auto"`` then cuts that budget to leave the KV cache it is opened for its room (``engine.fit``)
and hands the run's backend the budget it chose; a given keep is held to the budget as it is.

Why one default, free memory less a reserve (no longer half of free, 256 MiB..24 GiB, for a given keep): the budget
bounds what the weights may hold, and a keep given is refused only where its peak cannot fit beside the reserve; the
KV cache of a given keep is not known when the backend loads, and a real out-of-memory there is said as a BudgetError
naming the budget to lower. So a keep the fit would choose is never refused when given by hand.

Pure arithmetic, shared by whatever sizes a device cache (the cuda backend) and whatever reasons about one (a plugin).
"""

from __future__ import annotations

from kestrel_core.engine.fit import given_budget

RESERVE = 2 * 2**30  # what the weights leave free beside them: activations, logits, workspaces (and the KV cache's room)


def fit_room(free_bytes: int) -> int:
    """What the weights and the KV cache share: free memory less ``RESERVE``."""
    return max(0, free_bytes - RESERVE)


def resolve_budget(config_mb: int, free_bytes: int) -> tuple[int, str]:
    """(budget bytes, where it came from) with ``free_bytes`` free on the device: the budget the user gave
    (``fit.given_budget``, the rule cpu_ref reads too), else ``fit_room``."""
    given = given_budget(config_mb)
    if given is not None:
        return given
    return fit_room(free_bytes), f"default (free device memory less a {RESERVE >> 30} GiB reserve)"
