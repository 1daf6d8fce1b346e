"""What a gate sees: the options it is told, the model's config.json, memory totals, and measured runs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs

from kestrel_core.errors import ConfigError
from kestrel_core.formats.modelconfig import ModelConfig, read_model_config

from .figures import (ASSUMED, ASSUMED_TOTAL_MIB, DEFAULT_H2D_GBPS, DEFAULT_MAX_SEQ, GIVEN, KV_LAYOUTS,
                      MEASURED, WEIGHT_BYTES, MiB, Quantity)


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
            if v is not None and not (math.isfinite(v) and 1 <= v <= 2**40):  # inf overflows the byte counts, 1e-300 is 0
                raise ConfigError(f"{name} must be a finite number of MiB in 1..2**40, got {v}")
        if self.total_mb is not None and self.peak_mb is not None and self.peak_mb > self.total_mb:
            raise ConfigError(f"--peak-mb {self.peak_mb} is above --total-mb {self.total_mb}")
        if self.threshold is not None and not 0 < self.threshold < 1:
            raise ConfigError(f"--threshold must be between 0 and 1 (0.10 is the 10% rule), got {self.threshold}")
        if self.measure and self.peak_mb is not None:
            raise ConfigError("--peak-mb gives a peak that --measure would measure; pass one or the other")
        if not (math.isfinite(self.period_s) and self.period_s > 0):  # inf: the sampler would never sample
            raise ConfigError(f"--period-ms must be a positive, finite number, got {self.period_s * 1e3:g}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if not self.prompt_ids:
            raise ConfigError("the measured workload needs a prompt: --prompt-ids 1,2,3")
        if not (math.isfinite(self.h2d_gbps) and self.h2d_gbps > 0):  # inf: a window that costs nothing
            raise ConfigError(f"--h2d-gbps must be a positive, finite number, got {self.h2d_gbps}")


@attrs.frozen
class Workload:
    """One real ``generate`` run with the memory sampler on."""

    backend: str
    keep: Any
    result: Any  # GenerationResult
    memory: Any  # MemReport
    compute_dtype: str
    budget_bytes: int | None
    kv_bytes: int  # the runner's KV cache for this run: kvcache.kv_bytes of the positions its slot held (held_positions)
    error: str | None = None


def _read_config(model_dir: str | Path, gate_name: str) -> ModelConfig:
    """config.json as kestrel reads it (weights are optional); an error names the gate asking."""
    try:
        return read_model_config(Path(model_dir))
    except ConfigError as exc:
        if gate_name in ("?", ""):
            raise
        raise ConfigError(f"gate {gate_name}: {exc}") from None


class GateContext:
    """What a gate sees: the model's config, the options, and shared helpers (total memory, budget, runs)."""

    def __init__(self, model_dir: str | Path, options: GateOptions, gate_name: str = "?"):
        options.check()
        self.model_dir = Path(model_dir)
        self.options = options
        self.gate_name = gate_name
        self.config: ModelConfig = _read_config(model_dir, gate_name)
        self.notes: list[str] = []
        self.workloads: list[Workload] = []
        self.gpu_free: int | None = None  # free device memory, where a GPU was asked
        self._total: Quantity | None = None
        self._max_seq: Quantity | None = None

    # --- settings ---
    def max_seq(self) -> Quantity:
        if self._max_seq is None:
            limit = self.config.max_position_embeddings
            want = self.options.max_seq
            if want is not None:
                if want > limit:
                    raise ConfigError(f"--max-seq {want} exceeds the model's max_position_embeddings={limit}")
                self._max_seq = Quantity("max_seq", "max_seq", want, "tokens", GIVEN, "--max-seq")
            else:
                value = min(DEFAULT_MAX_SEQ, limit)
                src = f"default {DEFAULT_MAX_SEQ}" + (f", capped at max_position_embeddings={limit}" if limit < DEFAULT_MAX_SEQ else "")
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

    # --- memory ---
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
        """Free device memory, which the weight-cache budget is read from (``weight_cache_budget``)."""
        total = self.total_memory()
        free = self.gpu_free
        if free is not None and total.kind == MEASURED:
            return Quantity("free", "free device memory", int(free), "B", MEASURED, "torch.cuda.mem_get_info, before the run")
        if self.workloads and total.kind == MEASURED:
            m = self.workloads[0].memory
            return Quantity("free", "free memory", m.start_available_bytes, "B", MEASURED, f"sampler at start, {m.device}")
        return Quantity("free", "free device memory", total.value, "B", ASSUMED, "an idle card: free = total")

    def weight_cache_budget(self, free_bytes: float) -> tuple[int, str]:
        """(bytes, source) of the weight-cache budget a run would get with this much free memory: the cuda backend's
        rule (its class's ``weight_budget``, found in the registry)."""
        from kestrel_core import plugins

        return plugins.lookup("backends", "cuda").factory.weight_budget(self.options.budget_mb or 0, int(free_bytes))

    # --- runs ---
    def require_runnable(self) -> None:
        if not any(self.model_dir.glob("*.safetensors")):
            raise ConfigError(f"--measure runs the model, so it needs the weights: {self.model_dir} has no *.safetensors; "
                              "drop --measure for the config-only answer")

    def run_workload(self, keep: Any = "off", policy: str = "asymmetric") -> Workload:
        """Run ``generate`` on the chosen backend with the sampler on; a budget refusal is recorded, not raised."""
        import torch

        from kestrel_core import load
        from kestrel_core.config import KestrelConfig
        from kestrel_core.engine.kvcache import kv_bytes
        from kestrel_core.engine.slots import held_positions
        from kestrel_core.errors import BudgetError

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
                with load(self.model_dir) as model, model.open(cfg) as run:
                    budget = getattr(run.backend, "budget", None)
                    dtype = str(run.backend.dtype).replace("torch.", "")
                    result = run.generate(prompt_ids=list(o.prompt_ids))
            except BudgetError as exc:
                error = str(exc)
            finally:
                if on_gpu:
                    torch.cuda.empty_cache()  # the next run starts from the same free memory
        tokens = len(o.prompt_ids) + o.max_new_tokens  # a generate of one request: a slot of this many positions
        kv = 0 if result is None else kv_bytes(self.config, held_positions(tokens, tokens, torch.device(device)),
                                                getattr(torch, dtype))
        w = Workload(backend, keep, result, sampler.report, dtype, budget, kv, error)
        if free_before is not None and self.gpu_free is None:
            self.gpu_free = free_before  # the first run's: the budget a fresh process would get
        self.workloads.append(w)
        return w
