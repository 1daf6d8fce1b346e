"""The host tier: how many host bytes a run may pin for its weights, and the bounded ring of pinned slots.

A backend that uploads from pinned host memory either pins every streamed unit once at load
(``mode == "all"``: an upload is then one DMA per entry) or, where that does not fit the host
budget, stages each unit into one of a few pinned ring slots just before its upload
(``mode == "ring"``). A slot is filled from the safetensors mapping: the roles an entry fuses
(q, k, v; gate, up) are stacked and converted to the compute dtype while they are copied, on
several threads. A slot is refilled only once the upload that read it is done.

``KESTREL_HOST_MB`` beats the config's ``host_budget_mb``, which beats the default: everything
pinned where it fits in half of the available RAM, else a ring in that half.
"""

from __future__ import annotations

import os
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Sequence

import attrs
import torch

from backends.cuda.blocks import BlockWeight, layout_of_rows, segments_of
from kestrel_core.config import HOST_ENV, env_mib
from kestrel_core.engine.pipeline import host_share
from kestrel_core.errors import BudgetError, ConfigError

from .diskread import ALIGN, aligned_empty, round_up  # each entry of a slot starts on a page: what a DMA, and O_DIRECT, want




@attrs.frozen
class HostBudget:
    bytes: int
    source: str  # where it came from: KESTREL_HOST_MB, config, or the default
    mode: str  # "all": every streamed unit pinned once; "ring": a bounded ring of pinned slots


def resolve_host_budget(config_mb: float, available_bytes: int, staged_bytes: int) -> HostBudget:
    """The run's host budget, and whether every unit's staging (``staged_bytes``) fits in it."""
    env = env_mib(HOST_ENV)
    if env is not None:
        budget, source = env, HOST_ENV
    elif config_mb < 0:
        raise ConfigError(f"host_budget_mb must be >= 0 (0 means the default), got {config_mb}")
    elif config_mb:
        budget, source = int(config_mb * 2**20), "config"
    else:
        mine, share = host_share(available_bytes)  # a pipeline's ranks on this host share its memory
        budget, source = mine // 2, f"default (half of the available host memory{share})"
    mode = "all" if staged_bytes <= budget else "ring"
    pins = staged_bytes if mode == "all" else budget  # what the run would page-lock, at most
    if available_bytes and pins > available_bytes:  # an explicit budget past the host: refused before locking a page
        mib = 2**20
        raise BudgetError(
            f"host budget {budget // mib:,} MiB ({source}) would page-lock {pins // mib:,} MiB, more than the "
            f"{available_bytes // mib:,} MiB of host memory available now (MemAvailable); lower --host-budget-mb or "
            f"{HOST_ENV} below {available_bytes // mib:,} (0: the default, half of it)")
    return HostBudget(budget, source, mode)


def ring_slots(budget: HostBudget, slot_bytes: int, depth: int) -> int:
    """Slots the budget holds; refused below one unit being uploaded plus ``depth`` staged ahead."""
    need = (1 + depth) * slot_bytes
    if budget.bytes < need:
        mib = 2**20
        raise BudgetError(
            f"host budget {budget.bytes // mib} MiB ({budget.source}) is below one streamed unit plus the prefetch "
            f"depth: need at least {-(-need // mib)} MiB ({1 + depth} slots of {slot_bytes / mib:.1f} MiB); "
            f"raise --host-budget-mb or {HOST_ENV}, or lower prefetch"
        )
    return budget.bytes // slot_bytes


@attrs.frozen
class SlotEntry:
    """One entry of a unit as a slot holds it: ``parts`` (checkpoint tensor names) stacked along dim 0, converted to the
    slot's dtype; or, where ``blocks`` ((type name, rows) of each part) is set, each part's GGUF blocks as stored, back
    to back (``backends.cuda.blocks``)."""

    name: str
    shape: tuple[int, int]
    parts: tuple[str, ...]
    blocks: tuple[tuple[str, int], ...] | None = None

    def part_bytes(self) -> list[int]:
        """A block entry's parts' stored bytes, in order."""
        return [seg.nbytes for seg in segments_of(self.blocks, self.shape[1])]

    def nbytes(self, dtype: torch.dtype) -> int:
        if self.blocks is not None:
            return sum(self.part_bytes())
        return self.shape[0] * self.shape[1] * dtype.itemsize



def slot_bytes(units: Iterable[Sequence[SlotEntry]], dtype: torch.dtype) -> int:
    """The slot size: the largest unit's entries, each starting on a page."""
    return max(sum(round_up(e.nbytes(dtype)) for e in entries) for entries in units)


class HostMemory:
    """``nbytes`` of host memory starting on a page, page-locked where ``pin`` by registering it with CUDA
    (``cudaHostRegister``): exactly these bytes are pinned, where torch's pinned allocator would round a
    block up to a power of two. ``close`` (or the object's end) unregisters it."""

    def __init__(self, nbytes: int, pin: bool):
        self.raw = aligned_empty(nbytes, ALIGN, pin_memory=False)
        self.pinned_bytes = 0
        if pin and nbytes:
            try:
                torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(self.raw.data_ptr(), nbytes, 0))
            except RuntimeError as exc:  # out of lockable memory (RLIMIT_MEMLOCK, or the host is full)
                raise BudgetError(f"cannot page-lock {nbytes / 2**20:,.0f} MiB of host memory ({str(exc).splitlines()[0]}); "
                                  f"lower --host-budget-mb or {HOST_ENV}") from None
            self.pinned_bytes = nbytes
            self._finalizer = weakref.finalize(self, _unregister, self.raw.data_ptr())

    def close(self) -> None:
        if self.pinned_bytes:
            self._finalizer()
            self.pinned_bytes = 0


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


class Slot:
    """One pinned buffer of the ring; ``done`` is what its last reader left (an event, or None: free now)."""

    def __init__(self, raw: torch.Tensor, index: int):
        self.raw, self.index = raw, index
        self.done: Any = None
        self.owner: Any = None  # the unit staged in it (the stager's bookkeeping)

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()
            self.done = None


def fill_threads() -> int:
    """The threads that fill a slot: every core but two (the decode loop's and the stager's), 2 to 16."""
    return max(2, min(16, (os.cpu_count() or 4) - 2))


class PendingFill:
    """A unit's fill started on the ring's threads: ``result()`` waits for its copies and returns each entry's view."""

    def __init__(self, ring: "PinnedRing", out: dict[str, torch.Tensor], futures: list, nbytes: int):
        self.ring, self.out, self.futures, self.nbytes = ring, out, futures, nbytes

    def result(self) -> dict[str, torch.Tensor]:
        errors = []
        for f in self.futures:  # every copy ends before the slot is handed on, even where one failed
            exc = f.exception()
            if exc is not None:
                errors.append(exc)
        self.futures = []
        if errors:
            raise errors[0]
        if self.nbytes:
            self.ring.bytes_staged += self.nbytes
            self.nbytes = 0
        return self.out


class PinnedRing:
    """``n`` slots of ``nbytes`` each, in one block pinned where a GPU is there to pin for, handed out in turn.

    ``acquire`` returns the oldest slot once its last upload is done; ``fill`` copies a unit into it
    from the checkpoint mapping (fused and converted on the way) and returns each entry's view
    (``start`` queues the copies and returns at once, so that several units copy side by side).

    The block is registered (``HostMemory``), so exactly the budget's bytes are locked. torch copies
    from registered memory asynchronously, at the pinned rate (``bench/ring_copy_bench.py``), but its
    ``is_pinned()`` is False, so a CUDA graph refuses to capture such a copy: a ring's step runs eagerly.
    ``threads`` (default ``fill_threads()``) copy a unit's parts side by side.
    """

    def __init__(self, n: int, nbytes: int, dtype: torch.dtype, threads: int | None = None, pin: bool | None = None):
        if n < 1:
            raise ConfigError(f"a ring needs at least one slot, got {n}")
        if nbytes % ALIGN:
            raise ConfigError(f"a ring's slot must be a multiple of {ALIGN} bytes (slot_bytes), got {nbytes}")
        pin = torch.cuda.is_available() if pin is None else pin
        self.dtype, self.nbytes = dtype, nbytes
        self.memory = HostMemory(n * nbytes, pin)
        self.pinned_bytes = self.memory.pinned_bytes
        self.slots = [Slot(self.memory.raw[i * nbytes : (i + 1) * nbytes], i) for i in range(n)]
        self._slots = deque(self.slots)
        threads = fill_threads() if threads is None else max(1, threads)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kestrel-ring") if threads > 1 else None
        self._laid_out: dict = {}  # (slot, entries, rows) -> its views (``_lay_out``)
        self.bytes_staged = 0

    def __len__(self) -> int:
        return len(self._slots)

    def acquire(self) -> Slot:
        slot = self._slots.popleft()
        self._slots.append(slot)  # handed out in turn: the next acquire gets the oldest
        slot.wait()
        return slot

    def fill(self, slot: Slot, entries: Sequence[SlotEntry], view) -> dict[str, torch.Tensor]:
        """Stack and convert each entry's parts (``view(name)``: the mapped tensor) into the slot."""
        return self.start(slot, entries, view).result()

    def start(self, slot: Slot, entries: Sequence[SlotEntry], view) -> "PendingFill":
        """``fill``, its copies queued on the ring's threads behind those of any fill started before; ``result()``
        waits for them. Several units started back to back are copied side by side."""
        # each part: a tensor to copy (and convert), or a part that reads itself into the slot
        srcs = [[view(name) for name in entry.parts] for entry in entries]
        rows = tuple(tuple(s.shape[0] if isinstance(s, torch.Tensor) else s.rows for s in ss) for ss in srcs)
        key = (slot.index, tuple((e.name, e.shape) for e in entries), rows)
        laid = self._laid_out.get(key)
        if laid is None:
            laid = self._laid_out[key] = self._lay_out(slot, entries, rows)
        out, dsts = laid
        work = []  # (function, argument): a copy, or a piece of a read straight into the slot
        for ss, ds in zip(srcs, dsts):
            for src, (dst, flat) in zip(ss, ds):
                if isinstance(src, torch.Tensor):
                    work.append((dst.copy_, src))
                else:
                    work += src.pieces(flat)
        nbytes = sum(e.nbytes(self.dtype) for e in entries)
        if self._pool is None:
            for fn, arg in work:
                fn(arg)
            return PendingFill(self, dict(out), [], nbytes)
        # torch's copy and os.preadv release the GIL: the parts copy side by side
        return PendingFill(self, dict(out), [self._pool.submit(fn, arg) for fn, arg in work], nbytes)

    def _lay_out(self, slot: Slot, entries: Sequence[SlotEntry], rows: tuple) -> tuple[dict, list]:
        """A unit's layout in a slot, made once for each slot and layout (every expert of a model has the same):
        each entry's view, and each part's rows in it (and those rows as flat bytes, which a part reads into)."""
        out, dsts, at = {}, [], 0
        for entry, part_rows in zip(entries, rows):
            n = entry.nbytes(self.dtype)
            if at + n > self.nbytes:
                raise ConfigError(f"entry {entry.name} does not fit the ring's slot of {self.nbytes} bytes")
            if sum(part_rows) != entry.shape[0]:
                raise ConfigError(f"entry {entry.name}: its parts have {sum(part_rows)} rows, the entry {entry.shape[0]}")
            if entry.blocks is not None:  # each part's blocks as stored, back to back
                raw, parts, off = slot.raw[at : at + n], [], 0
                for r, nb in zip(part_rows, entry.part_bytes()):
                    part = raw[off : off + nb].view(r, nb // r)
                    parts.append((part, raw[off : off + nb]))
                    off += nb
                out[entry.name] = BlockWeight(raw, entry.shape[1], layout_of_rows(entry.blocks))
                dsts.append(parts)
                at = round_up(at + n)
                continue
            dst = slot.raw[at : at + n].view(self.dtype).view(entry.shape)
            parts, row = [], 0
            for r in part_rows:
                part = dst[row : row + r]
                parts.append((part, part.view(-1).view(torch.uint8)))
                row += r
            out[entry.name] = dst
            dsts.append(parts)
            at = round_up(at + n)
        return out, dsts

    def release(self, slot: Slot, done: Any) -> None:
        """The slot's last reader (an event with ``synchronize``), waited for before the slot is refilled."""
        slot.done = done

    def close(self) -> None:
        for slot in self._slots:
            slot.wait()
        self._slots.clear()
        if self._pool is not None:
            self._pool.shutdown()
        self.memory.close()
