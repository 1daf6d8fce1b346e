"""The cuda backend's weight-cache budget: the one rule, ``kestrel_core.budget`` (re-exported here)."""

from kestrel_core.budget import CAP, ENV, FLOOR, default_budget, resolve_budget

__all__ = ["CAP", "ENV", "FLOOR", "default_budget", "resolve_budget"]
