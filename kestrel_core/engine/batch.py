"""The token loop: a batch of sequences decoding together, one pass over the layers a step, joining and leaving.

Each sequence holds a KV slot. A step is one pass of the runner: the next token of every decoding sequence (a row
each), and beside them a chunk of a new sequence's prompt, so that a long prompt does not stall the others. One pass
serves every row with the same plans, so the bytes a step streams are shared by its rows. A step whose rows are all
decode rows and whose plan repeats is replayed as a captured graph, one a batch size (``BUCKETS``).

A sequence whose request asks for ``logprobs`` gets each token's log-probability (and its top alternatives) computed
where the token is chosen: from the step's logits of its row, on the device, in the same step (a greedy row's are read
back with its token, a step late). ``on_logprobs`` hears them just before ``on_token`` hears the token; other
sequences pay nothing.

Greedy rows never make the host wait before the next step: each step's tokens (and non-finite flags, and where the
step read the expert table, its routing) are copied to host memory without a wait and read one step later, so a
step may run past a sequence's end. That row is dropped, with its counters, and ``on_token`` hears of a token only
once it is read back: exactly the tokens of the result, in order. A step with a sampled row is read at once.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

import attrs
import torch

from kestrel_core.config import GenerationConfig
from kestrel_core.engine.contracts import Drafter, Drafting
from kestrel_core.errors import BudgetError, ConfigError, KestrelError
from kestrel_core.engine.limits import RequestLimits
from kestrel_core.engine.model import Span
from kestrel_core.engine.plan import delta
from kestrel_core.engine.results import MODES, GenerationResult, TokenLogprobs
from kestrel_core.engine.probe import nonfinite
from kestrel_core.engine.runner import Runner
from kestrel_core.engine.step import Launched, StepRequest
from kestrel_core.engine.sampling import Constraint, Sampler, check_logprobs, token_logprobs
from kestrel_core.engine.speculative import SpecStats, accept, begin_drafting, check_draft

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # decode rows a captured step is made for: a batch pads up to one

SOLO_KV_FIX = "lower max_new_tokens (--max-new-tokens) or shorten the prompt"  # one sequence's KV cache too large


# Prompt tokens a step takes beside the decoding rows, by default: where the step's weights stay put, a chunk bounds how
# long the decoding rows wait; where each chunk streams its layers' routed experts (a MoE model under an expert policy)
# a step costs about as much at 512 tokens as at 8,192 (on an H100, 8 layers of the 30B-A3B shape at the 4 GiB-eq
# budget: 180.8 ms a whole 512-token prompt, 264.7 ms a whole 8,192; 8,192 tokens took 3,150 ms in chunks of 512, 269
# whole: bench/results/moe-prefill_20261206T052705Z.json), so the rows wait least behind the largest chunk there
PREFILL_CHUNK = 512
STREAMED_EXPERTS_PREFILL_CHUNK = 8192


LEFT_OUT_CHUNK = f"{PREFILL_CHUNK}, or {STREAMED_EXPERTS_PREFILL_CHUNK} for a MoE model under an expert policy"


def default_prefill_chunk(streams_experts: bool) -> tuple[int, str]:
    """The prompt chunk a server's steps take where none is given, and why."""
    if streams_experts:
        return STREAMED_EXPERTS_PREFILL_CHUNK, ("each chunk streams its layers' routed experts, which costs a step about "
                                                "as much at 512 tokens as at 8,192")
    return PREFILL_CHUNK, "the decoding sequences wait for at most this many prompt tokens a step"


def check_batch(max_batch, prefill_chunk, names: tuple[str, str] = ("max_batch", "prefill_chunk"),
                left_out: str = "a whole prompt a step") -> None:
    """A ConfigError naming the setting (as its door calls it: ``names``) where ``max_batch`` (1..the largest bucket)
    or ``prefill_chunk`` (>= 1, or None: ``left_out``) is not one a Batch can run with."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or not 1 <= max_batch <= BUCKETS[-1]:
        raise ConfigError(f"{names[0]} must be a whole number in 1..{BUCKETS[-1]}, got {max_batch!r}")
    if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                      or prefill_chunk < 1):
        hint = f" (or left out: {left_out})" if left_out else ""
        raise ConfigError(f"{names[1]} must be a whole number >= 1{hint}, got {prefill_chunk!r}")


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
    drafter: Drafter | None = None  # speculative decoding: proposes up to ``draft_tokens`` a step, verified in the step
    draft_tokens: int = 0
    logprobs: int | None = None  # each token's log-probability and this many alternatives (0..20); None: not computed
    on_logprobs: Callable[[TokenLogprobs], None] | None = None  # a token's, just before ``on_token`` hears it
    constraint: Callable[[], Constraint] | None = None  # makes each sequence's constraint (a grammar's state)
    # each prompt token's log-probability after the first, and this many alternatives (0..20); None: not computed
    prompt_logprobs: int | None = None
    sampler: Sampler | None = None  # draws its tokens (None: one made from ``gen``); a caller drawing on across requests
    # prompt tokens already in the KV slot it takes, left there by the sequence before it in a batch of one slot (a
    # draft run's, ``engine.draft_run``): it prefills from there
    cached: int = 0

    def check(self) -> None:
        """What it asks beside its tokens is in range (a ConfigError naming it)."""
        check_logprobs(self.logprobs)
        check_logprobs(self.prompt_logprobs)
        if not 0 <= self.cached < len(self.prompt_ids):
            raise ConfigError(f"cached must be in 0..{len(self.prompt_ids) - 1} (prompt tokens already in the slot; at "
                              f"least the last goes through), got {self.cached}")


@attrs.define(eq=False)
class _Pass:
    """One step: as the runner launched it, the sequences whose tokens it made, and the counters of hearing its
    routing (a step later)."""

    launched: Launched
    rows: dict[int, "Sequence"]  # slot -> the sequence whose token the step made there (a decode row)
    verified: dict[int, "Sequence"] = attrs.Factory(dict)  # slot -> the sequence whose drafts it verified (a span)
    heard: dict[str, int] = attrs.Factory(dict)
    logprobs: dict[int, tuple] = attrs.Factory(dict)  # slot -> its row's log-probabilities, on the device (asked for)

    @property
    def mode(self) -> str:
        return self.launched.mode

    @property
    def decode_index(self) -> int:
        return self.launched.decode_index

    @property
    def table(self) -> bool:
        return self.launched.table


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
    logprobs: list[TokenLogprobs] = attrs.Factory(list)  # each token's, where its request asks
    prompt_logprobs: list[TokenLogprobs] = attrs.Factory(list)  # its prompt's tokens' after the first, where asked
    leader: "Sequence | None" = None  # the sequence whose prefill of the same prompt this one shares (its KV copied)
    followers: list["Sequence"] = attrs.Factory(list)  # the sequences that share this one's prefill
    drafting: Drafting | None = None  # what drafts for it (its request's drafter, begun on its prompt)
    spec: SpecStats | None = None
    kept: list[int] = attrs.Factory(list)  # tokens each of its passes kept (speculative decoding)
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
    ``prefill_chunk``: prompt tokens a step takes beside the decode rows (None: a whole prompt in one step).

    The batch schedules (who joins, which rows and spans a step carries) and reads (each row's token to its sequence);
    the runner runs each step."""

    def __init__(self, runner: Runner, slots: int, max_seq: int, prefill_chunk: int | None = None,
                 fix: str = SOLO_KV_FIX):
        """``fix``: what the caller's user changes where the KV cache of ``slots`` x ``max_seq`` cannot be had."""
        self.runner, self.slots, self.max_seq, self.prefill_chunk = runner, slots, max_seq, prefill_chunk
        try:
            self.dev = runner.open_slots(slots, max_seq, fix)
        except BudgetError as exc:
            raise BudgetError(f"{exc}; {fix}") from None
        self.free = list(range(slots))
        self.active: dict[int, Sequence] = {}  # slot -> its sequence
        self.waiting: deque[Sequence] = deque()
        self.passes: list[_Pass] = []
        self.unread: deque[int] = deque()  # steps launched whose row is not read back yet
        self.ids = 0
        self.fixed_resident_bytes = runner.resident_bytes

    # --- sequences ---------------------------------------------------------------------------------------
    def add(self, request: Request, seq: Sequence | None = None) -> Sequence:
        """Queue a sequence (``seq``, where another thread made it for ``request`` and holds it); it joins at a step
        that has a free slot for it."""
        RequestLimits(self.max_seq, "this batch").budget(request.gen.max_new_tokens, len(request.prompt_ids))
        request.check()
        if request.cached and self.slots != 1:
            raise ConfigError(f"a request with cached prompt tokens needs a batch of one slot (the slot its last "
                              f"sequence wrote), and this one has {self.slots}")
        if seq is None:
            seq = Sequence(request)
        seq.id, seq.prefilled = self.ids, request.cached
        seq.sampler = request.sampler or Sampler(request.gen, request.constraint() if request.constraint else None,
                                                 self.runner.masks_on_device)
        if request.drafter is not None:
            seq.drafting, seq.spec = begin_drafting(request.drafter, request.prompt_ids), SpecStats()
        self.ids += 1
        self.waiting.append(seq)
        return seq

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active or self.unread)

    def run_until_done(self) -> None:
        while self.busy:
            self.step()

    def forget(self) -> None:
        """Drop the records of the steps taken so far, the batch idle (one that lives across many requests, a draft
        run's, keeps no step of a sequence done)."""
        if self.busy:
            raise KestrelError("a batch forgets its steps only when idle: no sequence waiting, running or unread")
        self.passes.clear()

    # --- one step: schedule, run, read -----------------------------------------------------------------------
    def step(self) -> None:
        """Admit; ask each drafting sequence for its drafts; launch one step (decode rows, then verify spans, then
        prompt chunks where they wait); read back what is due."""
        self._drop_cancelled()
        while self.waiting and self.free:
            seq = self.waiting.popleft()
            seq.slot = self.free.pop(0)
            self.active[seq.slot] = seq
            self.runner.park(self.dev, seq.slot)
            self._share_prefill(seq)
        verify = self._drafts()
        rows_live = {slot: seq for slot, seq in self.active.items()
                     if seq.decoding and not seq.done and slot not in verify and self._wants_a_row(seq)}
        prefilling = [s for s in self.active.values()
                      if not s.done and s.leader is None and s.prefilled < len(s.request.prompt_ids)]
        if not rows_live and not prefilling and not verify:
            if self.unread:
                self._take(self.unread.popleft())
            return
        rows = bucket(max(rows_live) + 1, self.slots) if rows_live else 0
        spans, row = [], rows
        for slot, (draft, _) in verify.items():  # the last token and its drafts, each row's logits back
            seq = self.active[slot]
            ids = (seq.tokens[-1], *draft)
            start = len(seq.request.prompt_ids) + len(seq.tokens) - 1
            spans.append((seq, Span(slot, row, start, len(ids), verify=True), ids))
            row += len(ids)
        # Every waiting prompt rides this step, in the order they came, up to prefill_chunk tokens in all: a streamed
        # layer serves them all at once.
        budget = self.prefill_chunk
        for seq in prefilling:
            if budget is not None and budget <= 0:
                break
            prompt = seq.request.prompt_ids
            n = len(prompt) - seq.prefilled if budget is None else min(budget, len(prompt) - seq.prefilled)
            spans.append((seq, Span(seq.slot, row, seq.prefilled, n), tuple(prompt[seq.prefilled:seq.prefilled + n])))
            row += n
            budget = None if budget is None else budget - n
        sampled = tuple(slot for slot, seq in rows_live.items() if seq.sampler.on_host)
        # A verify span's rows all come back, and a prompt chunk's where its request asks for the prompt's logprobs.
        every_row = frozenset(i for i, (seq, _, _) in enumerate(spans)
                              if i < len(verify) or seq.request.prompt_logprobs is not None)
        request = StepRequest(rows, frozenset(rows_live), tuple((sp, ids) for _, sp, ids in spans), every_row, sampled)
        masked = {slot: seq for slot, seq in rows_live.items() if seq.sampler.masks_on_device}
        launched = self.runner.step(self.dev, request, self._sample_row,
                                    (lambda: self._masks(masked)) if masked else None)
        for seq in rows_live.values():
            seq.launched += 1
        k = len(self.passes)
        self.passes.append(_Pass(launched, dict(rows_live), {slot: self.active[slot] for slot in verify},
                                 logprobs=self._row_logprobs(rows_live)))
        for seq in rows_live.values():
            if seq.request.keep_logits and not seq.done:
                seq.logits.append(self.runner.decode_logits(self.dev, seq.slot).clone())
        for i, (seq, sp, ids) in enumerate(spans):
            if i < len(verify):
                self._verified(seq, sp, ids, verify[seq.slot][1], launched.span_logits[i], k)
            else:
                self._prefilled(seq, sp, launched.span_logits[i], k)
        self.unread.append(k)
        # read at once where the host chose a token or where drafts wait on it (a masked row's is read in the next step)
        lag = 0 if sampled or any(seq.drafting is not None for seq in rows_live.values()) else 1
        while len(self.unread) > lag:
            self._take(self.unread.popleft())

    def _wants_a_row(self, seq: Sequence) -> bool:
        """Whether a decoding sequence needs another token (a greedy row read a step late counts its step launched)."""
        if seq.drafting is not None:  # read back at once: its tokens are all known
            return len(seq.tokens) < seq.request.gen.max_new_tokens
        return 1 + seq.launched < seq.request.gen.max_new_tokens

    def _drafts(self) -> dict[int, tuple[list[int], list | None]]:
        """Each drafting sequence's drafts for this step (by slot), where it proposed any: it rides as a verify span.
        One that proposes none decodes as a row."""
        out = {}
        for slot, seq in list(self.active.items()):  # a drafter's error ends its sequence: it leaves active
            if seq.drafting is None or seq.done or not seq.decoding:
                continue
            gen = seq.request.gen
            room = gen.max_new_tokens - len(seq.tokens) - 1  # the pass adds one token of the target's own
            k = min(seq.request.draft_tokens, room)
            if k <= 0:
                continue
            t0 = time.perf_counter()
            try:
                draft, probs = seq.drafting.propose(list(seq.request.prompt_ids) + seq.tokens, k)
                draft = check_draft(seq.request.drafter, draft, probs, k, self.runner.vocab_size)
            except Exception as exc:  # noqa: BLE001 - one sequence's drafter, not the batch's state
                self._fail(seq, exc)
                continue
            seq.spec.draft_ms += (time.perf_counter() - t0) * 1e3
            if draft:
                out[slot] = (draft, probs)
                self.runner.park(self.dev, slot)  # its decode row, if the step has one, writes nowhere read
        return out

    def _verified(self, seq: Sequence, span: Span, ids: tuple[int, ...], probs, logits: torch.Tensor, k: int) -> None:
        """A verify span went through: keep the drafts the target agrees with and one token of its own (stopping at
        an end), then place the slot's next decode row after them."""
        draft = list(ids[1:])
        bad = ~torch.isfinite(logits).all(dim=-1)
        if bool(bad.any()):
            row = int(bad.nonzero()[0])
            self._fail(seq, nonfinite(self.runner, self.dev, list(ids[: row + 1]), span.start, "decode", seq.slot))
            return
        try:
            n, own = accept(logits, draft, probs, seq.sampler, seq.request.gen.temperature == 0)
        except Exception as exc:  # noqa: BLE001 - one sequence's settings, not the batch's state
            self._fail(seq, exc)
            return
        seq.spec.drafted += len(draft)
        seq.spec.accepted += n
        kept = draft[:n] + [own]
        ends = next((i + 1 for i, token in enumerate(kept) if self._ends(seq, token, len(seq.tokens) + i + 1)), None)
        kept = kept[:ends]  # an end inside the pass: what follows it is dropped
        seq.passes.append(k)
        seq.kept.append(len(kept))
        lps = self._logprobs(seq, logits[: len(kept)], kept)
        for i, token in enumerate(kept):
            if seq.request.keep_logits:
                seq.logits.append(logits[i].clone())
            self._hear_token(seq, token, lps[i] if lps else None)
        if not seq.done:
            seq.drafting.accepted(list(seq.request.prompt_ids) + seq.tokens)
            self.runner.place(self.dev, seq.slot, len(seq.request.prompt_ids) + len(seq.tokens) - 1, seq.tokens[-1])

    def _masks(self, masked: dict[int, Sequence]) -> tuple[tuple[int, torch.Tensor], ...]:
        """The masks this step holds its greedy constrained rows to on the device, by slot (``Sampler.mask``), asked
        by ``Runner.step`` once the step's pass is launched, so this runs beside it: every step not read yet is read
        first (each grammar moves on past its row's last token), then each row whose sequence goes on gets its mask.
        A sequence that ended there, or whose grammar fails here (it ends with the error), rode the step as a row read
        past its end: dropped."""
        while self.unread:
            self._take(self.unread.popleft())
        out = []
        for slot, seq in masked.items():
            if seq.done:
                continue
            try:
                out.append((slot, seq.sampler.mask(self.runner.vocab_size)))
            except Exception as exc:  # noqa: BLE001 - one sequence's grammar, not the batch's state
                self._fail(seq, exc)
        return tuple(out)

    def _sample_row(self, slot: int, logits: torch.Tensor) -> int | None:
        """A sampled row's next token, drawn on the host (which reads its logits anyway, so checks them there)."""
        seq = self.active[slot]
        if not bool(torch.isfinite(logits).all()):
            pos = len(seq.request.prompt_ids) + len(seq.tokens) - 1
            self._fail(seq, nonfinite(self.runner, self.dev, [seq.tokens[-1]], pos, "decode", slot))
            return None
        return self._sample(seq, logits)

    def _share_prefill(self, seq: Sequence) -> None:
        """Where a sequence still in its prefill has the same prompt (a request's ``n`` choices, or two requests that
        send one prompt), ``seq`` waits for it, then takes a copy of its keys and values and its last logits: the
        prompt goes through the layers once."""
        if seq.prefilled:
            return
        for other in self.active.values():
            if (other is not seq and other.leader is None and not other.done
                    and other.prefilled < len(other.request.prompt_ids)
                    and other.request.prompt_ids == seq.request.prompt_ids
                    and other.request.prompt_logprobs == seq.request.prompt_logprobs):
                seq.leader = other
                other.followers.append(seq)
                return

    def _prefilled(self, seq: Sequence, span: Span, rows: torch.Tensor, k: int) -> None:
        """A prompt chunk went through (``rows``: its last row's logits, or every row's where its request asks for
        the prompt's log-probabilities): where it was the last, its last row gives the first token, on the host now."""
        seq.prefilled += span.T
        seq.prefill_passes.append(k)
        prompt = seq.request.prompt_ids
        if seq.request.prompt_logprobs is not None:
            # row j predicts the prompt's token at span.start + j + 1; the last row of the last chunk, the first token
            nxt = list(prompt[span.start + 1: span.start + span.T + 1])
            if nxt:
                chosen, values, ids = token_logprobs(rows[: len(nxt)], torch.tensor(nxt), seq.request.prompt_logprobs)
                seq.prompt_logprobs += [_on_host(t, chosen[i], values[i], ids[i]) for i, t in enumerate(nxt)]
        logits = rows[-1]
        if seq.prefilled < len(prompt):
            return
        if not bool(torch.isfinite(logits).all()):
            start = span.start
            error = nonfinite(self.runner, self.dev, prompt[start:], start, "prefill", seq.slot)
            for one in (seq, *seq.followers):
                if not one.done:  # a follower cancelled while it waited has ended already
                    self._fail(one, error)
            return
        for follower in seq.followers:  # its prompt's keys and values are this one's: a copy, not another prefill
            follower.leader = None
            if follower.done:
                continue
            self.runner.copy_prefix(self.dev, seq.slot, follower.slot, len(prompt))
            follower.prefilled, follower.prefill_passes = len(prompt), list(seq.prefill_passes)
            follower.prompt_logprobs = list(seq.prompt_logprobs)
            self._first_token(follower, logits, k)
        seq.followers = []
        self._first_token(seq, logits, k)

    def _first_token(self, seq: Sequence, logits: torch.Tensor, k: int) -> None:
        """The prompt went through (its last row's ``logits``, on step ``k``): the sequence's first token."""
        prompt = seq.request.prompt_ids
        token = self._sample(seq, logits)
        if token is None:
            return
        first = seq.prefill_passes[0]
        since = self.passes[first - 1].launched.mark if first else self.dev.t0
        seq.prefill_ms = self.runner.elapsed_ms(since, self.passes[k].launched.mark)
        if seq.request.keep_logits:
            seq.logits.insert(0, logits.clone())
        lps = self._logprobs(seq, logits.view(1, -1), [token])
        self.runner.place(self.dev, seq.slot, len(prompt), token)
        self._hear_token(seq, token, lps[0] if lps else None)

    def _take(self, k: int) -> None:
        """Read step k back: each of its rows' tokens goes to its sequence (and its routing to the window)."""
        p = self.passes[k]
        back = self.runner.read(self.dev, p.launched, hear=[slot for slot, seq in p.rows.items() if not seq.done])
        p.heard = back.heard
        for slot, seq in p.rows.items():
            if seq.done:
                continue  # a step launched past its end: dropped
            if back.bad[slot]:
                pos = len(seq.request.prompt_ids) + len(seq.tokens) - 1
                self._fail(seq, nonfinite(self.runner, self.dev, [seq.tokens[-1]], pos, "decode", slot))
                continue
            seq.passes.append(k)
            seq.kept.append(1)
            if seq.sampler.masks_on_device:
                try:
                    seq.sampler.chosen(back.tokens[slot])
                except Exception as exc:  # noqa: BLE001 - one sequence's grammar, not the batch's state
                    self._fail(seq, exc)
                    continue
            lp = p.logprobs.pop(slot, None)
            self._hear_token(seq, back.tokens[slot], _on_host(back.tokens[slot], *lp) if lp else None)

    # --- log-probabilities, where a request asks ---------------------------------------------------------
    def _row_logprobs(self, rows: dict[int, Sequence]) -> dict[int, tuple]:
        """The log-probabilities of the tokens this step chose for the decode rows whose requests ask, from the step's
        logits of each row and its chosen token (a greedy row's argmax, a sampled row's draw), on the device: nothing
        waits here; ``_take`` reads them with the rows' tokens."""
        asking = sorted(slot for slot, seq in rows.items() if seq.request.logprobs is not None and not seq.done)
        if not asking:
            return {}
        logits = torch.stack([self.runner.decode_logits(self.dev, slot) for slot in asking])
        tokens = torch.stack([self.runner.decode_token(self.dev, slot) for slot in asking])
        chosen, values, ids = token_logprobs(logits, tokens, max(rows[slot].request.logprobs for slot in asking))
        return {slot: (chosen[i], values[i, :rows[slot].request.logprobs], ids[i, :rows[slot].request.logprobs])
                for i, slot in enumerate(asking)}

    @staticmethod
    def _logprobs(seq: Sequence, logits: torch.Tensor, tokens: list[int]) -> list[TokenLogprobs] | None:
        """The log-probabilities of ``tokens`` chosen at the rows of ``logits`` [len(tokens), vocab], where the
        sequence's request asks (a prompt's first token, a verify pass's kept tokens: on the host now)."""
        k = seq.request.logprobs
        if k is None or not tokens:
            return None
        chosen, values, ids = token_logprobs(logits, torch.tensor(tokens), k)
        return [_on_host(token, chosen[i], values[i], ids[i]) for i, token in enumerate(tokens)]

    def _hear_token(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None = None) -> None:
        seq.tokens.append(token)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
            if seq.request.on_logprobs:
                seq.request.on_logprobs(logprobs)
        if seq.request.on_token:
            seq.request.on_token(token)
        reason = self._ends(seq, token, len(seq.tokens))
        if reason:
            self._finish(seq, reason)

    @staticmethod
    def _ends(seq: Sequence, token: int, count: int) -> str | None:
        """Why ``token``, the sequence's ``count``-th, ends it ("stop": an end id; "length"), or None."""
        gen = seq.request.gen
        if gen.stop_at_eos and token in seq.request.eos_ids:
            return "stop"
        return "length" if count >= gen.max_new_tokens else None

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
            return seq.sampler(logits, seq.request.prompt_ids, seq.tokens)
        except Exception as exc:  # noqa: BLE001 - one sequence's settings, not the batch's state
            self._fail(seq, exc)
            return None

    def _fail(self, seq: Sequence, error: Exception) -> None:
        seq.error = error
        self._finish(seq, "error")

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.done, seq.finish_reason = True, reason
        for follower in seq.followers:  # it leaves before its prefill ended: they prefill on their own
            follower.leader = None
        seq.followers = []
        if seq.slot >= 0 and self.active.get(seq.slot) is seq:
            del self.active[seq.slot]
            self.free.append(seq.slot)
            self.free.sort()
        if reason != "error":
            seq.result = self._result(seq)
        seq.end(reason)

    def _result(self, seq: Sequence) -> GenerationResult:
        runner = self.runner
        kept = [self.passes[k].launched for k in seq.passes]
        decode_ms = [runner.elapsed_ms(self.passes[k - 1].launched.mark, self.passes[k].launched.mark)
                     for k in seq.passes]
        final = runner.snapshot()
        last = seq.passes[-1] if seq.passes else (seq.prefill_passes[-1] if seq.prefill_passes else -1)
        for p in self.passes[last + 1:]:  # launched past its last token: dropped from its counters
            if any(s is seq for s in p.rows.values()):
                a, b = p.launched.after, p.launched.before
                final = {k: v - a[k] + b[k] if not k.startswith(("peak_", "resident_")) else v for k, v in final.items()}
        logits = [t.cpu() for t in seq.logits[: len(seq.tokens)]] if seq.request.keep_logits else None
        return GenerationResult(
            prompt_ids=list(seq.request.prompt_ids),
            token_ids=list(seq.tokens),
            prefill_ms=seq.prefill_ms,
            decode_ms=decode_ms,
            counters=final,
            per_token=[{**_plus(delta(p.launched.after, p.launched.before), p.heard), "sequences_in_step": len(p.rows) + len(p.verified)}
                       for p in (self.passes[k] for k in seq.passes)],
            memory=runner.memory_stats(),
            fixed_resident_bytes=self.fixed_resident_bytes,
            logits=logits,
            steps={m: sum(p.mode == m for p in kept) for m in MODES},
            step_modes=[p.mode for p in kept],
            **self._speculative(seq, decode_ms),
            logprobs=list(seq.logprobs) if seq.request.logprobs is not None else None,
            prompt_logprobs=list(seq.prompt_logprobs) if seq.request.prompt_logprobs is not None else None,
        )

    def _speculative(self, seq: Sequence, decode_ms: list[float]) -> dict:
        """A drafting sequence's result fields: the tokens each pass kept, and its drafts' figures."""
        if seq.spec is None:
            return {}
        spec = attrs.evolve(seq.spec, passes=len(seq.passes), kept=sum(seq.kept), verify_ms=sum(decode_ms))
        return {"tokens_per_step": list(seq.kept), "speculative": spec.to_json()}

    # --- the batch's life --------------------------------------------------------------------------------
    def __enter__(self) -> "Batch":
        self._torch_mode = torch.inference_mode()
        self._torch_mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.dev.close()
        self._torch_mode.__exit__(*exc)


def _on_host(token: int, chosen: torch.Tensor, values: torch.Tensor, ids: torch.Tensor) -> TokenLogprobs:
    return TokenLogprobs(token, float(chosen), tuple(zip(ids.tolist(), values.tolist())))


def _plus(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: v + b.get(k, 0) for k, v in a.items()}


def generate_one(runner: Runner, request: Request) -> GenerationResult:
    """Generate ``request`` (checked by the caller): a batch of one. Its ``on_token(id)`` hears each token of the
    result as soon as it is read back (the first from the prefill)."""
    with Batch(runner, slots=1, max_seq=len(request.prompt_ids) + request.gen.max_new_tokens) as batch:
        seq = batch.add(request)
        batch.run_until_done()
    if seq.error is not None:
        raise seq.error
    return seq.result
