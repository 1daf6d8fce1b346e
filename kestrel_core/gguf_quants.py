"""GGUF tensor types: which ones kestrel reads, their block geometry, and dequantization of one tensor's bytes.

Every type is a run of fixed-size blocks along a row (ggml's ``ne[0]``, the fastest dimension: the
``in`` of a ``[out, in]`` weight), so a row, a run of rows or one expert of a 3-D tensor is a
contiguous byte range that dequantizes on its own. Dequantization is ``gguf.quants.dequantize``
(ggml-org's numpy port of ggml's ``dequantize_row_*``) on exactly the bytes asked for: nothing
else of the file is read.

Q8_0 (one f16 scale ``d`` and 32 int8 ``q`` a block, ``w = d * q``) is kestrel's own q8 format with
group 32, so ``q8_0_to_kestrel`` repacks it into ``quant.dequantize``'s layout without rounding:
``qweight[k, n] = q``, ``scales[k // 32, n] = float32(d)``; the product of an int8 and an f16 is
exact in float32, so both dequantize to the same floats.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as _quants

from .quant import N_ALIGN, pad_n

T = GGMLQuantizationType
# The types kestrel reads; the float ones are mapped zero-copy, the rest dequantized to float32 on demand.
FLOAT_TYPES = {T.F32: "F32", T.F16: "F16", T.BF16: "BF16"}
QUANT_TYPES = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K)
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


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """float32 ``shape`` (HF order, the last dimension the row) from ``raw``, the uint8 bytes of exactly those values."""
    out = _quants.dequantize(raw.reshape(-1, row_nbytes(qtype, shape[-1])), qtype)
    return np.ascontiguousarray(out, dtype=np.float32).reshape(shape)


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
