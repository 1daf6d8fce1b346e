"""The residency window: which layers are resident, the policy's advice at each boundary, and the counters."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from . import plugins
from .errors import PluginError

if TYPE_CHECKING:
    from .backend import Backend


@attrs.frozen
class Advice:
    """A policy's answer at a layer boundary."""

    evict: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    prefetch: tuple[int, ...] = attrs.field(default=(), converter=tuple)


@attrs.frozen
class Geometry:
    """Exact-match key of a buffer: a pool reuses a buffer only for the same geometry."""

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    device: str
    layout: tuple = ()  # backend-specific extras, e.g. (n_pad, n_groups) for q8


@attrs.define(eq=False)
class Entry:
    """One weight-cache entry, keyed by (layer, name)."""

    layer: int
    name: str
    geometry: Geometry
    factory: Any  # makes and frees real buffers: new_buffer(geometry), free_buffer(buffer)


@attrs.define
class Counters:
    uploads: int = 0  # entries uploaded
    layer_uploads: int = 0
    bytes_uploaded: int = 0
    evictions: int = 0  # entries evicted
    layer_evictions: int = 0
    bytes_evicted: int = 0
    allocations: int = 0  # real buffer allocations
    frees: int = 0  # real buffer frees
    pool_hits: int = 0
    resident_bytes: int = 0  # weight bytes resident now (streamed + never-evicted)
    peak_resident_bytes: int = 0
    resident_entries: int = 0
    peak_resident_entries: int = 0

    def add_resident(self, nbytes: int, entries: int = 1) -> None:
        self.resident_bytes += nbytes
        self.resident_entries += entries
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)
        self.peak_resident_entries = max(self.peak_resident_entries, self.resident_entries)

    def snapshot(self) -> dict[str, int]:
        return attrs.asdict(self)


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after if not k.startswith(("peak_", "resident_"))}


class Window:
    """What the layer loop asks at each boundary; what policies see as ``window``."""

    def __init__(self, backend: "Backend", policy: Any, n_layers: int):
        self.backend = backend
        self.policy = policy
        self.n_layers = n_layers
        self.keep = getattr(policy, "keep", None)
        self.phase = "prefill"
        self.token = 0
        self._weights: dict[int, dict] = {}
        self._advance = plugins.resolved("on_layer_advance")
        # Layers the backend uploads ahead on a side stream (0 where it cannot overlap).
        self.prefetch_depth = getattr(backend, "prefetch_depth", 0) if getattr(policy, "windowed", False) else 0

    def horizon(self, layer: int) -> list[int]:
        """The layers a prefetching backend wants next after ``layer`` (the loop wraps to the next token)."""
        return [(layer + d) % self.n_layers for d in range(1, self.prefetch_depth + 1)]

    @property
    def resident(self) -> frozenset[int]:
        return frozenset(self._weights)

    def preload(self) -> None:
        layers: set[int] = set()
        for answer in plugins.pm.hook.preload(window=self):
            if answer is None:
                continue
            if isinstance(answer, (str, bytes)) or not isinstance(answer, Iterable):
                raise PluginError(f"preload must return layer numbers (e.g. range(n) or []) or None, got {answer!r}")
            layers.update(self._layer(x, "preload") for x in answer)
        for layer in sorted(layers):
            self.acquire(layer)

    def advance(self, layer: int, phase: str) -> None:
        """The layer boundary before ``layer`` runs: apply every plugin's advice."""
        self.phase = phase
        evict: set[int] = set()
        prefetch: list[int] = []
        for advice in self._advance(window=self, layer=layer, phase=phase):
            if advice is None:
                continue
            if not isinstance(advice, Advice):
                raise PluginError(f"on_layer_advance must return an Advice or None, got {type(advice).__name__}")
            evict.update(self._layer(x, "evict") for x in advice.evict)
            prefetch.extend(self._layer(x, "prefetch") for x in advice.prefetch)
        if layer in evict:
            raise PluginError(f"policy {self.policy.name!r} asked to evict layer {layer}, which is about to run")
        for victim in sorted(evict):
            weights = self._weights.pop(victim, None)
            if weights is not None:
                self.backend.evict_layer(victim, weights)
        for ahead in [*prefetch, *self.horizon(layer)]:
            if ahead not in self._weights and ahead != layer:
                self._weights[ahead] = self.backend.prefetch_layer(ahead)

    def acquire(self, layer: int) -> dict:
        """The layer's weights, uploaded on demand."""
        weights = self._weights.get(layer)
        if weights is None:
            weights = self._weights[layer] = self.backend.upload_layer(layer)
        self.backend.before_use(layer)
        return weights

    def release_all(self) -> None:
        for layer in sorted(self._weights):
            self.backend.evict_layer(layer, self._weights.pop(layer))

    def _layer(self, value: Any, what: str) -> int:
        """A layer number from a plugin: any integral type (numpy's too), in range."""
        if isinstance(value, np.generic):
            value = value.item()  # so that a message says 7, not np.int64(7)
        try:
            layer = operator.index(value)
        except TypeError:
            layer = None
        if layer is None or isinstance(value, bool):
            raise PluginError(f"policy {self.policy.name!r} asked to {what} {value!r}, which is not a layer number; "
                              f"give whole numbers 0..{self.n_layers - 1}")
        if not 0 <= layer < self.n_layers:
            raise PluginError(f"policy {self.policy.name!r} asked to {what} layer {layer}; layers are 0..{self.n_layers - 1}")
        return layer
