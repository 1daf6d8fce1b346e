"""The GGUF K-quant GEMV in CUDA C++ (``csrc/gguf_gemv.cuh``) for Q4_K and Q6_K, the two types of a Q4_K_M file's
linears: decode and small batches at the memory's speed, where the Triton kernel (``gguf_kernels``) spends its time
in layout shuffles and per-value conversions: one row of Q4_K and Q6_K at 54 to 60% of an H100's copy rate against
the Triton kernel's 21 to 28% (``bench/results/gguf-gemv_20261207T150648Z.json``).

Same contract as ``gguf_kernels.matmul``: y [M, N] float32 = x [M, K] @ W.T on the file's own blocks, float32
arithmetic on ggml's values (no activation quantization), and row m of any batch bitwise that row alone (every
order of the sum comes from the weight's shape; the rows a block shares, chosen by M, change no row's bits). Rows run
as launches of up to 8 (Q4_K's chunks of 5 to 8 rows as one-row launches: its 8-row kernel measured slower). Any weight address works: a 16-byte aligned Q4_K weight is read with vector loads, the rest
(Q6_K's 210-byte blocks always) as aligned words shifted together, the same bytes into the same arithmetic.

Built on first use with torch.utils.cpp_extension (``csrc.build``); ``usable()`` says why not where it
cannot run, and ``gguf_kernels.matmul`` then keeps these types on Triton. ``KESTREL_GGUF_CUDA=0`` turns it off.
"""

from __future__ import annotations

import os
import warnings

import torch
from gguf import GGMLQuantizationType

from csrc.build import Extension
from kestrel_core.errors import KestrelNote
from kestrel_core.formats.gguf_quants import check_product

T = GGMLQuantizationType
TYPES = (T.Q4_K, T.Q6_K)
WARPS = (1, 2, 4)


TURNED_OFF = "the CUDA GGUF kernel is turned off (KESTREL_GGUF_CUDA=0)"


def _why_not() -> str | None:
    if os.environ.get("KESTREL_GGUF_CUDA", "1") == "0":
        return TURNED_OFF
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return "the CUDA GGUF kernel needs a CUDA GPU and a CUDA build of torch"
    return None


EXTENSION = Extension("kestrel_gguf_gemv", ["gguf_gemv.cpp", "gguf_gemv.cu"], "the CUDA GGUF kernel", cuda=True,
                      check=_why_not)
load, usable = EXTENSION.load, EXTENSION.usable  # the built module (RuntimeError: why not); why not (None: it runs)


_said = False


def takes(x: torch.Tensor, qtype: GGMLQuantizationType, k: int) -> bool:
    """Whether ``matmul`` runs this product: a K-quant it computes, x on a CUDA device, whole super-blocks, built. On
    a GPU where it cannot build, a note says so once (these types then run on the Triton kernel)."""
    global _said
    if qtype not in TYPES or not x.is_cuda or k % 256:
        return False
    why = usable()
    if why is not None and why != TURNED_OFF and not _said:  # the user's own switch needs no note
        _said = True
        warnings.warn(f"{why}; Q4_K and Q6_K run on the slower Triton kernel instead", KestrelNote, stacklevel=2)
    return why is None


def plan(k: int, m: int = 1, qtype: GGMLQuantizationType = T.Q4_K) -> tuple[int, int]:
    """(warps a block, from K alone; weight rows a block for a chunk of m activation rows of ``qtype``)."""
    warps, rows = load().plan(k, m, int(qtype))
    return warps, rows


def matmul(x: torch.Tensor, weight: torch.Tensor, qtype: GGMLQuantizationType, n: int, k: int, *,
           out: torch.Tensor | None = None, warps: int | None = None) -> torch.Tensor:
    """y [M, n] float32 = x [M, k] @ W.T for W [n, k] held in ``weight`` as ``qtype`` blocks (uint8, ggml's layout).
    ``out``: where y goes, float32 or x's dtype (each output rounded once from its float32 sum), rows contiguous, a
    column slice of a wider output allowed. ``warps`` forces the block's warps (1, 2 or 4; a row's bits depend on it:
    for measuring)."""
    if qtype not in TYPES:
        raise ValueError(f"the CUDA GGUF kernel computes {', '.join(t.name for t in TYPES)}, not "
                         f"{getattr(qtype, 'name', qtype)}")
    check_product(x, weight, qtype, n, k)
    if warps is not None and warps not in WARPS:
        raise ValueError(f"warps must be one of {WARPS}, not {warps!r}")
    module = load()
    del module  # built: the op below is registered
    x = x.contiguous()
    y = out if out is not None else torch.empty((x.shape[0], n), dtype=torch.float32, device=x.device)
    if (y.shape != (x.shape[0], n) or y.dtype not in (torch.float32, x.dtype) or y.stride(1) != 1
            or y.stride(0) < n or y.device != x.device):
        raise ValueError(f"out must be [{x.shape[0]}, {n}] of float32 or {x.dtype} on {x.device}, its rows "
                         "contiguous")
    torch.ops.kestrel_gguf.gemv_out(x, weight.reshape(-1), int(qtype), n, k, y, warps or 0)
    return y

