"""The shared rule of expert policies: keep the experts within a byte budget, evicting by a rank.

An expert policy answers at a sparse layer's decision point, after the router and before the
routed experts are fetched (``on_experts_routed``). It evicts resident experts, never one the
layer has just routed to, lowest rank first, until the routed ones fit in the budget.
"""

from __future__ import annotations

import math

from kestrel_core.errors import ConfigError
from kestrel_core.engine.plan import Advice


class ExpertCache:
    """Experts under ``budget`` bytes; evict the lowest-ranked resident experts until the routed ones fit.

    It admits every routed expert and evicts by a rank, so a decode step may land its misses itself (``lands``;
    ``engine.landing``): the run then holds ``hold_back`` bytes of the budget for the landing ring's free slots, and
    while a landed step is heard (``window.admits`` false) a routed expert not resident asks for no room."""

    name = "?"
    lands = True

    def __init__(self, budget: int):
        self.budget = budget
        self.clock = 0
        self.last: dict[tuple, int] = {}  # expert unit -> the decision point that last routed to it
        self.uses: dict[tuple, int] = {}  # expert unit -> how many decision points routed to it

    def rank(self, key: tuple) -> tuple:
        raise NotImplementedError

    def on_experts_routed(self, window, layer, experts, phase):
        self.clock += 1
        routed = {(layer, e) for e in experts}
        for key in routed:
            self.last[key] = self.clock
            self.uses[key] = self.uses.get(key, 0) + 1
        held = window.resident_experts  # kept by the window as experts come and go: asked at every sparse layer
        used = window.resident_expert_bytes
        need = sum(window.units[k].nbytes for k in routed if k not in held) if window.admits else 0
        if used + need <= self.budget:  # the common answer: nothing to rank
            return None
        victims = []
        for key in sorted((k for k in held if k not in routed), key=self.rank):
            if used + need <= self.budget:
                break
            victims.append(key)
            used -= held[key]
        return Advice(evict=victims) if victims else None

    def hold_back(self, nbytes: int) -> None:
        """Keep ``nbytes`` of the budget free (a landing ring's slots): what is resident fits in the rest."""
        self.budget -= nbytes


def budget_bytes(budget_mb: float, per_token: int, largest: int) -> int:
    """An expert budget in bytes; refused below one token's routed experts (``per_token`` of the ``largest``)."""
    if not (math.isfinite(budget_mb) and budget_mb > 0):  # int() of inf overflows; the callers check, this holds for plugins
        raise ConfigError(f"expert budget must be a finite number of MiB above 0, got {budget_mb:g}; "
                          "set --expert-budget-mb")
    budget = int(budget_mb * 2**20)
    if budget < per_token * largest:
        need = per_token * largest
        raise ConfigError(f"expert budget {budget_mb:g} MiB ({budget:,} bytes) is below one token's routed experts: "
                          f"{per_token} x {largest:,} bytes = {need:,} bytes ({need / 2**20:.6g} MiB); raise "
                          f"--expert-budget-mb to at least {need / 2**20:.6g}")
    return budget
