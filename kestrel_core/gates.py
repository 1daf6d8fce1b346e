"""Benefit gates: an optimisation's structural upper bound, set against what it competes with, before anyone builds it.

A gate declares the quantities it needs (computed from config.json, or measured by a
run), its upper-bound formula, a threshold (the 10% rule by default) and its flip
variables. ``run_gate`` evaluates the formula at the current settings, gives a
verdict (``build``, ``don't build`` or ``re-measure``), and evaluates it again over a
grid of card sizes, context lengths and slot counts, marking where the verdict flips.

Gates are plugins: ``register_gates(register)`` calls ``register(name, GateSubclass)``.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any, Callable

import attrs

from .errors import ConfigError, PluginError

GiB = 2**30
MiB = 2**20

BUILD, DONT_BUILD, REMEASURE = "build", "don't build", "re-measure"
VERDICTS = (BUILD, DONT_BUILD, REMEASURE)
SHORT = {BUILD: "B", DONT_BUILD: "D", REMEASURE: "R"}

# How a figure was obtained; every quantity in the output carries one.
COMPUTED, MEASURED, GIVEN, ASSUMED = "computed", "measured", "given", "assumed"

DEFAULT_THRESHOLD = 0.10  # re-measure once the bound exceeds ~10% of what it competes with
DEFAULT_MAX_SEQ = 8192
# An RTX 5090 as nvidia-smi reports it: the seed's card, assumed when no total is given or visible.
ASSUMED_TOTAL_MIB = 32_607
# Pinned host->device copy measured on the H200 machine (DESIGN.md, "Limits").
DEFAULT_H2D_GBPS = 55.0

# Bytes per weight in the device weight cache. int8 is kestrel's q8 at its default group of 32
# (one f32 scale per 32 weights); int4 approximates Q4_K (about 4.5 bits), the seed's q4.
WEIGHT_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "int8": 1.125, "int4": 0.5625}
KV_LAYOUTS = ("int8", "bfloat16", "float16", "float32", "runner")
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


# --- the model's facts, straight from config.json ----------------------------------------------
_MISSING = object()


@attrs.frozen
class ModelFacts:
    """The fields gates need, read from config.json directly.

    ``parse_model_config`` accepts only the dense types the runner executes; gates must
    also answer for models nobody runs here (Qwen3-30B-A3B is ``qwen3_moe``), so they
    read the fields themselves and a missing one is an error naming it.
    """

    path: str
    raw: dict = attrs.field(repr=False)
    who: str = "this"  # the gate asking, named in errors

    @classmethod
    def read(cls, model_dir: str | Path, who: str = "this") -> "ModelFacts":
        d = Path(model_dir)
        if not d.is_dir():
            raise ConfigError(f"model directory {str(d)!r} does not exist (a gate needs at least its config.json)")
        path = d / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: missing; a gate needs the model's config.json (weights are optional)")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(raw, str(path), who)

    @classmethod
    def from_dict(cls, raw: Any, where: str = "config.json", who: str = "this") -> "ModelFacts":
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: must hold a JSON object")
        # Vision-language configs nest the decoder under text_config.
        if "num_hidden_layers" not in raw and isinstance(raw.get("text_config"), dict):
            raw = {**raw["text_config"], "model_type": raw["text_config"].get("model_type", raw.get("model_type"))}
        return cls(where, raw, who)

    def int_field(self, key: str, why: str, default: Any = _MISSING) -> int:
        value = self.raw.get(key, _MISSING)
        if value is _MISSING or value is None:
            if default is _MISSING:
                raise ConfigError(f"{self.path}: missing field {key!r}; the {self.who} gate needs it for {why}")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{self.path}: field {key!r} must be a positive integer, got {value!r}")
        return value

    @property
    def model_type(self) -> str:
        return str(self.raw.get("model_type", "?"))

    @property
    def n_layers(self) -> int:
        return self.int_field("num_hidden_layers", "the layer count")

    @property
    def n_heads(self) -> int:
        return self.int_field("num_attention_heads", "the attention shapes")

    @property
    def n_kv_heads(self) -> int:
        if "num_key_value_heads" in self.raw:
            return self.int_field("num_key_value_heads", "the KV shapes")
        return self.n_heads  # Hugging Face's default: multi-head attention

    @property
    def hidden(self) -> int:
        return self.int_field("hidden_size", "the weight shapes")

    @property
    def head_dim(self) -> int:
        if self.raw.get("head_dim") is not None:
            return self.int_field("head_dim", "the KV shapes")
        if "hidden_size" not in self.raw or "num_attention_heads" not in self.raw:
            raise ConfigError(f"{self.path}: missing field 'head_dim' (or hidden_size and num_attention_heads to derive it); "
                              f"the {self.who} gate needs it for the KV shapes")
        return self.hidden // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def vocab(self) -> int:
        return self.int_field("vocab_size", "the embedding shapes")

    @property
    def tied(self) -> bool:
        return bool(self.raw.get("tie_word_embeddings", False))

    @property
    def max_position_embeddings(self) -> int | None:
        v = self.raw.get("max_position_embeddings")
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    @property
    def checkpoint_dtype(self) -> str:
        return str(self.raw.get("torch_dtype") or self.raw.get("dtype") or "bfloat16")

    @property
    def n_experts(self) -> int:
        for key in ("num_experts", "num_local_experts", "n_routed_experts"):
            v = self.raw.get(key)
            if v:
                return self.int_field(key, "the expert count")
        return 0

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def qk_norm(self) -> bool:
        return self.model_type.startswith("qwen3")

    def moe_layer(self, layer: int) -> bool:
        """Hugging Face's qwen*_moe rule: sparse every ``decoder_sparse_step`` layers, except ``mlp_only_layers``."""
        if not self.is_moe:
            return False
        step = self.int_field("decoder_sparse_step", "the MoE layer pattern", default=1)
        return layer not in (self.raw.get("mlp_only_layers") or []) and (layer + 1) % step == 0

    def n_moe_layers(self) -> int:
        return sum(self.moe_layer(layer) for layer in range(self.n_layers))

    def streamed_params(self, layer: int) -> int:
        """Parameters of the layer's big matrices: what a window streams."""
        h = self.hidden
        attn = self.q_dim * h + 2 * self.kv_dim * h + h * self.q_dim
        if not self.moe_layer(layer):
            return attn + 3 * h * self.int_field("intermediate_size", "the dense MLP shapes")
        moe_i = self.raw.get("moe_intermediate_size")
        if moe_i is None:  # Mixtral: each expert has the dense intermediate size
            moe_i = self.int_field("intermediate_size", "the expert MLP shapes")
        else:
            moe_i = self.int_field("moe_intermediate_size", "the expert MLP shapes")
        experts = self.n_experts * 3 * h * moe_i + self.n_experts * h  # experts + router
        shared = self.raw.get("shared_expert_intermediate_size")
        if shared:
            experts += 3 * h * self.int_field("shared_expert_intermediate_size", "the shared expert") + h
        return attn + experts

    def small_params(self, layer: int) -> int:
        """Norms and biases of a layer: small, resident for the whole run."""
        n = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        if self.raw.get("attention_bias"):
            n += self.q_dim + 2 * self.kv_dim
        return n

    def global_params(self) -> int:
        vh = self.vocab * self.hidden
        return vh * (1 if self.tied else 2) + self.hidden

    def param_count(self) -> int:
        L = self.n_layers
        return self.global_params() + sum(self.streamed_params(i) + self.small_params(i) for i in range(L))

    def describe(self) -> str:
        parts = [self.model_type]
        try:
            parts.append(f"{self.n_layers} layers, {self.n_kv_heads} kv heads x {self.head_dim}")
        except ConfigError:
            pass
        if self.is_moe:
            per = self.raw.get("num_experts_per_tok")
            parts.append(f"MoE: {self.n_experts} experts" + (f", {per} per token" if per else ""))
        return ", ".join(parts)


# --- quantities, evaluations, the grid ---------------------------------------------------------
@attrs.frozen
class Needs:
    """A quantity a gate declares it needs, and how it may be obtained ('config', 'run', 'config or run', 'flag')."""

    name: str
    how: str
    what: str = ""


@attrs.frozen
class Quantity:
    key: str
    label: str
    value: Any
    unit: str  # "B", "count", "ratio", "ms", "GB/s", "tokens", "" (a label)
    kind: str  # computed | measured | given | assumed
    source: str = ""

    def share(self, total: float | None) -> float | None:
        if self.unit != "B" or not total or not isinstance(self.value, (int, float)):
            return None
        return self.value / total


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


@attrs.frozen
class GateOptions:
    """Everything a gate run is told; None means 'not given' (the gate picks a default and says so)."""

    max_seq: int | None = None
    slots: int = 1
    fill: float = 0.0
    kv_layout: str = "int8"
    total_mb: float | None = None
    peak_mb: float | None = None
    budget_mb: int | None = None
    weight_dtype: str | None = None
    threshold: float | None = None
    measure: bool = False
    backend: str | None = None
    dtype: str | None = None
    device: str | None = None
    prompt_ids: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    max_new_tokens: int = 16
    period_s: float = 0.5
    h2d_gbps: float = DEFAULT_H2D_GBPS

    def check(self) -> None:
        if self.max_seq is not None and self.max_seq <= 0:
            raise ConfigError(f"--max-seq must be a positive number of tokens, got {self.max_seq}")
        if self.slots <= 0:
            raise ConfigError(f"--slots must be a positive number of concurrent KV states, got {self.slots}")
        if not 0.0 <= self.fill <= 1.0:
            raise ConfigError(f"--fill is the written fraction of the context, 0..1; got {self.fill}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ConfigError(f"unknown --kv-layout {self.kv_layout!r}; available: {', '.join(KV_LAYOUTS)}")
        if self.weight_dtype is not None and self.weight_dtype not in WEIGHT_BYTES:
            raise ConfigError(f"unknown --weight-dtype {self.weight_dtype!r}; available: {', '.join(WEIGHT_BYTES)}")
        for name, v in (("--total-mb", self.total_mb), ("--peak-mb", self.peak_mb), ("--budget-mb", self.budget_mb)):
            if v is not None and v <= 0:
                raise ConfigError(f"{name} must be positive, got {v}")
        if self.total_mb is not None and self.peak_mb is not None and self.peak_mb > self.total_mb:
            raise ConfigError(f"--peak-mb {self.peak_mb} is above --total-mb {self.total_mb}")
        if self.threshold is not None and not 0 < self.threshold < 1:
            raise ConfigError(f"--threshold must be between 0 and 1 (0.10 is the 10% rule), got {self.threshold}")
        if self.measure and self.peak_mb is not None:
            raise ConfigError("--peak-mb gives a peak that --measure would measure; pass one or the other")
        if not self.period_s > 0:
            raise ConfigError(f"--period-ms must be positive, got {self.period_s * 1e3:g}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if not self.prompt_ids:
            raise ConfigError("the measured workload needs a prompt: --prompt-ids 1,2,3")
        if not self.h2d_gbps > 0:
            raise ConfigError(f"--h2d-gbps must be positive, got {self.h2d_gbps}")


# --- measured workloads -------------------------------------------------------------------------
@attrs.frozen
class Workload:
    """One real ``generate`` run with the memory sampler on."""

    backend: str
    keep: Any
    result: Any  # GenerationResult
    memory: Any  # MemReport
    compute_dtype: str
    budget_bytes: int | None
    kv_bytes: int  # the runner's KV cache for this run: 2 x layers x tokens x kv_dim x itemsize
    error: str | None = None


class GateContext:
    """What a gate sees: the model's facts, the options, and shared helpers (total memory, runs)."""

    def __init__(self, model_dir: str | Path, options: GateOptions, gate_name: str = "?"):
        options.check()
        self.model_dir = Path(model_dir)
        self.options = options
        self.gate_name = gate_name
        self.facts = ModelFacts.read(model_dir, gate_name)
        self.notes: list[str] = []
        self.workloads: list[Workload] = []
        self.gpu_free: int | None = None  # free device memory, where a GPU was asked
        self._total: Quantity | None = None
        self._max_seq: Quantity | None = None

    # --- settings ---
    def max_seq(self) -> Quantity:
        if self._max_seq is None:
            limit = self.facts.max_position_embeddings
            want = self.options.max_seq
            if want is not None:
                if limit is not None and want > limit:
                    raise ConfigError(f"--max-seq {want} exceeds the model's max_position_embeddings={limit}")
                self._max_seq = Quantity("max_seq", "max_seq", want, "tokens", GIVEN, "--max-seq")
            else:
                value = min(DEFAULT_MAX_SEQ, limit) if limit else DEFAULT_MAX_SEQ
                src = f"default {DEFAULT_MAX_SEQ}" + (f", capped at max_position_embeddings={limit}" if limit and limit < DEFAULT_MAX_SEQ else "")
                self._max_seq = Quantity("max_seq", "max_seq", value, "tokens", ASSUMED, src)
        return self._max_seq

    def weight_dtype(self) -> tuple[str, str, str]:
        """(dtype, kind, source) of the weights the device cache holds."""
        o = self.options
        if o.weight_dtype:
            return o.weight_dtype, GIVEN, "--weight-dtype"
        if o.dtype in WEIGHT_BYTES:
            return o.dtype, GIVEN, "--dtype"
        return "bfloat16", ASSUMED, "the cuda backend's default compute dtype"

    def backend_name(self) -> str:
        if self.options.backend:
            return self.options.backend
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu_ref"

    def compute_dtype(self, backend: str) -> str:
        if self.options.dtype:
            return self.options.dtype
        return "bfloat16" if backend == "cuda" else "float32"

    def total_memory(self) -> Quantity:
        """The memory the shares are taken of: --total-mb, the measured device, a visible GPU, or the seed's card."""
        if self._total is None:
            o = self.options
            if o.total_mb is not None:
                self._total = Quantity("total", "total memory", int(o.total_mb * MiB), "B", GIVEN, "--total-mb")
            elif self.workloads:
                m = self.workloads[0].memory
                self._total = Quantity("total", "total memory", m.total_bytes, "B", MEASURED, f"sampler, {m.device}")
            else:
                q = self._visible_gpu_total()
                self._total = q or Quantity("total", "total memory", ASSUMED_TOTAL_MIB * MiB, "B", ASSUMED,
                                            "no GPU visible: the seed's 32 GB card (--total-mb to set)")
        return self._total

    def _visible_gpu_total(self) -> Quantity | None:
        import torch

        if not torch.cuda.is_available():
            return None
        dev = torch.device(self.options.device or "cuda")
        free, total = torch.cuda.mem_get_info(dev)
        self.gpu_free = free
        return Quantity("total", "total memory", int(total), "B", MEASURED, f"torch.cuda.mem_get_info({dev})")

    def free_memory(self) -> Quantity:
        """Free device memory the weight-cache budget is half of."""
        total = self.total_memory()
        free = self.gpu_free
        if free is not None and total.kind == MEASURED:
            return Quantity("free", "free device memory", int(free), "B", MEASURED, "torch.cuda.mem_get_info, before the run")
        if self.workloads and total.kind == MEASURED:
            m = self.workloads[0].memory
            return Quantity("free", "free memory", m.start_available_bytes, "B", MEASURED, f"sampler at start, {m.device}")
        return Quantity("free", "free device memory", total.value, "B", ASSUMED, "an idle card: free = total")

    # --- runs ---
    def require_runnable(self) -> None:
        from .modelconfig import SUPPORTED

        if self.facts.is_moe or self.facts.model_type not in SUPPORTED:
            raise ConfigError(
                f"--measure runs the model, and kestrel runs dense {'/'.join(SUPPORTED)} models only "
                f"({self.model_dir} is {self.facts.model_type}); drop --measure for the config-only answer"
            )
        if not any(self.model_dir.glob("*.safetensors")):
            raise ConfigError(f"--measure runs the model, so it needs the weights: {self.model_dir} has no *.safetensors; "
                              "drop --measure for the config-only answer")

    def run_workload(self, keep: Any = "off", policy: str = "asymmetric") -> Workload:
        """Run ``generate`` on the chosen backend with the sampler on; a budget refusal is recorded, not raised."""
        import torch

        from .config import KestrelConfig
        from .engine import Model, open_run
        from .errors import BudgetError
        from .generate import generate
        from .memsampler import MemSampler

        self.require_runnable()
        o = self.options
        backend = self.backend_name()
        cfg = KestrelConfig(model=str(self.model_dir)).override(
            backend__name=backend, backend__dtype=o.dtype, backend__device=o.device,
            residency__policy=policy, residency__keep=keep, residency__budget_mb=o.budget_mb,
            generation__max_new_tokens=o.max_new_tokens, generation__stop_at_eos=False,
        )
        on_gpu = backend != "cpu_ref" and torch.cuda.is_available()
        device = (o.device or "cuda") if on_gpu else "cpu"
        free_before = torch.cuda.mem_get_info(torch.device(device))[0] if on_gpu else None
        result, error, budget, dtype = None, None, None, self.compute_dtype(backend)
        with MemSampler(device, o.period_s) as sampler:
            try:
                with Model(self.model_dir) as model, open_run(model, cfg) as run:
                    budget = getattr(run.backend, "budget", None)
                    dtype = str(run.backend.dtype).replace("torch.", "")
                    result = generate(run, list(o.prompt_ids), cfg.generation)
            except BudgetError as exc:
                error = str(exc)
            finally:
                if on_gpu:
                    torch.cuda.empty_cache()  # the next run starts from the same free memory
        tokens = len(o.prompt_ids) + o.max_new_tokens
        kv = 0 if result is None else 2 * self.facts.n_layers * tokens * self.facts.kv_dim * _ITEMSIZE.get(dtype, 4)
        w = Workload(backend, keep, result, sampler.report, dtype, budget, kv, error)
        if free_before is not None and self.gpu_free is None:
            self.gpu_free = free_before  # the first run's: the budget a fresh process would get
        self.workloads.append(w)
        return w


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
    from . import plugins

    reg = plugins.lookup("gates", name)
    return instantiate(reg)


def instantiate(reg) -> Gate:
    factory = reg.factory
    gate = factory if isinstance(factory, Gate) else factory()
    if not isinstance(gate, Gate):
        raise PluginError(f"gate {reg.name!r} from {reg.plugin} is a {type(gate).__name__}, not a kestrel_core.gates.Gate")
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
            "kinds": {k: [q.key for q in self.quantities if q.kind == k] for k in (COMPUTED, MEASURED, GIVEN, ASSUMED)},
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
        model_facts=ctx.facts.describe(),
        quantities=quantities,
        current=current,
        sentence=gate.summary(ctx, current, qmap),
        threshold=threshold,
        cells=tuple(cells),
        flips_one_at_a_time=one,
        notes=tuple(ctx.notes) + tuple(n for w in ctx.workloads if w.memory for n in w.memory.notes),
        workloads=tuple(ctx.workloads),
        max_position_embeddings=ctx.facts.max_position_embeddings,
    )


# --- rendering ---------------------------------------------------------------------------------
def fmt_mib(n: float) -> str:
    """Bytes for a sentence: MiB with thousands separators (as nvidia-smi), small ones in bytes."""
    return f"{n / MiB:,.1f} MiB" if abs(n) >= MiB else f"{n:,.0f} B"


def fmt_bytes(n: float) -> str:
    if abs(n) >= GiB:
        return f"{n / MiB:,.1f} MiB ({n / GiB:,.2f} GiB)"
    if abs(n) >= MiB:
        return f"{n / MiB:,.1f} MiB"
    return f"{n:,.0f} B"


def fmt_value(q: Quantity) -> str:
    v = q.value
    if v is None:
        return "n/a"
    if q.unit == "B":
        s = fmt_bytes(v)
        return f"{v:,.0f} B ({v / MiB:,.1f} MiB)" if q.key.endswith("slot") and MiB <= abs(v) < GiB else s
    if q.unit == "ratio":
        return "n/a (nothing left)" if v is None else f"{v:.1%}"
    if q.unit == "ms":
        return f"{v:,.2f} ms"
    if q.unit == "GB/s":
        return f"{v:,.1f} GB/s"
    if q.unit in ("count", "tokens") and isinstance(v, (int, float)):
        return f"{v:,}" if isinstance(v, int) else f"{v:,.2f}"
    return str(v)


def fmt_ratio(r: float | None) -> str:
    if r is None:
        return "n/f"
    if r >= 10:
        return f"{r:,.0f}x"
    return f"{r:.1%}" if r < 1 else f"{r:.0%}"


def _table(header: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def quantities_table(result: GateResult, markdown: bool = False) -> str:
    total = result.total_bytes
    rows = []
    for q in result.quantities:
        share = q.share(total)
        rows.append([q.label, fmt_value(q), "" if share is None else f"{share:.1%}", q.kind, q.source])
    return _table(["quantity", "value", "share of total", "kind", "source"], rows, markdown)


def flip_tables(result: GateResult, markdown: bool = False) -> list[tuple[str, str]]:
    """(caption, table) pairs: rows are the first flip variable, columns the second, one table per other value."""
    axes = result.gate.flip_axes
    cells = {tuple(c.point.get(a.name) for a in axes): c for c in result.cells}
    if not axes:
        return []
    rows_axis, col_axis, rest = axes[0], (axes[1] if len(axes) > 1 else None), axes[2:]
    out = []
    for rest_values in itertools.product(*(a.values for a in rest)) or [()]:
        caption = ", ".join(f"{a.label} {a.fmt(v)}" for a, v in zip(rest, rest_values))
        limit = result.max_position_embeddings
        if limit and any(a.name == "max_seq" and v > limit for a, v in zip(rest, rest_values)):
            caption += f" (beyond this model's max_position_embeddings={limit})"
        header = [rows_axis.label] + ([f"{col_axis.label} {col_axis.fmt(v)}" for v in col_axis.values] if col_axis else ["ratio"])
        rows = []
        for rv in rows_axis.values:
            row = [rows_axis.fmt(rv)]
            for cv in (col_axis.values if col_axis else [None]):
                key = (rv,) + ((cv,) if col_axis else ()) + tuple(rest_values)
                c = cells[key]
                row.append(f"{fmt_ratio(c.evaluation.ratio)} {SHORT[c.evaluation.verdict]}{'*' if c.flips else ''}")
            rows.append(row)
        out.append((caption, _table(header, rows, markdown)))
    return out


def _flip_line(result: GateResult) -> str:
    parts = []
    for axis in result.gate.flip_axes:
        vals = result.flips_one_at_a_time.get(axis.name, [])
        if vals:
            parts.append(f"{axis.label} " + ", ".join(axis.fmt(v) for v in vals))
    if not parts:
        return "no single flip variable on the grid changes the verdict"
    return "; ".join(parts)


def render(result: GateResult, markdown: bool = False) -> str:
    g = result.gate
    h = (lambda s, lvl=2: f"{'#' * lvl} {s}") if markdown else (lambda s, lvl=2: s)
    kinds = {k: sum(q.kind == k for q in result.quantities) for k in (COMPUTED, MEASURED, GIVEN, ASSUMED)}
    lines = [
        h(f"gate {g.name}: {g.title}", 1),
        "",
        f"model: {result.model} ({result.model_facts})",
        f"mode: {result.mode}; figures: " + ", ".join(f"{n} {k}" for k, n in kinds.items()),
        "",
        quantities_table(result, markdown),
        "",
        f"upper bound: {g.formula}",
        f"against: {g.against}; bound / against = {fmt_ratio(result.current.ratio)} (threshold {result.threshold:.0%})",
        "",
        ("**verdict: " + result.verdict + "**") if markdown else f"verdict: {result.verdict.upper()}",
        result.sentence,
        "",
        f"flips (one variable at a time): {_flip_line(result)}",
        "",
        h("flip table", 2),
        f"bound / against at each point, then the verdict: {SHORT[BUILD]} build, {SHORT[DONT_BUILD]} don't build, "
        f"{SHORT[REMEASURE]} re-measure; * where it differs from the verdict above; n/f: does not fit, nothing left to compete with. "
        "Cards are nominal sizes taken as GiB, idle when fresh.",
    ]
    for caption, table in flip_tables(result, markdown):
        lines += ["", (f"*{caption}*" if markdown else caption) if caption else "", table]
    if result.workloads:
        lines += ["", h("measured runs", 2)]
        for w in result.workloads:
            head = f"- {w.backend}, keep={w.keep}, {w.compute_dtype}: "
            if w.error:
                lines.append(head + f"refused: {w.error}")
            else:
                lines.append(head + f"{w.result.ms_per_token:.2f} ms/token, "
                             f"{w.result.counters['peak_resident_entries']} resident entries at peak")
            if w.memory:
                lines.append("  " + w.memory.describe())
    if result.notes:
        lines += ["", h("notes", 2)] + [f"- {n}" for n in result.notes]
    return "\n".join(lines).replace("\n\n\n", "\n\n") + "\n"
