"""The cuda backend's landing ring (``kestrel_core.engine.landing``): a decode step copies each routed miss into a free
slot as it comes to it, so the expert crosses the link once; and a miss that finds the ring empty into a staging slot,
read there for that step alone.

The ring lives on the device: each slot's two addresses (``gate_up``, ``down``), and a state row [1 + size] holding
the head (positions consumed) and each slot's owner (layer * experts + expert), and the tail the host has filled to.
Before a sparse layer's grouped experts, two kernels run in the step's stream, reading only device memory (so they
replay inside a captured step):

- ``plan``, one program: the layer's routed experts over every row, distinct and in ascending order; each whose table
  row points at its host copy takes the ring's next slot while the head is below the tail; its table row then points
  at the slot, the slot's owner is noted, the head moves on, and the landings are listed for ``copy``. The misses
  past the ring's room take the staging slots in turn, their table rows pointed there, listed as staged;
- ``copy``: each listed expert's two entries from the host copy (its mapped pinned address) into its slot, 16 KB a
  block, ``GROUP`` programs an entry.

After the grouped experts, ``restore`` points each staged expert's table row back at its host copy: it was not
admitted, and the host's record of the table (the expert schedule) still has it there. A staged miss crosses the link
once, as one read from its host copy does; the copy reads it several times faster than the expert kernels read the
host (``bench/results/expert-rows_20261206T140047Z.json``: Q4_K blocks 27-30 GB/s copied, 4-9 read in place). The
grouped kernel reads the landed and staged experts from their slots, the same bytes, so no result changes.
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
    def plan(ids, n, table, host, ring, state, tail, staging, out, owner_at, E: tl.constexpr, NE: tl.constexpr,
             NI: tl.constexpr, R: tl.constexpr, S: tl.constexpr, NOUT: tl.constexpr):
        e = tl.arange(0, NE)
        i = tl.arange(0, NI)
        chosen = tl.load(ids + i, mask=i < n, other=-1)
        routed = tl.sum((chosen[None, :] == e[:, None]).to(tl.int32), axis=1) > 0
        valid = e < E
        at_host = tl.load(table + e * 2, mask=valid, other=0) == tl.load(host + e * 2, mask=valid, other=1)
        wanted = routed & valid & at_host
        rank = tl.cumsum(wanted.to(tl.int64), axis=0)  # 1, 2, ... among the misses, in expert order
        head = tl.load(state)
        room = tl.maximum(tl.load(tail) - head, 0)
        take = wanted & (rank <= room)
        stage = wanted & (rank > room) & (rank <= room + S)  # past the ring's room: a staging slot for this step
        slot = (head + rank - 1) % R
        at = tl.maximum(rank - room - 1, 0)
        d0 = tl.where(take, tl.load(ring + slot * 2, mask=take, other=0), tl.load(staging + at * 2, mask=stage, other=0))
        d1 = tl.where(take, tl.load(ring + slot * 2 + 1, mask=take, other=0),
                      tl.load(staging + at * 2 + 1, mask=stage, other=0))
        moved = take | stage
        tl.store(table + e * 2, d0, mask=moved)
        tl.store(table + e * 2 + 1, d1, mask=moved)
        tl.store(state + 1 + slot, (owner_at + e).to(tl.int64), mask=take)
        tl.store(state, head + tl.sum(take.to(tl.int64), axis=0))
        j = tl.arange(0, NOUT)
        match = (rank[None, :] == (j[:, None] + 1)) & moved[None, :]
        has = tl.sum(match.to(tl.int32), axis=1) > 0
        tl.store(out + j * 4, tl.where(has, tl.sum(tl.where(match, e[None, :], 0), axis=1), -1).to(tl.int64))
        tl.store(out + j * 4 + 1, tl.sum(tl.where(match, d0[None, :], 0), axis=1))
        tl.store(out + j * 4 + 2, tl.sum(tl.where(match, d1[None, :], 0), axis=1))
        tl.store(out + j * 4 + 3, tl.sum(tl.where(match & stage[None, :], 1, 0), axis=1).to(tl.int64))

    @triton.jit
    def copy(out, host, W0, W1, GROUP: tl.constexpr, BLOCK: tl.constexpr):
        j, which, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        e = tl.load(out + j * 4)
        if e >= 0:
            src = tl.load(host + e * 2 + which).to(tl.pointer_type(tl.int32))
            dst = tl.load(out + j * 4 + 1 + which).to(tl.pointer_type(tl.int32))
            words = tl.where(which == 0, W0, W1)
            for c in range(g * BLOCK, words, GROUP * BLOCK):
                offs = c + tl.arange(0, BLOCK)
                m = offs < words
                tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)

    @triton.jit
    def restore(out, table, host, NOUT: tl.constexpr):
        j = tl.arange(0, NOUT)
        e = tl.load(out + j * 4)
        staged = (e >= 0) & (tl.load(out + j * 4 + 3) == 1)
        at = tl.maximum(e, 0) * 2
        tl.store(table + at, tl.load(host + at, mask=staged, other=0), mask=staged)
        tl.store(table + at + 1, tl.load(host + at + 1, mask=staged, other=0), mask=staged)

    return plan, copy, restore


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class LandingRing:
    """The ring of ``size`` slots on ``device`` for experts whose two entries are ``entry_bytes`` each, of a model of
    ``experts`` experts a sparse layer, and ``staged`` staging slots beside it; ``host`` [layers, experts, 2] their
    host copies' addresses."""

    def __init__(self, size: int, host: torch.Tensor, experts: int, entry_bytes: tuple[int, int], device: torch.device,
                 staged: int = 0):
        self.size, self.E, self.S = size, experts, staged
        self.words = tuple(b // 4 for b in entry_bytes)
        self.staging_slots = [tuple(torch.empty(w, dtype=torch.int32, device=device) for w in self.words)
                              for _ in range(staged)]
        self.staging = torch.tensor([[t.data_ptr() for t in pair] for pair in self.staging_slots] or [[0, 0]],
                                    dtype=torch.int64).to(device)
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

    def land(self, layer: int, table: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s routed misses (``chosen`` [rows, k]) into the ring, and those past its room into the
        staging slots; ``table`` is the layer's [experts, 2]. What to hand ``restore`` after the layer's experts."""
        plan, copy, _ = _kernels()
        ids = chosen.reshape(-1)
        n = ids.numel()
        nout = _pow2(min(n, self.E))
        out = self._out.get(nout)
        if out is None:
            out = self._out[nout] = torch.empty((nout, 4), dtype=torch.int64, device=self.device)
        plan[(1,)](ids, n, table, self.host[layer], self.ring, self.state, self.tail, self.staging, out,
                   layer * self.E, E=self.E, NE=_pow2(self.E), NI=_pow2(n), R=self.size, S=self.S, NOUT=nout)
        copy[(nout, 2, GROUP)](out, self.host[layer], self.words[0], self.words[1], GROUP=GROUP, BLOCK=BLOCK)
        return out

    def restore(self, layer: int, table: torch.Tensor, landed: torch.Tensor) -> None:
        """After the layer's experts read them: the staged experts' table rows back at their host copies."""
        if self.S:
            _kernels()[2][(1,)](landed, table, self.host[layer], NOUT=landed.shape[0])
