"""Activations times a weight held as the file's own GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, Q8_0, and
the large MoE files' Q2_K, Q3_K, IQ4_NL and IQ4_XS),
dequantized inside the kernel and summed in float32, so the device reads the file's bytes (4.5 to 8.5 bits a weight)
and never a dequantized copy.

A weight W [N, K] is stored as ggml stores it: each of its N rows is a run of blocks along K, so the bytes are uint8
[N, K / values_per_block * bytes_per_block] (``kestrel_core.formats.gguf_quants.block_geometry``). ``matmul(x, raw, qtype, n,
k)`` gives y [M, N] = x [M, K] @ W.T in float32, for M = 1 (decode at batch 1) up to 64 rows a launch (batched decode,
speculative verify passes; more rows run as further launches); ``gemv`` is its one-row form.

One kernel serves every M, and each row's sum runs in the same order whatever M is, so row m of a batch is bitwise the
one-row result on x[m] (batched ids equal solo ids). A program owns BLOCK_N outputs and walks a fixed range of K in
chunks (one 256-value super-block, or eight 32-value blocks); it dequantizes the chunk's weight tile once, then for
each row (a ``tl.static_range`` loop, the same code for any M) reduces that row's products over the tile with the same
shape and adds them to the row's accumulator. No ``tl.dot`` (its order depends on the tile shape), no atomics. Where
few programs would cover N, K is cut into a number of slices chosen from (type, N, K) alone, never from M, and a short
epilogue adds the slices' float32 partial sums in slice order.

Measured once (``bench/results/gguf-gemv_20261205T145716Z.json``, H100, Triton 3.6, default plan, a dirty tree): one row reads Q4_K at 590 to 835 GB/s
and Q8_0 at 900 to 1280 GB/s on the Qwen3-8B q and gate shapes (20 to 44% of the device copy), 6 to 15x
dequantize-then-linear; 8 rows take 2.5 to 4x one row's time; 64 rows are compute-bound on the per-row reductions
(each row's x tile crosses shared memory) and slower than dequantize-then-linear.

Each type's bits are read as ggml's ``dequantize_row_*`` reads them; ``kestrel_core.formats.gguf_quants`` (bit-exact with ggml)
is the reference the tests hold these kernels to. Triton compiles them on first use; where Triton is missing,
``available()`` says so.
"""

from __future__ import annotations

import functools

import torch
from gguf import GGMLQuantizationType

from backends.cuda import gguf_cuda
from backends.cuda.triton_check import available  # noqa: F401 - one rule for where Triton kernels can run
from kestrel_core.formats.gguf_quants import block_geometry, check_product

T = GGMLQuantizationType
TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS)
MAX_ROWS = 64  # rows a launch: the per-row loop is unrolled, so each M up to this is its own compiled kernel
BLOCK_N = 16  # outputs a program
NUM_WARPS = 4
MIN_PROGRAMS = 512  # K is sliced until about this many programs cover the weight (a few per SM on an H100)

# qtype -> (G, L): a chunk is a [G, L] tile of values, G groups of L sharing a scale (one super-block for the K-types,
# eight 32-value blocks for the others)
_CHUNK = {T.Q4_0: (8, 32), T.Q4_1: (8, 32), T.Q5_0: (8, 32), T.Q5_1: (8, 32), T.Q8_0: (8, 32), T.Q4_K: (8, 32),
          T.Q5_K: (8, 32), T.Q6_K: (16, 16), T.Q2_K: (16, 16), T.Q3_K: (16, 16), T.IQ4_NL: (8, 32), T.IQ4_XS: (8, 32)}


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def f16_at(p, mask):
        """The little-endian float16 at byte pointers ``p`` (blocks are packed, so it may sit at any even or odd
        offset: read as two bytes), as float32."""
        lo = tl.load(p, mask=mask, other=0).to(tl.uint16)
        hi = tl.load(p + 1, mask=mask, other=0).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def byte_at(p, mask):
        return tl.load(p, mask=mask, other=0).to(tl.int32)

    @triton.jit
    def iq4_level(q):
        """IQ4_NL's and IQ4_XS's level of 4-bit ``q`` (ggml's kvalues_iq4nl), as float32: the 16 levels plus 127 are
        bytes of four words, picked by arithmetic (a kernel here takes no table)."""
        q = q.to(tl.int64)
        word = tl.where(q < 4, 0x3E2C1700, tl.where(q < 8, 0x75695C4E, tl.where(q < 12, 0xA5988C80, 0xF0D8C4B4)))
        return (((word >> (8 * (q % 4))) & 255) - 127).to(tl.float32)

    globals().update(iq4_level=iq4_level)

    @triton.jit
    def weight_tile(wrow, rows_ok, c, NB, QT: tl.constexpr, G: tl.constexpr, L: tl.constexpr, EVEN: tl.constexpr):
        """Chunk ``c`` of each row as float32 [BLOCK_N, G, L]: value (g, l) is the row's value c * G * L + g * L + l.
        ``wrow`` [BLOCK_N, 1, 1] points at each row's first byte; a row past N reads as zeros. Each product and sum
        is ggml's, in its order (d * q, then + m or - dmin * m)."""
        g = tl.arange(0, G)[None, :, None]
        l = tl.arange(0, L)[None, None, :]  # noqa: E741
        if QT == "Q8_0" or QT == "Q4_0" or QT == "Q4_1" or QT == "Q5_0" or QT == "Q5_1" or QT == "IQ4_NL":
            blk = c * G + g  # a block of 32 values a group
            if EVEN:
                ok = rows_ok & (g < G)
            else:
                ok = rows_ok & (blk < NB)  # the last chunk of a K that is not whole chunks
            if QT == "Q8_0":  # d f16, then 32 int8
                p = wrow + blk * 34
                q = tl.load(p + 2 + l, mask=ok, other=0).to(tl.int8, bitcast=True)
                wt = q.to(tl.float32) * f16_at(p, ok)
            elif QT == "Q4_0":  # d f16, then 16 bytes: value j in byte j's low nibble, value j + 16 in its high one
                p = wrow + blk * 18
                q = (byte_at(p + 2 + (l % 16), ok) >> ((l // 16) * 4)) & 15
                wt = (q - 8).to(tl.float32) * f16_at(p, ok)
            elif QT == "IQ4_NL":  # d f16, then Q4_0's nibbles, each a level
                p = wrow + blk * 18
                q = (byte_at(p + 2 + (l % 16), ok) >> ((l // 16) * 4)) & 15
                wt = f16_at(p, ok) * iq4_level(q)
            elif QT == "Q4_1":  # d f16, m f16, then Q4_0's nibbles
                p = wrow + blk * 20
                q = (byte_at(p + 4 + (l % 16), ok) >> ((l // 16) * 4)) & 15
                wt = q.to(tl.float32) * f16_at(p, ok) + f16_at(p + 2, ok)
            else:  # Q5_0: d f16, qh (bit l: value l's fifth bit), Q4_0's nibbles; Q5_1: d, m, then Q5_0's bits
                p = wrow + blk * (22 if QT == "Q5_0" else 24)
                at = 2 if QT == "Q5_0" else 4
                q = (byte_at(p + at + 4 + (l % 16), ok) >> ((l // 16) * 4)) & 15
                q = q | (((byte_at(p + at + l // 8, ok) >> (l % 8)) & 1) << 4)
                if QT == "Q5_0":
                    wt = (q - 16).to(tl.float32) * f16_at(p, ok)
                else:
                    wt = q.to(tl.float32) * f16_at(p, ok) + f16_at(p + 2, ok)
        elif QT == "Q4_K" or QT == "Q5_K":
            # d f16, dmin f16, 12 bytes of eight 6-bit scales and mins (get_scale_min_k4), then the quants. Group g's
            # scale and min come from bytes a = [g % 4], b = [4 + g % 4], e = [8 + g % 4] of the 12.
            p = wrow + c * (144 if QT == "Q4_K" else 176)
            ok = rows_ok & (g < G)
            a = byte_at(p + 4 + g % 4, ok)
            b = byte_at(p + 8 + g % 4, ok)
            e = byte_at(p + 12 + g % 4, ok)
            low = g < 4
            sc = tl.where(low, a & 63, (e & 15) | ((a >> 6) << 4))
            mn = tl.where(low, b & 63, (e >> 4) | ((b >> 6) << 4))
            d1 = f16_at(p, rows_ok) * sc.to(tl.float32)
            m1 = f16_at(p + 2, rows_ok) * mn.to(tl.float32)
            # 64 values a 32-byte run: group g is the low (g even) or high nibbles of run g // 2
            if QT == "Q4_K":
                q = (byte_at(p + 16 + (g // 2) * 32 + l, ok) >> ((g % 2) * 4)) & 15
            else:  # Q5_K: the fifth bit of value l of group g is bit g of qh[l]
                q = (byte_at(p + 48 + (g // 2) * 32 + l, ok) >> ((g % 2) * 4)) & 15
                q = q | (((byte_at(p + 16 + l, ok) >> g) & 1) << 4)
            wt = d1 * q.to(tl.float32) - m1
        elif QT == "IQ4_XS":
            # d f16, scales_h (2 bits a 32-value group), scales_l[4] (a nibble a group), then 16 bytes a group: its
            # values' low nibbles, then their high ones, each a level times d * (scale - 32)
            p = wrow + c * 136
            ok = rows_ok & (g < G)
            sh = byte_at(p + 2, rows_ok) | (byte_at(p + 3, rows_ok) << 8)
            ls = ((byte_at(p + 4 + g // 2, ok) >> (4 * (g % 2))) & 15) | (((sh >> (2 * g)) & 3) << 4)
            dl = f16_at(p, rows_ok) * (ls - 32).to(tl.float32)
            q = (byte_at(p + 8 + 16 * g + (l % 16), ok) >> ((l // 16) * 4)) & 15
            wt = dl * iq4_level(q)
        elif QT == "Q2_K" or QT == "Q3_K":
            # 16 groups of 16: value l of group g is 2 bits (shift 2j) of byte 16 (g % 2) + l of the half's 32 quant
            # bytes, h = g // 8 the half and j = (g % 8) // 2 its pass (as dequantize_row_q2_K / q3_K walk them)
            ok = rows_ok & (g < G)
            h = g // 8
            shift = 2 * ((g % 8) // 2)
            at = 32 * h + 16 * (g % 2) + l
            if QT == "Q2_K":  # scales[16] (low nibble a scale, high a min), qs[64], d, dmin
                p = wrow + c * 84
                sc = byte_at(p + g, ok)
                q = (byte_at(p + 16 + at, ok) >> shift) & 3
                dl = f16_at(p + 80, rows_ok) * (sc & 15).to(tl.float32)
                ml = f16_at(p + 82, rows_ok) * (sc >> 4).to(tl.float32)
                wt = dl * q.to(tl.float32) - ml
            else:  # Q3_K: hmask[32] (bit 4h + j of byte 16 (g % 2) + l: no - 4), qs[64], 12 bytes of 6-bit scales, d
                p = wrow + c * 110
                q = (byte_at(p + 32 + at, ok) >> shift) & 3
                hbit = (byte_at(p + 16 * (g % 2) + l, ok) >> (4 * h + shift // 2)) & 1
                sc = ((byte_at(p + 96 + g % 8, ok) >> (4 * (g // 8))) & 15) | (((byte_at(p + 104 + g % 4, ok)
                                                                                >> (2 * (g // 4))) & 3) << 4)
                dl = f16_at(p + 108, rows_ok) * (sc - 32).to(tl.float32)
                wt = dl * (q - 4 * (1 - hbit)).to(tl.float32)
        else:  # Q6_K: ql[128], qh[64], 16 int8 scales, d f16; two halves of 128 values, each four quarters of 32
            p = wrow + c * 210
            ok = rows_ok & (g < G)
            h = g // 8  # the half
            t = (g % 8) // 2  # the quarter in it
            j = (g % 2) * 16 + l  # the value in the quarter
            lo = (byte_at(p + 64 * h + 32 * (t % 2) + j, ok) >> (4 * (t // 2))) & 15
            hi = (byte_at(p + 128 + 32 * h + j, ok) >> (2 * t)) & 3
            q = (lo | (hi << 4)) - 32
            sc = tl.load(p + 192 + g, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            wt = (f16_at(p + 208, rows_ok) * sc) * q.to(tl.float32)
        return wt

    # gguf_rows calls these by name, and Triton (compiler and interpreter alike) looks a called function up in the
    # module's globals, not in this closure
    globals().update(f16_at=f16_at, byte_at=byte_at, weight_tile=weight_tile)

    @triton.jit
    def gguf_rows(x, w, out, N, K, ROW_BYTES, NB, NCH, CPS, M: tl.constexpr, QT: tl.constexpr, G: tl.constexpr,
                  L: tl.constexpr, EVEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
        """out[s, m, n] = sum over the chunks of slice s of W[n, chunk] . x[m, chunk], for m < M (x [M, K]
        contiguous); chunks are G * L values, NB blocks a row, NCH chunks a row, CPS chunks a slice; EVEN: every
        chunk is whole (no block past the row's last to mask). The shape is passed at run time (one compiled
        kernel a type, M and plan, not a layer), M and the tile as constants."""
        pn, s = tl.program_id(0), tl.program_id(1)
        rows = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        r3 = rows[:, None, None]
        rows_ok = r3 < N
        wrow = w + r3.to(tl.int64) * ROW_BYTES
        g2 = tl.arange(0, G)[:, None]
        xoff = g2 * L + tl.arange(0, L)[None, :]  # [G, L]: the chunk's values, in the tile's order
        mcol = tl.arange(0, BLOCK_M)[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # acc[n, m]: the layout of a row's partial sums
        for c in range(s * CPS, tl.minimum(s * CPS + CPS, NCH)):
            wt = weight_tile(wrow, rows_ok, c, NB, QT, G, L, EVEN)  # read and dequantized once for all rows
            if EVEN:
                xok = g2 < G
            else:
                xok = (c * G + g2) < NB
            for m in tl.static_range(M):
                # the same ops on the same tile for every row and every M: the row's bits do not depend on M
                xv = tl.load(x + m * K + c * (G * L) + xoff, mask=xok, other=0.0).to(tl.float32)
                part = tl.sum(tl.sum(wt * xv[None, :, :], axis=2), axis=1)
                acc = tl.where(mcol == m, acc + part[:, None], acc)
        dst = out + s * (M * N) + mcol * N + rows[:, None]
        tl.store(dst, acc, mask=(rows[:, None] < N) & (mcol < M))

    @triton.jit
    def expert_weight_rows(table, expert, WHICH: tl.constexpr, BYTE_AT, pn, N, ROW_BYTES, BLOCK_N: tl.constexpr,
                           G: tl.constexpr, L: tl.constexpr):
        """A program's block of W's rows, for the entry the expert table holds at column WHICH for ``expert``: the rows,
        which are in W, their byte pointers, and a chunk's [G, L] value offsets."""
        base = tl.load(table + expert * 2 + WHICH)
        w = base.to(tl.pointer_type(tl.uint8)) + BYTE_AT
        rows = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        r3 = rows[:, None, None]
        g2 = tl.arange(0, G)[:, None]
        return rows, r3 < N, w + r3.to(tl.int64) * ROW_BYTES, g2, g2 * L + tl.arange(0, L)[None, :]

    @triton.jit
    def chunk_x(xs, c, g2, xoff, NB, G: tl.constexpr, L: tl.constexpr, EVEN: tl.constexpr):
        """Chunk ``c`` of the input row at ``xs``, [G, L] float32 (zeros past the row's blocks)."""
        if EVEN:
            xok = g2 < G
        else:
            xok = (c * G + g2) < NB
        return tl.load(xs + c * (G * L) + xoff, mask=xok, other=0.0).to(tl.float32)

    globals().update(expert_weight_rows=expert_weight_rows, chunk_x=chunk_x)  # as above: the kernels find them there

    @triton.jit
    def expert_rows(x, ids, table, part, WHICH: tl.constexpr, BYTE_AT, N, K, ROW_BYTES, NB, NCH, CPS,
                    X_PER_SLOT: tl.constexpr, QT: tl.constexpr, G: tl.constexpr, L: tl.constexpr, EVEN: tl.constexpr,
                    BLOCK_N: tl.constexpr):
        """part[s, slot, n] = sum over the chunks of slice s of W[n, chunk] . x[chunk] (x [slots, K] where
        X_PER_SLOT, else one x [K] for every slot): W's rows are blocks at byte BYTE_AT of the entry the expert
        table holds at column WHICH for the slot's expert (``ids[slot]``). The one-row ``gguf_rows``, its weight's
        address read from the table."""
        slot, pn, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows, rows_ok, wrow, g2, xoff = expert_weight_rows(table, tl.load(ids + slot), WHICH, BYTE_AT, pn, N,
                                                           ROW_BYTES, BLOCK_N, G, L)
        xs = x + slot * K if X_PER_SLOT else x
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for c in range(s * CPS, tl.minimum(s * CPS + CPS, NCH)):
            wt = weight_tile(wrow, rows_ok, c, NB, QT, G, L, EVEN)
            xv = chunk_x(xs, c, g2, xoff, NB, G, L, EVEN)
            acc += tl.sum(tl.sum(wt * xv[None, :, :], axis=2), axis=1)
        nslots = tl.num_programs(0)
        tl.store(part + (s * nslots + slot) * N + rows, acc, mask=rows < N)

    @triton.jit
    def expert_rows_grouped(x, pairs, experts, ends, table, part, WHICH: tl.constexpr, BYTE_AT, N, K, ROW_BYTES, NB,
                            NCH, CPS, X_PER_SLOT: tl.constexpr, QT: tl.constexpr, G: tl.constexpr, L: tl.constexpr,
                            EVEN: tl.constexpr, BLOCK_N: tl.constexpr, KT: tl.constexpr, SLICES: tl.constexpr):
        """``expert_rows`` for several rows' pairs (``grouped_experts.expert_runs``): the program at the start of an
        expert's run dequantizes each weight tile once and adds it into each of the run's pairs' partial sums in turn,
        through memory, the same additions in the same order as ``expert_rows``. ``part`` is [rows, S, KT, N]."""
        p, pn, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        end = tl.load(ends + p)
        rows, rows_ok, wrow, g2, xoff = expert_weight_rows(table, tl.load(experts + p), WHICH, BYTE_AT, pn, N,
                                                           ROW_BYTES, BLOCK_N, G, L)
        first = s * CPS
        for c in range(first, tl.minimum(first + CPS, NCH)):
            wt = weight_tile(wrow, rows_ok, c, NB, QT, G, L, EVEN)
            for t in range(p, end):
                q = tl.load(pairs + t)
                xv = chunk_x(x + (q if X_PER_SLOT else q // KT) * K, c, g2, xoff, NB, G, L, EVEN)
                at = part + (((q // KT) * SLICES + s) * KT + q % KT) * N + rows
                before = tl.where(c > first, tl.load(at, mask=rows < N, other=0.0), 0.0)  # the first chunk starts at 0
                tl.store(at, before + tl.sum(tl.sum(wt * xv[None, :, :], axis=2), axis=1), mask=rows < N)

    @triton.jit
    def add_slices(part, out, TOTAL, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        """out[i] = part[0, i] + part[1, i] + ... in slice order."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < TOTAL
        acc = tl.load(part + i, mask=ok, other=0.0)
        for s in tl.static_range(1, SPLIT):
            acc = acc + tl.load(part + s * TOTAL + i, mask=ok, other=0.0)
        tl.store(out + i, acc, mask=ok)

    return gguf_rows, add_slices, expert_rows, expert_rows_grouped


def add_slices_kernel():
    """The epilogue that adds K slices' float32 partial sums in slice order (``add_slices``)."""
    return _kernels()[1]


def plan(qtype: GGMLQuantizationType, n: int, k: int, block_n: int | None = None,
         split: int | None = None) -> tuple[int, int, int]:
    """(BLOCK_N, K slices, chunks a slice) for W [n, k] of ``qtype``: from the weight's shape alone, never from M,
    so every M reduces each row in one order. ``split`` asks for that many slices (fewer where the chunks run out)."""
    values, _ = block_geometry(qtype)
    g, l = _CHUNK[qtype]  # noqa: E741
    nch = -(-(k // values) // (g * l // values))  # chunks a row
    bn = block_n or BLOCK_N
    want = split if split is not None else -(-MIN_PROGRAMS // -(-n // bn))
    cps = -(-nch // max(1, min(want, nch)))
    return bn, -(-nch // cps), cps


def check(x: torch.Tensor, weight: torch.Tensor, qtype, n: int, k: int) -> None:
    if qtype not in _CHUNK:
        raise ValueError(f"no GGUF kernel for {getattr(qtype, 'name', qtype)}; these run: "
                         + ", ".join(t.name for t in TYPES))
    check_product(x, weight, qtype, n, k)


def matmul(x: torch.Tensor, weight: torch.Tensor, qtype: GGMLQuantizationType, n: int, k: int, *,
           out: torch.Tensor | None = None, block_n: int | None = None, split: int | None = None,
           num_warps: int | None = None, impl: str = "auto") -> torch.Tensor:
    """y [M, n] float32 = x [M, k] @ W.T, W [n, k] held in ``weight`` as GGUF ``qtype`` blocks (uint8, n rows of
    whole blocks, ggml's layout). Row m of y is bitwise the result for x[m] alone, for any M. ``block_n``, ``split``
    and ``num_warps`` override the Triton kernel's plan (for measuring: a row's bits depend on them, so keep them
    fixed across M). ``impl``: "auto" runs Q4_K and Q6_K on the CUDA C++ kernel (``gguf_cuda``) where it runs here
    and no Triton plan is forced, the rest on Triton; "triton" or "cuda" ask for one."""
    if impl not in ("auto", "triton", "cuda"):
        raise ValueError(f"impl must be 'auto', 'triton' or 'cuda', not {impl!r}")
    forced = block_n is not None or split is not None or num_warps is not None
    if impl == "cuda" or (impl == "auto" and not forced and gguf_cuda.takes(x, qtype, k)):
        return gguf_cuda.matmul(x, weight, qtype, n, k, out=out)
    rows, add_slices = _kernels()[:2]
    check(x, weight, qtype, n, k)
    x = x.contiguous()
    m_all = x.shape[0]
    y = out if out is not None else torch.empty((m_all, n), dtype=torch.float32, device=x.device)
    if y.shape != (m_all, n) or y.dtype != torch.float32 or not y.is_contiguous():
        raise ValueError(f"out must be contiguous float32 [{m_all}, {n}]")
    values, nbytes = block_geometry(qtype)
    g, l = _CHUNK[qtype]  # noqa: E741
    bn, slices, cps = plan(qtype, n, k, block_n, split)
    nb, per_chunk = k // values, g * l // values  # blocks a row, blocks a chunk
    for at in range(0, m_all, MAX_ROWS):
        m = min(MAX_ROWS, m_all - at)
        dst = y[at:at + m]
        part = dst if slices == 1 else torch.empty((slices, m, n), dtype=torch.float32, device=x.device)
        rows[(-(-n // bn), slices)](
            x[at:at + m], weight, part, n, k, nb * nbytes, nb, -(-nb // per_chunk), cps, M=m, QT=qtype.name, G=g,
            L=l, EVEN=nb % per_chunk == 0, BLOCK_N=bn, BLOCK_M=1 << (m - 1).bit_length(),
            num_warps=num_warps or NUM_WARPS)
        if slices > 1:
            add_slices[(-(-(m * n) // 1024),)](part, dst, m * n, SPLIT=slices, BLOCK=1024, num_warps=4)
    return y


def expert_slices(qtype: GGMLQuantizationType, k: int, want: int) -> int:
    """The most slices, at most ``want``, that cut a row of ``k`` values into equal runs of whole chunks (1 where ``k``
    is not whole chunks): what ``expert_matmul``'s ``part`` is laid out by."""
    values, _ = block_geometry(qtype)
    g, l = _CHUNK[qtype]  # noqa: E741
    nch, per = -(-(k // values) // (g * l // values)), g * l
    if k % per:
        return 1
    return max(s for s in range(1, min(want, nch) + 1) if nch % s == 0)


def expert_matmul(x: torch.Tensor, ids: torch.Tensor, table: torch.Tensor, part: torch.Tensor, which: int, byte_at: int,
                  qtype: GGMLQuantizationType, n: int, k: int, x_per_slot: bool, block_n: int = BLOCK_N) -> None:
    """part [S, slots, n] float32 = each slot's expert's W [n, k] (``qtype`` blocks at byte ``byte_at`` of its entry
    ``which`` in ``table`` [experts, 2] int64 addresses) times x ([slots, k] where ``x_per_slot``, else [1, k]), summed
    over S slices of k (``expert_slices``); the caller adds the slices in order. One row a slot: as ``gemv`` reads."""
    expert_rows = _kernels()[2]
    nch, kw = _expert_args(which, byte_at, qtype, n, k, x_per_slot, block_n)
    slices, slots = part.shape[0], ids.numel()
    if nch % slices or part.shape[1:] != (slots, n) or part.dtype != torch.float32:
        raise ValueError(f"part must be float32 [{slices} slices dividing {nch} chunks, {slots}, {n}]")
    expert_rows[(slots, -(-n // block_n), slices)](x, ids, table, part, CPS=nch // slices, **kw)


def expert_matmul_grouped(x: torch.Tensor, runs: tuple, table: torch.Tensor, part: torch.Tensor, which: int,
                          byte_at: int, qtype: GGMLQuantizationType, n: int, k: int, x_per_slot: bool,
                          block_n: int = BLOCK_N) -> None:
    """``expert_matmul`` for several rows: ``runs`` = (experts, pairs, ends) of their routed pairs
    (``grouped_experts.expert_runs``), ``part`` [rows, S, slots a row, n] float32, x [rows, k] (or, ``x_per_slot``,
    [rows * slots a row, k]); each pair's partial sums bitwise the one-row call's."""
    expert_rows_grouped = _kernels()[3]
    experts, pairs, ends = runs
    nch, kw = _expert_args(which, byte_at, qtype, n, k, x_per_slot, block_n)
    rows, slices, kt = part.shape[:3]
    if nch % slices or part.shape[3] != n or rows * kt != pairs.numel() or part.dtype != torch.float32:
        raise ValueError(f"part must be float32 [rows, {slices} slices dividing {nch} chunks, slots, {n}]")
    expert_rows_grouped[(pairs.numel(), -(-n // block_n), slices)](x, pairs, experts, ends, table, part,
                                                                     CPS=nch // slices, KT=kt, SLICES=slices, **kw)


def _expert_args(which: int, byte_at: int, qtype: GGMLQuantizationType, n: int, k: int, x_per_slot: bool,
                 block_n: int) -> tuple[int, dict]:
    """The chunks of k, and the launch arguments the one-row and the grouped expert kernels share."""
    values, nbytes = block_geometry(qtype)
    g, l = _CHUNK[qtype]  # noqa: E741
    nb, per_chunk = k // values, g * l // values
    nch = -(-nb // per_chunk)
    return nch, dict(WHICH=which, BYTE_AT=byte_at, N=n, K=k, ROW_BYTES=nb * nbytes, NB=nb, NCH=nch,
                     X_PER_SLOT=x_per_slot, QT=qtype.name, G=g, L=l, EVEN=nb % per_chunk == 0, BLOCK_N=block_n,
                     num_warps=NUM_WARPS)


def gemv(x: torch.Tensor, weight: torch.Tensor, qtype: GGMLQuantizationType, n: int, k: int, **kw) -> torch.Tensor:
    """y [n] float32 = W @ x for one row x [k] (or [1, k]): ``matmul`` with M = 1."""
    return matmul(x.reshape(1, k), weight, qtype, n, k, **kw).reshape(n)


def stored_bytes(qtype: GGMLQuantizationType, n: int, k: int) -> int:
    """Bytes of W [n, k] as ``qtype`` blocks: what one call reads of the weight."""
    values, nbytes = block_geometry(qtype)
    return n * (k // values) * nbytes
