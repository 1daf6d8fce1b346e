"""GGUF block GEMV on the host's cores (``csrc/host_gguf.cpp``): y [M, N] float32 = x [M, K] @ W.T with W [N, K]
held as ggml's blocks (uint8, each row a run of blocks) for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K.
cpu_ref computes a GGUF's linears of these types with it (``[backend] host_kernels = "auto"``).

As ggml's CPU ``vec_dot`` does it, each row of x is first quantized to 8 bits a value: q8_0 for Q8_0, Q4_0 and Q5_0
(per 32 values d = max|x| / 127, kept as float16 as ggml keeps it, q = round-half-even(x * 127 / max|x|)), q8_1 for
Q4_1 and Q5_1 (q8_0 and each block's s = d * sum(q), d before its float16 rounding, s kept as float16, as ggml's
``quantize_row_q8_1``; the weight's min m meets x through m * s), q8_K for the K-quants (per 256 values a float32
d = 1 / (127 / max|x|), the same q, int16 sums per 16). Each weight block is
combined with x's by exact integer dot products (AVX2 ``maddubs`` / ``madd`` as ggml's; for the K-quants on AVX-512,
``maddubs`` and VNNI's ``dpwssd`` on 512-bit vectors; or plain C), then one float32
term a block, added into lane ``b % 4`` of four accumulators; the output is ``(l0 + l1) + (l2 + l3)`` (the source's
header gives each type's term). The build has no fused multiply-add (``-ffp-contract=off``), so the AVX-512 path, the
AVX2 path, the scalar path and ``reference`` (numpy, the same steps) give the same bits; the tests hold them bitwise
equal.

Against the float32 product ``x @ dequantize(W).T`` the result differs by the quantization of x: each value of x
moves by at most half a step, d / 2 = max|x of its block| / 254 (float16 rounding of q8_0's d adds 2^-11
relative), so ``|y - x @ Wd.T| <= sum_k |Wd[n, k]| * blockmax|x| / 254 * 1.001 + float32 rounding``; for Q4_1 and
Q5_1 the float16 rounding of s (|s| <= 32 blockmax|x|) adds at most ``|m| * 32 * blockmax|x| * 2^-11`` a block;
``TOLERANCE`` states it as that bound (``bound``) plus 1e-5 of ``sum |x| |Wd|`` for the float32 sums.

Built on first use with torch.utils.cpp_extension (C++ only, no GPU needed; torch caches the build). ``usable()``
says in one line why it cannot run here. The path is AVX2 where the CPU has AVX2, FMA and F16C, else scalar;
``KESTREL_HOST_GGUF_ISA=avx512`` (or ``scalar``, ``avx2``) forces one, as does ``matmul(isa=...)``: the AVX-512 path
(F, BW, VL and VNNI; the K-quants on 512-bit vectors, the 32-value types as on AVX2) measured no faster than AVX2 on 2
cores of a Xeon (``bench/results/host-gemv_20261207T172219Z.json``), so auto does not pick it. The first call says
once on stderr which path runs.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
from gguf import GGMLQuantizationType

from csrc.build import Extension
from kestrel_core.formats.gguf_quants import block_geometry, dequantize, row_nbytes

T = GGMLQuantizationType
TYPES = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K)  # what the kernel computes
# What cpu_ref holds as blocks and computes here under host_kernels = "auto". Q4_1, Q5_0, Q5_1 and Q5_K stay float32
# there for now: x at one int8 digit (ggml's vec_dot) moves SmolLM2's Q4_1 model enough that its chat answer and its
# greedy ids leave the float32 ones (tests/test_real_model.py); x at two digits, as cuda's int8 kernels hold it, first.
HELD = (T.Q8_0, T.Q4_0, T.Q4_K, T.Q6_K)
K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)  # x as q8_K (256 values a block)
Q8_1 = (T.Q4_1, T.Q5_1)  # x as q8_1: the 32-value types with a min
ISAS = ("auto", "scalar", "avx2", "avx512")
ISA_ENV = "KESTREL_HOST_GGUF_ISA"
# |y - x @ dequantize(W).T| <= bound(x, W) + FLOAT_SLACK * (|x| @ |W|.T), per output (see the docstring)
FLOAT_SLACK = 1e-5
TOLERANCE = ("|y - x @ Wd.T| <= sum_k |Wd[n,k]| * blockmax|x| / 254 * 1.001 + 1e-5 * sum_k |x[k]| |Wd[n,k]| "
             "(+ sum_b |m[n,b]| * 32 * blockmax_b|x| * 2^-11 for Q4_1/Q5_1), Wd = dequantize(W), blockmax over x's "
             "quantization block (32 values for Q8_0/Q4_0/Q4_1/Q5_0/Q5_1, 256 for K-quants)")

_told = False

EXTENSION = Extension("kestrel_host_gguf", ["host_gguf.cpp"], "the host GGUF kernel", cuda=False,
                      cflags=("-O3", "-ffp-contract=off"))
load, usable = EXTENSION.load, EXTENSION.usable  # the built module (RuntimeError: why not); why not (None: it runs)


def which_isa(asked: str | None = None) -> str:
    """The path a call runs: ``asked``, else $KESTREL_HOST_GGUF_ISA, else auto's: 'avx2' where the CPU has it, else
    'scalar' ('avx512' runs where asked for)."""
    asked = asked or os.environ.get(ISA_ENV) or "auto"
    if asked not in ISAS:
        raise ValueError(f"the host GGUF kernel's isa is one of {', '.join(ISAS)}, not {asked!r}"
                         + (f" (from ${ISA_ENV})" if asked == os.environ.get(ISA_ENV) else ""))
    best = load().best_isa()
    if asked == "auto":
        return best
    if asked == "avx2" and best == "scalar":
        raise ValueError("the host GGUF kernel's avx2 path needs a CPU with AVX2, FMA and F16C; this one lacks one")
    if asked == "avx512" and not load().has_avx512():
        raise ValueError("the host GGUF kernel's avx512 path needs a CPU with AVX-512 F, BW, VL and VNNI (and AVX2, "
                         "FMA, F16C); this one lacks one: ask for avx2 or auto")
    return asked


def _name(qtype) -> str:
    return getattr(qtype, "name", str(qtype))


def check(x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType, n: int, k: int) -> None:
    """One-line ValueErrors for what ``matmul`` cannot take."""
    if qtype not in TYPES:
        raise ValueError(f"the host GGUF kernel computes {', '.join(t.name for t in TYPES)}, not {_name(qtype)}")
    values = block_geometry(qtype)[0]
    if not (isinstance(n, (int, np.integer)) and isinstance(k, (int, np.integer))) or n < 1 or k < 1 or k % values:
        raise ValueError(f"{qtype.name}: n must be a positive int and k a positive multiple of {values}, "
                         f"not n={n!r}, k={k!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be a [M, {k}] tensor, not {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.device.type != "cpu":
        raise ValueError(f"x must be float32, bfloat16 or float16 on the CPU, not {x.dtype} on {x.device}")
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8 or raw.device.type != "cpu":
        raise ValueError("the weight must be a uint8 CPU tensor of ggml's blocks")
    want = n * row_nbytes(qtype, k)
    if raw.numel() != want:
        raise ValueError(f"a {qtype.name} [{n}, {k}] weight is {want} bytes, not {raw.numel()}")


def matmul(x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType, n: int, k: int,
           threads: int | None = None, isa: str | None = None) -> torch.Tensor:
    """y [M, n] float32 = x [M, k] @ W.T for W [n, k] held in ``raw`` as ``qtype`` blocks (uint8, ggml's layout),
    on the host's cores (``threads`` of them for this call, default torch's). ``isa``: 'auto', 'scalar', 'avx2' or 'avx512'."""
    global _told
    if isinstance(raw, np.ndarray):
        raw = torch.from_numpy(raw)
    check(x, raw, qtype, n, k)
    path = which_isa(isa)
    if not _told:
        _told = True
        print(f"kestrel: the host GGUF kernel runs its {path} path", file=sys.stderr)
    x = x.float().contiguous()
    raw = raw.contiguous().reshape(-1)
    module = load()
    if threads is None:
        return module.gemv(x, raw, int(qtype), n, k, path)
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive int, not {threads!r}")
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return module.gemv(x, raw, int(qtype), n, k, path)
    finally:
        torch.set_num_threads(saved)


# ---- the reference: the same steps in numpy --------------------------------------------------------------------

def quantize_x(x: np.ndarray, qtype: GGMLQuantizationType
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """x float32 [M, K] as the kernel quantizes it: q int8 [M, K], d float32 [M, K / block], bsums int16
    [M, K / 16] (K-quants; else None), s float32 [M, K / 32] (q8_1, for Q4_1 and Q5_1: each block's float16
    d * sum(q), d unrounded; else None)."""
    kq = qtype in K_QUANTS
    block = 256 if kq else 32
    m, k = x.shape
    xb = x.astype(np.float32).reshape(m, k // block, block)
    amax = np.abs(xb).max(axis=2)
    with np.errstate(divide="ignore"):
        iscale = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * iscale[..., None]), -127, 127).astype(np.int8).reshape(m, k)
    if kq:
        with np.errstate(divide="ignore"):
            d = np.where(amax != 0, np.float32(1) / iscale, np.float32(0)).astype(np.float32)
        bsums = q.reshape(m, k // 16, 16).astype(np.int32).sum(axis=2).astype(np.int16)
        return q, d, bsums, None
    d_exact = (amax / np.float32(127)).astype(np.float32)
    d = d_exact.astype(np.float16).astype(np.float32)
    s = None
    if qtype in Q8_1:
        qsum = q.reshape(m, k // block, block).astype(np.int32).sum(axis=2).astype(np.float32)
        s = (d_exact * qsum).astype(np.float32).astype(np.float16).astype(np.float32)
    return q, d, None, s


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 8 scales and mins [..., 8] (int64) from the 12 bytes [..., 12]."""
    s = s.astype(np.int64)
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 63, (md & 0xF) | ((d >> 6) << 4)], axis=-1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 6) << 4)], axis=-1)
    return sc, mn


def _nib32(b: np.ndarray, qtype) -> np.ndarray:
    """Q4_1, Q5_0, Q5_1 blocks [n, nb, bytes] as their 32 integer values [n, nb, 32] (Q5_0's minus 16)."""
    has_min, has_qh = qtype in Q8_1, qtype in (T.Q5_0, T.Q5_1)
    nbytes = b.shape[-1]
    qs = b[..., nbytes - 16:].astype(np.int64)
    w = np.concatenate([qs & 0xF, qs >> 4], axis=-1)
    if has_qh:
        at = 4 if has_min else 2
        qh = np.ascontiguousarray(b[..., at:at + 4]).view("<u4")[..., 0].astype(np.int64)
        w = w | (((qh[..., None] >> np.arange(32)) & 1) << 4)
    return w - (0 if has_min else 16)


def _block_terms(xq, xd, bsums, xs, raw: np.ndarray, qtype, n: int, k: int) -> np.ndarray:
    """float32 terms [M, n, blocks]: each block's term as the kernel forms it."""
    values, nbytes = block_geometry(qtype)
    nb = k // values
    b = raw.reshape(n, nb, nbytes)
    m = xq.shape[0]
    xi = xq.astype(np.int64).reshape(m, nb, values)
    if qtype in (T.Q8_0, T.Q4_0):
        if qtype == T.Q8_0:
            w = b[..., 2:].view(np.int8).astype(np.int64)
        else:
            qs = b[..., 2:].astype(np.int64)
            w = np.concatenate([qs & 0xF, qs >> 4], axis=-1) - 8
        isum = np.einsum("nbj,mbj->mnb", w, xi)
        dd = xd[:, None, :] * _f16(b, 0)[None]
        return (dd * isum.astype(np.float32)).astype(np.float32)
    if qtype in (T.Q4_1, T.Q5_0, T.Q5_1):
        isum = np.einsum("nbj,mbj->mnb", _nib32(b, qtype), xi)
        dd = xd[:, None, :] * _f16(b, 0)[None]
        term = (dd * isum.astype(np.float32)).astype(np.float32)
        if qtype in Q8_1:
            term = (term + _f16(b, 2)[None] * xs[:, None, :]).astype(np.float32)
        return term
    if qtype in (T.Q4_K, T.Q5_K):
        at = 48 if qtype == T.Q5_K else 16
        qs = b[..., at:at + 128].astype(np.int64).reshape(n, nb, 4, 32)
        w = np.stack([qs & 0xF, qs >> 4], axis=3).reshape(n, nb, 8, 32)  # sub-block 2c: low, 2c + 1: high
        if qtype == T.Q5_K:  # the fifth bit of sub-block s's value l: bit s of qh[l]
            qh = b[..., 16:48].astype(np.int64)
            w = w | (((qh[:, :, None, :] >> np.arange(8)[:, None]) & 1) << 4)
        sc, mn = _k4_scales(b[..., 4:16])
        dots = np.einsum("nbsj,mbsj->mnbs", w, xi.reshape(m, nb, 8, 32))
        S = (dots * sc[None]).sum(axis=-1)
        sub = bsums.astype(np.int64).reshape(m, nb, 8, 2).sum(axis=-1)
        mins = np.einsum("nbs,mbs->mnb", mn, sub)
        d = xd[:, None, :] * _f16(b, 0)[None]
        dmin = xd[:, None, :] * _f16(b, 2)[None]
        return (d * S.astype(np.float32) - dmin * mins.astype(np.float32)).astype(np.float32)
    if qtype == T.Q6_K:
        ql = b[..., :128].astype(np.int64).reshape(n, nb, 2, 2, 32)  # [h, c & 1, l]
        qh = b[..., 128:192].astype(np.int64).reshape(n, nb, 2, 1, 32)
        lo = np.concatenate([ql & 0xF, ql >> 4], axis=3)  # [h, c, l], c = 0..3
        hi = (qh >> (2 * np.arange(4).reshape(1, 1, 1, 4, 1))) & 3
        w = (lo | (hi << 4)).reshape(n, nb, 16, 16) - 32
        sc = b[..., 192:208].view(np.int8).astype(np.int64)
        dots = np.einsum("nbgj,mbgj->mnbg", w, xi.reshape(m, nb, 16, 16))
        S = (dots * sc[None]).sum(axis=-1)
        d = xd[:, None, :] * _f16(b, 208)[None]
        return (d * S.astype(np.float32)).astype(np.float32)
    raise ValueError(f"the host GGUF kernel computes {', '.join(t.name for t in TYPES)}, not {_name(qtype)}")


def reference(x: torch.Tensor, raw, qtype: GGMLQuantizationType, n: int, k: int) -> torch.Tensor:
    """The kernel's result computed in numpy by the same steps (x's 8-bit blocks, exact integer dots, the same
    float32 terms and the same four-lane order): bitwise the kernel's. Slow; for tests."""
    raw_t = torch.from_numpy(np.asarray(raw)) if not isinstance(raw, torch.Tensor) else raw
    check(x, raw_t, qtype, n, k)
    xq, xd, bsums, xs = quantize_x(x.float().numpy(), qtype)
    terms = _block_terms(xq, xd, bsums, xs, raw_t.contiguous().numpy().reshape(-1), qtype, n, k)
    acc = np.zeros((4, *terms.shape[:2]), dtype=np.float32)
    for blk in range(terms.shape[2]):
        acc[blk % 4] += terms[..., blk]
    return torch.from_numpy((acc[0] + acc[1]) + (acc[2] + acc[3]))


def bound(x: torch.Tensor, raw, qtype: GGMLQuantizationType, n: int, k: int) -> torch.Tensor:
    """Per output [M, n], the largest |y - x @ dequantize(W).T| the kernel may show (``TOLERANCE``)."""
    block = 256 if qtype in K_QUANTS else 32
    raw_t = torch.from_numpy(np.asarray(raw)) if not isinstance(raw, torch.Tensor) else raw
    wd = dequantize(raw_t.reshape(-1), qtype, (n, k)).double().abs()
    xf = x.double()
    blockmax = xf.abs().reshape(x.shape[0], k // block, block).amax(dim=2)
    step = blockmax / 254 * 1.001  # half of x's step a block
    per_k = step.repeat_interleave(block, dim=1)
    out = per_k @ wd.T + FLOAT_SLACK * (xf.abs() @ wd.T)
    if qtype in Q8_1:  # s's float16 rounding: |s| <= 32 blockmax, half an ulp 2^-11 of it, times |m|
        blocks = raw_t.contiguous().reshape(-1).numpy().reshape(n, k // block, -1)
        m = torch.from_numpy(np.abs(_f16(blocks, 2))).double()
        out = out + (blockmax * 32 * 2.0**-11) @ m.T
    return out.float()
