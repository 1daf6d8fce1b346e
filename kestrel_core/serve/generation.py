"""One request's sequence as the event loop sees it: the scheduler's thread posts each token (and the end) to the
loop, and ``pieces()`` turns them into text, cut at a stop string, until the sequence ends.

    gen = Generation(loop, tokenizer, stop_strings, end_ids)
    gen.seq = scheduler.submit(attrs.evolve(request, on_token=gen.on_token, on_finish=gen.on_finish))
    async for piece in gen.pieces(): ...      # then gen.finish_reason, gen.tokens, gen.result

Each token heard is timed (``gen.token_times``, for /metrics). A request whose ``on_logprobs`` is ``gen.on_logprobs``
has each token's log-probabilities in ``gen.logprobs`` and each token's character offset in the text in ``gen.offsets``,
both beside ``gen.tokens``. ``merged(gens)`` interleaves the pieces of a request's several choices as they come.
"""

from __future__ import annotations

import asyncio
import time

import attrs

from kestrel_core.engine.batch import Sequence
from kestrel_core.engine.results import GenerationResult, TokenLogprobs
from kestrel_core.formats.tokenizer import Tokenizer
from kestrel_core.serve.stops import TextOutput

_FINISHED = object()


class GenerationFailed(Exception):
    """The sequence ended with an error (non-finite logits, or the batch's thread failed)."""


@attrs.frozen
class Piece:
    text: str
    token_ids: list[int]
    first: int = 0  # the index in ``Generation.tokens`` of its first id


class Generation:
    def __init__(self, loop: asyncio.AbstractEventLoop, tokenizer: Tokenizer, stop: list[str],
                 end_ids: frozenset[int], prompt_tokens: int):
        self.loop, self.end_ids, self.prompt_tokens = loop, end_ids, prompt_tokens
        self.output = TextOutput(tokenizer, stop)
        self.seq: Sequence | None = None  # set by whoever submits it, before the loop runs again
        self.tokens: list[int] = []  # what the request generated: up to the stop string or end id, inclusive
        self.logprobs: list[TokenLogprobs] = []  # each token's, where the request asked
        self.offsets: list[int] = []  # where each token's text begins in the text (characters)
        self.token_times: list[float] = []  # when each token was heard (monotonic); the first len(tokens) are tokens'
        self.finish_reason: str | None = None  # "stop", "length" or "abort" (cut from outside), once pieces() ended
        self.why_cut: str | None = None  # why it was cancelled from outside (a disconnect, the shutdown)
        self._queue: asyncio.Queue = asyncio.Queue()

    # --- the scheduler's thread -------------------------------------------------------------------------
    def on_token(self, token: int) -> None:
        self.token_times.append(time.monotonic())
        self._post(token)

    def on_logprobs(self, logprobs: TokenLogprobs) -> None:
        self._post(logprobs)  # just before its token

    def on_finish(self, seq: Sequence) -> None:
        self._post(_FINISHED)

    def _post(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is gone and no one listens; the batch must go on
            pass

    # --- the event loop --------------------------------------------------------------------------------
    def cut(self, why: str) -> None:
        """Cancel it (its client went away, or the server is stopping): it leaves the batch at the next step."""
        if self.seq is not None and not self.seq.done:
            self.why_cut = self.why_cut or why
            self.seq.cancel()

    async def pieces(self, every_id: bool = False):
        """The text as it becomes safe to send, each piece with the ids read since the last; then the rest.
        ``every_id``: a piece for each id as it comes, its text empty while held back (a stream asking for ids)."""
        pending: list[int] = []
        logprobs = None
        while True:
            item = await self._queue.get()
            if item is _FINISHED:
                break
            if isinstance(item, TokenLogprobs):
                logprobs = item  # its token comes next
                continue
            if self.output.stopped:
                continue  # read back after the stop string, before the sequence left: not the request's
            self.tokens.append(item)
            self.offsets.append(len(self.output.text))
            if logprobs is not None:
                self.logprobs.append(logprobs)
                logprobs = None
            pending.append(item)
            if item in self.end_ids:
                continue  # an end-of-sequence id ends the text without being part of it
            text = self.output.push(item)
            if self.output.stopped:
                self.seq.cancel()  # then wait for it to leave, so that its result is there
            if text or self.output.stopped or every_id:
                yield Piece(text, pending, len(self.tokens) - len(pending))
                pending = []
        seq = self.seq
        if seq.finish_reason == "error":
            raise GenerationFailed(str(seq.error) or type(seq.error).__name__) from seq.error
        rest = self.output.finish()
        if rest or pending:
            yield Piece(rest, pending, len(self.tokens) - len(pending))
        # A cut from outside (the shutdown's) is "abort", as vLLM says it: not the length limit the client set.
        if self.output.stopped or seq.finish_reason == "stop":
            self.finish_reason = "stop"
        else:
            self.finish_reason = "abort" if self.why_cut else "length"

    @property
    def result(self) -> GenerationResult | None:
        return self.seq.result if self.seq is not None else None


async def merged(gens: list[Generation], every_id: bool = False):
    """``(index, piece)`` for the pieces of every one of ``gens`` as they come (each's in order), and ``(index, None)``
    once that one has ended; the first error of any ends it all."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, gen: Generation) -> None:
        try:
            async for piece in gen.pieces(every_id):
                queue.put_nowait((index, piece, None))
            queue.put_nowait((index, None, None))
        except Exception as exc:  # noqa: BLE001 - raised where the pieces are read
            queue.put_nowait((index, None, exc))

    tasks = [asyncio.create_task(pump(i, gen)) for i, gen in enumerate(gens)]
    try:
        running = len(gens)
        while running:
            index, piece, error = await queue.get()
            if error is not None:
                raise error
            running -= piece is None
            yield index, piece
    finally:
        for task in tasks:
            task.cancel()
