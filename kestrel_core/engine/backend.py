"""The backend base class: the contract of ``contracts.Backend``, and the flow every backend shares."""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

import attrs
import torch
import torch.nn.functional as F

from kestrel_core.formats.checkpoint import Checkpoint
from kestrel_core.config import BackendConfig, ResidencyConfig
from kestrel_core.errors import ConfigError
from kestrel_core.engine.fit import FitFacts
from kestrel_core.engine.host import HostStore
from kestrel_core.engine.model import TORCH_OPS, LayerOps, sparse_mlp
from kestrel_core.formats.modelconfig import ModelConfig
from kestrel_core.engine.plan import Counters, Fetch, Plan, Resident
from kestrel_core.formats.tensor_table import global_specs, small_specs
from kestrel_core.formats.units import EntrySpec, Geometry, Unit, UnitKey, UnitSpec, UnitTable


@attrs.frozen
class BackendContext:
    """Everything a backend factory gets."""

    checkpoint: Checkpoint
    model: ModelConfig
    backend: BackendConfig
    residency: ResidencyConfig
    counters: Counters
    peak_layers: int  # the policy's peak of resident layers (before any prefetch)
    host: HostStore  # lives as long as the opened Model: host copies reused across runs
    unit_specs: tuple[UnitSpec, ...]  # the model's residency units
    quant: Any = None  # the checkpoint's kestrel_core.formats.quant.QuantInfo, None for a float checkpoint
    # The policy's peak of resident layers at keep k (a refusal names the largest keep that fits: ``fit.refuse_over_budget``)
    keep_peak: Callable[[int], int] = attrs.field(default=lambda k: k, eq=False)
    # The weights' budget keep = "auto" fitted the run to, (bytes, where it came from), which the backend holds; None:
    # a keep given, held to the backend's own budget (``fit.given_budget``, else its default)
    fitted_budget: tuple[int, str] | None = None


class Backend:
    """A place where the layer loop runs (implements ``contracts.Backend``).

    A subclass lays each residency unit out as buffers (``layout``), makes, fills and frees
    real buffers, and loads the never-evicted tensors. The window decides what is resident
    and hands each boundary's plan to ``execute``; the backend keeps no record of its own.
    """

    name = "?"
    device: torch.device = torch.device("cpu")
    device_type = "cpu"  # the kind of device it computes on, known before one is made (a pipeline's transport)
    dtype: torch.dtype = torch.float32
    prefetch_depth = 0
    budget: int | None = None  # device bytes for weights; None: unbounded
    captures = False  # whether ``capture`` can return a replayable decode step
    expert_table = False  # whether a decode step can read its routed experts through ``routed_experts``
    row_exact = False  # whether a row's result never depends on the rows beside it (``linear`` and attention row by row)
    device_per_rank = True  # a pipeline's ranks each compute on a device of their own (a GPU each)
    lands = False  # whether a decode step through the table can land its misses in a ring of slots (``engine.landing``)
    expert_table_refusal = "it has none"  # why not, where it cannot (for the error that names it)
    layer_ops: LayerOps = TORCH_OPS  # a layer's steps between its linears: torch's, or the backend's fused kernels

    def __init__(self, ctx: BackendContext):
        self.check_prefetch(ctx.backend.prefetch)
        self.ctx = ctx
        self.cfg = ctx.model
        self.ckpt = ctx.checkpoint
        self.counters = ctx.counters
        self.globals: dict[str, torch.Tensor] = {}
        self.small: list[dict[str, torch.Tensor]] = []
        self.units = UnitTable(())

    @classmethod
    def available(cls) -> bool:
        """Whether this machine can run the backend (``kestrel demo`` sweeps every available one)."""
        return True

    @classmethod
    def check_prefetch(cls, depth: int) -> None:
        """Refuse a prefetch depth this backend cannot honour; the base has no side stream."""
        if depth:
            raise ConfigError(f"{cls.name} has no side stream to prefetch on; set prefetch = 0 for this backend")

    @classmethod
    def entries_of(cls, tensors: dict) -> int:
        """How many device entries a unit with these roles (``UnitSpec.tensors``) takes here: one a role, unless the
        backend fuses them (what a gate counts without making a backend)."""
        return len(tensors)

    @classmethod
    def weight_budget(cls, config_mb: int, free_bytes: int) -> tuple[int, str] | None:
        """(bytes, where it came from) of the weight cache a run would get with ``free_bytes`` free on the device, or
        None where the backend keeps no budgeted cache."""
        return None

    @classmethod
    def fit_facts(cls, ctx: BackendContext) -> FitFacts | None:
        """What ``keep = "auto"`` fits (``engine.fit``): this backend's budget and its layers' bytes in its layout, read
        without loading anything; None where it states no budget (the run is then resident)."""
        return None

    # --- what a subclass provides -------------------------------------------------
    def layout(self, spec: UnitSpec) -> Iterable[EntrySpec]:
        """The buffers that hold one unit in this backend's compute layout."""
        raise NotImplementedError

    def fill(self, buffer: Any, source: Any) -> None:
        raise NotImplementedError

    def new_buffer(self, geometry: Geometry, raw: bool = False) -> Any:
        raise NotImplementedError

    def free_buffer(self, buffer: Any) -> None:
        raise NotImplementedError

    def load_resident(self, host: torch.Tensor) -> torch.Tensor:
        """A never-evicted copy of a host tensor in compute layout."""
        raise NotImplementedError

    def retire(self, resident: Resident) -> None:
        """Backend work once a unit is evicted (cpu_ref drops its pages; cuda notes its buffers' last reader)."""

    def before_use(self, key: UnitKey) -> None:
        """Order the compute after the unit's upload (a side-stream backend waits on an event)."""

    def synchronize(self) -> None:
        """Wait for queued device work."""

    def mark(self) -> Any:
        """A point in the device's queue (for timing and for waiting on); nothing waits here."""
        return time.perf_counter()

    def elapsed_ms(self, start: Any, stop: Any) -> float:
        """Milliseconds of device work between two marks, waiting for the second."""
        return (stop - start) * 1e3

    def wait(self, mark: Any) -> None:
        """Wait until the device's work up to ``mark`` is done (the CPU's is done when marked)."""

    def capture(self, step: Callable[[], None], plans: list[Plan]) -> Any:
        """One decode step captured for replay, or None where this backend cannot capture (it then runs eagerly)."""
        return None

    def replay(self, graph: Any) -> None:
        """Run a captured step again (on the backends whose ``capture`` returns one)."""
        raise NotImplementedError(f"{self.name} captures nothing, so it has nothing to replay")

    def memory_stats(self) -> dict[str, int]:
        return {}

    # --- the expert table (where ``expert_table``) ---------------------------------------
    def point_experts(self, host: list[UnitKey], slots: list[tuple[UnitKey, tuple]]) -> None:
        """In stream order: point the table at the host copies of the ``host`` experts, and at the device buffers of the
        ``slots`` experts (each after its upload)."""
        raise NotImplementedError(f"{self.name} has no expert table")

    def fetched_experts(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, used: list[int],
                        weights_of: dict, prompt_from: int | None = None) -> torch.Tensor:
        """A sparse layer's routed experts the host routed and fetched: ``weights_of[e]`` holds expert e's buffers,
        ``used`` the experts (one token's in routing order). A backend whose table path runs its own kernel runs
        the same one here, so that where the experts were read from never changes a result. ``prompt_from``: the
        pass's first prompt row (``Attend.prompt_from``), for a backend that computes a prompt's experts by other
        kernels (as its ``prompt_linear``); here every row takes ``linear``."""
        return sparse_mlp(x, weights, chosen, weights_of.__getitem__, self.linear, used)

    def routed_experts(self, layer: int, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """One token's routed experts of ``layer`` (``chosen`` [1, k], ``weights`` [1, k]), each read where the table
        points, summed by weight in expert order: the same bytes give the same result wherever they were read."""
        raise NotImplementedError(f"{self.name} has no expert table")

    # --- landing (where ``lands``: ``engine.landing``) ------------------------------------
    def landing_open(self, size: int, staged: int = 0) -> None:
        """A ring of ``size`` expert slots that a decode step through the table lands its misses in, head and tail 0;
        and up to ``staged`` slots beside it that a step may copy the misses it cannot land into, read there for that
        step alone (where the link reads faster so: the results are the same bytes')."""
        raise NotImplementedError(f"{self.name} lands no expert")

    def landing_fill(self, filled: list[tuple[int, tuple]], tail: int) -> None:
        """In stream order: each (position, buffers) into its slot (position % size), then the ring's tail."""
        raise NotImplementedError(f"{self.name} lands no expert")

    def landing_state(self) -> torch.Tensor:
        """The ring as the steps left it, on the device: [1 + size] long, the head then each slot's owner (an expert's
        flat number, layer * experts + expert; -1 for none yet). A step copies it into its output row."""
        raise NotImplementedError(f"{self.name} lands no expert")

    @staticmethod
    def linear(x: torch.Tensor, w: Any) -> torch.Tensor:
        """``x @ w.T`` for a buffer of this backend (a plain function: torch.compile sees the same one every run)."""
        return F.linear(x, w)

    def prompt_linear(self, prompt_from: int) -> Callable[[torch.Tensor, Any], torch.Tensor]:
        """The linear of a pass whose rows from ``prompt_from`` on are a prompt's (``Attend.prompt_from``; the rows
        before: decode rows and verify spans): ``linear`` itself here. A backend that computes a prompt's rows by
        other kernels than a decode row's (cuda's GGUF blocks: ``gguf_kernels``) routes each row by its kind, so a
        row's bits follow its kind and its values alone, never the rows beside it."""
        return self.linear

    # --- shared flow -------------------------------------------------------------
    def lay_out_units(self) -> None:
        """The run's unit table in this backend's layout (call once dtype and device are set)."""
        self.units = UnitTable(Unit.of(spec, self.layout(spec)) for spec in self.ctx.unit_specs)

    def execute(self, plan: Plan) -> None:
        for resident in plan.evict:
            self.retire(resident)
        for fetch in plan.fetch:
            self.fill_unit(fetch)

    def fill_unit(self, fetch: Fetch) -> None:
        for entry, buffer in zip(fetch.unit.entries, fetch.buffers):
            self.fill(buffer, entry.source)

    def load_globals(self) -> None:
        """Embeddings, the final norm, lm_head and per-layer norms: resident for the whole run."""
        for role, (name, _) in global_specs(self.cfg).items():
            self.globals[role] = self._resident(name)
        if self.cfg.tie_word_embeddings and self.cfg.head:  # a part that computes the logits
            self.globals["lm_head"] = self.globals["embed"]
        self.small = [
            {role: self._resident(name) for role, (name, _) in small_specs(self.cfg, layer).items()}
            for layer in range(self.cfg.num_hidden_layers)
        ]

    def _resident(self, name: str) -> torch.Tensor:
        t = self.load_resident(self.ckpt.view(name))
        self.counters.add_resident(t.numel() * t.element_size())
        return t

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.globals["embed"][ids.to(self.device)]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        x = self.layer_ops.rms_norm(h, self.globals["norm"], self.cfg.rms_norm_eps)
        return self.linear(x, self.globals["lm_head"]).float()

    def close(self) -> None:
        self.globals.clear()
        self.small.clear()
