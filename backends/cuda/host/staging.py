"""Staging units into the host ring: where each part's bytes come from, and a worker that stages ahead.

``Filler`` reads the parts of one unit for a ring slot. A part stored in the slot's dtype reads
itself into the slot in pieces, side by side (``PartRead``): a piece whose pages are all in the
page cache (``mincore``) with buffered ``pread`` (the hot path: the cache's copy, nothing mapped),
any other with ``O_DIRECT`` into the thread's aligned scratch and copied from there (the cold path,
which neither needs the file's pages nor leaves them in the cache). A part that must be converted
is copied from the mapping and converted where all its pages are cached, else read with
``O_DIRECT`` (several reads in flight) and converted from there; the pages a mapping copy faulted in
are dropped from the mapping once the unit is staged (``MADV_DONTNEED``). So the process's RSS
holds the ring and the scratch, not the model.

``Stager`` stages units into ring slots on one worker thread. An upload takes its unit's slot
(staging it then if it was not staged yet) and hands the slot back with the event its copy left.
Small units queued together (experts) are staged side by side, their copies on the ring's threads
at once, and handed out in order as each is done.
Units a plan is about to upload (``expect``: a sparse layer's routed experts, known only at its
router) are staged ahead first, in order, as many at a time as the slots allow. After each layer
unit it takes, the worker stages the units that followed that one in the last pass over the
layers: the window's plans repeat token after token, so the last pass is the forecast of the next
(a forecast that misses costs a staging on demand, never a wrong result).
"""

from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Hashable, Sequence

import torch

from kestrel_core.formats.checkpoint import DTYPES, Checkpoint
from kestrel_core.errors import CheckpointError, ConfigError
from kestrel_core.formats.units import is_expert

from .diskread import CHUNK, HAVE_O_DIRECT, DirectFile, Reader, aligned_empty, direct_io_supported, round_up
from .pagecache import cached_fraction, range_cached
from .tier import PinnedRing, Slot, SlotEntry


class PartRead:
    """A part stored in the slot's dtype, ``rows`` rows of ``nbytes`` at file ``offset``, read straight into the slot
    in pieces of ``PIECE`` bytes that the ring's threads read side by side. A part of a few MiB (an expert's) is one
    piece: cut smaller, on more threads, an expert staged slower on the H200 host (1.96 ms against 1.11 ms for its
    parts whole, ``bench/expert_staging_bench.py``, record ``bench/results/expert_staging_20261204T110041Z.json``).

    A piece whose pages are all cached (``pagecache.range_cached``: ``cachestat`` on the file, else ``mincore`` on the
    part's mapped address ``mapped_ptr``; no page is faulted in) is read with buffered ``pread``; any other with ``O_DIRECT`` (``direct``)
    into the reading thread's aligned scratch and copied into the slot, or, where there is no
    ``direct``, with buffered ``pread`` too. Each piece counts its bytes on the filler, hot or cold.
    """

    PIECE = CHUNK

    def __init__(self, filler: "Filler", fd: int, offset: int, nbytes: int, rows: int, path: str,
                 mapped_ptr: int | None, direct: DirectFile | None):
        self.filler, self.fd, self.offset, self.nbytes, self.rows, self.path = filler, fd, offset, nbytes, rows, path
        self.mapped_ptr, self.direct = mapped_ptr, direct

    def pieces(self, flat: torch.Tensor) -> list:
        """The (function, argument) jobs that read this part into ``flat`` (its rows as bytes), ``PIECE`` bytes each."""
        if flat.numel() != self.nbytes:
            raise ConfigError(f"{self.path}: a part of {self.nbytes} bytes does not fill its {flat.numel()}-byte rows")
        step = self.PIECE
        return [(self._read, (flat, lo, min(lo + step, self.nbytes))) for lo in range(0, self.nbytes, step)]

    def _read(self, job) -> None:
        flat, lo, hi = job
        n = hi - lo
        cached = range_cached(self.fd, self.offset + lo, n, None if self.mapped_ptr is None else self.mapped_ptr + lo)
        if cached or self.direct is None:
            self._pread(memoryview(flat.numpy())[lo:hi], self.offset + lo)
        else:
            scratch = self.filler.piece_scratch(self.direct.alignment, self.direct.span_bytes(self.offset + lo, n))
            flat[lo:hi].copy_(self.direct.read_span(scratch, self.offset + lo, n))
        self.filler.count(hot=n if cached else 0, cold=0 if cached else n)

    def _pread(self, buf: memoryview, offset: int) -> None:
        at = 0
        while at < len(buf):
            got = os.preadv(self.fd, [buf[at:]], offset + at)
            if got <= 0:
                raise CheckpointError(f"{self.path}: truncated file: a read at offset {offset + at} "
                                      "found its end; re-download or re-create it")
            at += got


class Filler:
    """One unit's parts for a slot: parts in the slot's dtype as ``PartRead`` (hot pieces by pread, cold ones by
    O_DIRECT), the rest as mapping views where cached, else read from disk into scratch. Where O_DIRECT is off, what
    is not cached is read through the page cache, and counts as cold."""

    def __init__(self, ckpt: Checkpoint, threads: int = 4, direct: bool | None = None):
        self.ckpt = ckpt
        if direct is None:  # O_DIRECT where every shard's filesystem takes it
            direct = HAVE_O_DIRECT and all(direct_io_supported(f.path) for f in ckpt.files.values())
        self.direct = direct
        self._reader = Reader(threads) if direct else None
        self._files: dict[Any, DirectFile] = {}
        self._scratch = aligned_empty(0)
        self._local = threading.local()  # each ring thread's scratch for a cold piece
        self._lock = threading.Lock()
        self._fds: dict[Any, int] = {}  # buffered descriptors of the hot path's pread
        self._parts: dict[tuple, PartRead] = {}  # (name, slot dtype) -> the part that reads itself, made once
        self._reads_itself: set[str] = set()  # those parts' names: never mapped
        self.hot_bytes = 0  # part bytes copied from the page cache
        self.cold_bytes = 0  # part bytes read from disk

    @property
    def disk_bytes_read(self) -> int:
        """What the cold reads took from disk (their aligned supersets, less what lay past a file's end)."""
        return sum(df.bytes_read for df in self._files.values())

    def count(self, hot: int = 0, cold: int = 0) -> None:
        with self._lock:
            self.hot_bytes += hot
            self.cold_bytes += cold

    def piece_scratch(self, align: int, nbytes: int) -> torch.Tensor:
        """The calling thread's aligned scratch of at least ``nbytes`` (kept for its next cold piece)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < nbytes or buf.data_ptr() % align:
            buf = self._local.buf = aligned_empty(max(nbytes, PartRead.PIECE + 2 * align), align)
        return buf

    def sources(self, entries: Sequence[SlotEntry], dtype: torch.dtype | None = None) -> dict[str, Any]:
        """Each part's bytes: where it is stored in ``dtype`` (the slot's), a ``PartRead`` that reads it into the slot
        (and counts it); else the mapping's view where all its pages are cached, which the ring converts as it
        copies, or a tensor of its stored dtype and shape read from disk. A part whose stored bytes are not its view's (a
        GGUF's quantized or permuted tensor, ``info.raw`` False) is its view, made from the mapping (dequantized to float32),
        hot or cold by its stored bytes; a part of a block entry (``SlotEntry.blocks``) is its stored blocks, read
        through the mapping (never O_DIRECT), hot or cold the same way."""
        views: dict[str, Any] = {}
        made: set[str] = set()  # parts made in memory from their stored bytes (a GGUF's quantized or permuted tensor)
        for e in entries:
            for n in e.parts:
                if e.blocks is not None:  # the blocks as stored (whole rows moved where permuted), never dequantized
                    info = self.ckpt.info(n)
                    hot = range_cached(self._fd(self.ckpt.file_of(n).path), info.start, info.nbytes)
                    views[n] = self.ckpt.blocks(n)
                    made.add(n)
                    self.count(**{"hot" if hot else "cold": info.nbytes})
                    continue
                part = self._parts.get((n, dtype))
                if part is None:
                    info = self.ckpt.info(n)
                    if not info.raw:  # its file bytes are not the view's: made from the mapping, counted by what it read
                        hot = range_cached(self._fd(self.ckpt.file_of(n).path), info.start, info.nbytes)
                        views[n] = self.ckpt.view(n)
                        made.add(n)
                        self.count(**{"hot" if hot else "cold": info.nbytes})
                        continue
                    v = self.ckpt.view(n)
                    if v.dtype != dtype or v.dim() != 2:
                        views[n] = v
                        continue
                    f = self.ckpt.file_of(n)
                    part = self._parts[(n, dtype)] = PartRead(self, self._fd(f.path), info.start, info.nbytes, v.shape[0],
                                                              str(f.path), v.data_ptr(), self._direct(f) if self.direct else None)
                    self._reads_itself.add(n)
                views[n] = part
        rest = [n for n, v in views.items() if not isinstance(v, PartRead) and n not in made]
        cached = {n for n in rest if cached_fraction(views[n]) == 1.0}
        for n in rest:
            nbytes = views[n].numel() * views[n].element_size()
            if n in cached:
                self.count(hot=nbytes)
            else:
                self.count(cold=nbytes)
        cold = [n for n in rest if self.direct and n not in cached]
        if cold:
            views.update(self._read(cold))
        return views

    def _fd(self, path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def _read(self, names: list[str]) -> dict[str, torch.Tensor]:
        infos = [self.ckpt.info(n) for n in names]
        files = [self._direct(self.ckpt.file_of(n)) for n in names]
        align = max(df.alignment for df in files)  # each read's buffer starts on its file's alignment
        sizes = [round_up(df.span_bytes(info.start, info.nbytes), align) for df, info in zip(files, infos)]
        if self._scratch.numel() < sum(sizes) or self._scratch.data_ptr() % align:
            self._scratch = aligned_empty(sum(sizes), align)
        pending, at = [], 0
        by_file: dict[DirectFile, tuple[list, list, list]] = {}
        for name, info, df, size in zip(names, infos, files, sizes):
            dsts, spans, which = by_file.setdefault(df, ([], [], []))
            dsts.append(self._scratch[at : at + size])
            spans.append((info.start, info.nbytes))
            which.append((name, info))
            at += size
        for df, (dsts, spans, which) in by_file.items():
            pending.append((self._reader.submit(df, dsts, spans), which))
        out = {}
        for reads, which in pending:
            for raw, (name, info) in zip(reads.result(), which):
                _, dtype, _ = DTYPES[info.dtype]
                t = raw.view(torch.bfloat16 if info.dtype == "BF16" else dtype)
                out[name] = t.view(info.shape)
        return out

    def _direct(self, f) -> DirectFile:
        df = self._files.get(f)
        if df is None:
            df = self._files[f] = DirectFile(f.path)
        return df

    def done(self, entries: Sequence[SlotEntry]) -> None:
        """The unit is in its slot: take the pages it copied from the mapping out of it (they stay in the cache, not
        in our RSS); a part that read itself (pread or O_DIRECT) never mapped any."""
        mapped = [name for e in entries for name in e.parts if name not in self._reads_itself]
        if mapped:
            self.ckpt.drop_pages(mapped)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        for df in self._files.values():
            df.close()
        self._files.clear()
        if self._reader is not None:
            self._reader.close()


class Stager:
    """Units staged into ``ring`` slots on a worker thread: on demand (``take``), ahead of a plan's uploads
    (``expect``), and ahead along the last pass.

    ``entries_of(key)`` is a unit's slot layout; ``lookahead`` how many units the worker stages
    ahead of the one just taken (at most the ring's slots less one, which an upload may hold).
    """

    BATCH_BYTES = 64 * 2**20  # units staged side by side at most, in bytes (a larger unit goes alone)

    def __init__(self, ring: PinnedRing, filler: Filler, entries_of: Callable[[Hashable], Sequence[SlotEntry]],
                 lookahead: int):
        self.ring, self.filler, self.entries_of = ring, filler, entries_of
        self.lookahead = max(0, min(lookahead, len(ring) - 1))
        self._cv = threading.Condition()
        self._jobs: deque = deque()  # (key, future), demand first
        self._staged: dict[Hashable, Future] = {}  # staged or being staged, not yet taken
        self._held: set[int] = set()  # slots taken and not yet handed back
        self._next = 0  # the slot the ring hands out next
        self._expected: deque = deque()  # units a plan uploads next, not yet staged
        self._last_pass: list[Hashable] = []
        self._pass: list[Hashable] = []
        self._stop = False
        self._worker = threading.Thread(target=self._run, name="kestrel-stager", daemon=True)
        self._worker.start()
        self.staged_ahead = 0  # units staged before their upload asked for them
        self.ahead_hits = 0  # of those, the ones an upload then took

    # --- the uploading thread ---------------------------------------------------------
    def expect(self, keys: Sequence[Hashable]) -> None:
        """The units the next uploads take, in order (a plan's fetches): staged ahead back to back, at most
        ``lookahead`` staged and not yet taken at a time (more would take the slot of one staged and not yet taken)."""
        with self._cv:
            self._expected = deque(k for k in keys if k not in self._staged)
            self._top_up()

    def _top_up(self) -> None:  # holds the lock
        while self._expected and len(self._staged) < self.lookahead:
            key = self._expected.popleft()
            if key not in self._staged:
                self._submit(key, demand=False)

    def take(self, key: Hashable) -> tuple[Slot, dict[str, torch.Tensor]]:
        """The unit's slot and entry views, staged now if it was not already; hand it back with ``give_back``."""
        with self._cv:
            fut = self._staged.pop(key, None)
            if fut is None:
                fut = self._submit(key, demand=True)
                del self._staged[key]  # taken at once: its slot is the upload's from the start
            elif not fut.done():  # staged ahead but not yet: it goes first now
                job = next((j for j in self._jobs if j[1] is fut), None)
                if job is not None:
                    self._jobs.remove(job)
                    self._jobs.appendleft(job)
            if fut.ahead:  # type: ignore[attr-defined]
                self.ahead_hits += 1
            if key in self._expected:
                self._expected.remove(key)
        slot, views = fut.result()
        with self._cv:
            self._held.add(slot.index)
            self._top_up()
        self._forecast(key)
        return slot, views

    def give_back(self, slot: Slot, done: Any) -> None:
        """The slot's upload is queued; ``done`` (an event) is what a refill waits for."""
        with self._cv:
            slot.owner = None
            slot.done = done
            self._held.discard(slot.index)
            self._cv.notify_all()

    def _forecast(self, key: Hashable) -> None:
        if is_expert(key):  # an expert: routed, so not forecast
            return
        if self._pass and key[0] <= self._pass[-1][0]:
            self._last_pass, self._pass = self._pass, []
        self._pass.append(key)
        order = self._last_pass
        if not self.lookahead or key not in order:
            return
        i = order.index(key)
        ahead = [order[(i + d) % len(order)] for d in range(1, len(order))][: self.lookahead]
        with self._cv:
            for k in ahead:
                if k not in self._staged:
                    self._submit(k, demand=False)

    def _submit(self, key: Hashable, demand: bool) -> Future:
        fut: Future = Future()
        fut.ahead = not demand  # type: ignore[attr-defined]
        self._staged[key] = fut
        (self._jobs.appendleft if demand else self._jobs.append)((key, fut))
        self._cv.notify_all()
        return fut

    # --- the worker -------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                batch = self._batch()
            started = []
            for key, fut, slot in batch:  # each unit's copies queued on the ring's threads behind the one before
                try:
                    slot.wait()  # its last upload is done
                    entries = self.entries_of(key)
                    pending = self.ring.start(slot, entries, self.filler.sources(entries, self.ring.dtype).__getitem__)
                    started.append((fut, slot, entries, pending))
                except BaseException as exc:  # the uploading thread raises it
                    self._failed(fut, slot, exc)
            for fut, slot, entries, pending in started:  # handed out in order, each as soon as its copies are done
                try:
                    views = pending.result()
                    self.filler.done(entries)
                except BaseException as exc:
                    self._failed(fut, slot, exc)
                    continue
                if fut.ahead:
                    self.staged_ahead += 1
                fut.set_result((slot, views))

    def _batch(self) -> list[tuple[Hashable, Future, Slot]]:
        """The next job with its slot (waited for), and the jobs queued behind it that have a free slot now, up to
        ``BATCH_BYTES`` in all: small units (experts) are staged side by side, a layer alone. Holds the lock."""
        batch: list = []
        nbytes = 0
        while self._jobs and nbytes < self.BATCH_BYTES:
            key, fut = self._jobs[0]
            if fut.cancelled():
                self._jobs.popleft()
                continue
            slot = self._acquire(key, wait=not batch)
            if slot is None:
                break
            self._jobs.popleft()
            batch.append((key, fut, slot))
            nbytes += sum(e.nbytes(self.ring.dtype) for e in self.entries_of(key))
        return batch

    def _failed(self, fut: Future, slot: Slot, exc: BaseException) -> None:
        with self._cv:
            slot.owner = None
        fut.set_exception(exc)

    def _acquire(self, key: Hashable, wait: bool = True) -> Slot | None:
        """The next slot in turn that no upload holds, taking it from a unit staged ahead and not yet taken
        (that unit is staged again if asked for). Holds the lock; None where the job was dropped meanwhile, or where
        no slot is free now and not ``wait``."""
        slots = self.ring.slots
        while True:
            for d in range(len(slots)):
                slot = slots[(self._next + d) % len(slots)]
                if slot.index in self._held:
                    continue
                owner = slot.owner
                if owner is not None:
                    fut = self._staged.get(owner)
                    if fut is None or not fut.done():
                        continue  # taken (its upload is being queued), or being staged
                    del self._staged[owner]  # staged ahead, never taken: its slot goes to this unit
                self._next = (slot.index + 1) % len(slots)
                slot.owner = key
                return slot
            if not wait:
                return None
            self._cv.wait()
            if self._stop:
                return None

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._worker.join()
        for key, fut in self._jobs:
            fut.cancel()
        self.filler.close()
