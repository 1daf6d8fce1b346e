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


@attrs.frozen
class KeepChoice:
    keep: int | str  # a layer count, or "off": every layer resident
    peak_layers: int  # the most layers resident at once (with the prefetch)
    need: int  # bytes at that peak, the fixed ones included
    budget: int
    line: str  # what was chosen and why, one line

    def to_json(self) -> dict:
        return {"keep": self.keep, "peak_layers": self.peak_layers, "need_bytes": self.need,
                "budget_bytes": self.budget, "why": self.line}


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
