"""One token's routed experts, each read wherever the expert table points: its device buffer (a slot) or its page-locked
host copy (a mapped pinned address: the kernel reads it over the link, and no step waits for the host).

The table holds, for every expert of every sparse layer, two addresses: its ``gate_up`` entry ([2I, H] float, or q8
[H, 2I padded] with its scales after, or GGUF blocks: ``gguf_kernels.expert_matmul`` or ``gguf_int8``'s) and its
``down`` entry ([H, I], or q8 [I, H padded], or blocks). Two kernels each split
their reduction over a grid of (expert, block of outputs, slice of the inputs) and write float32 partial sums; a
short epilogue adds the slices and the experts in a fixed order, rounding where ``F.linear`` rounds. Nothing is
atomic, so the same kernel on the same bytes gives bitwise the same result whichever memory it read.

Triton compiles them on first use; where Triton is missing, ``available()`` says so and the backend routes on the host.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import blocks, gguf_int8, gguf_kernels
from .triton_check import available  # noqa: F401 - where the kernels run, as the backend asks


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def float_rows(x, ids, table, part, which: tl.constexpr, N: tl.constexpr, K: tl.constexpr, ROWS_AT: tl.constexpr,
                   KS: tl.constexpr, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   X_PER_SLOT: tl.constexpr):
        """part[s, slot, n] = sum over k in slice s of W[ROWS_AT + n, k] * x[k]: W [*, K] row-major at the table's
        address ``which`` of the slot's expert."""
        slot, nb, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        w = tl.load(table + tl.load(ids + slot) * 2 + which).to(tl.pointer_type(DTYPE))
        xs = x + slot * K if X_PER_SLOT else x
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for kk in range(0, KS, BLOCK_K):  # constant bounds: the slice's offset is added inside
            cols = s * KS + kk + tl.arange(0, BLOCK_K)
            xk = tl.load(xs + cols).to(tl.float32)
            wt = tl.load(w + (ROWS_AT + rows[:, None]) * K + cols[None, :], mask=rows[:, None] < N, other=0.0)
            acc += tl.sum(wt.to(tl.float32) * xk[None, :], axis=1)
        nslots = tl.num_programs(0)
        tl.store(part + (s * nslots + slot) * N + rows, acc, mask=rows < N)

    @triton.jit
    def q8_cols(x, ids, table, part, which: tl.constexpr, N: tl.constexpr, K: tl.constexpr, NPAD: tl.constexpr,
                COLS_AT: tl.constexpr, KS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                X_PER_SLOT: tl.constexpr):
        """part[s, slot, n] = sum over k in slice s of q[k, COLS_AT + n] * scale[k // GROUP, COLS_AT + n] * x[k]: a q8
        entry (qweight int8 [K, NPAD], then its float32 scales [K / GROUP, NPAD]) at the table's address ``which``."""
        slot, nb, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        base = tl.load(table + tl.load(ids + slot) * 2 + which)
        q = base.to(tl.pointer_type(tl.int8))
        sc = (base + K * NPAD).to(tl.pointer_type(tl.float32))
        xs = x + slot * K if X_PER_SLOT else x
        mc = cols < N
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for kk in range(0, KS, GROUP):
            k0 = s * KS + kk
            ks = k0 + tl.arange(0, GROUP)
            xk = tl.load(xs + ks).to(tl.float32)
            qt = tl.load(q + ks[:, None] * NPAD + (COLS_AT + cols[None, :]), mask=mc[None, :], other=0)
            scale = tl.load(sc + (k0 // GROUP) * NPAD + COLS_AT + cols, mask=mc, other=0.0)
            acc += tl.sum(qt.to(tl.float32) * xk[:, None], axis=0) * scale
        nslots = tl.num_programs(0)
        tl.store(part + (s * nslots + slot) * N + cols, acc, mask=mc)

    # Several rows' experts (a batched step's): one program a (routed pair in expert order, block of outputs, slice);
    # the first pair of each expert's run reads each weight tile once and adds it into every pair of the run in turn.
    # A pair's partial sums go through memory in float32 between tiles, the same additions in the same order as the
    # one-row kernels', so each row's result is its result alone, bitwise. ``pairs[t]``: the t-th pair in expert order
    # (row * KT + slot); ``ends[t]``: where the run starting at t ends (t itself where t starts none). ``part`` is
    # [rows, slices, KT, N]: each row's block laid out as the one-row kernels' buffer.

    @triton.jit
    def float_rows_grouped(x, pairs, experts, ends, table, part, which: tl.constexpr, N: tl.constexpr,
                           K: tl.constexpr, ROWS_AT: tl.constexpr, KS: tl.constexpr, DTYPE: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, X_PER_SLOT: tl.constexpr, KT: tl.constexpr,
                           SLICES: tl.constexpr):
        p, nb, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        end = tl.load(ends + p)
        w = tl.load(table + tl.load(experts + p) * 2 + which).to(tl.pointer_type(DTYPE))
        for kk in range(0, KS, BLOCK_K):
            cols = s * KS + kk + tl.arange(0, BLOCK_K)
            wt = tl.load(w + (ROWS_AT + rows[:, None]) * K + cols[None, :], mask=rows[:, None] < N, other=0.0)
            for t in range(p, end):
                q = tl.load(pairs + t)
                xs = x + (q if X_PER_SLOT else q // KT) * K
                xk = tl.load(xs + cols).to(tl.float32)
                at = part + (((q // KT) * SLICES + s) * KT + q % KT) * N + rows
                before = tl.load(at, mask=(rows < N) & (kk > 0), other=0.0)
                tl.store(at, before + tl.sum(wt.to(tl.float32) * xk[None, :], axis=1), mask=rows < N)

    @triton.jit
    def q8_cols_grouped(x, pairs, experts, ends, table, part, which: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                        NPAD: tl.constexpr, COLS_AT: tl.constexpr, KS: tl.constexpr, GROUP: tl.constexpr,
                        BLOCK_N: tl.constexpr, X_PER_SLOT: tl.constexpr, KT: tl.constexpr, SLICES: tl.constexpr):
        p, nb, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        end = tl.load(ends + p)
        base = tl.load(table + tl.load(experts + p) * 2 + which)
        qw = base.to(tl.pointer_type(tl.int8))
        sc = (base + K * NPAD).to(tl.pointer_type(tl.float32))
        mc = cols < N
        for kk in range(0, KS, GROUP):
            k0 = s * KS + kk
            ks = k0 + tl.arange(0, GROUP)
            qt = tl.load(qw + ks[:, None] * NPAD + (COLS_AT + cols[None, :]), mask=mc[None, :], other=0)
            scale = tl.load(sc + (k0 // GROUP) * NPAD + COLS_AT + cols, mask=mc, other=0.0)
            for t in range(p, end):
                q = tl.load(pairs + t)
                xs = x + (q if X_PER_SLOT else q // KT) * K
                xk = tl.load(xs + ks).to(tl.float32)
                at = part + (((q // KT) * SLICES + s) * KT + q % KT) * N + cols
                before = tl.load(at, mask=mc & (kk > 0), other=0.0)
                tl.store(at, before + tl.sum(qt.to(tl.float32) * xk[:, None], axis=0) * scale, mask=mc)

    return float_rows, q8_cols, float_rows_grouped, q8_cols_grouped


def _tl_dtype(dtype: torch.dtype):
    import triton.language as tl

    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def _split(k: int, want: int, step: int) -> int:
    """The most slices, at most ``want``, that cut ``k`` inputs into equal runs of a multiple of ``step``."""
    return max(s for s in range(1, want + 1) if k % s == 0 and (k // s) % step == 0)


def _block_k(k: int) -> int:
    """The widest K block (a power of two, up to 64) that divides ``k``."""
    return next(b for b in (64, 32, 16, 8, 4, 2, 1) if k % b == 0)


def expert_runs(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch's routed pairs (row * k + slot of ``ids`` [rows, k]) in expert order, on the device and without a sync:
    (each pair's expert, the pairs, and for each place t where an expert's run starts, where it ends; elsewhere t, an
    empty run), so that exactly one program reads each routed expert."""
    experts, pairs = torch.sort(ids.reshape(-1), stable=True)
    starts = torch.ones_like(experts, dtype=torch.bool)
    starts[1:] = experts[1:] != experts[:-1]
    at = torch.arange(experts.numel(), device=ids.device)
    return experts, pairs, torch.where(starts, torch.searchsorted(experts, experts, right=True), at)


class GroupedExperts:
    """The launcher for one model's experts: ``hidden`` H, ``inter`` an expert's intermediate size I, ``k`` routed a
    token; ``q8`` = (group, gate_up n_pad, down n_pad) for a q8 checkpoint; ``blocks``: the experts are GGUF blocks
    (``backends.cuda.blocks``), each call told its layer's layouts."""

    def __init__(self, hidden: int, inter: int, k: int, dtype: torch.dtype, device: torch.device,
                 q8: tuple[int, int, int] | None = None, block_n: int | None = None, split: tuple[int, int] | None = None,
                 blocks: bool = False, int8: bool = False):
        self.H, self.I, self.k, self.dtype, self.q8, self.blocks = hidden, inter, k, dtype, q8, blocks
        self.int8 = int8  # GGUF blocks through the int8 kernels (gguf_int8), else the float ones (gguf_kernels)
        self.device, self._parts = device, {}
        self.bk_gu, self.bk_d = _block_k(hidden), _block_k(inter)
        want = split or ((8, 4) if q8 else (2, 3))
        # a slice is whole groups of a q8 entry, whole K blocks of a float one
        self.split_gu = _split(hidden, want[0], q8[0] if q8 else self.bk_gu)
        self.split_d = _split(inter, want[1], q8[0] if q8 else self.bk_d)
        self.block_n = block_n or (128 if q8 else 32)
        # float32 partial sums: fixed buffers, so a captured step keeps their addresses
        self.gate = torch.empty((self.split_gu, k, inter), dtype=torch.float32, device=device)
        self.up = torch.empty_like(self.gate)
        self.down = torch.empty((self.split_d, k, hidden), dtype=torch.float32, device=device)
        self.h = torch.empty((k, inter), dtype=dtype, device=device)  # each expert's SwiGLU output
        self.slots = torch.arange(k, device=device).view(1, k)  # ids for a table of the k routed experts, in order
        self._at = torch.arange(k + 1, device=device)  # one row's routed pairs, each its own run (blocks)

    # One row's epilogue, the same ops on the same shapes whichever path (one row, several, floats or blocks) calls it:
    # what keeps a row's bits its own
    def _summed(self, part: torch.Tensor) -> torch.Tensor:
        """[slices, k, n] float32 partial sums -> [k, n]: the slices added in order, rounded as F.linear rounds."""
        return part.sum(0).to(self.dtype)

    def _weighted(self, y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """[k, H] each routed expert's output, ``weights`` its k router weights -> [1, H], added in float32."""
        return (y * weights.reshape(self.k, 1)).float().sum(0, keepdim=True).to(self.dtype)

    def _block_parts(self, qtype, k: int, n: int, want: int) -> torch.Tensor:
        """A fixed float32 [slices, k routed, n] buffer of block partial sums (a captured step keeps its address):
        ``_block_rows_parts``'s of one row."""
        return self._block_rows_parts(qtype, k, n, want, 1)[0]

    def _blocks(self, x, weights, ids, table, layouts) -> torch.Tensor:
        """The block form: gate and up from the gate_up entry's rows (each in its segment), down from the down entry:
        through the float kernels (``gguf_kernels.expert_matmul``), or the int8 ones (``gguf_int8.expert_matmul``,
        each routed expert its own run)."""
        H, I = self.H, self.I  # noqa: E741
        gu, dn = layouts
        runs = gguf_int8.single_runs(ids, self._at) if self.int8 else None
        halves = []
        for row in (0, I):
            qtype, at = blocks.rows_at(gu, row, I, H)
            part = self._block_parts(qtype, H, I, 8)
            if self.int8:
                gguf_int8.expert_matmul(x, runs, table, part[None], 0, at, qtype, I, H, x_per_slot=False)
            else:
                gguf_kernels.expert_matmul(x, ids, table, part, 0, at, qtype, I, H, x_per_slot=False)
            halves.append(self._summed(part))
        self.h.copy_(F.silu(halves[0]) * halves[1])
        qtype, at = blocks.rows_at(dn, 0, H, I)
        part = self._block_parts(qtype, I, H, 4)
        if self.int8:
            gguf_int8.expert_matmul(self.h, runs, table, part[None], 1, at, qtype, H, I, x_per_slot=True)
        else:
            gguf_kernels.expert_matmul(self.h, ids, table, part, 1, at, qtype, H, I, x_per_slot=True)
        return self._weighted(self._summed(part), weights)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, table: torch.Tensor,
                 layouts: tuple | None = None) -> torch.Tensor:
        """x [1, H], weights [1, k], ids [1, k] (int64), table [E, 2] int64 addresses -> [1, H]; ``layouts``: the
        (gate_up, down) block layouts of these experts, for a model of GGUF blocks."""
        if self.blocks:
            return self._blocks(x.contiguous(), weights, ids.contiguous(), table, layouts)
        float_rows, q8_cols = _kernels()[:2]
        H, I, k, bn = self.H, self.I, self.k, self.block_n  # noqa: E741
        x, ids = x.contiguous(), ids.contiguous()
        grid_gu = (k, -(-I // bn), self.split_gu)
        grid_d = (k, -(-H // bn), self.split_d)
        if self.q8 is None:
            dt = _tl_dtype(self.dtype)
            kw = dict(DTYPE=dt, BLOCK_N=bn, BLOCK_K=self.bk_gu)
            float_rows[grid_gu](x, ids, table, self.gate, which=0, N=I, K=H, ROWS_AT=0, KS=H // self.split_gu,
                                X_PER_SLOT=False, **kw)
            float_rows[grid_gu](x, ids, table, self.up, which=0, N=I, K=H, ROWS_AT=I, KS=H // self.split_gu,
                                X_PER_SLOT=False, **kw)
        else:
            group, npad_gu, npad_d = self.q8
            kw = dict(GROUP=group, BLOCK_N=bn, X_PER_SLOT=False)
            q8_cols[grid_gu](x, ids, table, self.gate, which=0, N=I, K=H, NPAD=npad_gu, COLS_AT=0,
                             KS=H // self.split_gu, **kw)
            q8_cols[grid_gu](x, ids, table, self.up, which=0, N=I, K=H, NPAD=npad_gu, COLS_AT=I,
                             KS=H // self.split_gu, **kw)
        g = self._summed(self.gate)
        u = self._summed(self.up)
        self.h.copy_(F.silu(g) * u)
        if self.q8 is None:
            float_rows[grid_d](self.h, ids, table, self.down, which=1, N=H, K=I, ROWS_AT=0, KS=I // self.split_d,
                               X_PER_SLOT=True, DTYPE=_tl_dtype(self.dtype), BLOCK_N=bn, BLOCK_K=self.bk_d)
        else:
            q8_cols[grid_d](self.h, ids, table, self.down, which=1, N=H, K=I, NPAD=self.q8[2], COLS_AT=0,
                            KS=I // self.split_d, GROUP=self.q8[0], BLOCK_N=bn, X_PER_SLOT=True)
        return self._weighted(self._summed(self.down), weights)

    def rows(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, table: torch.Tensor,
             layouts: tuple | None = None) -> torch.Tensor:
        """Several rows' routed experts (a batched step's), x [R, H], weights and ids [R, k] -> [R, H], each expert read
        once for every row routed to it (the grouped kernels), and each row's result bitwise its one-row call's: the
        same partial sums in the same order, and each row's epilogue the one-row call's ops on the same shapes. Float
        and q8 experts here; GGUF block experts in ``_blocks_rows``, told their ``layouts``."""
        if self.blocks:
            return self._blocks_rows(x.contiguous(), weights, ids, table, layouts)
        _, _, float_grouped, q8_grouped = _kernels()
        H, I, k, bn = self.H, self.I, self.k, self.block_n  # noqa: E741
        R = x.shape[0]
        gate, up, down, h = self._rows_buffers(R)
        x = x.contiguous()
        experts, pairs, ends = expert_runs(ids)
        grid_gu, grid_d = (R * k, -(-I // bn), self.split_gu), (R * k, -(-H // bn), self.split_d)
        runs = dict(KT=k)
        if self.q8 is None:
            kw = dict(DTYPE=_tl_dtype(self.dtype), BLOCK_N=bn, BLOCK_K=self.bk_gu, X_PER_SLOT=False,
                      SLICES=self.split_gu, **runs)
            for part, rows_at in ((gate, 0), (up, I)):
                float_grouped[grid_gu](x, pairs, experts, ends, table, part, which=0, N=I, K=H, ROWS_AT=rows_at,
                                       KS=H // self.split_gu, **kw)
        else:
            group, npad_gu, npad_d = self.q8
            for part, cols_at in ((gate, 0), (up, I)):
                q8_grouped[grid_gu](x, pairs, experts, ends, table, part, which=0, N=I, K=H, NPAD=npad_gu,
                                    COLS_AT=cols_at, KS=H // self.split_gu, GROUP=group, BLOCK_N=bn, X_PER_SLOT=False,
                                    SLICES=self.split_gu, **runs)
        for r in range(R):  # each row's epilogue as the one-row call's
            g = self._summed(gate[r])
            u = self._summed(up[r])
            h[r].copy_(F.silu(g) * u)
        if self.q8 is None:
            float_grouped[grid_d](h, pairs, experts, ends, table, down, which=1, N=H, K=I, ROWS_AT=0,
                                  KS=I // self.split_d, DTYPE=_tl_dtype(self.dtype), BLOCK_N=bn, BLOCK_K=self.bk_d,
                                  X_PER_SLOT=True, SLICES=self.split_d, **runs)
        else:
            q8_grouped[grid_d](h, pairs, experts, ends, table, down, which=1, N=H, K=I, NPAD=self.q8[2], COLS_AT=0,
                               KS=I // self.split_d, GROUP=self.q8[0], BLOCK_N=bn, X_PER_SLOT=True,
                               SLICES=self.split_d, **runs)
        return torch.cat([self._weighted(self._summed(down[r]), weights[r]) for r in range(R)])

    def _blocks_rows(self, x, weights, ids, table, layouts) -> torch.Tensor:
        """``rows`` for GGUF block experts: each expert's weight read once for the rows routed to it
        (``gguf_kernels.expert_matmul_grouped``; int8: up to 8 at a time, ``gguf_int8.expert_matmul``), each pair's sums
        and each row's epilogue bitwise ``_blocks``'s."""
        H, I, k, R = self.H, self.I, self.k, x.shape[0]  # noqa: E741
        runs, (gu, dn) = expert_runs(ids), layouts
        halves = []
        for row in (0, I):
            qtype, at = blocks.rows_at(gu, row, I, H)
            part = self._block_rows_parts(qtype, H, I, 8, R)
            if self.int8:
                gguf_int8.expert_matmul(x, runs, table, part, 0, at, qtype, I, H, x_per_slot=False)
            else:
                gguf_kernels.expert_matmul_grouped(x, runs, table, part, 0, at, qtype, I, H, x_per_slot=False)
            halves.append([self._summed(part[r]) for r in range(R)])  # before the next kernel reuses part
        key = ("rows-h", R)
        if key not in self._parts:
            self._parts[key] = torch.empty((R, k, I), dtype=self.dtype, device=self.device)
        h = self._parts[key]
        for r in range(R):
            h[r].copy_(F.silu(halves[0][r]) * halves[1][r])
        qtype, at = blocks.rows_at(dn, 0, H, I)
        part = self._block_rows_parts(qtype, I, H, 4, R)
        if self.int8:
            gguf_int8.expert_matmul(h.reshape(R * k, I), runs, table, part, 1, at, qtype, H, I, x_per_slot=True)
        else:
            gguf_kernels.expert_matmul_grouped(h, runs, table, part, 1, at, qtype, H, I, x_per_slot=True)
        return torch.cat([self._weighted(self._summed(part[r]), weights[r]) for r in range(R)])

    def _block_rows_parts(self, qtype, k: int, n: int, want: int, rows: int) -> torch.Tensor:
        """``_block_parts`` for a batch of ``rows``: [rows, slices, k routed, n], each row's block that buffer's
        layout."""
        slices = (gguf_int8 if self.int8 else gguf_kernels).expert_slices(qtype, k, want)
        key = ("rows", slices, n, rows)
        if key not in self._parts:
            self._parts[key] = torch.empty((rows, slices, self.k, n), dtype=torch.float32, device=self.device)
        return self._parts[key]

    def _rows_buffers(self, rows: int) -> tuple[torch.Tensor, ...]:
        """A batch of ``rows``' fixed buffers (a captured step keeps their addresses): the gate, up and down partial
        sums, [rows, slices, k, n] float32 (each row's block the one-row buffers' layout), and the SwiGLU outputs."""
        key = ("rows", rows)
        if key not in self._parts:
            k, dev = self.k, self.device
            gate = torch.empty((rows, self.split_gu, k, self.I), dtype=torch.float32, device=dev)
            self._parts[key] = (gate, torch.empty_like(gate),
                                torch.empty((rows, self.split_d, k, self.H), dtype=torch.float32, device=dev),
                                torch.empty((rows, k, self.I), dtype=self.dtype, device=dev))
        return self._parts[key]

    def fetched(self, x: torch.Tensor, weights: torch.Tensor, buffers: list) -> torch.Tensor:
        """The k routed experts (in routing order) from the buffers the host fetched them into: the same kernels on a
        table of their addresses."""
        addrs = [b.data_ptr() for pair in buffers for b in pair]
        table = torch.tensor(addrs, dtype=torch.int64).pin_memory().to(x.device, non_blocking=True).view(self.k, 2)
        layouts = (buffers[0][0].layout, buffers[0][1].layout) if self.blocks else None  # one layer: one layout
        return self(x, weights, self.slots, table, layouts)
