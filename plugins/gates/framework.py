"""The gate contract and how a gate runs: quantities, evaluations, flip axes, the threshold rule, the result.

A gate declares the quantities it needs (computed from config.json, or measured by a
run), its upper-bound formula, a threshold (the 10% rule by default) and its flip
variables. ``run_gate`` evaluates the formula at the current settings, gives a verdict
(``build``, ``don't build`` or ``re-measure``), and evaluates it again over a grid of card
sizes, context lengths and slot counts, marking where the verdict flips.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Callable

import attrs

from kestrel_core.errors import PluginError

from .figures import (BUILD, DEFAULT_THRESHOLD, DONT_BUILD, GiB, KINDS, REMEASURE, VERDICTS, Quantity, fmt_mib,
                      fmt_ratio)
from .shapes import describe

if TYPE_CHECKING:
    from .context import GateContext, Workload


# --- quantities, evaluations, the grid ---------------------------------------------------------
@attrs.frozen
class Needs:
    """A quantity a gate declares it needs, and how it may be obtained ('config', 'run', 'config or run', 'flag')."""

    name: str
    how: str
    what: str = ""


@attrs.frozen
class Evaluation:
    """The formula at one point: the upper bound of the benefit, what it competes with, and the verdict."""

    bound: float
    against: float
    ratio: float | None  # None: what it competes with is used up (the workload does not fit)
    verdict: str
    why: str = ""


@attrs.frozen
class Axis:
    """A flip variable: its name, grid values, and how a value changes a point."""

    name: str
    label: str
    values: tuple
    apply: Callable[[dict, Any], dict]
    fmt: Callable[[Any], str] = str


def _card(point: dict, gb: Any) -> dict:
    # A nominal card size, taken as GiB (nvidia-smi reports a "32 GB" card as 32,607 MiB); idle when fresh.
    return {**point, "card_bytes": gb * GiB, "free_bytes": gb * GiB, "card_gb": gb}


CARD_GB = Axis("card_gb", "card GB", (12, 16, 24, 32, 80, 141), _card)
MAX_SEQ = Axis("max_seq", "max_seq", (8192, 32768, 40960), lambda p, v: {**p, "max_seq": v})
SLOTS = Axis("slots", "slots", (1, 4, 8, 16), lambda p, v: {**p, "slots": v})
WEIGHT_DTYPE = Axis("weight_dtype", "weights", ("int4", "int8", "bfloat16", "float32"),
                    lambda p, v: {**p, "weight_dtype": v})
STANDARD_AXES = (CARD_GB, SLOTS, MAX_SEQ)


def ten_percent_rule(bound: float, against: float, threshold: float, build_at: float = 1.0) -> tuple[float | None, str]:
    """bound/against under ``threshold``: don't build; from there to ``build_at``: re-measure; above: build."""
    if against <= 0:
        return None, BUILD
    ratio = bound / against
    if ratio < threshold:
        return ratio, DONT_BUILD
    if ratio < build_at:
        return ratio, REMEASURE
    return ratio, BUILD


# --- the gate contract -----------------------------------------------------------------------
class Gate:
    """Subclass this, set the class attributes, and write ``collect`` and ``evaluate``.

    - ``collect(ctx)`` returns the quantities (each says if it is computed, measured, given or assumed);
      with ``ctx.options.measure`` it may call ``ctx.run_workload(...)``.
    - ``evaluate(ctx, point)`` is pure arithmetic on those quantities at one point of the grid
      (``point`` holds card_bytes, free_bytes, max_seq, slots, weight_dtype) and returns an Evaluation;
      ``self.decide(bound, against)`` applies the threshold rule.
    """

    name = "?"
    title = ""  # what the optimisation is, in one line
    formula = ""  # the upper bound, as a formula
    against = ""  # what the bound competes with
    needs: tuple[Needs, ...] = ()
    threshold = DEFAULT_THRESHOLD
    flip_axes: tuple[Axis, ...] = STANDARD_AXES
    actions = {BUILD: "build it", DONT_BUILD: "don't build it", REMEASURE: "re-measure before deciding"}

    def collect(self, ctx: GateContext) -> list[Quantity]:
        raise NotImplementedError

    def current_point(self, ctx: GateContext) -> dict:
        total = ctx.total_memory()
        return {
            "card_bytes": total.value,
            "free_bytes": ctx.free_memory().value,
            "card_gb": total.value / GiB,
            "max_seq": ctx.max_seq().value,
            "slots": ctx.options.slots,
            "weight_dtype": ctx.weight_dtype()[0],
        }

    def evaluate(self, ctx: GateContext, point: dict) -> Evaluation:
        raise NotImplementedError

    def decide(self, bound: float, against: float, threshold: float | None = None) -> tuple[float | None, str]:
        return ten_percent_rule(bound, against, self.threshold if threshold is None else threshold)

    def summary(self, ctx: GateContext, ev: Evaluation, quantities: dict[str, Quantity]) -> str:
        """The verdict in one sentence; gates override it to name their figures."""
        if ev.ratio is None:
            return f"{self.actions[ev.verdict]}: {ev.why or 'nothing is left to compete with'}."
        against = self.against or "what it competes with"
        return (f"{self.actions[ev.verdict]}: the bound, {fmt_mib(ev.bound)}, is {fmt_ratio(ev.ratio)} of "
                f"{against} ({fmt_mib(ev.against)}); threshold {self.threshold:.0%}.")

    def describe(self) -> dict:
        return {"name": self.name, "title": self.title, "formula": self.formula, "against": self.against,
                "threshold": self.threshold, "flip_variables": [a.name for a in self.flip_axes],
                "needs": [attrs.asdict(n) for n in self.needs]}


def make_gate(name: str) -> Gate:
    """The registered gate ``name``; an unknown name lists the ones available."""
    from kestrel_core import plugins

    return instantiate(plugins.lookup("gates", name))


def instantiate(reg) -> Gate:
    factory = reg.factory
    gate = factory if isinstance(factory, Gate) else factory()
    if not isinstance(gate, Gate):
        raise PluginError(f"gate {reg.name!r} from {reg.plugin} is a {type(gate).__name__}, not a plugins.gates.Gate")
    if gate.name in ("?", ""):
        gate.name = reg.name
    return gate


# --- running a gate --------------------------------------------------------------------------
@attrs.frozen
class FlipCell:
    point: dict
    evaluation: Evaluation
    flips: bool


@attrs.frozen
class GateResult:
    gate: Gate
    model: str
    model_facts: str
    quantities: tuple[Quantity, ...]
    current: Evaluation
    sentence: str
    threshold: float
    cells: tuple[FlipCell, ...]
    flips_one_at_a_time: dict[str, list]
    notes: tuple[str, ...]
    workloads: tuple[Workload, ...]
    max_position_embeddings: int | None = None

    @property
    def verdict(self) -> str:
        return self.current.verdict

    @property
    def total_bytes(self) -> float | None:
        for q in self.quantities:
            if q.key == "total":
                return q.value
        return None

    @property
    def mode(self) -> str:
        return "measured" if self.workloads else "config-only"

    def quantity(self, key: str) -> Quantity:
        for q in self.quantities:
            if q.key == key:
                return q
        raise KeyError(key)

    def to_json(self) -> dict:
        total = self.total_bytes
        return {
            "gate": self.gate.name,
            "title": self.gate.title,
            "model": self.model,
            "model_facts": self.model_facts,
            "mode": self.mode,
            "formula": self.gate.formula,
            "against": self.gate.against,
            "threshold": self.threshold,
            "quantities": [
                {"key": q.key, "label": q.label, "value": q.value, "unit": q.unit, "kind": q.kind, "source": q.source,
                 "share_of_total": q.share(total)}
                for q in self.quantities
            ],
            "kinds": {k: [q.key for q in self.quantities if q.kind == k] for k in KINDS},
            "bound_bytes": self.current.bound,
            "against_bytes": self.current.against,
            "ratio": self.current.ratio,
            "verdict": self.verdict,
            "summary": self.sentence,
            "flip_variables": [a.name for a in self.gate.flip_axes],
            "flips_one_at_a_time": self.flips_one_at_a_time,
            "flip_table": [
                {**{a.name: c.point.get(a.name) for a in self.gate.flip_axes}, "ratio": c.evaluation.ratio,
                 "verdict": c.evaluation.verdict, "flips": c.flips}
                for c in self.cells
            ],
            "measurements": [_workload_json(w) for w in self.workloads],
            "notes": list(self.notes),
        }


def _workload_json(w: Workload) -> dict:
    out = {"backend": w.backend, "keep": w.keep, "compute_dtype": w.compute_dtype, "budget_bytes": w.budget_bytes,
           "kv_bytes": w.kv_bytes, "error": w.error, "memory": w.memory.to_json() if w.memory else None}
    if w.result is not None:
        r = w.result
        out.update(ms_per_token=r.ms_per_token, prefill_ms=r.prefill_ms, token_ids=r.token_ids,
                   peak_resident_entries=r.counters["peak_resident_entries"],
                   peak_resident_bytes=r.counters["peak_resident_bytes"])
    return out


def _grid_point(base: dict, axes: tuple[Axis, ...], values: tuple) -> dict:
    point = dict(base)
    for axis, value in zip(axes, values):
        point = axis.apply(point, value)
    return point


def run_gate(gate: Gate, ctx: GateContext) -> GateResult:
    threshold = ctx.options.threshold if ctx.options.threshold is not None else gate.threshold
    if threshold != gate.threshold:
        gate.threshold = threshold  # the gate's decide() reads it
    quantities = tuple(gate.collect(ctx))
    keys = [q.key for q in quantities]
    dup = {k for k in keys if keys.count(k) > 1}
    if dup:
        raise PluginError(f"gate {gate.name!r} reports quantity {sorted(dup)[0]!r} twice")
    base = gate.current_point(ctx)
    current = gate.evaluate(ctx, base)
    if current.verdict not in VERDICTS:
        raise PluginError(f"gate {gate.name!r} gave verdict {current.verdict!r}; verdicts are {', '.join(VERDICTS)}")
    cells = []
    for values in itertools.product(*(a.values for a in gate.flip_axes)):
        ev = gate.evaluate(ctx, _grid_point(base, gate.flip_axes, values))
        cells.append(FlipCell(_grid_point({}, gate.flip_axes, values), ev, ev.verdict != current.verdict))
    one = {}
    for axis in gate.flip_axes:
        flips = [v for v in axis.values if gate.evaluate(ctx, axis.apply(base, v)).verdict != current.verdict]
        one[axis.name] = flips
    qmap = {q.key: q for q in quantities}
    return GateResult(
        gate=gate,
        model=str(ctx.model_dir),
        model_facts=describe(ctx.config),
        quantities=quantities,
        current=current,
        sentence=gate.summary(ctx, current, qmap),
        threshold=threshold,
        cells=tuple(cells),
        flips_one_at_a_time=one,
        notes=tuple(ctx.notes) + tuple(n for w in ctx.workloads if w.memory for n in w.memory.notes),
        workloads=tuple(ctx.workloads),
        max_position_embeddings=ctx.config.max_position_embeddings,
    )
