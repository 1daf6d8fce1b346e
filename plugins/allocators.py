"""Built-in allocators: ``pool`` reuses buffers of an exact geometry; ``free`` releases for real."""

from __future__ import annotations

import heapq
import itertools

from kestrel_core.hookspecs import hookimpl


class Free:
    """Every alloc is a real allocation, every release a real free (on CUDA: raw cudaMalloc/cudaFree)."""

    name = "free"
    deterministic = False  # fresh buffers every time: a step that uses them cannot be replayed
    raw = True  # bypass any caching allocator, so that the synchronising cost of a real free shows

    def __init__(self, counters, slots: int = 0):
        self.counters = counters

    def alloc(self, entry):
        self.counters.allocations += 1
        return entry.factory.new_buffer(entry.geometry, raw=self.raw)

    def release(self, entry, buffer):
        self.counters.frees += 1
        entry.factory.free_buffer(buffer)

    def drain(self):
        """Nothing is held."""


class Pool:
    """A geometry-keyed free list: eviction is an O(1)-ish push, a hit a pop.

    A buffer is reused only for an identical geometry, and the lowest-numbered free buffer
    goes first: the same sequence of requests always gets the same buffers, so a window that
    repeats from token to token repeats its buffers too. Once ``slots`` buffers wait in the
    pool, a further release falls back to a real free.
    """

    name = "pool"
    deterministic = True

    def __init__(self, counters, slots: int = 128):
        self.counters = counters
        self.slots = slots
        self._free: dict = {}  # geometry -> heap of (serial, buffer factory, buffer)
        self._serial: dict[int, int] = {}  # id(buffer) -> its number, for every buffer this pool made
        self._numbers = itertools.count()
        self._held = 0

    def alloc(self, entry):
        bucket = self._free.get(entry.geometry)
        if bucket:
            self._held -= 1
            self.counters.pool_hits += 1
            return heapq.heappop(bucket)[2]
        self.counters.allocations += 1
        buffer = entry.factory.new_buffer(entry.geometry)
        self._serial[id(buffer)] = next(self._numbers)
        return buffer

    def release(self, entry, buffer):
        if self._held < self.slots:
            heapq.heappush(self._free.setdefault(entry.geometry, []), (self._serial[id(buffer)], entry.factory, buffer))
            self._held += 1
        else:
            self._free_for_real(entry.factory, buffer)

    def drain(self):
        """Free every pooled buffer for real (end of run)."""
        for bucket in self._free.values():
            while bucket:
                _, factory, buffer = bucket.pop()
                self._free_for_real(factory, buffer)
        self._free.clear()
        self._held = 0

    def _free_for_real(self, factory, buffer):
        self._serial.pop(id(buffer), None)
        self.counters.frees += 1
        factory.free_buffer(buffer)


@hookimpl
def register_allocators(register):
    register("pool", Pool)
    register("free", Free)
