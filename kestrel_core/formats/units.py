"""Residency units: what the window makes resident or evicts, each measured in bytes.

The model declares its units (``model.unit_specs``): each layer's own weights are one unit ``(layer,)``,
and a Mixture-of-Experts layer adds one unit ``(layer, e)`` per expert (``is_expert``). A backend lays
each unit out as the buffers it computes from (``EntrySpec``: a name, a geometry and the backend's own
note of where the bytes come from), which gives the unit its size. Units of one model may differ in
size: budgets and peaks add real bytes.
"""

from __future__ import annotations

from typing import Any, Iterable

import attrs

UnitKey = tuple  # (layer,) for a layer's own weights, (layer, expert) for an expert


def is_expert(key: UnitKey) -> bool:
    """Whether ``key`` names an expert, (layer, expert), rather than a layer's own weights, (layer,)."""
    return len(key) == 2


@attrs.frozen
class Geometry:
    """Exact-match key of a buffer: a pool reuses a buffer only for the same geometry."""

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    device: str
    layout: tuple = ()  # backend-specific extras, e.g. ("q8", n_pad, n_groups)


@attrs.frozen
class UnitSpec:
    """A unit as the model declares it: its key, its layer, and its checkpoint tensors (role -> (name, shape))."""

    key: UnitKey
    layer: int
    tensors: dict = attrs.field(eq=False)


@attrs.frozen
class EntrySpec:
    """One buffer of a unit, as a backend lays it out."""

    name: str  # what the layer's math calls it, e.g. "qkv"
    geometry: Geometry
    source: Any = attrs.field(eq=False, repr=False)  # the backend's own: where fill() reads from


@attrs.frozen
class Unit:
    key: UnitKey
    layer: int
    entries: tuple[EntrySpec, ...]
    nbytes: int

    @classmethod
    def of(cls, spec: UnitSpec, entries: Iterable[EntrySpec]) -> "Unit":
        entries = tuple(entries)
        return cls(spec.key, spec.layer, entries, sum(e.geometry.nbytes for e in entries))


class UnitTable:
    """Every streamed unit of a run, by key and by layer."""

    def __init__(self, units: Iterable[Unit]):
        self.units: dict[UnitKey, Unit] = {u.key: u for u in units}
        self.by_layer: dict[int, tuple[Unit, ...]] = {}
        for u in self.units.values():
            self.by_layer[u.layer] = (*self.by_layer.get(u.layer, ()), u)
        self.layer_bytes = {layer: sum(u.nbytes for u in us) for layer, us in self.by_layer.items()}

    def __getitem__(self, key: UnitKey) -> Unit:
        return self.units[key]

    def __len__(self) -> int:
        return len(self.units)

    def experts(self) -> list[Unit]:
        """The expert units, in the table's order."""
        return [u for key, u in self.units.items() if is_expert(key)]

    def own(self) -> list[Unit]:
        """The layers' own units (every unit but the experts), in the table's order."""
        return [u for key, u in self.units.items() if not is_expert(key)]

    def of_layer(self, layer: int) -> tuple[Unit, ...]:
        return self.by_layer.get(layer, ())

    def peak_bytes(self, layers: int) -> int:
        """The most bytes ``layers`` resident layers can hold: the largest ones."""
        return sum(sorted(self.layer_bytes.values(), reverse=True)[:max(0, layers)])

    @property
    def total_bytes(self) -> int:
        return sum(self.layer_bytes.values())
