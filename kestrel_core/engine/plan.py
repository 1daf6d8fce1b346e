"""The window's plan data: what a policy advises, what a boundary plans, what the runner executes, and the counters.

Plain data, shared by the window (which plans), the runner (which executes plans through the
backend), the backends and the plugins: none of them needs the others to read it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import attrs

from kestrel_core.formats.units import Geometry, Unit, UnitKey

__all__ = ["Advice", "Boundary", "Counters", "Entry", "Fetch", "Observers", "Plan", "Resident", "TokenPlan", "delta"]


@attrs.frozen
class Advice:
    """A policy's answer at a layer boundary: layer numbers (every unit of the layer) or unit keys."""

    evict: tuple = attrs.field(default=(), converter=tuple)
    prefetch: tuple = attrs.field(default=(), converter=tuple)


@attrs.define(eq=False)
class Entry:
    """One buffer request, as an allocator sees it: which unit, which of its buffers, and who makes buffers."""

    layer: int
    name: str
    geometry: Geometry
    factory: Any  # the backend: new_buffer(geometry, raw=False), free_buffer(buffer)
    unit: UnitKey = ()


@attrs.frozen
class Resident:
    unit: Unit
    buffers: tuple
    weights: dict = attrs.field(eq=False)  # entry name -> buffer, what the layer math reads


@attrs.frozen
class Fetch:
    unit: Unit
    buffers: tuple
    ahead: bool  # for a later boundary: a backend with a side stream uploads it there


@attrs.frozen
class Plan:
    """One boundary: evictions first (their buffers may be reused), then fetches in order."""

    layer: int
    phase: str
    evict: tuple[Resident, ...] = ()
    fetch: tuple[Fetch, ...] = ()

    @property
    def signature(self) -> tuple:
        """What must repeat, token after token, for the step to be replayed as it was: units and buffers."""
        return (self.layer, tuple(r.unit.key for r in self.evict),
                tuple((f.unit.key, tuple(map(id, f.buffers)), f.ahead) for f in self.fetch))


@attrs.frozen
class Boundary:
    """One layer boundary of a token: its plan, and the unit and weights the layer then reads."""

    plan: Plan
    key: UnitKey
    weights: dict = attrs.field(eq=False)


class TokenPlan:
    """Every boundary of one token, planned ahead. Iterating consumes it, so a buffer freed in the plan
    dies once its layer has run rather than at the end of the token."""

    def __init__(self, boundaries: Iterable[Boundary]):
        self._left = deque(boundaries)

    def __iter__(self) -> Iterator[Boundary]:
        while self._left:
            yield self._left.popleft()


@attrs.define
class Counters:
    uploads: int = 0  # entries uploaded
    layer_uploads: int = 0  # units uploaded (a dense layer is one unit)
    bytes_uploaded: int = 0
    evictions: int = 0  # entries evicted
    layer_evictions: int = 0  # units evicted
    bytes_evicted: int = 0
    allocations: int = 0  # real buffer allocations
    frees: int = 0  # real buffer frees
    pool_hits: int = 0
    expert_hits: int = 0  # routed experts found resident at a sparse layer's decision point
    expert_misses: int = 0  # and those fetched there (or, through the expert table, read from their host copies)
    # Through the expert table a step reads a missed expert from its host copy, over the link: those bytes, and of
    # the uploads (``bytes_uploaded``) the admissions of experts that the step heard read so, the second time their
    # bytes cross. What crosses the link a token is bytes_uploaded + bytes_read_host.
    bytes_read_host: int = 0
    bytes_reread: int = 0
    expert_landed: int = 0  # misses a step landed in a slot as it read them (``engine.landing``): uploads, read once
    expert_prefetches: int = 0  # experts uploaded ahead on a speculative guess
    expert_guessed: int = 0  # routed experts at decision points that had a guess (recall's denominator)
    expert_guess_hits: int = 0  # of those, the ones the guess named (recall = expert_guess_hits / expert_guessed)
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


def bytes_streamed(counters: Mapping[str, int]) -> int:
    """The weight bytes that crossed from the host: uploads, and the host copies a step read through the expert table
    (a ``Counters`` snapshot, or a token's delta)."""
    return counters["bytes_uploaded"] + counters["bytes_read_host"]


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after if not k.startswith(("peak_", "resident_"))}


@attrs.frozen
class Observers:
    """The observers of one run, resolved once when it opens: for each hook, the functions to call (keyword arguments,
    as pluggy calls a hook), after the run's own policy or allocator has answered."""

    on_layer_advance: tuple = ()
    on_experts_routed: tuple = ()
    preload: tuple = ()
    alloc: tuple = ()
    release: tuple = ()
