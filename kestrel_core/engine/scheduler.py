"""A continuous batch on a thread of its own, for a server: requests are submitted from any thread, first come first
served; a sequence joins the batch at the next step with a free slot, and its tokens come back through its request's
``on_token``, called on the batch's thread. All device work happens on that thread.

    sched = Scheduler(run, max_batch=8, max_seq=4096)
    sched.start()
    seq = sched.submit(run.request(prompt="hello", max_new_tokens=32, on_token=print))
    seq.finished.wait(); seq.cancel()        # cancel: it leaves at the next step, its slot freed
    sched.stop()                             # stop admitting; finish what runs (or cancel it), then return
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

from kestrel_core.engine.batch import PREFILL_CHUNK, Batch, Request, Sequence, check_batch
from kestrel_core.errors import ConfigError, KestrelError
from kestrel_core.engine.limits import RequestLimits

KV_FIX = "lower the context or the slots (kestrel serve: --max-seq, --max-batch)"  # a KV cache too large


class QueueFull(KestrelError):
    """Every slot is taken and ``max_queue`` requests wait already: try again later (a server answers 429)."""


class Scheduler:
    def __init__(self, run, max_batch: int = 8, max_seq: int | None = None, prefill_chunk: int | None = PREFILL_CHUNK,
                 max_queue: int = 64, on_error: Callable[[BaseException], None] | None = None):
        """``max_queue``: requests that may wait for a slot while all ``max_batch`` are taken (0: none wait);
        ``on_error(exc)``: hears, on the batch's thread, the error that ended the batch (a server logs it)."""
        check_batch(max_batch, prefill_chunk)
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ConfigError(f"max_queue must be a whole number >= 0, got {max_queue!r}")
        positions = run.model.config.max_position_embeddings
        self.max_seq = min(positions, max_seq or positions)
        if self.max_seq < 2:
            raise ConfigError(f"max_seq must be at least 2 positions, got {max_seq!r}")
        self.limits = RequestLimits(self.max_seq, "this scheduler")  # its slots' positions
        self.run, self.max_batch, self.prefill_chunk, self.max_queue = run, max_batch, prefill_chunk, max_queue
        self.on_error = on_error
        self._incoming: deque[Sequence] = deque()
        self._unfinished: list[Sequence] = []  # submitted and not done: what the queue bound counts
        self._ready = threading.Event()  # the batch (and its KV cache) is made, or the thread ended trying
        self._lock = threading.Condition()
        self._stopping = self._stopped = False
        self._batch: Batch | None = None
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # what ended the batch's thread, if anything did
        self.steps = 0

    # --- any thread -----------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the batch's thread once its KV cache is allocated; a cache that cannot be had raises here."""
        self._thread = threading.Thread(target=self._loop, name="kestrel-batch", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self.error is not None:
            raise self.error

    def submit(self, request: Request) -> Sequence:
        """Queue a request (checked by ``run.request``); ``QueueFull`` where every slot is taken and ``max_queue``
        wait already."""
        return self.submit_all([request])[0]

    def submit_all(self, requests: list[Request]) -> list[Sequence]:
        """Queue several requests together (a server's ``n`` choices of one prompt), all or none: ``QueueFull`` where
        the slots and the queue have no room for every one."""
        for request in requests:
            self.limits.budget(request.gen.max_new_tokens, len(request.prompt_ids))
            request.check()
        with self._lock:
            if self._stopping:
                raise QueueFull("the server is shutting down and takes no new request")
            # Counted from what was submitted and is not done, not from the deques, which the batch's thread moves
            # sequences between: the bound holds whenever the batch takes them.
            self._unfinished = [s for s in self._unfinished if not s.done]
            if len(self._unfinished) + len(requests) > self.max_batch + self.max_queue:
                busy = len(self._unfinished)
                if len(requests) > 1:
                    raise QueueFull(f"{len(requests)} sequences do not fit: {busy} run or wait, and the "
                                    f"{self.max_batch} slots and the queue of {self.max_queue} hold "
                                    f"{self.max_batch + self.max_queue}; try again shortly")
                raise QueueFull(f"all {self.max_batch} slots are taken and {busy - self.max_batch} "
                                f"requests wait (the queue holds {self.max_queue}); try again shortly")
            seqs = [Sequence(request) for request in requests]
            self._incoming.extend(seqs)
            self._unfinished.extend(seqs)
            self._lock.notify()
        return seqs

    def stop(self, cancel: bool = False, timeout: float | None = None) -> None:
        """Stop admitting; let every queued and running sequence finish (or cancel them), then end the thread."""
        with self._lock:
            self._stopping = True
            if cancel:
                for seq in self._incoming:
                    seq.cancel()
            self._lock.notify()
        if cancel and self._batch is not None:
            for seq in list(self._batch.active.values()) + list(self._batch.waiting):
                seq.cancel()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def waiting(self) -> int:
        return len(self._incoming) + (len(self._batch.waiting) if self._batch else 0)

    @property
    def running(self) -> int:
        return len(self._batch.active) if self._batch else 0

    @property
    def kv_cache_bytes(self) -> int:
        """The bytes the batch's KV cache holds now (0 before the batch opens)."""
        batch = self._batch
        return batch.dev.cache_bytes if batch is not None else 0

    # --- the batch's thread ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            with Batch(self.run.runner, self.max_batch, self.max_seq, self.prefill_chunk,
                       fix=KV_FIX) as batch:
                self._batch = batch
                self._ready.set()
                while True:
                    with self._lock:
                        while not self._incoming and not batch.busy and not self._stopping:
                            self._lock.wait()
                        new = list(self._incoming)
                        self._incoming.clear()
                        if self._stopping and not new and not batch.busy:
                            break
                    for seq in new:
                        self._take(batch, seq)
                    if batch.busy:
                        batch.step()
                        self.steps += 1
        except BaseException as exc:  # the batch cannot go on: every sequence ends with the error
            self.error = exc
            self._fail_all(exc)
            if self.on_error is not None and self._batch is not None:  # before it started, start() raises it
                self.on_error(exc)
        finally:
            self._stopped = True
            self._ready.set()

    @staticmethod
    def _take(batch: Batch, seq: Sequence) -> None:
        if seq.cancelled.is_set():
            seq.end("cancelled")
            return
        try:
            batch.add(seq.request, seq)
        except KestrelError as exc:  # this request's own (its grammar could not start): the batch goes on
            seq.end("error", exc)

    def _fail_all(self, exc: BaseException) -> None:
        seqs = list(self._incoming)
        if self._batch is not None:
            seqs += list(self._batch.active.values()) + list(self._batch.waiting)
        for seq in seqs:
            if not seq.done:
                seq.end("error", exc if isinstance(exc, Exception) else KestrelError(str(exc)))


def wait_all(seqs: list[Sequence], poll: float = 0.05) -> None:
    """Block until every sequence is done (for scripts and tests)."""
    while not all(s.finished.is_set() for s in seqs):
        time.sleep(poll)
