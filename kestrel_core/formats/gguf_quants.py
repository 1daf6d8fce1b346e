"""GGUF tensor types: which ones kestrel reads, their block geometry, and dequantization of one tensor's bytes.

Every type is a run of fixed-size blocks along a row (ggml's ``ne[0]``, the fastest dimension: the
``in`` of a ``[out, in]`` weight), so a row, a run of rows or one expert of a 3-D tensor is a
contiguous byte range that dequantizes on its own. Dequantization runs on exactly the bytes asked
for (nothing else of the file is read), in torch, as ggml's ``dequantize_row_*`` does it: the same
float32 products and sums in the same order, so the floats are ggml's bit for bit (the tests hold
them against a transcription of ggml's C and against ``gguf.quants``, ggml-org's numpy port, which
is single-threaded and was most of a streamed token's time on the CPU).

Q8_0 (one f16 scale ``d`` and 32 int8 ``q`` a block, ``w = d * q``) is kestrel's own q8 format with
group 32, so ``q8_0_to_kestrel`` repacks it into ``quant.dequantize``'s layout without rounding:
``qweight[k, n] = q``, ``scales[k // 32, n] = float32(d)``; the product of an int8 and an f16 is
exact in float32, so both dequantize to the same floats.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kestrel_core.formats.quant import N_ALIGN, pad_n

T = GGMLQuantizationType
# The types kestrel reads; the float ones are mapped zero-copy, the rest dequantized to float32 on demand.
FLOAT_TYPES = {T.F32: "F32", T.F16: "F16", T.BF16: "BF16"}
QUANT_TYPES = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS)
# IQ4_NL's and IQ4_XS's 16 levels (ggml's kvalues_iq4nl)
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
SUPPORTED = (*FLOAT_TYPES, *QUANT_TYPES)
SUPPORTED_NAMES = ", ".join(t.name for t in SUPPORTED)
Q8_0_GROUP = 32


def block_geometry(qtype: GGMLQuantizationType) -> tuple[int, int]:
    """(values a block, bytes a block) of ``qtype``."""
    return GGML_QUANT_SIZES[qtype]


def row_nbytes(qtype: GGMLQuantizationType, n_values: int) -> int:
    """Bytes of ``n_values`` values of one row (``n_values`` a multiple of the block size)."""
    block, size = GGML_QUANT_SIZES[qtype]
    return n_values // block * size


def view_dtype(qtype: GGMLQuantizationType) -> str:
    """The safetensors-style dtype a tensor of ``qtype`` is served in: its own for a float type, F32 once dequantized."""
    return FLOAT_TYPES.get(qtype, "F32")


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte ``at`` of every block, as float32 [n, 1]."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _unpack(qs: torch.Tensor, out: torch.Tensor, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """Spread packed fields into ``out`` [n, groups, len(shifts), width] (any numeric dtype): for each group of
    ``width`` bytes of ``qs`` [n, groups * width], its ``(byte >> shift) & mask`` for each shift, in turn."""
    q = qs.reshape(out.shape[0], out.shape[1], out.shape[3])
    for i, shift in enumerate(shifts):
        field = q >> shift if shift else q
        out[:, :, i].copy_(field if (0xFF >> shift) & ~mask == 0 else field & mask)  # the top field needs no mask
    return out


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: the 8 6-bit scales and 8 6-bit mins packed in 12 bytes, as float32 [n, 8, 1] each."""
    n = scales.shape[0]
    d, m, m_d = scales.reshape(n, 3, 4).unbind(1)
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc.float().reshape(n, 8, 1), mn.float().reshape(n, 8, 1)


# Each writes its values once into a new float32 tensor and scales it in place: the new memory is touched by as few
# passes as the arithmetic needs (the products and sums are ggml's, in its order: d * q, then + m or - dmin * m).

def _q8_0(b: torch.Tensor) -> torch.Tensor:
    out = torch.empty(b.shape[0], 32)
    out.copy_(b[:, 2:].contiguous().view(torch.int8))
    return out.mul_(_f16(b, 0))


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _unpack(b[:, 2:], torch.empty(b.shape[0], 1, 2, 16, dtype=torch.int8), (0, 4), 0x0F)
    out = torch.empty(b.shape[0], 32)
    out.copy_(q.reshape(-1, 32).sub_(8))
    return out.mul_(_f16(b, 0))


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    out = _unpack(b[:, 4:], torch.empty(b.shape[0], 1, 2, 16), (0, 4), 0x0F).reshape(-1, 32)
    return out.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q5_values(b: torch.Tensor, at: int) -> torch.Tensor:
    """Q5_0/Q5_1's 5-bit values [n, 32] (int32) from qh (4 bytes, little-endian: bit j is value j's fifth) and the 16
    bytes of nibbles after it (value j the low nibble of byte j, value j + 16 the high one) at byte ``at``."""
    n = b.shape[0]
    qh = b[:, at:at + 4].contiguous().view(torch.int32)
    high = (qh >> torch.arange(32, dtype=torch.int32)) & 1
    low = _unpack(b[:, at + 4:at + 20], torch.empty(n, 1, 2, 16, dtype=torch.int32), (0, 4), 0x0F).reshape(n, 32)
    return low.bitwise_or_(high.bitwise_left_shift_(4))


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    out = torch.empty(b.shape[0], 32)
    out.copy_(_q5_values(b, 2).sub_(16))
    return out.mul_(_f16(b, 0))


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    out = torch.empty(b.shape[0], 32)
    out.copy_(_q5_values(b, 4))
    return out.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    """scales[16] (low nibble a scale, high a min), qs[64] of 2-bit values, d, dmin: value 16j + l of half h is
    bits 2j of qs[32h + 16(j % 2) + l] ... as dequantize_row_q2_K walks them."""
    n = b.shape[0]
    sc = b[:, :16].to(torch.int32)
    dl = (_f16(b, 80) * (sc & 0xF).float()).reshape(n, 16, 1)
    ml = (_f16(b, 82) * (sc >> 4).float()).reshape(n, 16, 1)
    q = b[:, 16:80].to(torch.int32).reshape(n, 2, 1, 2, 16)  # [half, -, which 16 of its 32 bytes, l]
    shifts = torch.arange(0, 8, 2, dtype=torch.int32).reshape(1, 1, 4, 1, 1)
    vals = ((q >> shifts) & 3).reshape(n, 16, 16).float()  # [half, shift, which] -> the 16 groups in ggml's order
    return (dl * vals - ml).reshape(n, 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    """hmask[32], qs[64] of 2-bit values, 12 bytes of sixteen 6-bit scales, d: value (q - 4 where its hmask bit is
    clear) times d * (scale - 32), as dequantize_row_q3_K."""
    n = b.shape[0]
    aux = b[:, 96:108].contiguous().view(torch.int32)  # [n, 3], little-endian words
    a0, a1, tmp = aux[:, 0], aux[:, 1], aux[:, 2]
    m2, m1 = 0x0F0F0F0F, 0x03030303
    words = torch.stack([(a0 & m2) | (((tmp >> 0) & m1) << 4), (a1 & m2) | (((tmp >> 2) & m1) << 4),
                         ((a0 >> 4) & m2) | (((tmp >> 4) & m1) << 4), ((a1 >> 4) & m2) | (((tmp >> 6) & m1) << 4)], 1)
    scales = words.contiguous().view(torch.int8).reshape(n, 16).to(torch.int32)
    dl = (_f16(b, 108) * (scales - 32).float()).reshape(n, 16, 1)
    q = b[:, 32:96].to(torch.int32).reshape(n, 2, 1, 2, 16)
    hm = b[:, :32].to(torch.int32).reshape(n, 1, 1, 2, 16)
    shifts = torch.arange(0, 8, 2, dtype=torch.int32).reshape(1, 1, 4, 1, 1)
    bit = (torch.arange(8, dtype=torch.int32).reshape(1, 2, 4, 1, 1))  # m = 1 << (4 * half + j)
    vals = ((q >> shifts) & 3) - torch.where((hm >> bit) & 1 == 1, 0, 4)
    return (dl * vals.reshape(n, 16, 16).float()).reshape(n, 256)


def _iq4_levels(nibbles: torch.Tensor) -> torch.Tensor:
    return torch.tensor(IQ4_LEVELS, dtype=torch.float32)[nibbles.long()]


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    q = b[:, 2:18].to(torch.int32)
    return _f16(b, 0) * _iq4_levels(torch.cat([q & 0xF, q >> 4], dim=1))


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    """d, scales_h (2 bits a 32-value block), scales_l[4] (a nibble a block), qs[128]: block ib's values are
    d * (ls - 32) * level, its 16 bytes' low nibbles then high ones, as dequantize_row_iq4_xs."""
    n = b.shape[0]
    sh = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    sl = b[:, 4:8].to(torch.int32)
    ib = torch.arange(8, dtype=torch.int32)
    ls = ((sl[:, ib // 2] >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4)
    dl = (_f16(b, 0) * (ls - 32).float()).reshape(n, 8, 1)
    q = b[:, 8:136].to(torch.int32).reshape(n, 8, 16)
    return (dl * _iq4_levels(torch.cat([q & 0xF, q >> 4], dim=2))).reshape(n, 256)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d, dm = _f16(b, 0).reshape(n, 1, 1) * sc, _f16(b, 2).reshape(n, 1, 1) * mn
    out = _unpack(b[:, 16:], torch.empty(n, 4, 2, 32), (0, 4), 0x0F).reshape(n, 8, 32)
    return out.mul_(d).sub_(dm).reshape(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d, dm = _f16(b, 0).reshape(n, 1, 1) * sc, _f16(b, 2).reshape(n, 1, 1) * mn
    low = _unpack(b[:, 48:], torch.empty(n, 4, 2, 32, dtype=torch.uint8), (0, 4), 0x0F).reshape(n, 8, 32)
    high = _unpack(b[:, 16:48], torch.empty(n, 1, 8, 32, dtype=torch.uint8), tuple(range(8)), 1).reshape(n, 8, 32)
    out = torch.empty(n, 8, 32)
    out.copy_(low.bitwise_or_(high.bitwise_left_shift_(4)))
    return out.mul_(d).sub_(dm).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = (_f16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    low = _unpack(b[:, :128], torch.empty(n, 2, 2, 64, dtype=torch.uint8), (0, 4), 0x0F).reshape(n, 8, 32)
    high = _unpack(b[:, 128:192], torch.empty(n, 2, 4, 32, dtype=torch.uint8), (0, 2, 4, 6), 3).reshape(n, 8, 32)
    q = low.bitwise_or_(high.bitwise_left_shift_(4)).view(torch.int8).sub_(32)
    out = torch.empty(n, 16, 16)
    out.copy_(q.reshape(n, 16, 16))
    return out.mul_(d).reshape(n, 256)


_DEQUANTIZE = {T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q2_K: _q2_k,
               T.Q3_K: _q3_k, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k, T.IQ4_NL: _iq4_nl, T.IQ4_XS: _iq4_xs}


def dequantize(raw: np.ndarray | torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 ``shape`` (HF order, the last dimension the row) from ``raw``, the uint8 bytes of exactly those values."""
    if isinstance(raw, np.ndarray):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only mapping: only read, never written through
            raw = torch.from_numpy(raw)
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    return _DEQUANTIZE[qtype](blocks).reshape(shape)


def q8_0_blocks(raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The int8 values [n, k] and f16 scales [n, k / 32] of a Q8_0 tensor ``[n, k]`` (its uint8 bytes)."""
    blocks = raw.reshape(n, k // Q8_0_GROUP, 2 + Q8_0_GROUP)
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16).reshape(n, k // Q8_0_GROUP)
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, k)
    return q, d


def q8_0_to_kestrel(raw: np.ndarray, n: int, k: int, rows: np.ndarray | None = None,
                    align: int = N_ALIGN) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 tensor ``[n, k]`` in kestrel's q8 layout (``quant.py``, group 32): qweight int8 [k, Npad], scales
    float32 [k / 32, Npad], pad columns zero. ``rows``: the order to take the rows in (an un-permutation)."""
    q, d = q8_0_blocks(raw, n, k)
    if rows is not None:
        q, d = q[rows], d[rows]
    npad = pad_n(n, align)
    qweight = np.zeros((k, npad), dtype=np.int8)
    qweight[:, :n] = q.T
    scales = np.zeros((k // Q8_0_GROUP, npad), dtype=np.float32)
    scales[:, :n] = d.T.astype(np.float32)
    return qweight, scales


def check_product(x, weight, qtype, n: int, k: int) -> None:
    """One-line ValueErrors for a product x [M, k] @ W.T whose W [n, k] is ``qtype`` blocks in ``weight``: whole
    blocks, the weight's bytes, x's shape and dtype, one device (what every GGUF kernel's caller must give)."""
    values, nbytes = block_geometry(qtype)
    if k % values:
        raise ValueError(f"k={k} is not whole {qtype.name} blocks of {values} values")
    want = n * (k // values) * nbytes
    if weight.dtype != torch.uint8 or weight.numel() != want or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous uint8 of {want} bytes ({qtype.name} [{n}, {k}])")
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x must be [M, {k}] float32, bfloat16 or float16, not {list(x.shape)} {x.dtype}")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but the weight on {weight.device}")
