"""``keep = "auto"``: the window chosen from the backend's budget when a run opens.

A backend states its budget and what its units weigh in its own layout (``Backend.fit_facts``): cuda its device
weight-cache budget (default free device memory less a stated reserve) and each layer's bytes as it streams them
(bf16, q8 or the file's blocks); cpu_ref its host budget for resident layers (default half of the host's available
memory) and each layer as it holds it (float32, or the file's blocks under ``host_kernels = "auto"``). A budget the
user gives (``--budget-mb``, or KESTREL_WCACHE_MB over it: ``given_budget``) is read by both alike, so at the same
budget and the same unit bytes both pick the same keep.
Each also states the room its weights share with the run's KV cache, and what that cache weighs: the budget is cut
to the room less the KV cache of the slots and positions the run is opened for (``KVRoom``). ``choose_keep`` keeps
every layer resident where the model fits, else takes the largest keep whose peak of resident layers (the policy's,
plus the prefetch) fits, else refuses with the numbers. A backend that states no budget runs resident. The budget
chosen goes to the run's backend (``KeepChoice.fitted_budget``), never into the config.
A keep given is held to the budget by the same rule on every backend (``refuse_over_budget``), its peak weighed as the
window holds layers (``layers_peak``).
"""

from __future__ import annotations

from typing import Callable

import attrs

from kestrel_core.config import OFF, WCACHE_ENV, env_mib
from kestrel_core.errors import BudgetError, ConfigError


def given_budget(config_mb: int) -> tuple[int, str] | None:
    """The weights' budget the user gave, (bytes, where it came from), or None (the backend's default): KESTREL_WCACHE_MB
    beats the config's ``budget_mb`` (``--budget-mb``; 0: the default). Every backend reads it here."""
    env = env_mib(WCACHE_ENV)
    if env is not None:
        return env, WCACHE_ENV
    if config_mb < 0:
        raise ConfigError(f"budget_mb must be >= 0 (0 means the default), got {config_mb}")
    if config_mb:
        return config_mb * 2**20, "config"
    return None


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
    # The memory the weights share with the KV cache (None: the KV cache lives elsewhere), its name for messages, and
    # the KV cache's bytes for (slots, positions) in this backend's dtype
    room: int | None = None
    room_what: str = ""
    kv_bytes: Callable[[int, int], int] = attrs.field(default=lambda slots, positions: 0, eq=False)


@attrs.frozen
class KVRoom:
    """The KV cache a run is opened for: ``slots`` sequences of up to ``positions`` each (the server's --max-batch and
    --max-seq; one sequence of DEFAULT_CONTEXT positions, or the model's fewer, where nothing says)."""

    slots: int = 1
    positions: int | None = None  # None: min(DEFAULT_CONTEXT, the model's positions)
    fix: str = "open the run with a smaller kv=(sequences, positions)"  # how the door that asked lowers it

    @classmethod
    def of(cls, kv) -> "KVRoom":
        """``kv`` as given to ``Model.open``: None, a KVRoom (a door's, with its fix), or (sequences, positions each),
        positive ints (positions None: the default)."""
        if kv is None:
            return cls()
        if isinstance(kv, KVRoom):
            return kv
        def count(n) -> bool:
            return isinstance(n, int) and not isinstance(n, bool) and n >= 1

        if not isinstance(kv, (tuple, list)) or len(kv) != 2 or not count(kv[0]) or not (kv[1] is None or count(kv[1])):
            raise ConfigError(f"kv must be (sequences, positions each), positive ints, got {str(kv)[:60]}")
        return cls(*kv)

    def resolve(self, model_positions: int) -> "KVRoom":
        return attrs.evolve(self, positions=self.positions or min(DEFAULT_CONTEXT, model_positions))


DEFAULT_CONTEXT = 4096  # positions a sequence may reach where nothing says (the server's --max-seq default)


EXPERT_POLICY = "expert_lru"  # the expert cache keep = "auto" gives a MoE model that does not fit whole


@attrs.frozen
class KeepChoice:
    keep: int | str  # a layer count, or "off": every layer resident
    peak_layers: int  # the most layers resident at once (with the prefetch)
    need: int  # bytes at that peak, the fixed ones included
    budget: int
    line: str  # what was chosen and why, one line
    expert_budget: int = 0  # bytes of an expert cache (EXPERT_POLICY) chosen with it; 0: none
    kv: int = 0  # bytes of the KV cache counted beside the weights
    source: str = ""  # where ``budget`` came from: the backend's (``FitFacts.source``), or its room less the KV cache

    @property
    def fitted_budget(self) -> tuple[int, str] | None:
        """The budget the run's backend holds, (bytes, where it came from) (``BackendContext.fitted_budget``); None
        where nothing was fitted (no budget stated)."""
        return (self.budget, self.source) if self.budget else None

    def to_json(self) -> dict:
        return {"keep": self.keep, "peak_layers": self.peak_layers, "need_bytes": self.need,
                "budget_bytes": self.budget, "kv_bytes": self.kv, "why": self.line,
                **({"expert_policy": EXPERT_POLICY, "expert_budget_bytes": self.expert_budget}
                   if self.expert_budget else {})}


def _size(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def _budget(facts: FitFacts, kv: KVRoom | None) -> tuple[int, int, str, str]:
    """(the weights' budget, the KV cache's bytes, the budget in words, where it came from): ``facts.budget``, cut to
    the room the weights share with the KV cache less that cache; a KV cache that leaves nothing is a BudgetError
    with the numbers."""
    where = f"the {_size(facts.budget)} {facts.what} ({facts.source})"
    if facts.room is None or kv is None:
        return facts.budget, 0, where, facts.source
    kv_bytes = facts.kv_bytes(kv.slots, kv.positions)
    left = facts.room - kv_bytes
    kv_what = f"a KV cache of {_size(kv_bytes)} ({kv.slots} x {kv.positions:,} positions)"
    if left <= facts.fixed:
        raise BudgetError(f"keep = auto: {kv_what} leaves {_size(max(0, left))} of the {_size(facts.room)} "
                          f"{facts.room_what}, under the {_size(facts.fixed)} resident for good; {kv.fix}, free "
                          "memory, or run a smaller model")
    if left < facts.budget:
        return (left, kv_bytes, f"the {_size(left)} left of the {_size(facts.room)} {facts.room_what} beside {kv_what}",
                f"keep = auto: {facts.room_what} less the KV cache")
    return facts.budget, kv_bytes, f"{where}, beside {kv_what}", facts.source


def choose_keep(facts: FitFacts, policy_peak: Callable[[int], int], prefetch: int, policy: str,
                kv: KVRoom | None = None) -> KeepChoice:
    """Every layer resident where the model fits ``facts.budget`` (cut to the room beside ``kv``'s cache, resolved);
    else the largest keep k whose peak (``policy_peak(k)`` layers, plus ``prefetch``) fits; else a BudgetError with
    the numbers."""
    L = facts.n_layers
    budget, kv_bytes, where, source = _budget(facts, kv)
    facts = attrs.evolve(facts, budget=budget)
    fix = ("raise --budget-mb or KESTREL_WCACHE_MB, " + (f"{kv.fix}, " if kv_bytes else "")
           + "free memory, or run a smaller or quantized model")
    total = facts.fixed + facts.peak_bytes(L)
    if total <= budget:
        return KeepChoice(OFF, L, total, budget, f"keep = auto: every layer resident ({_size(total)} within {where})",
                          kv=kv_bytes, source=source)
    if facts.own_peak_bytes is not None:
        return attrs.evolve(_experts_cached(facts, policy_peak, prefetch, policy, where, total, fix), kv=kv_bytes,
                           source=source)
    need = total
    for k in range(L - 1, 0, -1):
        peak = min(L, policy_peak(k) + prefetch)
        need = facts.fixed + facts.peak_bytes(peak)
        if need <= budget:
            return KeepChoice(k, peak, need, budget,
                              f"keep = auto: keep = {k} with {policy} ({peak} layers resident at most, {_size(need)} "
                              f"within {where}; every layer would need {_size(total)})", kv=kv_bytes, source=source)
    raise BudgetError(f"keep = auto: even keep = 1 needs {need / 2**20:,.0f} MiB ({facts.fixed / 2**20:,.0f} MiB of it "
                      f"resident for good), over {where}; {fix}")


def _experts_cached(facts: FitFacts, policy_peak, prefetch: int, policy: str, where: str, total: int,
                    fix: str) -> KeepChoice:
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
                                   f"MiB, {_size(own + experts)} within {where}; every layer would need {_size(total)}")
    raise BudgetError(f"keep = auto: even keep = 1 with one token's routed experts needs {need / 2**20:,.0f} MiB "
                      f"({facts.fixed / 2**20:,.0f} MiB of it resident for good), over {where}; {fix}")


def layers_peak(layers: list[int], own: list[int], experts: list[int], res, cfg) -> Callable[[int], int]:
    """The most bytes n resident layers hold, in a backend's layout (``layers``: each layer's bytes; ``own``: each
    layer unit's apart from the experts; ``experts``: each expert's): the largest n layers, or under an expert policy
    the largest n layers' own units, with the experts in the policy's budget (plus one layer's guesses where
    ``expert_prefetch``), as the window holds them."""
    if not experts or not res.expert_policy:
        biggest = sorted(layers, reverse=True)
        return lambda n: sum(biggest[:max(0, n)])
    biggest = sorted(own, reverse=True)
    spare = int(res.expert_budget_mb * 2**20)
    if res.expert_prefetch:
        spare += cfg.num_experts_per_tok * max(experts)
    spare = min(spare, sum(experts))
    return lambda n: sum(biggest[:max(0, n)]) + spare


def refuse_over_budget(budget: int, source: str, what: str, fixed: int, peak_bytes: Callable[[int], int],
                       n_layers: int, windowed: bool, peak_layers: int, keep_peak: Callable[[int], int],
                       prefetch: int, also: str = "") -> None:
    """The rule every backend holds a given keep to: where the run's peak of resident layers (``peak_layers``, the
    policy's, plus ``prefetch``; every layer without a window) with the ``fixed`` bytes is over ``budget``, a one-line
    BudgetError naming both, the largest keep that fits (``keep_peak(k)``: the policy's peak at keep k) and the fix
    (``also``: a backend's own further one, after a comma)."""
    peak = min(n_layers, peak_layers + prefetch) if windowed else n_layers
    need = fixed + peak_bytes(peak)
    if need <= budget:
        return
    mib = 2**20

    def peak_at(k: int) -> int:
        return min(n_layers, keep_peak(k) + prefetch)

    fits = [k for k in range(1, n_layers) if fixed + peak_bytes(peak_at(k)) <= budget]
    fix = (f"use keep = auto, or keep <= {fits[-1]} ({peak_at(fits[-1])} layers resident at most)" if fits
           else f"even keep = 1 needs {(fixed + peak_bytes(peak_at(1))) / mib:,.1f} MiB")
    raise BudgetError(f"this run peaks at {peak} resident layers = {need / mib:,.1f} MiB, over the {what} of "
                      f"{budget / mib:,.1f} MiB ({source}); {fix}{also}, or raise --budget-mb / {WCACHE_ENV}")


def moe_facts(res, cfg, own: list[int], experts: list[int]) -> dict:
    """``FitFacts``' expert fields for a backend's units (``own``: each layer's own units' bytes; ``experts``: each
    expert's): a MoE model given no expert policy (nor whole-layer fetching) can have its experts cached; else none."""
    if not experts or res.expert_policy or res.expert_fetch == "layer":
        return {}
    biggest = sorted(own, reverse=True)
    return {"own_peak_bytes": lambda n: sum(biggest[:max(0, n)]), "experts_bytes": sum(experts),
            "routed_bytes": cfg.num_experts_per_tok * max(experts)}

