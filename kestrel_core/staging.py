"""Staging units into the host ring: where each part's bytes come from, and a worker that stages ahead.

``Filler`` reads the parts of one unit for a ring slot. A part whose pages are all in the page
cache (``cached_fraction``) takes the hot path: read with buffered ``pread`` straight into the slot
where it is stored in the slot's dtype, else copied from the mapping and converted, several
pieces side by side. Any other part is read with ``O_DIRECT`` into an aligned scratch buffer
(several reads in flight) and converted from there: the cold path, which neither needs the file's
pages nor leaves them in the cache. The pages a mapping copy faulted in are dropped from the
mapping once the unit is staged (``MADV_DONTNEED``), so the process's RSS holds the ring and the
scratch, not the model.

``Stager`` stages units into ring slots on one worker thread. An upload takes its unit's slot
(staging it then if it was not staged yet) and hands the slot back with the event its copy left.
After each layer unit it takes, the worker stages the units that followed that one in the last
pass over the layers: the window's plans repeat token after token, so the last pass is the
forecast of the next (a forecast that misses costs a staging on demand, never a wrong result).
"""

from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Hashable, Sequence

import torch

from .checkpoint import DTYPES, Checkpoint
from .diskread import HAVE_O_DIRECT, DirectFile, Reader, aligned_empty, cached_fraction, direct_io_supported
from .host_tier import PartRead, PinnedRing, Slot, SlotEntry


class Filler:
    """One unit's parts for a slot: hot parts as reads into the slot (or mapping views), cold ones read from disk
    into scratch. Where O_DIRECT is off, a part not cached is read through the mapping, and counts as cold."""

    def __init__(self, ckpt: Checkpoint, threads: int = 4, direct: bool | None = None):
        self.ckpt = ckpt
        if direct is None:  # O_DIRECT where every shard's filesystem takes it
            direct = HAVE_O_DIRECT and all(direct_io_supported(f.path) for f in ckpt.files.values())
        self.direct = direct
        self._reader = Reader(threads) if direct else None
        self._files: dict[Any, DirectFile] = {}
        self._scratch = aligned_empty(0)
        self._fds: dict[Any, int] = {}  # buffered descriptors of the hot path's pread
        self._read_hot: set[str] = set()  # parts of the unit being staged that pread reads
        self.hot_bytes = 0  # part bytes copied from the page cache
        self.cold_bytes = 0  # part bytes read from disk
        self.disk_bytes_read = 0  # what those reads took from disk (their aligned supersets)

    def sources(self, entries: Sequence[SlotEntry], dtype: torch.dtype | None = None) -> dict[str, Any]:
        """Each part's bytes: read from disk first where not all cached (a tensor of its stored dtype and shape);
        where cached and stored in ``dtype`` (the slot's), a ``PartRead`` that reads it straight into the slot;
        else the mapping's view, which the ring converts as it copies."""
        views: dict[str, Any] = {name: self.ckpt.view(name) for e in entries for name in e.parts}
        cached = {n for n, v in views.items() if cached_fraction(v) == 1.0}
        for n, v in views.items():
            nbytes = v.numel() * v.element_size()
            if n in cached:
                self.hot_bytes += nbytes
            else:
                self.cold_bytes += nbytes
        cold = [n for n in views if self.direct and n not in cached]
        for n, v in views.items():
            if n in cached and v.dtype == dtype and v.dim() == 2:
                info, f = self.ckpt.info(n), self.ckpt.file_of(n)
                views[n] = PartRead(self._fd(f.path), info.start, info.nbytes, v.shape[0], str(f.path))
                self._read_hot.add(n)
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
        sizes = [_up(df.span_bytes(info.start, info.nbytes), align) for df, info in zip(files, infos)]
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
        before = self._reader.bytes_read
        for df, (dsts, spans, which) in by_file.items():
            pending.append((self._reader.submit(df, dsts, spans), which))
        out = {}
        for reads, which in pending:
            for raw, (name, info) in zip(reads.result(), which):
                _, dtype, _ = DTYPES[info.dtype]
                t = raw.view(torch.bfloat16 if info.dtype == "BF16" else dtype)
                out[name] = t.view(info.shape)
        self.disk_bytes_read += self._reader.bytes_read - before
        return out

    def _direct(self, f) -> DirectFile:
        df = self._files.get(f)
        if df is None:
            df = self._files[f] = DirectFile(f.path)
        return df

    def done(self, entries: Sequence[SlotEntry]) -> None:
        """The unit is in its slot: take the pages it copied from the mapping out of it (they stay in the cache, not
        in our RSS); a part read with pread or O_DIRECT never mapped any."""
        mapped = [name for e in entries for name in e.parts if name not in self._read_hot]
        if mapped:
            self.ckpt.drop_pages(mapped)
        self._read_hot.clear()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        for df in self._files.values():
            df.close()
        self._files.clear()
        if self._reader is not None:
            self._reader.close()


def _up(n: int, align: int) -> int:
    return -(-n // align) * align


class Stager:
    """Units staged into ``ring`` slots on a worker thread: on demand (``take``), and ahead along the last pass.

    ``entries_of(key)`` is a unit's slot layout; ``lookahead`` how many units the worker stages
    ahead of the one just taken (at most the ring's slots less one, which an upload may hold).
    """

    def __init__(self, ring: PinnedRing, filler: Filler, entries_of: Callable[[Hashable], Sequence[SlotEntry]],
                 lookahead: int):
        self.ring, self.filler, self.entries_of = ring, filler, entries_of
        self.lookahead = max(0, min(lookahead, len(ring) - 1))
        self._cv = threading.Condition()
        self._jobs: deque = deque()  # (key, future), demand first
        self._staged: dict[Hashable, Future] = {}  # staged or being staged, not yet taken
        self._held: set[int] = set()  # slots taken and not yet handed back
        self._next = 0  # the slot the ring hands out next
        self._last_pass: list[Hashable] = []
        self._pass: list[Hashable] = []
        self._stop = False
        self._worker = threading.Thread(target=self._run, name="kestrel-stager", daemon=True)
        self._worker.start()
        self.staged_ahead = 0  # units staged before their upload asked for them
        self.ahead_hits = 0  # of those, the ones an upload then took

    # --- the uploading thread ---------------------------------------------------------
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
        slot, views = fut.result()
        with self._cv:
            self._held.add(slot.index)
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
        if len(key) != 1:  # an expert: routed, so not forecast
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
                key, fut = self._jobs.popleft()
                if fut.cancelled():
                    continue
                slot = self._acquire(key)
            if slot is None:
                continue
            try:
                slot.wait()  # its last upload is done
                entries = self.entries_of(key)
                views = self.ring.fill(slot, entries, self.filler.sources(entries, self.ring.dtype).__getitem__)
                self.filler.done(entries)
            except BaseException as exc:  # the uploading thread raises it
                with self._cv:
                    slot.owner = None
                fut.set_exception(exc)
                continue
            if fut.ahead:
                self.staged_ahead += 1
            fut.set_result((slot, views))

    def _acquire(self, key: Hashable) -> Slot | None:
        """The next slot in turn that no upload holds, taking it from a unit staged ahead and not yet taken
        (that unit is staged again if asked for). Holds the lock; None where the job was dropped meanwhile."""
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
