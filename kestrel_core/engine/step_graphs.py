"""When a decode step runs eagerly, is captured, or is replayed: the runner's choice for each step.

Where the backend can capture (cuda) and the allocator hands out buffers deterministically
(pool), the whole token is planned first; a step whose plan repeats the one before it is
captured once and replayed for as long as the plan repeats, any other step runs eagerly, and
a new repeating plan is captured anew. Elsewhere each boundary is planned as the loop reaches it.

A step repeats when every boundary's plan (units and the identity of their buffers) equals the
step before's and no buffer was made or freed in between, so the same buffers still hold the
same units.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from kestrel_core.engine.contracts import Backend
from kestrel_core.engine.plan import Boundary
from kestrel_core.engine.residency import Window


class StepGraphs:
    """Runs each decode step: replayed where its plan is the captured one, captured where it repeats the last, else eager."""

    def __init__(self, window: Window, backend: Backend, enabled: bool, experts_in_step: bool = False,
                 on_replay: Callable[[list], None] | None = None):
        self.window, self.backend = window, backend
        self.on_replay = on_replay  # hears a replayed step's plans, which its graph carries out (for the runner's records)
        # Planning a whole token ahead takes every buffer it fetches at once: only a deterministic
        # allocator, which hands back the buffers the same token released, keeps that in the window.
        # A sparse layer that routes on the host knows its experts only once its router has run; one that reads them
        # through the expert table (``experts_in_step``) needs no host in the step.
        routed_on_host = any(window.sparse) and not experts_in_step
        self.enabled = enabled and backend.captures and window.allocator.deterministic and not routed_on_host
        self.graph: Any = None
        self._graph_key: tuple | None = None
        self._last_key: tuple | None = None

    def __call__(self, step: Callable[[Iterable[Boundary]], None], shape: Any = None) -> str:
        """Plan and run one decode step, ``step(boundaries)`` executing them; how it ran (one of ``results.MODES``).
        ``shape``: what else the step's graph bakes in (its attention's key bound): a step repeats only where it is
        the same."""
        window, counters = self.window, self.window.counters
        if not self.enabled:
            step(window.boundaries("decode"))
            return "eager"
        token = window.plan_token("decode")
        key = (tuple(window.signatures), counters.allocations + counters.frees, shape)
        last, self._last_key = self._last_key, key
        if self.graph is not None and key == self._graph_key:
            self.backend.replay(self.graph[0])
            if self.on_replay is not None:
                self.on_replay([b.plan for b in token])
            return "replayed"
        if key != last:
            step(token)
            return "eager"
        self.graph = self._graph_key = None  # one graph at a time: the old one's memory goes first
        # The captured step keeps its boundaries: the graph reads these buffers for as long as it lives.
        kept = list(token)
        graph = self.backend.capture(lambda: step(kept), [b.plan for b in kept])
        if graph is None:
            self.enabled = False  # the backend cannot capture this run's steps: eager from here on
            step(kept)
            return "eager"
        self.graph, self._graph_key = (graph, kept), key
        self.backend.replay(graph)  # its plans were executed as it was captured: the runner heard them then
        return "captured"

    def close(self) -> None:
        self.graph = None
