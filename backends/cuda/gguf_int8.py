"""GGUF blocks times activations quantized to int8, summed by int8 dot products: the GEMV of decode and batches (1 to
8 rows a launch, more as further launches) for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K.

Why: the float path (``gguf_kernels``) turns every 4-bit value into a float32 before its product, about four
instructions a weight, and reads at 14 to 20% of the device copy rate. Here, as in llama.cpp's ``mmvq``, each input
row is first quantized per 32 values (``quantize_rows``: int8 values, a float32 scale ``d = max|x| / 127`` and the
block's float32 sum), and a 32-bit word of weight quants meets a word of those int8 values in one ``dp4a`` (four byte
products and their sum). A word of 4-bit quants holds eight values: its low nibbles (``w & 0x0F0F0F0F``) and high
nibbles are a dp4a each; a fifth or sixth bit is OR-ed into each byte first (Q5_0, Q5_1, Q5_K, Q6_K), and an offset
(Q4_0's 8, Q5_0's 16, Q6_K's 32) is a dp4a of x against that byte in every lane. The integer sums are exact; each 16- or 32-value group's
sum is turned into float32 once, times the group's scales.

``y = sum_g d_g * dx_g * sum(q * xq)``, plus for the types with a min (Q4_1, Q5_1, Q4_K, Q5_K) ``m_g * sum_g(x)`` with the
block's exact float sum of x.

The order of every float operation is fixed by the weight's shape alone: a program keeps one float32 partial sum a
row and output, and adds each group's term into it, one add a term, in the weight's order (``fold``), never a float
reduction whose order would follow the layout. Integer sums are exact in any order. So row m of a batch is bitwise row m alone, for any M
and any rows beside it, and the tensor-core kernel for many rows (``kquant_mmq``) adds the same terms in the same
order.

``dp4a`` is PTX; under Triton's interpreter (CI) ``dot4`` spells the same integer arithmetic out, so the two are
bitwise one (a cuda test holds the GPU's dp4a to the spelt-out twin). Q4_K's and Q5_K's blocks (144 and 176 bytes)
are read as 32-bit words; the others' (18 to 34, and 210 bytes) as 16-bit halves joined in pairs.
"""
from __future__ import annotations

import functools
import os

import torch
from gguf import GGMLQuantizationType

from backends.cuda.gguf_kernels import add_slices_kernel, check
from kestrel_core.formats.gguf_quants import block_geometry, row_nbytes

T = GGMLQuantizationType
TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
WORDS = (T.Q4_K, T.Q5_K)  # read as 32-bit words (blocks of whole words); the rest as 16-bit halves
MAX_ROWS = 8  # rows a launch: the rows' partial sums are held together; more rows run as more launches
MMQ_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K)  # the types whose many rows run on the tensor cores (``kquant_mmq``)
MMQ_ROWS = 16  # from this many rows a call, those types run on the tensor cores (bitwise the one-row kernels' rows)
MMQ_BLOCK_N = 64
QUANT_BLOCK = 32  # values of x sharing one int8 scale
# int8 digits a value of x: 1 (as llama.cpp: x to 1/254 of its block's largest) or 2 (x1 * 254 + x2: to 1/64516 of it,
# float32-like; two dp4a where one would do). The gate: bench gguf-gemv --int8-plans with :D
DIGITS = 2
# qtype -> default (BLOCK_N, units a step, programs wanted, warps), a unit a super-block of 256 values (K-quants) or a
# block of 32 (the rest); the plan is the weight's shape's alone
DEFAULT_PLAN = {T.Q4_K: (16, 1, 1024, 4), T.Q5_K: (16, 1, 1024, 4), T.Q6_K: (16, 1, 1024, 4),
                T.Q8_0: (16, 8, 1024, 4), T.Q4_0: (16, 8, 1024, 4), T.Q4_1: (16, 8, 1024, 4),
                T.Q5_0: (16, 8, 1024, 4), T.Q5_1: (16, 8, 1024, 4)}


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    # the compiler resolves a jit function's names (its annotations' ``tl`` too) in this module's globals
    globals().update(tl=tl)

    @triton.jit
    def dot4(a, b, c, ASM: tl.constexpr):
        """c + the dot product of the four signed bytes of a and of b (int32 words): ``dp4a`` on a GPU; the same
        exact integer arithmetic spelt out where ``ASM`` is off (Triton's interpreter runs no PTX)."""
        if ASM:
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                             is_pure=True, pack=1)
        else:
            s = c
            for i in tl.static_range(4):
                s += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
            return s

    @triton.jit
    def dot2(q, x1, x2, c, DIGITS: tl.constexpr, ASM: tl.constexpr):
        """c + q . x for x held as DIGITS int8 digits a value (x1, or x1 * 254 + x2): exact in int32."""
        if DIGITS == 2:
            return dot4(q, x2, c + 254 * dot4(q, x1, c * 0, ASM), ASM)
        else:
            return dot4(q, x1, c, ASM)

    @triton.jit
    def x_words(xq, at, mask, XW, DIGITS: tl.constexpr):
        """The int8 words of x at word ``at`` of digit 1, and of digit 2 (XW words further; digit 1's where
        there is one digit)."""
        x1 = tl.load(xq + at, mask=mask, other=0)
        if DIGITS == 2:
            x2 = tl.load(xq + at + XW, mask=mask, other=0)
        else:
            x2 = x1
        return x1, x2

    @triton.jit
    def fold(acc, term, T: tl.constexpr):
        """acc [BM, BN] plus each of term's T slots [BM, BN, T] in slot order, one add each: the same additions in the
        same order whatever the layout, so a row's bits follow neither BM nor the tile (the tensor-core kernel adds
        its groups' terms so too). A slot is picked out exactly (a sum of it and zeros)."""
        slot = tl.arange(0, T)[None, None, :]
        for i in tl.static_range(T):
            acc = acc + tl.sum(tl.where(slot == i, term, 0.0), axis=2)
        return acc

    @triton.jit
    def f16_lo(word):
        """The float16 in the low half of an int32 word, as float32."""
        return (word & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

    globals().update(dot4=dot4, dot2=dot2, x_words=x_words, fold=fold, f16_lo=f16_lo)  # Triton finds called functions in the globals

    @triton.jit
    def quantize_rows(x, xq, xd, xs, K, NB, BLOCKS: tl.constexpr, DIGITS: tl.constexpr):
        """Row m of x [M, K] as int8 digits xq [M, DIGITS, K] per 32 values: with d = max|x| / 127, the first digit
        q1 = round(x / d) (half away from zero), the second q2 = round((x / d - q1) * 254); xd [M, NB] is the scale
        of the digits' integer (d, or d / 254 for q1 * 254 + q2), xs [M, NB] each block's float32 sum of x."""
        m, pb = tl.program_id(0), tl.program_id(1)
        b = pb * BLOCKS + tl.arange(0, BLOCKS)[:, None]
        lane = tl.arange(0, 32)[None, :]
        ok = b < NB
        v = tl.load(x + m * K + b * 32 + lane, mask=ok, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(v), axis=1)
        d = tl.div_rn(amax, 127.0)
        safe = tl.where(d > 0, d, 1.0)
        r = tl.div_rn(v, safe[:, None])
        q = tl.where(r >= 0, tl.floor(r + 0.5), -tl.floor(0.5 - r))
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(xq + m * (DIGITS * K) + b * 32 + lane, q.to(tl.int8), mask=ok)
        bb = pb * BLOCKS + tl.arange(0, BLOCKS)
        if DIGITS == 2:
            e = (r - q) * 254.0  # in [-127, 127]: |r - q| <= 1/2
            q2 = tl.where(e >= 0, tl.floor(e + 0.5), -tl.floor(0.5 - e))
            tl.store(xq + m * (DIGITS * K) + K + b * 32 + lane, q2.to(tl.int8), mask=ok)
            d = tl.div_rn(d, 254.0)
        tl.store(xd + m * NB + bb, d, mask=bb < NB)
        tl.store(xs + m * NB + bb, tl.sum(v, axis=1), mask=bb < NB)

    @triton.jit
    def word_at(w, at, mask, HALVES: tl.constexpr):
        """The int32 word ``at`` (in words) of the weight at ``w``: one load, or two 16-bit halves joined where the
        weight's address is only known to be even (an expert's entry)."""
        if HALVES:
            lo = tl.load(w + 2 * at, mask=mask, other=0).to(tl.int32) & 0xFFFF
            return lo | (tl.load(w + 2 * at + 1, mask=mask, other=0).to(tl.int32) << 16)
        else:
            return tl.load(w + at, mask=mask, other=0)

    @triton.jit
    def half_at(w, at, mask):
        """The 16-bit half ``at`` of a weight read as 16-bit halves, as int32 (sign-extended)."""
        return tl.load(w + at, mask=mask, other=0).to(tl.int32)

    @triton.jit
    def joined_at(w, at, mask):
        """The int32 word from halves ``at`` and ``at + 1`` of a weight read as 16-bit halves."""
        lo = tl.load(w + at, mask=mask, other=0).to(tl.int32) & 0xFFFF
        return lo | (tl.load(w + at + 1, mask=mask, other=0).to(tl.int32) << 16)

    @triton.jit
    def launch_rows(w, table, pairs, experts, ends, M, WHICH: tl.constexpr, BYTE_AT, UNIT: tl.constexpr,
                    EXPERTS: tl.constexpr):
        """(the program's output block, slice, weight base, first and end row place): the dense form reads rows
        0..M of x against ``w``; the expert form (program p of the routed pairs in expert order) reads its expert
        run's pairs, its weight where the expert table points (entry WHICH, BYTE_AT bytes in, UNIT bytes a load)."""
        if EXPERTS:
            p, pn, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
            addr = tl.load(table + tl.load(experts + p) * 2 + WHICH) + BYTE_AT
            if UNIT == 4:
                base = addr.to(tl.pointer_type(tl.int32))
            else:
                base = addr.to(tl.pointer_type(tl.int16))
            return pn, s, base, p, tl.load(ends + p)
        else:
            return tl.program_id(0), tl.program_id(1), w, 0, M

    @triton.jit
    def rows_of(t, last, pairs, s, M, KT, S_ALL, X_PER_SLOT: tl.constexpr, EXPERTS: tl.constexpr):
        """(valid, the output's row, then valid and x's row as [BM, 1, 1, 1] and [BM, 1, 1]) of row places ``t``: the
        dense form's row t of slice s, or the routed pair at place t (row q // KT, slot q % KT) whose x is row q
        (X_PER_SLOT) or q // KT, out [rows, S, KT, N]."""
        valid = t < last
        if EXPERTS:
            q = tl.load(pairs + t, mask=valid, other=0)
            if X_PER_SLOT:
                xrow = q
            else:
                xrow = q // KT
            orow = ((q // KT) * S_ALL + s) * KT + q % KT
        else:
            xrow = t
            orow = s * M + t
        return (valid, orow, valid[:, None, None, None], xrow[:, None, None, None], valid[:, None, None],
                xrow[:, None, None])

    @triton.jit
    def store_rows(out, orow, valid, n, N, y):
        """y [BM, BN] into the output's rows ``orow`` [BM] at outputs ``n`` [BN]."""
        tl.store(out + orow[:, None] * N + n[None, :], y, mask=valid[:, None] & (n[None, :] < N))

    globals().update(word_at=word_at, half_at=half_at, joined_at=joined_at, launch_rows=launch_rows, rows_of=rows_of,
                     store_rows=store_rows)

    @triton.jit
    def q4k_rows(w, xq, xd, xs, out, N, M, ROW_WORDS, NSB, SPS, table, pairs, experts, ends, BYTE_AT, KT, S_ALL,
                 WHICH: tl.constexpr, X_PER_SLOT: tl.constexpr, EXPERTS: tl.constexpr, HALVES: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, SB: tl.constexpr, FIVE: tl.constexpr,
                 DIGITS: tl.constexpr, ASM: tl.constexpr):
        """Q4_K (and FIVE: Q5_K) rows times x's rows, over the super-blocks of slice s (SPS each, SB at a step): a
        super-block is 36 words (d|dmin, three of scales and mins, 32 of quants), Q5_K's 44 (eight words of fifth
        bits, qh, before the quants; value l of group g takes bit g of qh byte l). Dense: out[s, m, n] for rows m < M
        of x, W int32 words [N, ROW_WORDS]. Experts (``launch_rows``): each routed pair's row of ``out``. Axes: [rows,
        BN outputs, T = SB * 4 runs of 64 values, 8 words a run]."""
        pn, s, base, first_row, last_row = launch_rows(w, table, pairs, experts, ends, M, WHICH, BYTE_AT,
                                                       2 if HALVES else 4, EXPERTS)
        T: tl.constexpr = SB * 4
        BW: tl.constexpr = 44 if FIVE else 36  # words a super-block
        n = pn * BN + tl.arange(0, BN)
        n4 = n[None, :, None, None]
        t4 = tl.arange(0, T)[None, None, :, None]
        j4 = tl.arange(0, 8)[None, None, None, :]
        sb4, r4 = t4 // 4, t4 % 4  # the super-block of the step, the run in it
        n3, t3 = n[None, :, None], tl.arange(0, T)[None, None, :]
        sb3, r3 = t3 // 4, t3 % 4
        row4 = n4.to(tl.int64) * ROW_WORDS
        row3 = n3.to(tl.int64) * ROW_WORDS
        XW = NSB * 64  # words of xq a row (one digit)
        NB = NSB * 8  # 32-value blocks a row
        first = s * SPS
        for t0 in range(first_row, last_row, BM):
            valid, orow, v4, x4, v3, x3 = rows_of(t0 + tl.arange(0, BM), last_row, pairs, s, M, KT, S_ALL,
                                                  X_PER_SLOT, EXPERTS)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for c0 in range(first, tl.minimum(first + SPS, NSB), SB):
                c4 = c0 + sb4
                ok4 = (n4 < N) & (c4 < NSB)
                qs = word_at(base, row4 + c4 * BW + (12 if FIVE else 4) + r4 * 8 + j4, ok4, HALVES)  # [1, BN, T, 8]
                qlo = qs & 0x0F0F0F0F
                qhi = (qs >> 4) & 0x0F0F0F0F
                if FIVE:
                    qh = word_at(base, row4 + c4 * BW + 4 + j4, ok4, HALVES)
                    qlo = qlo | (((qh >> (2 * r4)) & 0x01010101) << 4)
                    qhi = qhi | (((qh >> (2 * r4 + 1)) & 0x01010101) << 4)
                xok = v4 & (c4 < NSB)
                xlo, xlo2 = x_words(xq, x4 * (DIGITS * XW) + c4 * 64 + r4 * 16 + j4, xok, XW, DIGITS)  # [BM, 1, T, 8]
                xhi, xhi2 = x_words(xq, x4 * (DIGITS * XW) + c4 * 64 + r4 * 16 + 8 + j4, xok, XW, DIGITS)
                zero = tl.zeros((BM, BN, T, 8), dtype=tl.int32)
                ilo = tl.sum(dot2(qlo, xlo, xlo2, zero, DIGITS, ASM), axis=3)  # exact: any order
                ihi = tl.sum(dot2(qhi, xhi, xhi2, zero, DIGITS, ASM), axis=3)
                c3 = c0 + sb3
                ok3 = (n3 < N) & (c3 < NSB)
                head = word_at(base, row3 + c3 * BW, ok3, HALVES)  # d | dmin << 16
                d = f16_lo(head)
                dmin = f16_lo(head >> 16)
                g = 2 * r3  # the low nibbles' group; the high nibbles' is g + 1
                sh = 8 * (g % 4)  # groups g and g + 1 share a word of each scale array: bytes g % 4 and g % 4 + 1
                a = word_at(base, row3 + c3 * BW + 1, ok3, HALVES)
                b = word_at(base, row3 + c3 * BW + 2, ok3, HALVES)
                e = word_at(base, row3 + c3 * BW + 3, ok3, HALVES)
                a0, a1 = (a >> sh) & 255, (a >> (sh + 8)) & 255
                b0, b1 = (b >> sh) & 255, (b >> (sh + 8)) & 255
                e0, e1 = (e >> sh) & 255, (e >> (sh + 8)) & 255
                low = g < 4
                sc0 = tl.where(low, a0 & 63, (e0 & 15) | ((a0 >> 6) << 4))
                mn0 = tl.where(low, b0 & 63, (e0 >> 4) | ((b0 >> 6) << 4))
                sc1 = tl.where(low, a1 & 63, (e1 & 15) | ((a1 >> 6) << 4))
                mn1 = tl.where(low, b1 & 63, (e1 >> 4) | ((b1 >> 6) << 4))
                xb = x3 * NB + c3 * 8 + g  # x's block of the low nibbles' group
                xok3 = v3 & (c3 < NSB)
                dx0 = tl.load(xd + xb, mask=xok3, other=0.0)
                dx1 = tl.load(xd + xb + 1, mask=xok3, other=0.0)
                sx0 = tl.load(xs + xb, mask=xok3, other=0.0)
                sx1 = tl.load(xs + xb + 1, mask=xok3, other=0.0)
                term = (d * sc0.to(tl.float32)) * dx0 * ilo.to(tl.float32) - (dmin * mn0.to(tl.float32)) * sx0
                term = term + ((d * sc1.to(tl.float32)) * dx1 * ihi.to(tl.float32) - (dmin * mn1.to(tl.float32)) * sx1)
                acc = fold(acc, term, T)
            store_rows(out, orow, valid, n, N, acc)

    @triton.jit
    def q6k_rows(w, xq, xd, xs, out, N, M, ROW_HALVES, NSB, SPS, table, pairs, experts, ends, BYTE_AT, KT, S_ALL,
                 WHICH: tl.constexpr, X_PER_SLOT: tl.constexpr, EXPERTS: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, SB: tl.constexpr, DIGITS: tl.constexpr, ASM: tl.constexpr):
        """``q4k_rows`` for Q6_K (int16 halves [N, ROW_HALVES]; a super-block is 105 halves: ql[128], qh[64], 16 int8
        scales, d). Axes: [rows, BN outputs, U = SB * 8 units, 4 words]; unit (sb, h, p, jh) holds values
        128h + 32t + 16jh + 4jl .. + 3 for t = p (the ql bytes' low nibbles) and t = p + 2 (their high nibbles)."""
        pn, s, base, first_row, last_row = launch_rows(w, table, pairs, experts, ends, M, WHICH, BYTE_AT, 2, EXPERTS)
        U: tl.constexpr = SB * 8
        n = pn * BN + tl.arange(0, BN)
        n4 = n[None, :, None, None]
        u4 = tl.arange(0, U)[None, None, :, None]
        jl = tl.arange(0, 4)[None, None, None, :]
        sb4, h4, p4, jh4 = u4 // 8, (u4 // 4) % 2, (u4 // 2) % 2, u4 % 2
        n3, u3 = n[None, :, None], tl.arange(0, U)[None, None, :]
        sb3, h3, p3, jh3 = u3 // 8, (u3 // 4) % 2, (u3 // 2) % 2, u3 % 2
        row4 = n4.to(tl.int64) * ROW_HALVES
        row3 = n3.to(tl.int64) * ROW_HALVES
        XW = NSB * 64
        NB = NSB * 8
        first = s * SPS
        for t0 in range(first_row, last_row, BM):
            valid, orow, v4, x4, v3, x3 = rows_of(t0 + tl.arange(0, BM), last_row, pairs, s, M, KT, S_ALL,
                                                  X_PER_SLOT, EXPERTS)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for c0 in range(first, tl.minimum(first + SPS, NSB), SB):
                c4 = c0 + sb4
                ok4 = (n4 < N) & (c4 < NSB)
                at = row4 + c4 * 105
                ql = joined_at(base, at + 32 * h4 + 16 * p4 + 8 * jh4 + 2 * jl, ok4)  # bytes 64h + 32p + 16jh + 4jl
                qh = joined_at(base, at + 64 + 16 * h4 + 8 * jh4 + 2 * jl, ok4)  # bytes 128 + 32h + 16jh + 4jl
                qa = (ql & 0x0F0F0F0F) | (((qh >> (2 * p4)) & 0x03030303) << 4)  # t = p
                qb = ((ql >> 4) & 0x0F0F0F0F) | (((qh >> (2 * p4 + 4)) & 0x03030303) << 4)  # t = p + 2
                xok = v4 & (c4 < NSB)
                xa, xa2 = x_words(xq, x4 * (DIGITS * XW) + c4 * 64 + 32 * h4 + 8 * p4 + 4 * jh4 + jl, xok, XW, DIGITS)
                xb, xb2 = x_words(xq, x4 * (DIGITS * XW) + c4 * 64 + 32 * h4 + 8 * (p4 + 2) + 4 * jh4 + jl, xok, XW,
                                  DIGITS)
                minus32 = tl.full((BM, BN, U, 4), -522133280, tl.int32)  # 0xE0E0E0E0: -32 in each byte
                zero = tl.zeros((BM, BN, U, 4), dtype=tl.int32)
                ia = tl.sum(dot2(qa, xa, xa2, dot2(minus32, xa, xa2, zero, DIGITS, ASM), DIGITS, ASM), axis=3)  # exact
                ib = tl.sum(dot2(qb, xb, xb2, dot2(minus32, xb, xb2, zero, DIGITS, ASM), DIGITS, ASM), axis=3)
                c3 = c0 + sb3
                ok3 = (n3 < N) & (c3 < NSB)
                at3 = row3 + c3 * 105
                d = tl.load(base + at3 + 104, mask=ok3, other=0).to(tl.float16, bitcast=True).to(tl.float32)
                sc_at = at3 + 96 + 4 * h3 + p3  # scale 8h + 2t + jh sits in half 96 + 4h + t, byte jh
                sa = (half_at(base, sc_at, ok3) << (24 - 8 * jh3)) >> 24
                sb_ = (half_at(base, sc_at + 2, ok3) << (24 - 8 * jh3)) >> 24
                xok3 = v3 & (c3 < NSB)
                dxa = tl.load(xd + x3 * NB + c3 * 8 + 4 * h3 + p3, mask=xok3, other=0.0)
                dxb = tl.load(xd + x3 * NB + c3 * 8 + 4 * h3 + p3 + 2, mask=xok3, other=0.0)
                term = (d * sa.to(tl.float32)) * dxa * ia.to(tl.float32)
                term = term + (d * sb_.to(tl.float32)) * dxb * ib.to(tl.float32)
                acc = fold(acc, term, U)
            store_rows(out, orow, valid, n, N, acc)

    @triton.jit
    def block32_rows(w, xq, xd, xs, out, N, M, ROW_HALVES, NB, BPS, table, pairs, experts, ends, BYTE_AT, KT, S_ALL,
                     WHICH: tl.constexpr, X_PER_SLOT: tl.constexpr, EXPERTS: tl.constexpr, QT: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, TB: tl.constexpr, DIGITS: tl.constexpr,
                     ASM: tl.constexpr):
        """``q4k_rows`` for the 32-value blocks (int16 halves [N, ROW_HALVES]): Q8_0 (17 halves: d, 32 int8), Q4_0 (9:
        d, 16 bytes, value j the low nibble of byte j and value j + 16 its high one, q - 8), Q4_1 (10: d, m, Q4_0's
        nibbles, d * q + m), Q5_0 (11: d, qh whose bit j is value j's fifth, the nibbles, q - 16) and Q5_1 (12: d, m,
        qh, the nibbles, d * q + m). Slice s walks BPS blocks, TB at a step. Axes: [rows, BN outputs, TB blocks, 4
        words]."""
        pn, s, base, first_row, last_row = launch_rows(w, table, pairs, experts, ends, M, WHICH, BYTE_AT, 2, EXPERTS)
        n = pn * BN + tl.arange(0, BN)
        n4 = n[None, :, None, None]
        b4 = tl.arange(0, TB)[None, None, :, None]
        j4 = tl.arange(0, 4)[None, None, None, :]
        n3, b3 = n[None, :, None], tl.arange(0, TB)[None, None, :]
        if QT == "Q8_0":
            BH: tl.constexpr = 17
            Q0: tl.constexpr = 1
        elif QT == "Q4_0":
            BH: tl.constexpr = 9
            Q0: tl.constexpr = 1
        elif QT == "Q4_1":
            BH: tl.constexpr = 10
            Q0: tl.constexpr = 2
        elif QT == "Q5_0":
            BH: tl.constexpr = 11
            Q0: tl.constexpr = 3
        else:
            BH: tl.constexpr = 12
            Q0: tl.constexpr = 4
        row4 = n4.to(tl.int64) * ROW_HALVES
        row3 = n3.to(tl.int64) * ROW_HALVES
        XW = NB * 8  # words of xq a row (one digit)
        first = s * BPS
        for t0 in range(first_row, last_row, BM):
            valid, orow, v4, x4, v3, x3 = rows_of(t0 + tl.arange(0, BM), last_row, pairs, s, M, KT, S_ALL,
                                                  X_PER_SLOT, EXPERTS)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for c0 in range(first, tl.minimum(first + BPS, NB), TB):
                c4 = c0 + b4
                ok4 = (n4 < N) & (c4 < NB)
                xok = v4 & (c4 < NB)
                zero = tl.zeros((BM, BN, TB, 4), dtype=tl.int32)
                at = row4 + c4 * BH + Q0 + 2 * j4
                qa = joined_at(base, at, ok4)
                xa, xa2 = x_words(xq, x4 * (DIGITS * XW) + c4 * 8 + j4, xok, XW, DIGITS)
                xb, xb2 = x_words(xq, x4 * (DIGITS * XW) + c4 * 8 + 4 + j4, xok, XW, DIGITS)
                if QT == "Q8_0":  # words 0-3 and 4-7 of the block's int8 values
                    qb = joined_at(base, at + 8, ok4)
                    isum = tl.sum(dot2(qb, xb, xb2, dot2(qa, xa, xa2, zero, DIGITS, ASM), DIGITS, ASM), axis=3)
                elif QT == "Q4_0":  # (q - 8): -8 in each byte is 0xF8
                    minus8 = tl.full((BM, BN, TB, 4), -117901064, tl.int32)
                    lo = dot2(qa & 0x0F0F0F0F, xa, xa2, dot2(minus8, xa, xa2, zero, DIGITS, ASM), DIGITS, ASM)
                    isum = tl.sum(dot2((qa >> 4) & 0x0F0F0F0F, xb, xb2, dot2(minus8, xb, xb2, lo, DIGITS, ASM), DIGITS,
                                       ASM), axis=3)
                elif QT == "Q4_1":
                    isum = tl.sum(dot2((qa >> 4) & 0x0F0F0F0F, xb, xb2,
                                       dot2(qa & 0x0F0F0F0F, xa, xa2, zero, DIGITS, ASM), DIGITS, ASM), axis=3)
                else:  # Q5_0, Q5_1: four bits of qh a word, each to bit 4 of its byte
                    qh = joined_at(base, row4 + c4 * BH + Q0 - 2, ok4)
                    tl_ = (qh >> (4 * j4)) & 15
                    th = (qh >> (16 + 4 * j4)) & 15
                    qlo = (qa & 0x0F0F0F0F) | ((tl_ & 1) << 4) | ((tl_ & 2) << 11) | ((tl_ & 4) << 18) | ((tl_ & 8) << 25)
                    qhi = (((qa >> 4) & 0x0F0F0F0F) | ((th & 1) << 4) | ((th & 2) << 11) | ((th & 4) << 18)
                           | ((th & 8) << 25))
                    if QT == "Q5_0":  # (q - 16): -16 in each byte is 0xF0
                        minus16 = tl.full((BM, BN, TB, 4), -252645136, tl.int32)
                        lo = dot2(qlo, xa, xa2, dot2(minus16, xa, xa2, zero, DIGITS, ASM), DIGITS, ASM)
                        isum = tl.sum(dot2(qhi, xb, xb2, dot2(minus16, xb, xb2, lo, DIGITS, ASM), DIGITS, ASM), axis=3)
                    else:
                        isum = tl.sum(dot2(qhi, xb, xb2, dot2(qlo, xa, xa2, zero, DIGITS, ASM), DIGITS, ASM), axis=3)
                c3 = c0 + b3
                ok3 = (n3 < N) & (c3 < NB)
                xok3 = v3 & (c3 < NB)
                d = tl.load(base + row3 + c3 * BH, mask=ok3, other=0).to(tl.float16, bitcast=True).to(tl.float32)
                dx = tl.load(xd + x3 * NB + c3, mask=xok3, other=0.0)
                term = d * dx * isum.to(tl.float32)
                if QT == "Q4_1" or QT == "Q5_1":
                    mn = tl.load(base + row3 + c3 * BH + 1, mask=ok3, other=0).to(tl.float16, bitcast=True).to(tl.float32)
                    term = term + mn * tl.load(xs + x3 * NB + c3, mask=xok3, other=0.0)
                acc = fold(acc, term, TB)
            store_rows(out, orow, valid, n, N, acc)

    @triton.jit
    def digit_dot(xq, xat, xok, w, K, DIGITS: tl.constexpr):
        """x's int8 digits [BM, 32] at ``xat`` (digit 2 K further) times w int8 [32, BN] on the tensor cores, as the
        one integer the one-row kernels sum (x1 * 254 + x2): exact int32."""
        x1 = tl.load(xq + xat, mask=xok, other=0)
        s = tl.dot(x1, w, out_dtype=tl.int32)
        if DIGITS == 2:
            s = 254 * s + tl.dot(tl.load(xq + xat + K, mask=xok, other=0), w, out_dtype=tl.int32)
        return s

    globals().update(digit_dot=digit_dot)

    @triton.jit
    def kquant_mmq(w, xq, xd, xs, out, N, M, K, ROW_BYTES, NSB, SPS, tiles, rows_of, QT: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, DIGITS: tl.constexpr, GROUPED: tl.constexpr = False):
        """Rows of x times Q4_K, Q5_K or Q6_K rows (uint8 [N, ROW_BYTES]) on the tensor cores, for a batch or a
        prompt: each 16- or 32-value group's integer sum an int8 ``tl.dot`` (exact), then the one-row kernels' float
        terms added in their order (a run of 64 values after another for Q4_K/Q5_K, a unit for Q6_K:
        ``q4k_rows``/``q6k_rows`` at one super-block a step): each row bitwise the one-row kernels' result.
        out[s, m, n] over the super-blocks of slice s (SPS each).

        ``GROUPED`` (a prompt's routed experts, ``expert_mmq``): the output rows are a layer's routed pairs in expert
        order, and program row-tile t covers rows ``tiles[t, 0]``..``tiles[t, 1]`` of one expert, whose weight starts
        at address ``tiles[t, 2]`` (``w`` unused); output row r reads x's row ``rows_of[r]``."""
        pm, pn, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        n = pn * BN + tl.arange(0, BN)
        nr = n[None, :]  # [1, BN]
        if GROUPED:
            first, end = tl.load(tiles + pm * 3), tl.load(tiles + pm * 3 + 1)
            m = first + tl.arange(0, BM)
            w = tl.load(tiles + pm * 3 + 2).to(tl.pointer_type(tl.uint8))
            xr = tl.load(rows_of + m, mask=m < end, other=0)[:, None]  # [BM, 1]: each output row's row of x
            mok = m[:, None] < end
        else:
            m = pm * BM + tl.arange(0, BM)
            xr = m[:, None]
            mok = xr < M
        mc = m[:, None]  # [BM, 1]: the output rows
        l_k = tl.arange(0, 32)[:, None]  # a 32-value group's values, along K of the weight tile
        l_x = tl.arange(0, 32)[None, :]  # ... along K of the x tile
        wrow = w + nr.to(tl.int64) * ROW_BYTES
        nok = nr < N
        XR = DIGITS * K  # int8 digits a row of xq
        NB = NSB * 8
        acc = tl.zeros((BM, BN), dtype=tl.float32)  # the one-row kernels' order: group terms in turn
        first = s * SPS
        last = tl.minimum(first + SPS, NSB)
        if QT == "Q6_K":
            for u in range(first * 8, last * 8):  # the one-row kernel's unit (h, p, jh) of super-block c, in turn
                c, h, p, jh = u // 8, (u // 4) % 2, (u // 2) % 2, u % 2
                blk = wrow + c * 210
                d = (tl.load(blk + 208, mask=nok, other=0).to(tl.uint16)
                     | (tl.load(blk + 209, mask=nok, other=0).to(tl.uint16) << 8)).to(tl.float16, bitcast=True).to(tl.float32)
                qh = tl.load(blk + 128 + 32 * h + l_k, mask=nok, other=0)  # [32, BN]
                ql = tl.load(blk + 64 * h + 32 * p + l_k, mask=nok, other=0)
                half = (l_k >= 16 * jh) & (l_k < 16 * jh + 16)  # the 16-value group: the rest are zeros
                qa = tl.where(half, ((ql & 15) | (((qh >> (2 * p)) & 3) << 4)).to(tl.int32) - 32, 0)
                qb = tl.where(half, ((ql >> 4) | (((qh >> (2 * p + 4)) & 3) << 4)).to(tl.int32) - 32, 0)
                ia = digit_dot(xq, xr * XR + c * 256 + 128 * h + 32 * p + l_x, mok, qa.to(tl.int8), K, DIGITS)
                ib = digit_dot(xq, xr * XR + c * 256 + 128 * h + 32 * (p + 2) + l_x, mok, qb.to(tl.int8), K, DIGITS)
                sa = tl.load(blk + 192 + 8 * h + 2 * p + jh, mask=nok, other=0).to(tl.int8, bitcast=True).to(tl.int32)
                sb_ = tl.load(blk + 196 + 8 * h + 2 * p + jh, mask=nok, other=0).to(tl.int8, bitcast=True).to(tl.int32)
                dxa = tl.load(xd + xr * NB + c * 8 + 4 * h + p, mask=mok, other=0.0)
                dxb = tl.load(xd + xr * NB + c * 8 + 4 * h + p + 2, mask=mok, other=0.0)
                term = (d * sa.to(tl.float32)) * dxa * ia.to(tl.float32)
                term = term + (d * sb_.to(tl.float32)) * dxb * ib.to(tl.float32)
                acc = acc + term
        else:
            for u in range(first * 4, last * 4):  # run r of super-block c, in turn
                c, r = u // 4, u % 4
                blk = wrow + c * (176 if QT == "Q5_K" else 144)
                d = (tl.load(blk, mask=nok, other=0).to(tl.uint16) | (tl.load(blk + 1, mask=nok, other=0)
                     .to(tl.uint16) << 8)).to(tl.float16, bitcast=True).to(tl.float32)
                dmin = (tl.load(blk + 2, mask=nok, other=0).to(tl.uint16) | (tl.load(blk + 3, mask=nok, other=0)
                        .to(tl.uint16) << 8)).to(tl.float16, bitcast=True).to(tl.float32)
                qs = tl.load(blk + (48 if QT == "Q5_K" else 16) + 32 * r + l_k, mask=nok, other=0)  # [32, BN]
                qlo = qs & 15
                qhi = qs >> 4
                if QT == "Q5_K":
                    qh = tl.load(blk + 16 + l_k, mask=nok, other=0)  # value l's fifth bits, one a group
                    qlo = qlo | (((qh >> (2 * r)) & 1) << 4)
                    qhi = qhi | (((qh >> (2 * r + 1)) & 1) << 4)
                ilo = digit_dot(xq, xr * XR + c * 256 + 64 * r + l_x, mok, qlo.to(tl.int8), K, DIGITS)
                ihi = digit_dot(xq, xr * XR + c * 256 + 64 * r + 32 + l_x, mok, qhi.to(tl.int8), K, DIGITS)
                j = (2 * r) % 4  # groups 2r and 2r + 1: bytes j and j + 1 of each scale array
                sa0 = tl.load(blk + 4 + j, mask=nok, other=0).to(tl.int32)
                sa1 = tl.load(blk + 5 + j, mask=nok, other=0).to(tl.int32)
                sb0 = tl.load(blk + 8 + j, mask=nok, other=0).to(tl.int32)
                sb1 = tl.load(blk + 9 + j, mask=nok, other=0).to(tl.int32)
                se0 = tl.load(blk + 12 + j, mask=nok, other=0).to(tl.int32)
                se1 = tl.load(blk + 13 + j, mask=nok, other=0).to(tl.int32)
                low = r < 2
                sc0 = tl.where(low, sa0 & 63, (se0 & 15) | ((sa0 >> 6) << 4))
                mn0 = tl.where(low, sb0 & 63, (se0 >> 4) | ((sb0 >> 6) << 4))
                sc1 = tl.where(low, sa1 & 63, (se1 & 15) | ((sa1 >> 6) << 4))
                mn1 = tl.where(low, sb1 & 63, (se1 >> 4) | ((sb1 >> 6) << 4))
                xb = xr * NB + c * 8 + 2 * r
                dx0 = tl.load(xd + xb, mask=mok, other=0.0)
                dx1 = tl.load(xd + xb + 1, mask=mok, other=0.0)
                sx0 = tl.load(xs + xb, mask=mok, other=0.0)
                sx1 = tl.load(xs + xb + 1, mask=mok, other=0.0)
                term = (d * sc0.to(tl.float32)) * dx0 * ilo.to(tl.float32) - (dmin * mn0.to(tl.float32)) * sx0
                term = term + ((d * sc1.to(tl.float32)) * dx1 * ihi.to(tl.float32) - (dmin * mn1.to(tl.float32)) * sx1)
                acc = acc + term
        y = acc
        tl.store(out + s * (M * N) + mc * N + nr, y, mask=mok & nok)

    return quantize_rows, q4k_rows, q6k_rows, block32_rows, kquant_mmq


def mmq_tiles(m: int) -> tuple[int, int, int, int]:
    """The tensor-core kernel's (rows a tile, outputs a tile, warps, pipeline stages) for m rows; no bit follows them.
    32 x 64 on 4 warps led every 8B shape of Q4_K and Q6_K at 64 and 512 rows on an H100, 1.4-2.0x faster than the
    64 x 64 tile on 8 warps (``bench/results/gguf-gemv_20261207T101541Z.json``, ``...T101707Z.json``)."""
    return (32 if m >= 32 else 16), MMQ_BLOCK_N, 4, 3


def plan(qtype: GGMLQuantizationType, n: int, k: int, block_n: int | None = None, sb: int | None = None,
         split: int | None = None, programs: int | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_N, units a step, K slices, units a slice) for W [n, k], a unit its type's block (256 values for the
    K-quants, else 32): from its shape alone, never from the rows, so every batch sums a row in one order. K is sliced
    until about ``programs`` programs cover W."""
    bn0, sb0, want_programs, _ = DEFAULT_PLAN[qtype]
    bn, step = block_n or bn0, sb or sb0
    if bn & (bn - 1) or step & (step - 1):
        raise ValueError(f"BLOCK_N ({bn}) and super-blocks a step ({step}) must each be a power of two")
    nsb = k // block_geometry(qtype)[0]
    steps = -(-nsb // step)
    want = split if split is not None else -(-(programs or want_programs) // -(-n // bn))
    per = -(-steps // max(1, min(want, steps))) * step  # super-blocks a slice: whole steps
    return bn, step, -(-nsb // per), per


def expert_mmq(xq: torch.Tensor, xd: torch.Tensor, xs: torch.Tensor, rows_of: torch.Tensor, tiles: torch.Tensor,
               tile_rows: int, qtype: GGMLQuantizationType, n: int, k: int, rows: int,
               digits: int = DIGITS) -> torch.Tensor:
    """A prompt's routed experts on the tensor cores, every expert of a layer in one launch: y [rows, n] float32, its
    row r = x[rows_of[r]] @ W.T for the expert whose tile holds r. ``xq, xd, xs``: x as ``quantize`` gives it;
    ``tiles`` int64 [T, 3]: (first row, end row, the expert's weight address) a tile of at most ``tile_rows`` (16 or
    32) rows of one expert, the rows being the layer's routed pairs in expert order. K is not sliced (the tiles give
    the programs), so each row is bitwise ``matmul(..., split=1)`` of that x row against that expert alone."""
    if qtype not in MMQ_TYPES:
        raise ValueError(f"no tensor-core kernel for {qtype.name}; these run: {', '.join(t.name for t in MMQ_TYPES)}")
    bn, step, slices, per = plan(qtype, n, k, split=1)
    if step != 1:
        raise ValueError(f"{qtype.name} at {n} x {k}: the tensor-core kernel takes one super-block a step, plan has {step}")
    y = torch.empty((rows, n), dtype=torch.float32, device=xq.device)
    if not rows or not tiles.shape[0]:
        return y
    part = y if slices == 1 else torch.empty((slices, rows, n), dtype=torch.float32, device=xq.device)
    if tile_rows not in (16, 32):
        raise ValueError(f"tile_rows must be 16 or 32, got {tile_rows}")
    bm, bn_t, warps, stages = mmq_tiles(tile_rows)
    _kernels()[4][(tiles.shape[0], -(-n // bn_t), slices)](
        xq, xq.view(torch.int8), xd, xs, part, n, rows, k, row_nbytes(qtype, k), k // 256, per, tiles, rows_of,
        QT=qtype.name, BM=bm, BN=bn_t, DIGITS=digits, GROUPED=True, num_warps=warps, num_stages=stages)
    if slices > 1:
        add_slices_kernel()[(-(-(rows * n) // 1024),)](part, y, rows * n, SPLIT=slices, BLOCK=1024, num_warps=4)
    return y


def quantize(x: torch.Tensor, digits: int = DIGITS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float as the kernels read it: (int8 digits [M, digits, K] viewed as int32 words, the digits' scale
    [M, K / 32], each 32 values' float32 sum [M, K / 32]); a row's quantization is its own (``quantize_rows``)."""
    if digits not in (1, 2):
        raise ValueError(f"digits must be 1 or 2 (int8 digits a value of x), got {digits}")
    x = x.contiguous()
    m, k = x.shape
    nb = k // QUANT_BLOCK
    xq = torch.empty((m, digits, k), dtype=torch.int8, device=x.device)
    xd = torch.empty((m, nb), dtype=torch.float32, device=x.device)
    xs = torch.empty((m, nb), dtype=torch.float32, device=x.device)
    if m:
        _kernels()[0][(m, -(-nb // 8))](x, xq, xd, xs, k, nb, BLOCKS=8, DIGITS=digits, num_warps=1)
    return xq.view(torch.int32), xd, xs


def _launch(grid, w, xq, xd, xs, out, qtype, n: int, m: int, k: int, bm: int, bn: int, step: int, per: int, *,
            experts: tuple | None = None, digits: int, asm: bool, warps: int, halves: bool) -> None:
    """One launch of the type's kernel: dense (``experts`` None: rows 0..m of x against ``w``) or over the routed
    pairs of the expert table (``experts`` = (table, pairs, experts, ends, which, byte_at, kt, slices, x_per_slot))."""
    _, q4k, q6k, block32, _ = _kernels()
    values, nbytes = block_geometry(qtype)
    units, row_bytes = k // values, (k // values) * nbytes
    if experts is None:
        table = pairs = firsts = ends = w
        which, byte_at, kt, slices_all, x_per_slot = 0, 0, 1, 1, False
    else:
        table, pairs, firsts, ends, which, byte_at, kt, slices_all, x_per_slot = experts
    common = dict(WHICH=which, X_PER_SLOT=x_per_slot, EXPERTS=experts is not None, BM=bm, BN=bn, DIGITS=digits, ASM=asm,
                  num_warps=warps)
    row_units = row_bytes // (4 if qtype in WORDS else 2)  # Q4_K's and Q5_K's in words, even read as halves
    args = (w, xq, xd, xs, out, n, m, row_units, units, per, table, pairs, firsts, ends, byte_at, kt, slices_all)
    if qtype in WORDS:
        q4k[grid](*args, HALVES=halves, SB=step, FIVE=qtype == T.Q5_K, **common)
    elif qtype == T.Q6_K:
        q6k[grid](*args, SB=step, **common)
    else:
        block32[grid](*args, QT=qtype.name, TB=step, **common)


def matmul(x: torch.Tensor, weight: torch.Tensor, qtype: GGMLQuantizationType, n: int, k: int, *,
           out: torch.Tensor | None = None, block_n: int | None = None, sb: int | None = None,
           split: int | None = None, num_warps: int | None = None, asm: bool | None = None,
           digits: int = DIGITS, mmq: bool = True, mmq_plan: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """y [M, n] float32 = x [M, k] @ W.T, W [n, k] as ``qtype`` blocks (uint8, ggml's layout), x quantized to int8
    per 32 values first. Row m of y is bitwise the result for x[m] alone, for any M: up to 8 rows a launch of the
    one-row kernels, or from ``MMQ_ROWS`` rows of a K-quant every row at once on the tensor cores (``kquant_mmq``;
    ``mmq`` False keeps the one-row kernels). The plan's overrides are for measuring (a row's bits follow the plan;
    ``mmq_plan`` = (rows a tile, outputs a tile, warps, pipeline stages) of the tensor-core kernel changes no bit);
    ``asm`` False runs the spelt-out dot4 on a GPU too."""
    check(x, weight, qtype, n, k)
    if qtype not in TYPES:
        raise ValueError(f"no int8 GGUF kernel for {qtype.name}; these run: {', '.join(t.name for t in TYPES)}")
    if not aligned(weight, qtype):
        raise ValueError(f"{qtype.name} blocks are read as {'4' if qtype in WORDS else '2'}-byte words: the weight's "
                         "address must be a multiple of that (gguf_kernels.matmul reads any address)")
    asm = (x.is_cuda and not interpreted()) if asm is None else asm
    m_all = x.shape[0]
    y = out if out is not None else torch.empty((m_all, n), dtype=torch.float32, device=x.device)
    if y.shape != (m_all, n) or y.dtype != torch.float32 or not y.is_contiguous():
        raise ValueError(f"out must be contiguous float32 [{m_all}, {n}]")
    xq, xd, xs = quantize(x, digits)
    bn, step, slices, per = plan(qtype, n, k, block_n, sb, split)
    if m_all >= MMQ_ROWS and qtype in MMQ_TYPES and step == 1 and mmq:
        part = y if slices == 1 else torch.empty((slices, m_all, n), dtype=torch.float32, device=x.device)
        bm, bn_t, warps, stages = mmq_plan or mmq_tiles(m_all)  # no bit follows them: each output adds its own terms
        _kernels()[4][(-(-m_all // bm), -(-n // bn_t), slices)](
            weight, xq.view(torch.int8), xd, xs, part, n, m_all, k, row_nbytes(qtype, k), k // 256, per, weight, weight,
            QT=qtype.name, BM=bm, BN=bn_t, DIGITS=digits, num_warps=warps, num_stages=stages)
        if slices > 1:
            add_slices_kernel()[(-(-(m_all * n) // 1024),)](part, y, m_all * n, SPLIT=slices, BLOCK=1024, num_warps=4)
        return y
    warps = num_warps or DEFAULT_PLAN[qtype][3]
    words = weight.view(torch.int32) if qtype in WORDS else weight.view(torch.int16)
    for at in range(0, m_all, MAX_ROWS):
        m = min(MAX_ROWS, m_all - at)
        dst = y[at:at + m]
        part = dst if slices == 1 else torch.empty((slices, m, n), dtype=torch.float32, device=x.device)
        bm = 1 << (m - 1).bit_length()
        bn_m = bn if block_n or bm <= 2 else min(bn, 8)  # outputs a program: no bit follows it; 8 keeps 8 rows unspilled
        _launch((-(-n // bn_m), slices), words, xq[at:at + m], xd[at:at + m], xs[at:at + m], part, qtype, n, m, k,
                bm, bn_m, step, per, digits=digits, asm=asm, warps=warps, halves=False)
        if slices > 1:
            add_slices_kernel()[(-(-(m * n) // 1024),)](part, dst, m * n, SPLIT=slices, BLOCK=1024, num_warps=4)
    return y


EXPERT_BLOCK_N = 16


def expert_slices(qtype: GGMLQuantizationType, k: int, want: int) -> int:
    """The most slices, at most ``want``, that cut a row of ``k`` values into equal runs of whole blocks: what
    ``expert_matmul``'s ``part`` is laid out by."""
    units = k // block_geometry(qtype)[0]
    return max(s for s in range(1, min(want, units) + 1) if units % s == 0)


def single_runs(ids: torch.Tensor, at: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``expert_runs`` for one row's k routed experts (all different): each pair its own run, in routing order, with
    no sort; ``at``: ``arange(k + 1)`` on the device, made once by a caller that runs every step."""
    k = ids.numel()
    at = torch.arange(k + 1, device=ids.device) if at is None else at
    return ids.reshape(-1), at[:k], at[1:]


def expert_matmul(x: torch.Tensor, runs: tuple, table: torch.Tensor, part: torch.Tensor, which: int, byte_at: int,
                  qtype: GGMLQuantizationType, n: int, k: int, x_per_slot: bool, *, asm: bool | None = None,
                  digits: int = DIGITS) -> None:
    """part [rows, S, slots a row, n] float32 = for each routed pair (``runs`` = (experts, pairs, ends):
    ``grouped_experts.expert_runs``, or ``single_runs`` for one row), its expert's W [n, k] (``qtype`` blocks at byte
    ``byte_at`` of entry ``which`` in ``table`` [experts, 2] int64 addresses) times x ([rows * slots, k] where
    ``x_per_slot``, else [rows, k]), over S slices of k (``expert_slices``); the caller adds the slices in order. One
    program an expert's run reads its weight once for up to 8 of the run's pairs; each pair's sums are bitwise its own
    alone (the dense kernels' arithmetic)."""
    if qtype not in TYPES:
        raise ValueError(f"no int8 GGUF kernel for {qtype.name}; these run: {', '.join(t.name for t in TYPES)}")
    experts, pairs, ends = runs
    rows, slices, kt = part.shape[:3]
    units = k // block_geometry(qtype)[0]
    if (units % slices or part.shape[3] != n or rows * kt != pairs.numel() or part.dtype != torch.float32
            or not part.is_contiguous()):
        raise ValueError(f"part must be contiguous float32 [rows, slices dividing {units} blocks, slots, {n}]")
    asm = (x.is_cuda and not interpreted()) if asm is None else asm
    xq, xd, xs = quantize(x, digits)
    per = units // slices
    step = 1 if qtype in WORDS or qtype == T.Q6_K else next(s for s in (8, 4, 2, 1) if per % s == 0)
    bm = min(MAX_ROWS, 1 << (max(rows, 1) - 1).bit_length())  # an expert's run holds at most one pair a row
    _launch((pairs.numel(), -(-n // EXPERT_BLOCK_N), slices), table, xq, xd, xs, part, qtype, n, rows, k, bm,
            EXPERT_BLOCK_N, step, per, digits=digits, asm=asm, warps=4, halves=True,
            experts=(table, pairs, experts, ends, which, byte_at, kt, slices, x_per_slot))


def aligned(weight: torch.Tensor, qtype: GGMLQuantizationType) -> bool:
    """Whether ``weight``'s bytes can be read as this kernel's words (Q4_K: 4-byte aligned; Q6_K: 2-byte)."""
    size = 4 if qtype in WORDS else 2
    return weight.data_ptr() % size == 0 and weight.numel() % size == 0
