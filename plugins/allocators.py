"""Built-in allocators: ``pool`` reuses buffers of an exact geometry; ``free`` releases for real."""

from __future__ import annotations

from collections import defaultdict

from kestrel_core.hookspecs import hookimpl


class Free:
    """Every alloc is a real allocation, every release a real free (on CUDA: cudaMalloc/cudaFree)."""

    name = "free"

    def __init__(self, counters, slots: int = 0):
        self.counters = counters

    @hookimpl
    def alloc(self, entry):
        self.counters.allocations += 1
        return entry.factory.new_buffer(entry.geometry)

    @hookimpl
    def release(self, entry, buffer):
        self.counters.frees += 1
        entry.factory.free_buffer(buffer)


class Pool:
    """A geometry-keyed free list: eviction is an O(1) push, a hit an O(1) pop.

    A buffer is reused only for an identical geometry. Once ``slots`` buffers wait in
    the pool, a further release falls back to a real free.
    """

    name = "pool"

    def __init__(self, counters, slots: int = 128):
        self.counters = counters
        self.slots = slots
        self._free = defaultdict(list)
        self._held = 0

    @hookimpl
    def alloc(self, entry):
        bucket = self._free.get(entry.geometry)
        if bucket:
            self._held -= 1
            self.counters.pool_hits += 1
            return bucket.pop()[1]
        self.counters.allocations += 1
        return entry.factory.new_buffer(entry.geometry)

    @hookimpl
    def release(self, entry, buffer):
        if self._held < self.slots:
            self._free[entry.geometry].append((entry.factory, buffer))
            self._held += 1
        else:
            self.counters.frees += 1
            entry.factory.free_buffer(buffer)

    def drain(self):
        """Free every pooled buffer for real (end of run)."""
        for bucket in self._free.values():
            while bucket:
                factory, buffer = bucket.pop()
                self.counters.frees += 1
                factory.free_buffer(buffer)
        self._free.clear()
        self._held = 0


@hookimpl
def register_allocators(register):
    register("pool", Pool)
    register("free", Free)
