"""The backend contract, and the upload/evict flow every backend shares."""

from __future__ import annotations

import time
from typing import Any, Iterable

import attrs
import torch
import torch.nn.functional as F

from . import plugins
from .checkpoint import Checkpoint
from .config import BackendConfig, ResidencyConfig
from .errors import ConfigError, PluginError
from .model import rms_norm
from .modelconfig import ModelConfig
from .residency import Counters, Entry, Geometry


@attrs.frozen
class BackendContext:
    """Everything a backend factory gets."""

    checkpoint: Checkpoint
    model: ModelConfig
    backend: BackendConfig
    residency: ResidencyConfig
    counters: Counters
    peak_layers: int  # the policy's peak of resident layers (before any prefetch)
    shared: dict  # lives as long as the opened Model: host staging reused across runs
    quant: Any = None  # the checkpoint's kestrel_core.quant.QuantInfo, None for a float checkpoint


class Backend:
    """A place where the layer loop runs.

    Subclasses say what a layer's entries are (``layer_sources``), how to make and
    free a real buffer, and how to fill one from host memory. The base class runs
    each entry through the resolved ``alloc``/``release`` hooks and keeps the counters.
    """

    name = "?"
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32

    def __init__(self, ctx: BackendContext):
        self.check_prefetch(ctx.backend.prefetch)
        self.ctx = ctx
        self.cfg = ctx.model
        self.ckpt = ctx.checkpoint
        self.counters = ctx.counters
        self._alloc = plugins.resolved("alloc")
        self._release = plugins.resolved("release")
        self._entries: dict[int, list[tuple[Entry, Any]]] = {}
        self.globals: dict[str, torch.Tensor] = {}
        self.small: list[dict[str, torch.Tensor]] = []

    @classmethod
    def available(cls) -> bool:
        """Whether this machine can run the backend (``kestrel demo`` sweeps every available one)."""
        return True

    @classmethod
    def check_prefetch(cls, depth: int) -> None:
        """Refuse a prefetch depth this backend cannot honour; the base has no side stream."""
        if depth:
            raise ConfigError(f"{cls.name} has no side stream to prefetch on; set prefetch = 0 for this backend")

    # --- what a subclass provides -------------------------------------------------
    def layer_sources(self, layer: int) -> Iterable[tuple[str, Any, Geometry]]:
        """(entry name, host source, geometry) for each streamed entry of a layer."""
        raise NotImplementedError

    def fill(self, buffer: Any, source: Any) -> None:
        raise NotImplementedError

    def new_buffer(self, geometry: Geometry) -> Any:
        raise NotImplementedError

    def free_buffer(self, buffer: Any) -> None:
        raise NotImplementedError

    def load_resident(self, host: torch.Tensor) -> torch.Tensor:
        """A never-evicted copy of a host tensor in compute layout."""
        raise NotImplementedError

    def after_evict(self, layer: int) -> None:
        """Backend-specific work once a layer's entries are released (cpu_ref drops its pages)."""

    def prefetch_layer(self, layer: int) -> dict[str, Any]:
        """Start uploading a layer ahead of use; the default uploads at once."""
        return self.upload_layer(layer)

    def before_use(self, layer: int) -> None:
        """Order the compute after the layer's upload (a side-stream backend waits on an event)."""

    def synchronize(self) -> None:
        """Wait for queued device work."""

    def start_timer(self) -> Any:
        return time.perf_counter()

    def stop_timer(self, start: Any) -> float:
        """Milliseconds since ``start_timer``, with the device's work finished."""
        self.synchronize()
        return (time.perf_counter() - start) * 1e3

    def memory_stats(self) -> dict[str, int]:
        return {}

    def linear(self, x: torch.Tensor, w: Any) -> torch.Tensor:
        return F.linear(x, w)

    # --- shared flow -------------------------------------------------------------
    def load_globals(self) -> None:
        """Embeddings, the final norm, lm_head and per-layer norms: resident for the whole run."""
        from .model import global_specs, small_specs

        for role, (name, _) in global_specs(self.cfg).items():
            self.globals[role] = self._resident(name)
        if self.cfg.tie_word_embeddings:
            self.globals["lm_head"] = self.globals["embed"]
        self.small = [
            {role: self._resident(name) for role, (name, _) in small_specs(self.cfg, layer).items()}
            for layer in range(self.cfg.num_hidden_layers)
        ]

    def _resident(self, name: str) -> torch.Tensor:
        t = self.load_resident(self.ckpt.view(name))
        self.counters.add_resident(t.numel() * t.element_size())
        return t

    def upload_layer(self, layer: int) -> dict[str, Any]:
        entries = []
        weights: dict[str, Any] = {}
        for name, source, geometry in self.layer_sources(layer):
            entry = Entry(layer, name, geometry, self)
            buffer = self._alloc(entry=entry)
            if buffer is None:
                raise PluginError(f"no allocator returned a buffer for entry ({layer}, {name})")
            self.fill(buffer, source)
            entries.append((entry, buffer))
            weights[name] = buffer
            self.counters.uploads += 1
            self.counters.bytes_uploaded += geometry.nbytes
            self.counters.add_resident(geometry.nbytes)
        self.counters.layer_uploads += 1
        self._entries[layer] = entries
        return weights

    def evict_layer(self, layer: int, weights: dict[str, Any]) -> None:
        for entry, buffer in self._entries.pop(layer):
            self._release(entry=entry, buffer=buffer)
            self.counters.evictions += 1
            self.counters.bytes_evicted += entry.geometry.nbytes
            self.counters.add_resident(-entry.geometry.nbytes, -1)
        weights.clear()
        self.counters.layer_evictions += 1
        self.after_evict(layer)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.globals["embed"][ids.to(self.device)]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        x = rms_norm(h, self.globals["norm"], self.cfg.rms_norm_eps)
        return self.linear(x, self.globals["lm_head"]).float()

    def close(self) -> None:
        self.globals.clear()
        self.small.clear()
