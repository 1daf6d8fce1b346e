"""Pinned host memory for the full staging, carved out of a few blocks of torch's pinned allocator.

torch's pinned allocator rounds every block up to a power of two. Pinning each entry of the 8B
shape on its own (48, 32, 192 and 96 MiB a layer, plus the norms) locked 16.9 GiB for 12.9 GiB of
weights: the process's RSS, not the bytes asked for (``bench/results/host_tier_20261204T031712Z.json``,
the "all" rows). A ``PinnedArena`` hands out views, at page offsets, of a few large blocks instead, each
a power of two, the last one no larger than what is left needs. Each view stays one of torch's
pinned blocks, so a copy from it is asynchronous and a CUDA graph can capture it (memory
registered with ``cudaHostRegister`` is not).

``arena_bytes(sizes)`` is what an arena pins for those sizes, taken in that order: the budget's
"does everything fit" is asked of it, not of the bare sum.
"""

from __future__ import annotations

from typing import Iterable

import torch

from kestrel_core.errors import ConfigError

from .diskread import ALIGN, aligned_empty, round_up

BLOCK = 2**30  # the largest block the arena asks for, unless one entry is larger



def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class PinnedArena:
    """Views of ``total`` bytes (at most) to be taken one by one, packed in order into blocks of at most
    ``block`` bytes (or the power of two over the largest entry): a new block opens when an entry does not fit
    the current one, sized to the power of two over what is left to take, up to the cap. ``pinned_bytes`` counts
    the blocks (what is locked); ``pin=False`` takes pageable blocks (a machine without a GPU), and
    ``allocate=False`` only counts (``arena_bytes``)."""

    def __init__(self, total: int, largest: int, block: int = BLOCK, pin: bool = True, allocate: bool = True):
        if total < 0 or largest < 0 or round_up(largest) > round_up(total):
            raise ConfigError(f"an arena of {total} bytes cannot hold an entry of {largest}")
        self.cap = max(block, _pow2(round_up(largest)))
        self.pin, self.allocate = pin, allocate
        self._left = round_up(total)  # bytes not yet taken
        self._blocks: list[list] = []  # [tensor or None, size, bytes used]
        self.pinned_bytes = 0

    @property
    def blocks(self) -> list[int]:
        """Each block's size, in bytes."""
        return [size for _, size, _ in self._blocks]

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 view of ``nbytes`` pinned bytes at a page offset of the first block with room for it (None where
        the arena only counts)."""
        need = round_up(nbytes)
        if need > self.cap:
            raise ConfigError(f"an entry of {nbytes} bytes is larger than the arena's blocks of {self.cap}")
        block = next((b for b in self._blocks if b[1] - b[2] >= need), None)
        if block is None:
            size = max(_pow2(need), min(self.cap, _pow2(max(self._left, need))))
            block = [self._new(size) if self.allocate else None, size, 0]
            self._blocks.append(block)
            self.pinned_bytes += size
        at = block[2]
        block[2] += need
        self._left = max(0, self._left - need)
        return None if block[0] is None else block[0][at : at + nbytes]

    def _new(self, size: int) -> torch.Tensor:
        if self.pin:  # exactly a power of two, no slack to align within: torch's block starts on 512 bytes at least
            return torch.empty(size, dtype=torch.uint8, pin_memory=True)
        return aligned_empty(size, ALIGN)


def arena_bytes(sizes: Iterable[int], block: int = BLOCK) -> int:
    """What a ``PinnedArena`` pins for entries of ``sizes`` taken in that order (no memory is taken)."""
    sizes = list(sizes)
    if not sizes:
        return 0
    arena = PinnedArena(sum(round_up(n) for n in sizes), max(sizes), block, allocate=False)
    for n in sizes:
        arena.take(n)
    return arena.pinned_bytes


def release_cached_pinned() -> bool:
    """Hand the pinned blocks torch's allocator keeps cached (freed, still locked) back to the system; False where
    this torch has no way to (then they stay locked until the process ends)."""
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if empty is None:
        return False
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        empty()
    return True
