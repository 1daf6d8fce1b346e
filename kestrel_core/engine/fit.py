"""``keep = "auto"``: the window chosen from the backend's budget when a run opens.

A backend states its budget and what its units weigh in its own layout (``Backend.fit_facts``): cuda its device
weight-cache budget (``--budget-mb``, default half of free device memory up to 24 GiB; the other half holds the KV
cache and activations) and each layer's bytes as it streams them (bf16, q8 or the file's blocks); cpu_ref half of
the host's available memory and each layer in float32. ``choose_keep`` keeps every layer resident where the model
fits, else takes the largest keep whose peak of resident layers (the policy's, plus the prefetch) fits, else refuses
with the numbers. A backend that states no budget runs resident.
"""

from __future__ import annotations

from typing import Callable

import attrs

from kestrel_core.config import OFF
from kestrel_core.errors import BudgetError


@attrs.frozen
class FitFacts:
    budget: int  # bytes the weights may hold
    source: str  # where the budget came from
    what: str  # what the budget bounds, for messages ("device weight-cache budget")
    fixed: int  # bytes resident whatever the window (embeddings, lm_head, norms; an expert budget)
    n_layers: int
    peak_bytes: Callable[[int], int] = attrs.field(eq=False)  # streamed bytes of n resident layers (the largest n)
    # A Mixture-of-Experts model with no expert policy given: its layers' own units apart from its experts, so the
    # experts can be given an expert cache of what the budget leaves (None: not such a model, or a policy given)
    own_peak_bytes: Callable[[int], int] | None = attrs.field(default=None, eq=False)  # n layers' own units
    experts_bytes: int = 0  # every expert
    routed_bytes: int = 0  # one token's routed experts of one layer: the least an expert cache may hold


EXPERT_POLICY = "expert_lru"  # the expert cache keep = "auto" gives a MoE model that does not fit whole


@attrs.frozen
class KeepChoice:
    keep: int | str  # a layer count, or "off": every layer resident
    peak_layers: int  # the most layers resident at once (with the prefetch)
    need: int  # bytes at that peak, the fixed ones included
    budget: int
    line: str  # what was chosen and why, one line
    expert_budget: int = 0  # bytes of an expert cache (EXPERT_POLICY) chosen with it; 0: none

    def to_json(self) -> dict:
        return {"keep": self.keep, "peak_layers": self.peak_layers, "need_bytes": self.need,
                "budget_bytes": self.budget, "why": self.line,
                **({"expert_policy": EXPERT_POLICY, "expert_budget_bytes": self.expert_budget}
                   if self.expert_budget else {})}


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def choose_keep(facts: FitFacts, policy_peak: Callable[[int], int], prefetch: int, policy: str) -> KeepChoice:
    """Every layer resident where the model fits ``facts.budget``; else the largest keep k whose peak (``policy_peak(k)``
    layers, plus ``prefetch``) fits; else a BudgetError with the numbers."""
    L, budget = facts.n_layers, facts.budget
    where = f"the {_gib(budget)} {facts.what} ({facts.source})"
    total = facts.fixed + facts.peak_bytes(L)
    if total <= budget:
        return KeepChoice(OFF, L, total, budget, f"keep = auto: every layer resident ({_gib(total)} within {where})")
    if facts.own_peak_bytes is not None:
        return _experts_cached(facts, policy_peak, prefetch, policy, where, total)
    need = total
    for k in range(L - 1, 0, -1):
        peak = min(L, policy_peak(k) + prefetch)
        need = facts.fixed + facts.peak_bytes(peak)
        if need <= budget:
            return KeepChoice(k, peak, need, budget,
                              f"keep = auto: keep = {k} with {policy} ({peak} layers resident at most, {_gib(need)} "
                              f"within {where}; every layer would need {_gib(total)})")
    raise BudgetError(f"keep = auto: even keep = 1 needs {need / 2**20:,.0f} MiB ({facts.fixed / 2**20:,.0f} MiB of it "
                      f"resident for good), over {where}; raise --budget-mb or KESTREL_WCACHE_MB, free memory, or run "
                      "a smaller or quantized model")


def _experts_cached(facts: FitFacts, policy_peak, prefetch: int, policy: str, where: str, total: int) -> KeepChoice:
    """A MoE model that does not fit whole: its layers' own units resident where they fit beside one token's routed
    experts (else the largest window over them that does), and an expert cache of all the budget leaves."""
    L, budget = facts.n_layers, facts.budget
    need = total
    for k in (OFF, *range(L - 1, 0, -1)):
        peak = L if k == OFF else min(L, policy_peak(k) + prefetch)
        own = facts.fixed + facts.own_peak_bytes(peak)
        need = own + facts.routed_bytes
        if need <= budget:
            experts = min(budget - own, facts.experts_bytes)
            window = "every layer's own units resident" if k == OFF else f"keep = {k} with {policy} ({peak} layers' " \
                                                                          "own units resident at most)"
            return KeepChoice(k, peak, own + experts, budget, expert_budget=experts,
                              line=f"keep = auto: {window} and an {EXPERT_POLICY} expert cache of "
                                   f"{experts / 2**20:,.1f} MiB of the experts' {facts.experts_bytes / 2**20:,.1f} "
                                   f"MiB, {_gib(own + experts)} within {where}; every layer would need {_gib(total)}")
    raise BudgetError(f"keep = auto: even keep = 1 with one token's routed experts needs {need / 2**20:,.0f} MiB "
                      f"({facts.fixed / 2**20:,.0f} MiB of it resident for good), over {where}; raise --budget-mb or "
                      "KESTREL_WCACHE_MB, free memory, or run a smaller or quantized model")


def moe_facts(res, cfg, own: list[int], experts: list[int]) -> dict:
    """``FitFacts``' expert fields for a backend's units (``own``: each layer's own units' bytes; ``experts``: each
    expert's): a MoE model given no expert policy (nor whole-layer fetching) can have its experts cached; else none."""
    if not experts or res.expert_policy or res.expert_fetch == "layer":
        return {}
    biggest = sorted(own, reverse=True)
    return {"own_peak_bytes": lambda n: sum(biggest[:max(0, n)]), "experts_bytes": sum(experts),
            "routed_bytes": cfg.num_experts_per_tok * max(experts)}

