"""One decode step on the device, run eagerly or replayed as a captured graph.

The step reads its token and position from device tensors and writes the next token back
there, so the host never waits for a token before it launches the next step. Planning stays
in Python before every step, so each policy and observer sees every boundary. Where the
backend can capture (cuda) and the allocator hands out buffers deterministically (pool), the
whole token is planned first; a step whose plan repeats the one before it is captured once
and replayed for as long as the plan repeats, any other step runs eagerly, and a new
repeating plan is captured anew. Elsewhere each boundary is planned as the loop reaches it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Iterable

import torch

from .model import Attend, KVCache, RopeTable, decoder_layer, route
from .plan import Boundary

if TYPE_CHECKING:
    from .engine import Run

MODES = ("eager", "captured", "replayed")


class DecodeState:
    """What a decode step reads and writes on the compute device; a captured graph keeps these addresses."""

    def __init__(self, device: torch.device, rope: RopeTable, max_seq: int, greedy: bool):
        self.io = torch.zeros(2, dtype=torch.long, device=device)  # [the token, whether this step's logits were not finite]
        self.position = torch.zeros(1, dtype=torch.long, device=device)  # where the token goes
        self.key_positions = torch.arange(max_seq, device=device)
        self.rope = rope
        self.greedy = greedy  # the step writes its argmax into io[0]; otherwise the host samples from logits
        self.logits: torch.Tensor | None = None  # the last step's [vocab] float32

    def start(self, token: int, position: int) -> None:
        self.io[0].fill_(token)
        self.position.fill_(position)


@functools.cache
def _compiled_layer():
    return torch.compile(decoder_layer, dynamic=False)


def layer_math(compile: bool):
    """``decoder_layer``, or its torch.compile'd twin (one per process: its kernels are reused across runs)."""
    return _compiled_layer() if compile else decoder_layer


class DecisionPoint:
    """A sparse layer's decision point after its router, as ``decoder_layer`` calls it: ``(chosen, x) -> (used, weights)``.

    The host learns the routed experts here (the one sync a sparse layer needs). With speculative
    prefetch, a decode step also applies the next layer's router to this layer's hidden state ``x``
    and learns its guess in the same sync; the window prefetches the guessed experts on the side stream.
    """

    def __init__(self, run: "Run", layer: int, phase: str):
        self.window, self.layer, self.phase = run.window, layer, phase
        self.cfg, self.linear = run.model.config, run.backend.linear

    def __call__(self, chosen: torch.Tensor, x: torch.Tensor) -> tuple[list[int], dict]:
        """``used``: one token's experts in slot order (``sparse_mlp`` reads its weights by slot), else the distinct ones."""
        window, n = self.window, self.cfg.num_experts
        ids = chosen[0] if chosen.shape[0] == 1 else torch.unique(chosen)  # one token's k experts are distinct
        router = window.guess_router(self.layer) if self.phase == "decode" else None
        if router is None:
            used = ids.tolist()
            return used, window.route(self.layer, sorted(used), self.phase)
        guess = route(x, router, self.cfg, self.linear)[1]
        both = torch.cat((ids, torch.unique(guess) + n)).tolist()
        used = [e for e in both if e < n]
        return used, window.route(self.layer, sorted(used), self.phase, guess=[e - n for e in both if e >= n])


def experts_of(run: "Run", layer: int, phase: str) -> DecisionPoint | None:
    """A sparse layer's decision point (None for a dense layer)."""
    return DecisionPoint(run, layer, phase) if run.window.sparse[layer] else None


def decode_step(run: "Run", state: DecodeState, cache: list[KVCache], boundaries: Iterable[Boundary]) -> None:
    """Execute one token's boundaries and its layers; the next token (greedy) and the position move on on the device."""
    backend, cfg = run.backend, run.model.config
    layer_fn = layer_math(run.config.backend.compile)
    at = Attend.static(state.rope, state.position, state.key_positions)
    h = backend.embed(state.io[:1])
    for layer, b in enumerate(boundaries):
        if b.plan.evict or b.plan.fetch:
            backend.execute(b.plan)
        backend.before_use(b.key)
        h = layer_fn(h, b.weights, backend.small[layer], cache[layer], at, cfg, backend.linear,
                     experts_of(run, layer, "decode"))
        del b  # a buffer its plan freed dies here, not at the end of the token
    logits = backend.logits(h)[0]
    if state.greedy:
        state.io[:1].copy_(torch.argmax(logits, dim=-1, keepdim=True))
    state.io[1].copy_(~torch.isfinite(logits).all())
    state.position.add_(1)
    state.logits = logits


class StepRunner:
    """Runs each decode step: replayed where its plan is the captured one, captured where it repeats the last, else eager.

    A step repeats when every boundary's plan (units and the identity of their buffers) equals
    the step before's and no buffer was made or freed in between, so the same buffers still hold
    the same units. Each call says how its step ran (one of ``MODES``).
    """

    def __init__(self, run: "Run", state: DecodeState, cache: list[KVCache], graphs: bool):
        self.run, self.state, self.cache = run, state, cache
        # Planning a whole token ahead takes every buffer it fetches at once: only a deterministic
        # allocator, which hands back the buffers the same token released, keeps that in the window.
        # A sparse layer routes on the host: its experts are known only once its router has run.
        self.graphs = graphs and run.backend.captures and run.allocator.deterministic and not any(run.window.sparse)
        self.graph: Any = None
        self._graph_key: tuple | None = None
        self._last_key: tuple | None = None

    def __call__(self) -> str:
        """Plan and run one decode step; how it ran."""
        run = self.run
        if not self.graphs:
            decode_step(run, self.state, self.cache, run.window.boundaries("decode"))
            return "eager"
        token = run.window.plan_token("decode")
        key = (tuple(run.window.signatures), run.counters.allocations + run.counters.frees)
        last, self._last_key = self._last_key, key
        if self.graph is not None and key == self._graph_key:
            run.backend.replay(self.graph[0])
            return "replayed"
        if key != last:
            decode_step(run, self.state, self.cache, token)
            return "eager"
        self.graph = self._graph_key = None  # one graph at a time: the old one's memory goes first
        # The captured step keeps its boundaries: the graph reads these buffers for as long as it lives.
        kept = list(token)
        graph = run.backend.capture(lambda: decode_step(run, self.state, self.cache, kept), [b.plan for b in kept])
        if graph is None:
            self.graphs = False  # the backend cannot capture this run's steps: eager from here on
            decode_step(run, self.state, self.cache, kept)
            return "eager"
        self.graph, self._graph_key = (graph, kept), key
        run.backend.replay(graph)
        return "captured"

    def close(self) -> None:
        self.graph = None
