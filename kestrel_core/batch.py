"""The token loop: a batch of sequences decoding together, one pass over the layers a step, joining and leaving.

Each sequence holds a KV slot. A step is one pass of the runner: the next token of every decoding sequence (a row
each), and beside them a chunk of a new sequence's prompt, so that a long prompt does not stall the others. One pass
serves every row with the same plans, so the bytes a step streams are shared by its rows. A step whose rows are all
decode rows and whose plan repeats is replayed as a captured graph, one a batch size (``BUCKETS``).

Greedy rows never make the host wait before the next step: each step's tokens (and non-finite flags, and where the
step read the expert table, its routing) are copied to host memory without a wait and read one step later, so a
step may run past a sequence's end. That row is dropped, with its counters, and ``on_token`` hears of a token only
once it is read back: exactly the tokens of the result, in order. A step with a sampled row is read at once.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable

import attrs
import torch

from .config import GenerationConfig
from .errors import ConfigError, KestrelError
from .kvcache import allocate_cache
from .model import RopeTable, Span
from .plan import delta
from .results import MODES, GenerationResult
from .runner import Runner
from .sampling import Sampler
from .step_graphs import StepGraphs

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # decode rows a captured step is made for: a batch pads up to one


def check_batch(max_batch, prefill_chunk) -> None:
    """A ConfigError naming the setting where ``max_batch`` (1..the largest bucket) or ``prefill_chunk`` (>= 1, or
    None: a whole prompt a step) is not one a Batch can run with."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or not 1 <= max_batch <= BUCKETS[-1]:
        raise ConfigError(f"max_batch must be a whole number in 1..{BUCKETS[-1]}, got {max_batch!r}")
    if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                      or prefill_chunk < 1):
        raise ConfigError(f"prefill_chunk must be a whole number >= 1 (or None: a whole prompt a step), "
                          f"got {prefill_chunk!r}")


def bucket(rows: int, slots: int) -> int:
    return min(next((b for b in BUCKETS if b >= rows), rows), slots)


@attrs.define(eq=False)
class Request:
    """One sequence to generate: its prompt ids (checked by the caller), settings, and what ends it."""

    prompt_ids: list[int]
    gen: GenerationConfig
    eos_ids: frozenset[int] = frozenset()
    keep_logits: bool = False
    on_token: Callable[[int], None] | None = None
    on_finish: Callable[["Sequence"], None] | None = None  # once done (result or error set), on the batch's thread


@attrs.define(eq=False)
class _Pass:
    """One step: the counters around its plans (and around hearing its routing, a step later), how it ran, its mark."""

    before: dict[str, int]
    after: dict[str, int]
    mode: str
    mark: object
    rows: dict[int, "Sequence"]  # slot -> the sequence whose token the step made there
    decode_index: int  # its number among the steps with no prompt rows (the expert schedule counts those); -1 if it had
    heard: dict[str, int] = attrs.Factory(dict)
    table: bool = False  # whether its routing comes back in its row (a one-row step that read the expert table)


@attrs.define(eq=False)
class Sequence:
    """A request as it runs: its slot, the tokens read back so far, and, once done, its result or its error."""

    request: Request
    id: int = -1  # numbered, and given its sampler, by the batch that takes it
    sampler: Sampler | None = None
    slot: int = -1
    prefilled: int = 0  # prompt tokens through the layers so far
    tokens: list[int] = attrs.Factory(list)
    launched: int = 0  # decode steps launched for it (read back or not)
    passes: list[int] = attrs.Factory(list)  # the steps whose token it kept (its decode steps)
    prefill_passes: list[int] = attrs.Factory(list)
    prefill_ms: float = 0.0
    logits: list[torch.Tensor] = attrs.Factory(list)
    done: bool = False
    finish_reason: str | None = None  # "stop", "length", "cancelled" or "error"
    error: Exception | None = None
    result: GenerationResult | None = None
    cancelled: threading.Event = attrs.Factory(threading.Event)
    finished: threading.Event = attrs.Factory(threading.Event)

    def cancel(self) -> None:
        """Stop it at the next step; its slot is freed then."""
        self.cancelled.set()

    def end(self, reason: str, error: Exception | None = None) -> None:
        """Mark it done with ``reason`` (its result, if any, already set), wake its waiters and tell ``on_finish``."""
        if error is not None:
            self.error = error
        self.done, self.finish_reason = True, reason
        self.finished.set()
        if self.request.on_finish is not None:
            self.request.on_finish(self)

    @property
    def decoding(self) -> bool:
        return not self.done and self.prefilled == len(self.request.prompt_ids)


class Batch:
    """Sequences decoding together on ``runner``, each in one of ``slots`` KV slots of ``max_seq`` positions.
    ``prefill_chunk``: prompt tokens a step takes beside the decode rows (None: a whole prompt in one step)."""

    def __init__(self, runner: Runner, slots: int, max_seq: int, prefill_chunk: int | None = None):
        self.runner, self.slots, self.max_seq, self.prefill_chunk = runner, slots, max_seq, prefill_chunk
        backend, cfg = runner.backend, runner.cfg
        self.cache = allocate_cache(cfg, max_seq, backend.dtype, backend.device, slots)
        self.rope = RopeTable(cfg, max_seq, backend.dtype, backend.device)
        self.state = runner.decode_state(self.rope, slots, max_seq)
        self.ring = torch.zeros((4, self.state.out.numel()), dtype=torch.long, pin_memory=backend.device.type == "cuda")
        self.graphs: dict[int, StepGraphs] = {}
        self.free = list(range(slots))
        self.active: dict[int, Sequence] = {}  # slot -> its sequence
        self.waiting: deque[Sequence] = deque()
        self.passes: list[_Pass] = []
        self.unread: deque[int] = deque()  # steps launched whose row is not read back yet
        self.ids = 0
        self.started = False
        self.t0 = None  # the mark before the first step
        self.decode_steps = 0
        self._live: dict[int, int] = {}  # what the device's live flags hold, by slot

    # --- sequences ---------------------------------------------------------------------------------------
    def add(self, request: Request, seq: Sequence | None = None) -> Sequence:
        """Queue a sequence (``seq``, where another thread made it for ``request`` and holds it); it joins at a step
        that has a free slot for it."""
        total = len(request.prompt_ids) + request.gen.max_new_tokens
        if total > self.max_seq:
            raise KestrelError(f"this sequence needs {total} positions and the batch's slots hold {self.max_seq}")
        if seq is None:
            seq = Sequence(request)
        seq.id, seq.sampler = self.ids, Sampler(request.gen)
        self.ids += 1
        self.waiting.append(seq)
        return seq

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active or self.unread)

    def run_until_done(self) -> None:
        while self.busy:
            self.step()

    # --- one step ---------------------------------------------------------------------------------------
    def step(self) -> None:
        """Admit, launch one pass (decode rows, and a prompt chunk where one waits), and read back what is due."""
        runner, window, backend, counters, state = self.runner, self.runner.window, self.runner.backend, \
            self.runner.counters, self.state
        self._drop_cancelled()
        while self.waiting and self.free:
            seq = self.waiting.popleft()
            seq.slot = self.free.pop(0)
            self.active[seq.slot] = seq
            # Until it decodes, its slot's decode row (computed with the others, its output dropped) writes at the last
            # position, which its prompt never reaches and its own token overwrites before any query reads it.
            state.positions[seq.slot].fill_(self.max_seq - 1)
        rows_live = {slot: seq for slot, seq in self.active.items()
                     if seq.decoding and 1 + seq.launched < seq.request.gen.max_new_tokens and not seq.done}
        prefilling = [s for s in self.active.values() if not s.done and s.prefilled < len(s.request.prompt_ids)]
        if not rows_live and not prefilling:
            if self.unread:
                self._take(self.unread.popleft())
            return
        if not self.started:
            self.started = True
            runner.preload()
            backend.synchronize()
            self.t0 = backend.mark()
        else:
            window.next_token()
        rows = bucket(max(rows_live) + 1, self.slots) if rows_live else 0
        self._set_live(rows_live, rows)
        # Every waiting prompt rides this pass, in the order they came, up to prefill_chunk tokens in all: a streamed
        # layer serves them all at once.
        spans, budget, row = [], self.prefill_chunk, rows
        for seq in prefilling:
            if budget is not None and budget <= 0:
                break
            prompt = seq.request.prompt_ids
            n = len(prompt) - seq.prefilled if budget is None else min(budget, len(prompt) - seq.prefilled)
            spans.append((seq, Span(seq.slot, row, seq.prefilled, n), prompt[seq.prefilled:seq.prefilled + n]))
            row += n
            budget = None if budget is None else budget - n
        table = runner.reads_table(rows, spans)
        if not spans:
            runner.begin_step()
        before = counters.snapshot()
        last_logits = None
        if not spans:
            graphs = self.graphs.setdefault(rows, StepGraphs(window, backend, runner.settings.graphs,
                                                             experts_in_step=runner.reads_table(rows),
                                                             on_replay=runner.replayed))
            mode = graphs(lambda boundaries: runner.decode_step(state, self.cache, boundaries, rows))
        else:
            mode = "eager"
            last_logits = runner.decode_step(state, self.cache, window.boundaries("prefill"), rows,
                                             [(sp, ids) for _, sp, ids in spans])
        after = counters.snapshot()
        for seq in rows_live.values():
            seq.launched += 1
        k = len(self.passes)
        sampled = [seq for seq in rows_live.values() if seq.request.gen.temperature > 0]
        for seq in sampled:  # the sampler reads the logits on the host anyway: check them there
            logits = state.logits[seq.slot]
            if not bool(torch.isfinite(logits).all()):
                self._fail(seq, runner.nonfinite([seq.tokens[-1]], len(seq.request.prompt_ids) + len(seq.tokens) - 1,
                                                 self.cache, self.rope, "decode", seq.slot))
                continue
            token = self._sample(seq, logits)
            if token is not None:
                state.tokens[seq.slot].fill_(token)
        self.ring[k % len(self.ring)].copy_(state.out, non_blocking=True)
        mark = backend.mark()
        self.passes.append(_Pass(before, after, mode, mark, dict(rows_live), self.decode_steps if not spans else -1,
                                 table=table))
        if not spans:
            self.decode_steps += 1
        for seq in rows_live.values():
            if seq.request.keep_logits:
                seq.logits.append(state.logits[seq.slot].clone())
        for i, (seq, sp, _) in enumerate(spans):
            self._prefilled(seq, sp, last_logits[i], k)
        self.unread.append(k)
        lag = 0 if sampled else 1
        while len(self.unread) > lag:
            self._take(self.unread.popleft())

    def _set_live(self, rows_live: dict[int, Sequence], rows: int) -> None:
        """Each of the first ``rows`` slots moves on this step where its sequence decodes (a device write on a change)."""
        for slot in range(rows):
            want = 1 if slot in rows_live else 0
            if self._live.get(slot) != want:
                self.state.live[slot].fill_(want)
                self._live[slot] = want

    def _prefilled(self, seq: Sequence, span: Span, logits: torch.Tensor, k: int) -> None:
        """A prompt chunk went through: where it was the last, its logits give the first token, on the host now."""
        runner, state = self.runner, self.state
        seq.prefilled += span.T
        seq.prefill_passes.append(k)
        if seq.prefilled < len(seq.request.prompt_ids):
            return
        prompt = seq.request.prompt_ids
        if not bool(torch.isfinite(logits).all()):
            start = span.start
            self._fail(seq, runner.nonfinite(prompt[start:], start, self.cache, self.rope, "prefill", seq.slot))
            return
        token = self._sample(seq, logits)
        if token is None:
            return
        first = seq.prefill_passes[0]
        seq.prefill_ms = runner.backend.elapsed_ms(self.passes[first - 1].mark if first else self.t0, self.passes[k].mark)
        if seq.request.keep_logits:
            seq.logits.insert(0, logits.clone())
        state.tokens[seq.slot].fill_(token)
        state.positions[seq.slot].fill_(len(prompt))
        self._hear_token(seq, token)

    def _take(self, k: int) -> None:
        """Read step k back: each of its rows' tokens goes to its sequence (and its routing to the window)."""
        p = self.passes[k]
        backend = self.runner.backend
        backend.wait(p.mark)
        row = self.ring[k % len(self.ring)].tolist()
        slots = self.slots
        if p.table and any(not seq.done for seq in p.rows.values()):
            width = self.state.routed.shape[1]
            before = self.runner.counters.snapshot()
            self.runner.hear(p.decode_index, [row[i:i + width] for i in range(2 * slots, len(row), width)])
            p.heard = delta(self.runner.counters.snapshot(), before)
        for slot, seq in p.rows.items():
            if seq.done:
                continue  # a step launched past its end: dropped
            if row[slots + slot]:
                pos = len(seq.request.prompt_ids) + len(seq.tokens) - 1
                self._fail(seq, self.runner.nonfinite([seq.tokens[-1]], pos, self.cache, self.rope, "decode", slot))
                continue
            seq.passes.append(k)
            self._hear_token(seq, row[slot])

    def _hear_token(self, seq: Sequence, token: int) -> None:
        seq.tokens.append(token)
        if seq.request.on_token:
            seq.request.on_token(token)
        gen = seq.request.gen
        if gen.stop_at_eos and token in seq.request.eos_ids:
            self._finish(seq, "stop")
        elif len(seq.tokens) >= gen.max_new_tokens:
            self._finish(seq, "length")

    def _drop_cancelled(self) -> None:
        for seq in list(self.waiting):
            if seq.cancelled.is_set():
                self.waiting.remove(seq)
                self._finish(seq, "cancelled")
        for seq in list(self.active.values()):
            if seq.cancelled.is_set() and not seq.done:
                self._finish(seq, "cancelled")

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> int | None:
        """The sequence's next token; None where its sampler failed: that sequence ends with the error, the batch
        (a server's every other request) goes on."""
        try:
            return seq.sampler(logits)
        except Exception as exc:  # noqa: BLE001 - one sequence's settings, not the batch's state
            self._fail(seq, exc)
            return None

    def _fail(self, seq: Sequence, error: Exception) -> None:
        seq.error = error
        self._finish(seq, "error")

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.done, seq.finish_reason = True, reason
        if seq.slot >= 0 and self.active.get(seq.slot) is seq:
            del self.active[seq.slot]
            self.free.append(seq.slot)
            self.free.sort()
        if reason != "error":
            seq.result = self._result(seq)
        seq.end(reason)

    def _result(self, seq: Sequence) -> GenerationResult:
        backend = self.runner.backend
        kept = [self.passes[k] for k in seq.passes]
        decode_ms = [backend.elapsed_ms(self.passes[k - 1].mark, self.passes[k].mark) for k in seq.passes]
        final = self.runner.counters.snapshot()
        last = seq.passes[-1] if seq.passes else (seq.prefill_passes[-1] if seq.prefill_passes else -1)
        for p in self.passes[last + 1:]:  # launched past its last token: dropped from its counters
            if any(s is seq for s in p.rows.values()):
                final = {k: v - p.after[k] + p.before[k] if not k.startswith(("peak_", "resident_")) else v
                         for k, v in final.items()}
        logits = [t.cpu() for t in seq.logits[: len(seq.tokens)]] if seq.request.keep_logits else None
        return GenerationResult(
            prompt_ids=list(seq.request.prompt_ids),
            token_ids=list(seq.tokens),
            prefill_ms=seq.prefill_ms,
            decode_ms=decode_ms,
            counters=final,
            per_token=[{**_plus(delta(p.after, p.before), p.heard), "sequences_in_step": len(p.rows)} for p in kept],
            memory=backend.memory_stats(),
            fixed_resident_bytes=self.fixed_resident_bytes,
            logits=logits,
            steps={m: sum(p.mode == m for p in kept) for m in MODES},
            step_modes=[p.mode for p in kept],
        )

    # --- the batch's life --------------------------------------------------------------------------------
    def __enter__(self) -> "Batch":
        self.fixed_resident_bytes = self.runner.counters.resident_bytes
        self._torch_mode = torch.inference_mode()
        self._torch_mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for graphs in self.graphs.values():
            graphs.close()
        self._torch_mode.__exit__(*exc)


def _plus(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: v + b.get(k, 0) for k, v in a.items()}


def generate_one(runner: Runner, prompt_ids: list[int], gen: GenerationConfig, eos_ids: frozenset[int],
                 keep_logits: bool = False, on_token: Callable[[int], None] | None = None) -> GenerationResult:
    """Generate from ``prompt_ids`` (checked by the caller): a batch of one. ``on_token(id)`` is called with each token
    of the result as soon as it is read back (the first from the prefill); ``eos_ids`` end the generation where
    ``gen.stop_at_eos``."""
    with Batch(runner, slots=1, max_seq=len(prompt_ids) + gen.max_new_tokens) as batch:
        seq = batch.add(Request(list(prompt_ids), gen, eos_ids, keep_logits=keep_logits, on_token=on_token))
        batch.run_until_done()
    if seq.error is not None:
        raise seq.error
    return seq.result
