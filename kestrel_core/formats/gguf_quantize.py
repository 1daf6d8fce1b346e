"""GGUF blocks from float32 weights: ggml's reference quantizers for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K,
in numpy.

The inverse of ``gguf_quants`` (which dequantizes). Each function here is a transcription of the ``quantize_row_*_ref``
of llama.cpp's ``ggml/src/ggml-quants.c`` (what ``llama-quantize`` runs when it has no importance matrix), vectorised
over blocks rather than looped block by block, with the same float32 operations in the same order, so that the bytes
are ggml's: every sum that ggml runs left to right runs left to right here too (``_seq_sum``, never numpy's
pairwise ``sum``), products keep ggml's association (``w*l*x`` is ``(w*l)*x``), ``nearest_int`` is ggml's
magic-number rounding, and the f16 conversions round to nearest even as ``GGML_FP32_TO_FP16`` does.
``tests/test_gguf_quantize.py`` holds each against a loop-by-loop transcription of the C, and Q8_0, Q4_0, Q4_1, Q5_0
and Q5_1 against the ``gguf`` package's own quantizers (which has none for the K-quants).

The bytes are the C's as written, evaluated without contraction: they equal those C functions compiled with
``-ffp-contract=off`` or for baseline x86-64 (checked on 12,000 blocks a type). A ggml built for a CPU with FMA
(llama.cpp's default native build) lets the compiler fuse ``a*b + c``, which changes the chosen scales in some blocks:
compiled so (gcc 12, ``-O3 -march=native``), 6% of Q4_K, 30% of Q5_K and 2% of Q6_K blocks of normal data differed by
at least a byte; Q4_0 and Q4_1 came out equal either way (160,000 blocks each).

``quantize(values, qtype)`` takes a 2-D array (rows of a multiple of the block size) and gives its blocks as uint8
``[rows, row bytes]``, a few thousand rows at a time so that the temporaries stay small whatever the tensor.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType
QK_K = 256  # values in a K-quant super-block
GROUP_MAX_EPS = np.float32(1e-15)  # ggml-quants.c: below this a group is all zero
CHUNK_VALUES = 1 << 16  # values quantized at once: the K-quants' temporaries are a few dozen times this in bytes
F32 = np.float32


def _seq_sum(a: np.ndarray) -> np.ndarray:
    """The sum over the first axis, added in order in float32 as ggml's loops add (numpy's sum is pairwise): one
    vector add a term, which is several times faster than ``np.add.accumulate`` over a short last axis."""
    total = a[0].astype(np.float32, copy=True)
    for term in a[1:]:
        total += term
    return total


def nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: add 1.5 * 2**23 in float32 (rounding half to even) and read the low mantissa bits."""
    t = (np.asarray(v, dtype=np.float32) + F32(12582912.0)).view(np.int32)
    return (t & 0x007FFFFF) - 0x00400000


def _roundf(v: np.ndarray) -> np.ndarray:
    """C's roundf (half away from zero), exactly: the fraction and its double are exact in float32."""
    a = np.abs(v)
    whole = np.floor(a)
    return np.copysign(whole + np.floor(2 * (a - whole)), v)


def _half(v: np.ndarray) -> np.ndarray:
    """float32 values as the two bytes of their f16 (GGML_FP32_TO_FP16), [..., 2]."""
    return np.asarray(v, dtype=np.float32).astype(np.float16).view(np.uint8).reshape(*np.shape(v), 2)


def _half_value(v: np.ndarray) -> np.ndarray:
    """What an f16 of ``v`` reads back as (GGML_FP16_TO_FP32 of GGML_FP32_TO_FP16)."""
    return np.asarray(v, dtype=np.float32).astype(np.float16).astype(np.float32)


def _inverse(d: np.ndarray) -> np.ndarray:
    """``d ? 1.0f/d : 0.0f``."""
    with np.errstate(divide="ignore"):
        return np.where(d != 0, F32(1) / d, F32(0)).astype(np.float32)


# --- 32-value blocks -------------------------------------------------------------------------

def q8_0(x: np.ndarray) -> np.ndarray:
    """quantize_row_q8_0_ref: blocks [n, 32] -> [n, 34] (f16 d, 32 int8)."""
    d = np.abs(x).max(axis=1) / F32(127)
    q = _roundf(x * _inverse(d)[:, None]).astype(np.int8)
    return np.concatenate([_half(d), q.view(np.uint8)], axis=1)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """32 values of 0..15 a block [n, 32] as the 16 bytes ggml packs: value j low, value j + 16 high."""
    return (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)


def q4_0(x: np.ndarray) -> np.ndarray:
    """quantize_row_q4_0_ref: blocks [n, 32] -> [n, 18] (f16 d, 16 bytes of nibbles), d = the largest magnitude / -8."""
    at = np.abs(x).argmax(axis=1)  # the first of equal magnitudes, as ggml's strict `amax < fabsf(v)`
    d = x[np.arange(len(x)), at] / F32(-8)
    q = np.minimum(15, np.trunc(x * _inverse(d)[:, None] + F32(8.5)).astype(np.int32))  # (int8_t) truncates
    return np.concatenate([_half(d), _nibbles(q)], axis=1)


def q4_1(x: np.ndarray) -> np.ndarray:
    """quantize_row_q4_1_ref: blocks [n, 32] -> [n, 20] (f16 d, f16 min, 16 bytes of nibbles)."""
    lo, hi = x.min(axis=1), x.max(axis=1)
    d = (hi - lo) / F32(15)
    q = np.minimum(15, np.trunc((x - lo[:, None]) * _inverse(d)[:, None] + F32(0.5)).astype(np.int32))
    return np.concatenate([_half(d), _half(lo), _nibbles(q)], axis=1)


def _fifth_bits(q: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's qh: bit j of a little-endian uint32 is value j's fifth bit, [n, 4] bytes."""
    bits = ((q >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)
    return np.bitwise_or.reduce(bits, axis=1).astype("<u4").view(np.uint8).reshape(-1, 4)


def q5_0(x: np.ndarray) -> np.ndarray:
    """quantize_row_q5_0_ref: blocks [n, 32] -> [n, 22] (f16 d, qh, 16 bytes of low nibbles), d = the largest magnitude
    / -16, q = min(31, (int8_t)(x / d + 16.5))."""
    at = np.abs(x).argmax(axis=1)
    d = x[np.arange(len(x)), at] / F32(-16)
    q = np.minimum(31, np.trunc(x * _inverse(d)[:, None] + F32(16.5)).astype(np.int32))
    return np.concatenate([_half(d), _fifth_bits(q), _nibbles(q & 15)], axis=1)


def q5_1(x: np.ndarray) -> np.ndarray:
    """quantize_row_q5_1_ref: blocks [n, 32] -> [n, 24] (f16 d, f16 min, qh, 16 bytes of low nibbles), d = (max - min)
    / 31, q = (uint8_t)((x - min) / d + 0.5)."""
    lo, hi = x.min(axis=1), x.max(axis=1)
    d = (hi - lo) / F32(31)
    q = np.trunc((x - lo[:, None]) * _inverse(d)[:, None] + F32(0.5)).astype(np.int32)
    return np.concatenate([_half(d), _half(lo), _fifth_bits(q), _nibbles(q & 15)], axis=1)


# --- K-quant helpers ---------------------------------------------------------------------------

def make_qkx2_quants(x: np.ndarray, weights: np.ndarray, nmax: int, rmin: float, rdelta: float,
                     nstep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's make_qkx2_quants (use_mad false) for each column of ``x`` [n, m] (a group's n values run down a column,
    so that its sums are n vector adds): (scale [m], the_min [m], L uint8 [n, m]).

    An asymmetric fit ``x ~ scale * L - the_min`` with L in 0..nmax: a first guess from the range, then ``nstep + 1``
    trial scales around it, each refit by weighted least squares, the best weighted squared error kept."""
    fmax = F32(nmax)
    lo = x.min(axis=0)
    lo = np.where(lo > 0, F32(0), lo)  # `if (min > 0) min = 0`
    hi = x.max(axis=0)
    flat = hi == lo  # every L is 0, the scale 0
    first_lo = lo
    sum_w = _seq_sum(weights)
    sum_x = _seq_sum(weights * x)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = fmax / (hi - lo)
        scale = F32(1) / iscale
        L = np.clip(nearest_int(iscale * (x - lo)), 0, nmax).astype(np.float32)
        diff = scale * L + lo - x
        best = _seq_sum(weights * (diff * diff))
        for step in range(nstep + 1):
            iscale = ((F32(rmin) + F32(rdelta) * F32(step)) + fmax) / (hi - lo)  # `min` is the best fit's so far
            trial = np.clip(nearest_int(iscale * (x - lo)), 0, nmax).astype(np.float32)
            wl = weights * trial
            sum_l, sum_l2, sum_xl = _seq_sum(wl), _seq_sum(wl * trial), _seq_sum(wl * x)
            D = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            positive = this_min > 0
            this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
            this_min = np.where(positive, F32(0), this_min)
            diff = this_scale * trial + this_min - x
            error = _seq_sum(weights * (diff * diff))
            better = (D > 0) & (error < best)
            L = np.where(better, trial, L)
            best = np.where(better, error, best)
            scale = np.where(better, this_scale, scale)
            lo = np.where(better, this_min, lo)
    scale = np.where(flat, F32(0), scale).astype(np.float32)
    lo = np.where(flat, first_lo, lo)
    L = np.where(flat, 0, L).astype(np.uint8)
    return scale, (-lo).astype(np.float32), L


def make_qx_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's make_qx_quants with rmse_type 1 and no importance weights (what Q6_K uses) for each column of ``x``
    [n, m]: (scale [m], L uint8 [n, m] in 0..2*nmax-1). A symmetric fit ``x ~ scale * (L - nmax)`` weighted by x², the
    best of 19 trial scales around ``-nmax / max`` (max: the value of largest magnitude)."""
    at = np.abs(x).argmax(axis=0)  # the first of equal magnitudes, as ggml's strict `ax > amax`
    top = x[at, np.arange(x.shape[1])]
    zero = np.abs(top) < GROUP_MAX_EPS
    w = x * x
    wx = w * x

    def fit(iscale):
        l = np.clip(nearest_int(iscale * x), -nmax, nmax - 1).astype(np.float32)
        return l, _seq_sum(wx * l), _seq_sum(w * l * l)

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        l, sumlx, suml2 = fit(F32(-nmax) / top)
        L = l + F32(nmax)
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0))
        best = scale * sumlx
        for step in range(-9, 10):
            if step == 0:
                continue
            l, sumlx, suml2 = fit(-(F32(nmax) + F32(0.1) * F32(step)) / top)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            L = np.where(better, l + F32(nmax), L)
            scale = np.where(better, sumlx / suml2, scale)
            best = np.where(better, scale * sumlx, best)
    scale = np.where(zero, F32(0), scale).astype(np.float32)
    L = np.where(zero, 0, L).astype(np.uint8)
    return scale, L


def _pack_scales_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """The 8 six-bit scales and mins of a Q4_K/Q5_K block [n, 8] each, in ggml's 12 bytes (get_scale_min_k4's
    inverse): bytes 0-3 and 4-7 hold scales and mins 0-3 and the top two bits of 4-7; bytes 8-11 their low nibbles."""
    packed = np.zeros((len(ls), 12), dtype=np.uint8)
    packed[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    packed[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    return packed


def _by_group(x: np.ndarray, group: int) -> np.ndarray:
    """Super-blocks [n, 256] as groups of ``group`` values down the columns: [group, n * 256 / group]."""
    return np.ascontiguousarray(x.reshape(-1, group).T)


def _asymmetric_k(x: np.ndarray, nmax: int, rmin: float, nstep: int) -> tuple[np.ndarray, ...]:
    """The part quantize_row_q4_K_ref and quantize_row_q5_K_ref share, for super-blocks [n, 256]: 8 sub-blocks of 32
    fitted by make_qkx2_quants (weights: the sub-block's RMS plus |x|), their scales and mins quantized to 6 bits
    against the block's largest (f16 d and dmin), then every value quantized again against the scale and min it
    got. Returns (d and dmin bytes [n, 4], packed scales [n, 12], L [n, 256] in 0..nmax)."""
    n = len(x)
    sub = _by_group(x, 32)  # [32, n * 8]
    av_x = np.sqrt(_seq_sum(sub * sub) / F32(32))
    weights = av_x + np.abs(sub)
    scales, mins, L = make_qkx2_quants(sub, weights, nmax, rmin, 0.1, nstep)
    scales, mins = scales.reshape(n, 8), mins.reshape(n, 8)
    top_scale, top_min = scales.max(axis=1), mins.max(axis=1)
    max_scale = np.where(top_scale > 0, top_scale, F32(0))  # starts at +0 and keeps only larger ones
    max_min = np.where(top_min > 0, top_min, F32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0))
        inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0))
    ls = np.minimum(63, nearest_int(inv_scale[:, None] * scales) & 0xFF).astype(np.uint8)  # via uint8_t, as in C
    lm = np.minimum(63, nearest_int(inv_min[:, None] * mins) & 0xFF).astype(np.uint8)
    d, dmin = max_scale / F32(63), max_min / F32(63)
    step = (_half_value(d)[:, None] * ls.astype(np.float32)).reshape(-1)  # get_scale_min_k4 gives back ls and lm
    offset = (_half_value(dmin)[:, None] * lm.astype(np.float32)).reshape(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        again = np.clip(nearest_int((sub + offset) / step), 0, nmax)
    L = np.where(step != 0, again, L).astype(np.uint8)  # `if (!d) continue`: the fit's L stays
    return np.concatenate([_half(d), _half(dmin)], axis=1), _pack_scales_k4(ls, lm), L.T.reshape(n, QK_K)


def q4_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q4_K_ref: super-blocks [n, 256] -> [n, 144] (f16 d, f16 dmin, 12 bytes of scales, 128 of nibbles;
    values j and j + 32 of each 64 share a byte)."""
    head, scales, L = _asymmetric_k(x, 15, -1.0, 20)
    L = L.reshape(len(x), 4, 2, 32)
    qs = (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(len(x), 128)
    return np.concatenate([head, scales, qs], axis=1)


def q5_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q5_K_ref: super-blocks [n, 256] -> [n, 176] (f16 d, f16 dmin, 12 bytes of scales, 32 bytes of
    fifth bits, 128 of low nibbles laid out as Q4_K's)."""
    head, scales, L = _asymmetric_k(x, 31, -0.5, 15)
    L = L.reshape(len(x), 4, 2, 32)
    ql = ((L[:, :, 0] & 0xF) | ((L[:, :, 1] & 0xF) << 4)).reshape(len(x), 128)
    high = L >> 4  # [n, chunk c, half h, 32]: bit 2c + h of qh[j]
    qh = np.zeros((len(x), 32), dtype=np.uint8)
    for c in range(4):
        qh |= (high[:, c, 0] << (2 * c)) | (high[:, c, 1] << (2 * c + 1))
    return np.concatenate([head, scales, qh, ql], axis=1)


def q6_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q6_K_ref: super-blocks [n, 256] -> [n, 210] (128 bytes of low nibbles, 64 of high two bits, 16
    int8 scales, f16 d). 16 sub-blocks of 16 fitted by make_qx_quants, their scales quantized to int8 against the
    largest in magnitude (d = that / -128), every value quantized again against its scale."""
    n = len(x)
    sub = _by_group(x, 16)  # [16, n * 16]
    scales, L = make_qx_quants(sub, 32)
    scales = scales.reshape(n, 16)
    at = np.abs(scales).argmax(axis=1)  # the first of equal magnitudes, as `abs_scale > max_abs_scale`
    max_scale = scales[np.arange(n), at]
    zero = np.abs(max_scale) < GROUP_MAX_EPS  # the block is written as zeros
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = np.where(zero, F32(1), F32(-128) / max_scale)
        d = F32(1) / iscale
        sc = (np.minimum(127, nearest_int(iscale[:, None] * scales)) & 0xFF).astype(np.uint8).view(np.int8)
        step = (_half_value(d)[:, None] * sc.astype(np.float32)).reshape(-1)
        again = np.clip(nearest_int(sub / step), -32, 31) + 32
    L = np.where(step != 0, again, L).astype(np.uint8).T.reshape(n, 2, 4, 32)  # [n, half, quarter, 32]
    low = L & 0xF
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    qh = (L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4) | ((L[:, :, 3] >> 4) << 6)
    out = np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), _half(d)], axis=1)
    out[zero] = 0
    return out


BLOCK_QUANTIZERS = {T.Q8_0: q8_0, T.Q4_0: q4_0, T.Q4_1: q4_1, T.Q5_0: q5_0, T.Q5_1: q5_1, T.Q4_K: q4_k, T.Q5_K: q5_k,
                    T.Q6_K: q6_k}
TYPES = tuple(BLOCK_QUANTIZERS)


def quantize(values, qtype: GGMLQuantizationType) -> np.ndarray:
    """The blocks of ``values`` ([rows, cols], numpy or torch, any float dtype; cols a multiple of the block size) as
    ``qtype``: uint8 [rows, cols / block * block bytes], ggml's bytes. One thread: chunks on a thread pool ran slower
    on the (shared, 2-core) machine where it was measured; a larger one was not measured."""
    block, size = GGML_QUANT_SIZES[qtype]
    rows, cols = values.shape
    if cols % block:
        raise ValueError(f"rows of {cols} values do not split into {qtype.name} blocks of {block}")
    encode = BLOCK_QUANTIZERS[qtype]
    out = np.empty((rows, cols // block * size), dtype=np.uint8)
    step = max(1, CHUNK_VALUES // cols)
    for start in range(0, rows, step):
        chunk = values[start:start + step]
        if not isinstance(chunk, np.ndarray):  # a torch tensor (a bf16 view of a checkpoint, say)
            chunk = chunk.float().numpy()
        chunk = np.ascontiguousarray(chunk, dtype=np.float32)
        out[start:start + len(chunk)] = encode(chunk.reshape(-1, block)).reshape(len(chunk), -1)
    return out
