"""The runner: it owns every step of a run. One layer loop serves prefill, decode (of one sequence or a batch) and the
NaN probe, and the runner executes every plan the window makes, through the backend.

A pass over the layers carries rows: first the decode rows (row b: the next token of the sequence in KV slot b), then
spans: verify spans (a token and its drafts), then a prompt's tokens (a sequence's prompt, or a chunk of one). Every
row of a pass shares its plans: a layer brought in once serves them all. The token loop over these passes is the
batch's (``batch.Batch``).

Here: a step's launch and read-back (``Runner.step``, ``Runner.read``; what they take and give: ``step``), the passes
and the one layer loop (``Runner.layers``). Beside it, each a function of the runner where it needs one: the KV slots
and their growth (``slots``), the expert table's side of a step (``expert_landing``), a pipeline's ranks
(``follower``), a grammar's masks (``sampling.pick_masked``) and the NaN probe (``probe``).
"""

from __future__ import annotations

import functools
import threading
from collections import deque
from typing import Callable, Iterable

import torch

from kestrel_core.engine.contracts import Backend
from kestrel_core.errors import ConfigError
from kestrel_core.engine.expert_landing import (follow_plan, hear_routing, host_experts, land, refill, replayed,
                                                 table_experts)
from kestrel_core.engine.expert_schedule import ExpertSchedule
from kestrel_core.engine.follower import micro_batched, timed
from kestrel_core.engine.kvcache import KVCache
from kestrel_core.engine.landing import Landing
from kestrel_core.engine.model import Attend, RopeTable, Span, decoder_layer, key_bound
from kestrel_core.formats.modelconfig import ModelConfig
from kestrel_core.formats.units import is_expert
from kestrel_core.engine.plan import Boundary, Plan, delta
from kestrel_core.engine.probe import Probe
from kestrel_core.engine.pipeline import Pipeline
from kestrel_core.engine.residency import Window
from kestrel_core.engine.sampling import pick_masked
from kestrel_core.engine.slots import DecodeState, Slots
from kestrel_core.engine.step import Launched, Readback, StepRequest, StepSettings
from kestrel_core.engine.step_graphs import StepGraphs

PART_STEPS = 65536  # a pipeline rank's part of its last this many decode steps is kept (a server runs for days)


@functools.cache
def _compiled_layer():
    return torch.compile(decoder_layer, dynamic=False)


def layer_math(compile: bool):
    """``decoder_layer``, or its torch.compile'd twin (one per process: its kernels are reused across runs)."""
    return _compiled_layer() if compile else decoder_layer


class Runner:
    """Owns each step of a run on ``window`` and ``backend``: it plans through the window, executes every plan through
    the backend, and runs the layers."""

    def __init__(self, window: Window, backend: Backend, cfg: ModelConfig, settings: StepSettings,
                 guard: Callable[[], None] = lambda: None, pipeline: Pipeline | None = None):
        """``guard()``: raises where the files the run maps changed under it; asked before every step. ``pipeline``:
        this rank's place where the layers are split over ranks (``cfg`` is then its part's)."""
        self.window, self.backend, self.cfg, self.settings, self.guard = window, backend, cfg, settings, guard
        self.pipeline = pipeline
        self.counters = window.counters
        self.sparse = [layer for layer in range(cfg.num_hidden_layers) if window.sparse[layer]]
        self.schedule = ExpertSchedule() if settings.expert_table and self.sparse else None
        self.landing = None
        if self.schedule is not None and settings.landing:
            self.landing = Landing(settings.landing, cfg.num_experts)
            self._slot_like = next(key for key in window.units.units if is_expert(key))  # a slot's geometry: any expert's
            backend.landing_open(settings.landing, settings.staged)
        self.decode_steps = 0  # decode steps launched on this run (the expert schedule numbers them so)
        self._busy = threading.Lock()  # held by the one batch (its slots) stepping this run
        self.opened = 0  # slots opened on this run
        # In a pipeline rank 0 leads: every call below that changes the device's state is told to the other ranks,
        # which make it after it (``follower.follow``) and make none of their own
        self.leads = pipeline is not None and pipeline.first
        self.following = False
        # In a pipeline, this rank's part of each decode step: the time its layers took, from the step's input in hand
        # (the embedding, or the rank before's hidden state) to its layers' output (``follower.rank_parts``)
        self._part: list[tuple] | None = None  # the step being launched: (start, stop) marks around its layer passes
        self._part_marks: dict[tuple[int, int], list[tuple]] = {}  # (slots, step) launched, not read back yet
        self.part_ms: deque[float] = deque(maxlen=PART_STEPS)  # the decode steps read back, in order

    def tell(self, *op, now: bool = False) -> None:
        """Where this runner leads a pipeline: ``op`` (a call's name and arguments) for the other ranks to make."""
        if self.leads:
            self.pipeline.tell(op, now)

    def reads_table(self, rows: int, spans=()) -> bool:
        """Whether a step reads its routed experts through the expert table: a decode step (rows, no spans) on a run
        that has a table. Every caller asks here: the state's routing row, the graphs and the read-back agree."""
        return self.schedule is not None and not spans and rows >= 1

    def decode_state(self, rope: RopeTable, slots: int, max_seq: int) -> DecodeState:
        """The device state of ``slots`` KV slots; on a run with an expert table it has room for a step's routing."""
        routed = (len(self.sparse), self.cfg.num_experts_per_tok) if self.schedule is not None else (0, 0)
        return DecodeState(self.backend.device, rope, slots, max_seq, self.cfg.vocab_size, routed,
                           self.landing.size if self.landing is not None else 0)

    # --- a step, as a batch asks for it ----------------------------------------------------------------
    def open_slots(self, slots: int, max_seq: int, fix: str = "") -> Slots:
        """The device side of a batch of ``slots`` sequences of up to ``max_seq`` positions each. A run steps one
        batch at a time (its window holds one token's plans): a second, from another thread or a scheduler's, is
        refused at once, until the first closes its slots. ``fix``: what the caller's user changes where the KV cache
        cannot grow as far as its sequences reach (``Slots.reach``)."""
        if self.pipeline is not None and not self.leads and not self.following:
            raise ConfigError(f"this is rank {self.pipeline.rank} of a pipeline, which follows rank 0's steps: call "
                              "run.follow() on it (rank 0 generates, serves or runs the batch job)")
        if not self._busy.acquire(blocking=False):
            raise ConfigError("this run is generating already (in another thread, or a Scheduler's batch): a run steps "
                              "one batch at a time; open a second run with model.open(...), or submit the request to "
                              "the Scheduler")
        try:
            s = Slots(self, slots, max_seq, fix)
        except BaseException:
            self._busy.release()
            raise
        self.opened += 1
        self.tell("open", slots, max_seq)
        return s

    def step(self, s: Slots, request: StepRequest,
             sample: Callable[[int, torch.Tensor], int | None] | None = None,
             masks: Callable[[], tuple[tuple[int, torch.Tensor], ...]] | None = None) -> Launched:
        """Launch one step on ``s``: the window's token, its plans (the first step's preload), the pass (replayed,
        captured or eager), then each masked row's token (``masks()``, below), each sampled slot's token
        (``sample(slot, logits)``; None leaves the argmax), and the copy of the step's output row to the host, which
        ``read`` waits for.

        ``masks()`` is asked once the pass is launched, so the host's work for it runs while the device computes the
        pass: it gives (slot, [vocab] bool) for the decode rows whose token is their argmax among the ids a grammar
        allows (``Sampler.masks_on_device``). A grammar's next mask needs the token before, so the batch reads its
        earlier steps back in there; the step's argmax is then taken again on the device under the masks
        (``sampling.pick_masked``), before the output row is copied: the mask costs no wait and no host round trip a
        token."""
        window, backend, counters, state = self.window, self.backend, self.counters, s.state
        self.guard()  # a file truncated under its mapping would fault the process (SIGBUS) at the next touch
        self.tell("step", s.sid, request, now=True)
        if s.t0 is None:
            self.preload()
            backend.synchronize()
            s.t0 = backend.mark()
        else:
            window.next_token()
        rows, spans = request.rows, list(request.spans)
        furthest = 1 + max((s.positions[slot] for slot in request.live), default=0)  # past every live row's position
        s.reach(max([furthest] + [sp.start + sp.T for sp, _ in spans]))
        self._set_live(s, request.live, rows)
        table = self.reads_table(rows, spans)
        decode_index = self.begin_step() if not spans else -1
        self._part = [] if self.pipeline is not None and not spans else None  # a decode step's part is timed
        before = counters.snapshot()
        span_logits = []
        if not spans:
            graphs = s.graphs.get(rows)
            if graphs is None:
                graphs = s.graphs[rows] = StepGraphs(window, backend, self.settings.graphs, experts_in_step=table,
                                                     on_replay=functools.partial(replayed, self))
            bound = self._bound(s, furthest)
            mode = graphs(lambda boundaries: self.decode_step(state, s.cache, boundaries, rows, bound=bound), bound)
            if mode == "captured":  # a replay writes its logits where the capture's went
                s.graph_logits[rows] = state.logits
            elif mode == "replayed":
                state.logits = s.graph_logits[rows]
        else:
            mode = "eager"
            span_logits = self.decode_step(state, s.cache, window.boundaries("prefill"), rows, spans, request.every_row,
                                           bound=s.capacity)
        for slot in request.live:  # the step moved each live row on by one, on the device
            s.positions[slot] += 1
        after = counters.snapshot()
        if masks is not None:
            pick_masked(s, masks(), rows, self.backend)
        for slot in request.sample:
            token = sample(slot, state.logits[slot])
            if token is not None:
                state.tokens[slot].fill_(token)
        index, s.launched = s.launched, s.launched + 1
        if self._part is not None:
            self._part_marks[s.sid, index] = self._part
            self._part_marks.pop((s.sid, index - 2 * s.RING), None)  # a step never read back: not counted
            self._part = None
        s.ring[index % s.RING].copy_(state.out, non_blocking=True)
        return Launched(index, mode, before, after, backend.mark(), decode_index, table, span_logits)

    def read(self, s: Slots, step: Launched, hear: Iterable[int] = ()) -> Readback:
        """Wait for ``step`` and read its row back; where it read the expert table, the window hears the routing of the
        slots in ``hear`` (the rows whose sequences go on) and plans on it."""
        hear = sorted(hear)
        self.tell("read", s.sid, step.index, hear)
        self.backend.wait(step.mark)
        part = self._part_marks.pop((s.sid, step.index), None)
        if part:  # done by now: its marks read without a wait for a later step
            self.part_ms.append(sum(self.elapsed_ms(start, stop) for start, stop in part))
        row = s.ring[step.index % s.RING].tolist()
        n, heard = s.count, {}
        if step.table:
            sparse, slots, k = s.state.routed.shape
            end = 2 * n + sparse * slots * k
            routed = [row[i:i + slots * k] for i in range(2 * n, end, slots * k)]  # a sparse layer's slots
            landed = self.landing.consumed(row[end], row[end + 1:]) if self.landing is not None else None
            if hear:
                before = self.counters.snapshot()
                hear_routing(self, step.decode_index, [[e for slot in hear for e in layer[slot * k:(slot + 1) * k]]
                                                      for layer in routed], landed)
                heard = delta(self.counters.snapshot(), before)
            elif landed:
                land(self, step.decode_index, landed)
        return Readback(row[:n], [bool(b) for b in row[n:2 * n]], heard)

    def place(self, s: Slots, slot: int, position: int, token: int | None = None) -> None:
        """Where ``slot``'s next decode row writes (and, given, the token it reads)."""
        self.tell("place", s.sid, slot, position, token)
        if token is not None:
            s.state.tokens[slot].fill_(token)
        s.state.positions[slot].fill_(position)
        s.positions[slot] = position
        s.parked.discard(slot)

    def park(self, s: Slots, slot: int) -> None:
        """``slot``'s decode row, where a step has one, writes where no step reads (``Slots.park``) until it is placed
        again: its sequence does not decode this step (a prompt in chunks, a verify span)."""
        self.tell("park", s.sid, slot)
        s.state.positions[slot].fill_(s.park)
        s.positions[slot] = s.park
        s.parked.add(slot)

    def copy_prefix(self, s: Slots, src: int, dst: int, n: int) -> None:
        """Slot ``dst``'s first ``n`` positions' keys and values become slot ``src``'s (a prompt both hold), in stream
        order: a step launched after reads them."""
        self.tell("copy_prefix", s.sid, src, dst, n)
        for layer in s.cache:
            layer.k[dst, :n].copy_(layer.k[src, :n])
            layer.v[dst, :n].copy_(layer.v[src, :n])

    # --- a pipeline's other ranks ------------------------------------------------------------------------------
    def decode_logits(self, s: Slots, slot: int) -> torch.Tensor:
        """The last step's logits of ``slot``'s decode row, [vocab] float32, on the device."""
        return s.state.logits[slot]

    def decode_token(self, s: Slots, slot: int) -> torch.Tensor:
        """The token the last step chose for ``slot``'s decode row (its argmax, or the host's draw), a 0-d long tensor
        on the device: read it before the next step or ``place`` writes the slot's token."""
        return s.state.tokens[slot]

    def elapsed_ms(self, start, stop) -> float:
        return self.backend.elapsed_ms(start, stop)

    def snapshot(self) -> dict[str, int]:
        return self.counters.snapshot()

    def memory_stats(self) -> dict[str, int]:
        return self.backend.memory_stats()

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def resident_bytes(self) -> int:
        return self.counters.resident_bytes

    @property
    def masks_on_device(self) -> bool:
        """Whether a step can hold a greedy row to a grammar's mask before its argmax (not across a pipeline's ranks,
        where the mask would have to travel: there the host chooses such a row's token)."""
        return self.pipeline is None

    def _bound(self, s: Slots, furthest: int) -> int | None:
        """The keys a decode step's rows attend over where the backend reads whole slots under a mask (``key_bound``):
        the first ``furthest``, past every live row's position, rounded up. None where each row reads its own keys on
        the host (``_sliced``)."""
        if _sliced(self.backend):
            return None
        return key_bound(furthest, s.max_seq)

    def _set_live(self, s: Slots, live: frozenset[int], rows: int) -> None:
        """Each of the first ``rows`` slots moves on this step where its sequence decodes (a device write on a change)."""
        for slot in range(rows):
            want = 1 if slot in live else 0
            if s.live.get(slot) != want:
                s.state.live[slot].fill_(want)
                s.live[slot] = want

    # --- plans --------------------------------------------------------------------------------
    def execute(self, plan: Plan | None) -> None:
        """Execute a plan in stream order (the expert table, where there is one, follows it at once)."""
        if plan is None or not (plan.evict or plan.fetch):
            return
        self.backend.execute(plan)
        follow_plan(self, plan)

    def begin_step(self) -> int:
        """Before a decode step is launched: the admissions it reads from their slots. Its number among the run's
        decode steps."""
        index, self.decode_steps = self.decode_steps, self.decode_steps + 1
        if self.landing is not None:
            refill(self)
        if self.schedule is not None:
            slots = self.schedule.begin_step()
            if slots:
                self.backend.point_experts([], slots)
        return index

    def preload(self) -> None:
        self.execute(self.window.preload())

    def release_all(self) -> None:
        self.execute(self.window.release_all())
        if self.landing is not None:
            self.backend.synchronize()  # no step lands in a slot any more
            for buffers in self.landing.drained():
                self.window.free_slot(self._slot_like, buffers)

    # --- the one layer loop ---------------------------------------------------------------------
    def layers(self, h: torch.Tensor, at: Attend, cache: list[KVCache], boundaries: Iterable[Boundary], phase: str,
               layer_fn=decoder_layer, probe: Probe | None = None, table: DecodeState | None = None,
               first_row: int = 0) -> torch.Tensor:
        """Run every layer on ``h``: at each boundary, execute its plan, order the compute after the layer's upload,
        run the layer (a sparse one reads its routed experts: through the table where the step reads it, ``table``
        the state that takes its routing from row ``first_row`` on, else after the host has routed and fetched
        them)."""
        backend, cfg = self.backend, self.cfg
        ops = (backend.layer_ops,) if layer_fn is decoder_layer else ()  # a compiled layer: torch's, which it fuses
        prompt_from = at.prompt_from
        linear = backend.linear if prompt_from is None else backend.prompt_linear(prompt_from)
        for layer, b in enumerate(boundaries):
            self.execute(b.plan)
            backend.before_use(b.key)
            experts = None
            if self.window.sparse[layer]:
                experts = (table_experts(self, layer, table, first_row) if table is not None
                           else host_experts(self, layer, phase, prompt_from))
            h = layer_fn(h, b.weights, backend.small[layer], cache[layer], at, cfg, linear, experts, *ops)
            if probe:
                probe(f"layer {layer + cfg.first_layer}", h)  # the model's number (a pipeline's part counts from 0)
            del b  # a buffer its plan freed dies here, not at the end of the token
        return h

    # --- passes -----------------------------------------------------------------------------------------
    def forward(self, ids: list[int], start: int, cache: list[KVCache], rope: RopeTable, phase: str,
                probe: Probe | None = None, slot: int = 0) -> torch.Tensor:
        """Logits of the last position of one sequence's ``ids`` at ``start`` of ``slot``, each boundary planned as the
        loop reaches it (a prompt, and the NaN probe). ``probe(where, h)`` sees the hidden state after the embedding and
        after each layer."""
        backend = self.backend
        keys = torch.arange(cache[0].k.shape[1], device=backend.device) if backend.row_exact else None
        at = Attend.prefill(rope, start, len(ids), backend.device, slot, keys, sliced=_sliced(backend))
        h = self._embedded(torch.tensor(ids))
        if probe and (self.pipeline is None or self.pipeline.first):  # later ranks get the rank before's output
            probe("the embedding", h)
        h = self.layers(h, at, cache, self.window.boundaries(phase), phase, probe=probe)
        return self._logits(h, torch.tensor([len(ids) - 1], device=h.device))[0]

    def decode_step(self, state: DecodeState, cache: list[KVCache], boundaries: Iterable[Boundary], rows: int,
                    spans: list[tuple[Span, list[int]]] = (), every_row: frozenset[int] = frozenset(),
                    bound: int | None = None) -> list[torch.Tensor]:
        """One pass: the next token of each of the first ``rows`` slots (greedy: its argmax goes to its slot's token on
        the device, and its position moves on), then optionally spans of tokens, each a sequence's (a prompt or a chunk
        of one, or a token and its drafts). Returns each span's logits: its last row ([1, vocab]), or for the spans in
        ``every_row`` each of its rows' ([T, vocab]). The decode rows' logits stay in ``state.logits``; in a pipeline
        with micro-batches, a step of several decode rows goes through the ranks in pieces (``follower.micro_batched``).
        ``bound``: the rows read only the first ``bound`` keys of each slot (a decode step's key bound,
        ``Runner._bound``; a step with spans, what the cache holds, ``Slots.capacity``)."""
        table = state if self.reads_table(rows, spans) else None
        wanted: list[range] = []
        if not spans and self.pipeline is not None and rows > 1 and self.settings.micro_batches:
            logits = micro_batched(self, state, cache, boundaries, rows, layer_math(self.settings.compile), table,
                                   bound, _sliced(self.backend))
        else:
            logits, wanted = self._one_pass(state, cache, boundaries, rows, spans, every_row, table, bound)
        if table is not None and self.landing is not None:
            state.landed.copy_(self.backend.landing_state())  # read back with the tokens: what the step landed
        if rows:
            state.tokens[:rows].copy_(torch.argmax(logits[:rows], dim=-1))  # a grammar's rows: ``pick_masked``
            state.bad[:rows].copy_(~torch.isfinite(logits[:rows]).all(dim=-1))
            state.positions[:rows].add_(state.live[:rows])
        state.logits = logits[:rows]
        return list(logits[rows:].split([len(w) for w in wanted])) if spans else []

    def _one_pass(self, state: DecodeState, cache: list[KVCache], boundaries: Iterable[Boundary], rows: int,
                  spans, every_row: frozenset[int], table: DecodeState | None,
                  bound: int | None = None) -> tuple[torch.Tensor, list[range]]:
        """``decode_step``'s pass over its rows at once: the logits of the decode rows, then of each span's rows it
        keeps (which: the second item)."""
        backend = self.backend
        positions, slots = state.positions[:rows], state.slot_ids[:rows]
        sliced = _sliced(backend)
        live = state.live[:rows] if sliced else None  # a row-exact backend skips a parked row's attention
        if not spans:
            at = Attend.static(state.rope, positions, slots, state.key_positions, row_exact=backend.row_exact, live=live,
                               sliced=sliced, bound=bound)
            h = self._embedded(state.tokens[:rows])
        else:
            device = backend.device
            span_positions = torch.cat([torch.arange(s.start, s.start + s.T, device=device) for s, _ in spans])
            span_slots = torch.cat([torch.full((s.T,), s.slot, dtype=torch.long, device=device) for s, _ in spans])
            at = Attend.static(state.rope, positions, slots, state.key_positions, tuple(s for s, _ in spans),
                               span_positions, span_slots, row_exact=backend.row_exact, live=live, sliced=sliced,
                               bound=bound)
            ids = [t for _, chunk in spans for t in chunk]
            h = self._embedded(torch.cat((state.tokens[:rows], torch.tensor(ids, device=device))))
        phase = "decode" if not spans else "prefill"
        compiled = layer_math(self.settings.compile) if not spans else decoder_layer
        h = timed(self, lambda: self.layers(h, at, cache, boundaries, phase, compiled, table=table))
        wanted = [range(s.row, s.row + s.T) if i in every_row else range(s.row + s.T - 1, s.row + s.T)
                  for i, (s, _) in enumerate(spans)]
        picked = torch.tensor([*range(rows), *(r for w in wanted for r in w)], device=h.device) if spans else None
        return self._logits(h, picked), wanted

    def _embedded(self, ids: torch.Tensor) -> torch.Tensor:
        """The step's input to this run's layers: the tokens' embeddings, or, past a pipeline's first rank, the
        hidden state the rank before sends."""
        pipe, backend = self.pipeline, self.backend
        if pipe is None or pipe.first:
            return backend.embed(ids)
        return pipe.hidden_in(ids.numel(), self.cfg.hidden_size, backend.dtype, backend.device)

    def _logits(self, h: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The logits of ``h``'s ``rows`` (float32; None: every row); in a pipeline this rank's output goes on to the
        next rank, and rank 0 gets the last rank's logits (a rank between gets zeros: it chooses no token)."""
        pipe, backend = self.pipeline, self.backend
        if pipe is not None and not pipe.last:
            pipe.hidden_out(h)
            n = h.shape[0] if rows is None else rows.numel()
            return pipe.logits(None, n, self.cfg.vocab_size, backend.device)
        logits = backend.logits(h if rows is None else h.index_select(0, rows))
        return logits if pipe is None else pipe.logits(logits, logits.shape[0], self.cfg.vocab_size, backend.device)


def _sliced(backend) -> bool:
    """Whether a row-exact backend's rows read their positions on the host to attend over the keys in use: where its
    steps are never captured (a captured step replays whatever the host read when it was captured)."""
    return backend.row_exact and not backend.captures

