"""The cuda backend's landing ring (``kestrel_core.engine.landing``): a decode step copies each routed miss into a free
slot as it comes to it, so the expert crosses the link once.

The ring lives on the device: each slot's two addresses (``gate_up``, ``down``), and a state row [1 + size] holding
the head (positions consumed) and each slot's owner (layer * experts + expert), and the tail the host has filled to.
Before a sparse layer's grouped experts, two kernels run in the step's stream, reading only device memory (so they
replay inside a captured step):

- ``plan``, one program: the layer's routed experts over every row, distinct and in ascending order; each whose table
  row points at its host copy takes the ring's next slot while the head is below the tail; its table row then points
  at the slot, the slot's owner is noted, the head moves on, and the landings are listed for ``copy``;
- ``copy``: each listed expert's two entries from the host copy (its mapped pinned address) into the slot, 16 KB a
  block, ``GROUP`` programs an entry.

The grouped kernel that follows reads the landed experts from their slots, the same bytes, so no result changes.
"""

from __future__ import annotations

import functools

import torch

from .index_write import write_by_index

BLOCK = 4096  # int32 words a copy block moves (16 KB)
GROUP = 16  # programs that share one entry's copy


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def plan(ids, n, table, host, ring, state, tail, out, owner_at, E: tl.constexpr, NE: tl.constexpr,
             NI: tl.constexpr, R: tl.constexpr, NOUT: tl.constexpr):
        e = tl.arange(0, NE)
        i = tl.arange(0, NI)
        chosen = tl.load(ids + i, mask=i < n, other=-1)
        routed = tl.sum((chosen[None, :] == e[:, None]).to(tl.int32), axis=1) > 0
        valid = e < E
        at_host = tl.load(table + e * 2, mask=valid, other=0) == tl.load(host + e * 2, mask=valid, other=1)
        wanted = routed & valid & at_host
        rank = tl.cumsum(wanted.to(tl.int64), axis=0)  # 1, 2, ... among the misses, in expert order
        head = tl.load(state)
        take = wanted & (rank <= tl.load(tail) - head)
        slot = (head + rank - 1) % R
        d0 = tl.load(ring + slot * 2, mask=take, other=0)
        d1 = tl.load(ring + slot * 2 + 1, mask=take, other=0)
        tl.store(table + e * 2, d0, mask=take)
        tl.store(table + e * 2 + 1, d1, mask=take)
        tl.store(state + 1 + slot, (owner_at + e).to(tl.int64), mask=take)
        tl.store(state, head + tl.sum(take.to(tl.int64), axis=0))
        j = tl.arange(0, NOUT)
        match = (rank[None, :] == (j[:, None] + 1)) & take[None, :]
        has = tl.sum(match.to(tl.int32), axis=1) > 0
        tl.store(out + j * 3, tl.where(has, tl.sum(tl.where(match, e[None, :], 0), axis=1), -1).to(tl.int64))
        tl.store(out + j * 3 + 1, tl.sum(tl.where(match, d0[None, :], 0), axis=1))
        tl.store(out + j * 3 + 2, tl.sum(tl.where(match, d1[None, :], 0), axis=1))

    @triton.jit
    def copy(out, host, W0, W1, GROUP: tl.constexpr, BLOCK: tl.constexpr):
        j, which, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        e = tl.load(out + j * 3)
        if e >= 0:
            src = tl.load(host + e * 2 + which).to(tl.pointer_type(tl.int32))
            dst = tl.load(out + j * 3 + 1 + which).to(tl.pointer_type(tl.int32))
            words = tl.where(which == 0, W0, W1)
            for c in range(g * BLOCK, words, GROUP * BLOCK):
                offs = c + tl.arange(0, BLOCK)
                m = offs < words
                tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)

    return plan, copy


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class LandingRing:
    """The ring of ``size`` slots on ``device`` for experts whose two entries are ``entry_bytes`` each, of a model of
    ``experts`` experts a sparse layer; ``host`` [layers, experts, 2] their host copies' addresses."""

    def __init__(self, size: int, host: torch.Tensor, experts: int, entry_bytes: tuple[int, int], device: torch.device):
        self.size, self.E = size, experts
        self.words = tuple(b // 4 for b in entry_bytes)
        self.ring = torch.zeros((size, 2), dtype=torch.int64, device=device)
        self.state = torch.full((1 + size,), -1, dtype=torch.int64, device=device)
        self.state[0] = 0
        self.tail = torch.zeros(1, dtype=torch.int64, device=device)
        self.host = host.to(device)
        self.device = device
        self._out: dict[int, torch.Tensor] = {}  # by its rows: a step's landing list (a captured step keeps it)

    def fill(self, filled: list[tuple[int, tuple]], tail: int) -> None:
        """In stream order: each (position, buffers) into its slot, then the tail."""
        flat, vals = [], []
        for position, buffers in filled:
            for j, b in enumerate(buffers):
                flat.append((position % self.size) * 2 + j)
                vals.append(b.data_ptr())
        write_by_index(self.ring.view(-1), flat, vals)
        self.tail.fill_(tail)

    def land(self, layer: int, table: torch.Tensor, chosen: torch.Tensor) -> None:
        """Layer ``layer``'s routed misses (``chosen`` [rows, k]) into the ring; ``table`` is the layer's [experts, 2]."""
        plan, copy = _kernels()
        ids = chosen.reshape(-1)
        n = ids.numel()
        nout = _pow2(min(n, self.E))
        out = self._out.get(nout)
        if out is None:
            out = self._out[nout] = torch.empty((nout, 3), dtype=torch.int64, device=self.device)
        plan[(1,)](ids, n, table, self.host[layer], self.ring, self.state, self.tail, out, layer * self.E,
                   E=self.E, NE=_pow2(self.E), NI=_pow2(n), R=self.size, NOUT=nout)
        copy[(nout, 2, GROUP)](out, self.host[layer], self.words[0], self.words[1], GROUP=GROUP, BLOCK=BLOCK)
