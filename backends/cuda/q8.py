"""q8 weights on the CUDA backend: the device entry, the GEMV kernel (built lazily), the pure-torch path.

A ``Q8Weight`` is one linear in device layout, held in a single byte buffer: qweight int8
``[K, Npad]`` and right after it scales f32 ``[K/group, Npad]`` (see kestrel_core.formats.quant). One
buffer means one DMA per entry on upload and one pool key per geometry. It quacks like the
torch tensor the CUDA backend's upload flow expects (``copy_``, ``data_ptr``,
``record_stream``), so pooled buffers, side-stream prefetch and events work unchanged.

``q8_linear(x, w)`` runs one row (batch-1 decode) through the csrc kernel, int8 GEMV with fused
dequant and float32 accumulation (sm_80 or newer; its split-K runs as thread-block clusters on
sm_90 and newer, a single split below). Anything else (prefill, T > 1), or any call where the kernel
did not build, dequantizes into a reused buffer and runs a matmul. The kernel is compiled on
first use with torch.utils.cpp_extension for the current device's arch (sm_90 on the H200;
override with KESTREL_CUDA_ARCH=9.0) and cached by torch in its extensions directory; a
failed build raises KernelNotBuilt from ``load_kernel()`` (cached, no rebuild), and
``q8_linear`` then says so once on stderr and keeps to the torch path. KESTREL_Q8_KERNEL=0
turns the kernel off.
"""

from __future__ import annotations

import os
import warnings
from typing import Callable, Iterable, Sequence

import attrs
import torch

from csrc.build import Extension
from kestrel_core.formats import quant
from kestrel_core.formats.checkpoint import Checkpoint
from kestrel_core.errors import KestrelError, KestrelNote
from kestrel_core.formats.units import Geometry

DTYPE = "q8"  # Geometry.dtype of a q8 entry
# Largest dequantized slice the torch path materializes at once (elements): bounds its buffer.
WORKSPACE_ELEMS = 64 * 2**20


class KernelNotBuilt(KestrelError):
    """The q8 GEMV kernel could not be built or loaded here; the pure-torch path still works."""


# --- the device entry --------------------------------------------------------------------
class Q8Weight:
    """One q8 linear ``W [n, k]``: ``raw`` bytes = qweight int8 [k, n_pad] ++ scales f32 [k/group, n_pad]."""

    __slots__ = ("raw", "qweight", "scales", "n", "k", "group", "n_pad")

    def __init__(self, raw: torch.Tensor, n: int, k: int, group: int, n_pad: int):
        qbytes = k * n_pad
        if raw.dtype != torch.uint8 or raw.dim() != 1 or raw.numel() != quant.layout_nbytes(k, group, n_pad):
            raise ValueError(f"raw must be a uint8 vector of {quant.layout_nbytes(k, group, n_pad)} bytes")
        self.raw = raw
        self.qweight = raw[:qbytes].view(torch.int8).view(k, n_pad)
        self.scales = raw[qbytes:].view(torch.float32).view(k // group, n_pad)  # offset is a multiple of 64
        self.n, self.k, self.group, self.n_pad = n, k, group, n_pad

    @classmethod
    def empty(cls, n: int, k: int, group: int, n_pad: int | None = None, device="cpu", pin_memory: bool = False,
              empty: Callable = torch.empty) -> "Q8Weight":
        n_pad = quant.pad_n(n) if n_pad is None else n_pad
        nbytes = quant.layout_nbytes(k, group, n_pad)
        if pin_memory:
            raw = torch.empty((nbytes,), dtype=torch.uint8, pin_memory=True)
        else:
            raw = empty((nbytes,), dtype=torch.uint8, device=device)
        return cls(raw, n, k, group, n_pad)

    @classmethod
    def from_tensors(cls, qweight: torch.Tensor, scales: torch.Tensor, n: int, group: int, device="cpu",
                     pin_memory: bool = False) -> "Q8Weight":
        k, n_pad = qweight.shape
        w = cls.empty(n, k, group, n_pad, device=device, pin_memory=pin_memory)
        w.qweight.copy_(qweight)
        w.scales.copy_(scales)
        return w

    # the tensor-like surface the CUDA upload flow uses
    def copy_(self, src: "Q8Weight", non_blocking: bool = False) -> "Q8Weight":
        if (src.k, src.group, src.n_pad) != (self.k, self.group, self.n_pad):
            raise ValueError(f"q8 geometry mismatch: [{src.k}, {src.n_pad}]/g{src.group} into [{self.k}, {self.n_pad}]/g{self.group}")
        self.raw.copy_(src.raw, non_blocking=non_blocking)
        self.n = src.n  # a pooled buffer may have held another entry of the same geometry
        return self

    def data_ptr(self) -> int:
        return self.raw.data_ptr()

    def record_stream(self, stream) -> None:
        self.raw.record_stream(stream)

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    @property
    def n_groups(self) -> int:
        return self.k // self.group

    def to(self, device, non_blocking: bool = False) -> "Q8Weight":
        return Q8Weight(self.raw.to(device, non_blocking=non_blocking), self.n, self.k, self.group, self.n_pad)

    def geometry(self, device) -> Geometry:
        """The pool key of a device buffer for this entry: shape [K, Npad], Npad and ngroups in the layout."""
        return q8_geometry(self.k, self.group, self.n_pad, device)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """W [n, k] (a fresh tensor; for tests and references)."""
        return quant.dequantize(self.qweight, self.scales, self.n, self.group, dtype)

    def __repr__(self) -> str:
        return f"Q8Weight(n={self.n}, k={self.k}, group={self.group}, n_pad={self.n_pad}, device={self.device})"


def q8_geometry(k: int, group: int, n_pad: int, device) -> Geometry:
    return Geometry((k, n_pad), DTYPE, quant.layout_nbytes(k, group, n_pad), str(device), (DTYPE, n_pad, k // group))


def new_q8_buffer(geometry: Geometry, device, empty: Callable = torch.empty) -> Q8Weight:
    """A device buffer for a q8 geometry; ``empty`` may be rawcuda.raw_empty (the ``free`` allocator)."""
    k, n_pad = geometry.shape
    n_groups = geometry.layout[2]
    return Q8Weight.empty(n_pad, k, k // n_groups, n_pad, device=device, empty=empty)


def is_q8_geometry(geometry: Geometry) -> bool:
    return geometry.dtype == DTYPE


# --- host staging (what the CUDA backend pins once per model) ------------------------------
def stage_q8(ckpt: Checkpoint, parts: Sequence[quant.Q8Tensor], pin_memory: bool = True,
             alloc: Callable[[int], torch.Tensor] | None = None) -> Q8Weight:
    """One host entry in device layout. A single part is copied as stored; several (q, k, v or
    gate, up, which share K and the group) are fused along N: their real columns side by side,
    then one padding, so the fused output splits exactly like the float path's. ``alloc(nbytes)``, where
    given, supplies its bytes (a view of a ``PinnedArena``) instead of a block of its own."""
    k, group = parts[0].k, parts[0].group
    if any((p.k, p.group) != (k, group) for p in parts):
        raise ValueError("fused q8 parts must share K and the group size")
    n = sum(p.n for p in parts)
    n_pad = parts[0].n_pad if len(parts) == 1 else quant.pad_n(n)
    if alloc is not None:
        w = Q8Weight(alloc(quant.layout_nbytes(k, group, n_pad)), n, k, group, n_pad)
    else:
        w = Q8Weight.empty(n, k, group, n_pad, pin_memory=pin_memory)
    if len(parts) == 1:
        qweight, scales = quant.read_q8(ckpt, parts[0])
        w.qweight.copy_(qweight)
        w.scales.copy_(scales)
        return w
    w.raw.zero_()
    at = 0
    for p in parts:
        qweight, scales = quant.read_q8(ckpt, p)  # a GGUF's Q8_0: repacked from its blocks, not dequantized
        w.qweight[:, at : at + p.n].copy_(qweight[:, : p.n])
        w.scales[:, at : at + p.n].copy_(scales[:, : p.n])
        at += p.n
    return w


def stage_q8_unit(ckpt: Checkpoint, info: quant.QuantInfo, tensors: dict, fused: Iterable[tuple[str, Sequence[str]]],
                  pin_memory: bool = True) -> dict[str, Q8Weight]:
    """entry name -> pinned host Q8Weight for one unit (``tensors``: role -> (name, shape), as UnitSpec.tensors),
    with ``fused`` like cuda's ``fusion`` (e.g. (("qkv", ("q", "k", "v")), ("o", ("o",)), ...))."""
    return {
        name: stage_q8(ckpt, [info.tensors[tensors[role][0]] for role in roles], pin_memory=pin_memory)
        for name, roles in fused
    }


def unit_page_names(info: quant.QuantInfo, tensors: dict) -> list[str]:
    """The checkpoint tensors behind one unit's q8 weights (for Checkpoint.drop_pages after staging)."""
    return [n for name, _ in tensors.values() for n in (info.tensors[name].stored if name in info.tensors else (name,))]


def fused_geometry(parts: Sequence[quant.Q8Tensor], device) -> Geometry:
    """The device geometry of one q8 entry: a single part as stored, or parts fused along N (as stage_q8 does)."""
    n_pad = parts[0].n_pad if len(parts) == 1 else quant.pad_n(sum(p.n for p in parts))
    return q8_geometry(parts[0].k, parts[0].group, n_pad, device)


def load_resident_q8(ckpt: Checkpoint, t: quant.Q8Tensor, device) -> Q8Weight:
    """A never-evicted device copy (lm_head)."""
    return stage_q8(ckpt, [t], pin_memory=False).to(device)


# --- the kernel -----------------------------------------------------------------------------
_said_fallback = False


def _why_not() -> str | None:
    if os.environ.get("KESTREL_Q8_KERNEL", "1") == "0":
        return "the q8 GEMV kernel is turned off (KESTREL_Q8_KERNEL=0)"
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return "the q8 GEMV kernel needs a CUDA GPU and a CUDA build of torch"
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return (f"the q8 GEMV kernel needs compute capability 8.0 or newer (it streams weights with cp.async); "
                f"this GPU is {major}.{minor}")
    return None


EXTENSION = Extension("kestrel_q8_gemv", ["q8_gemv.cpp", "q8_gemv.cu"], "the q8 GEMV kernel", cuda=True,
                      check=_why_not, loaded=lambda module: _register_fake())


def load_kernel():
    """The compiled extension (built on the first call, then cached); raises KernelNotBuilt."""
    try:
        return EXTENSION.load()
    except RuntimeError as exc:
        raise KernelNotBuilt(str(exc)) from exc


def _register_fake() -> None:
    """Shapes of the ops' outputs without running them, for torch.compile (--compile)."""

    @torch.library.register_fake("kestrel::q8_gemv")
    def _(x, qweight, scales, group, n, splits=0, out_dtype=None):
        return x.new_empty((*x.shape[:-1], n), dtype=out_dtype or x.dtype)


def kernel_available() -> bool:
    """Whether the kernel is (or can be) built here; builds it on the first call."""
    try:
        load_kernel()
        return True
    except KernelNotBuilt:
        return False


def q8_gemv(x: torch.Tensor, w: Q8Weight, out_dtype: torch.dtype | None = None, splits: int = 0) -> torch.Tensor:
    """The kernel alone: one row ``x [K]`` or ``[1, K]`` -> ``[N]`` / ``[1, N]`` (raises KernelNotBuilt).

    ``splits``: 0 lets the launcher pick the split-K count (a thread-block cluster of that many
    blocks per 128 columns); 1..8 forces one, rounded down to 1, 2, 4 or 8 and to at most one
    32-row unit per split, for tests and tuning.
    """
    module = load_kernel()
    if x.shape[-1] != w.k or x.numel() != w.k:
        raise ValueError(f"q8_gemv takes one row of K={w.k}, got x of shape {list(x.shape)}")
    # Checked here, not left to the binding: on the H200 image a C++ exception thrown inside
    # the extension kills the process (README, q8 weights) instead of reaching Python.
    if not isinstance(splits, int) or not 0 <= splits <= 8:
        raise ValueError(f"q8_gemv: splits must be 0 (auto) or 1..8, got {splits!r}")
    if x.device != w.qweight.device:
        raise ValueError(f"q8_gemv: x is on {x.device} but the weights are on {w.qweight.device}; move x there")
    del module  # built: the op below is registered
    return torch.ops.kestrel.q8_gemv(x, w.qweight, w.scales, w.group, w.n, splits, out_dtype)


def _device_index(device: int) -> int:
    """A CUDA device index that exists here (checked in Python: the binding would otherwise fall
    back to device 0 silently, or fail inside the extension)."""
    count = torch.cuda.device_count()
    if not isinstance(device, int) or not 0 <= device < count:
        raise ValueError(f"no CUDA device {device!r} here; this machine has {count} (use 0..{count - 1})" if count
                         else f"no CUDA device {device!r} here; this machine has none")
    return device


def gemv_plan(w: Q8Weight, splits: int = 0, device: int = 0) -> tuple[int, int, int]:
    """(column blocks, splits, units per split) the kernel launches for ``w`` on ``device``."""
    device = _device_index(device)
    return tuple(load_kernel().plan(w.k, w.n_pad, splits, device))


def gemv_device_facts(device: int = 0) -> tuple[int, float, int]:
    """(SMs, peak DRAM GB/s or 0 where the driver does not say, blocks per SM) behind the kernel's
    automatic split count on ``device``."""
    device = _device_index(device)
    sms, peak, per_sm = load_kernel().device_facts(device)
    return int(sms), float(peak), int(per_sm)


# --- the pure-torch path --------------------------------------------------------------------
_workspace: dict[tuple, torch.Tensor] = {}


def _buffer(device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A flat scratch buffer reused across calls (same device and dtype; stream order keeps it safe)."""
    key = (device, dtype)
    buf = _workspace.get(key)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing() and (buf is None or buf.numel() < numel):
        return torch.empty((numel,), dtype=dtype, device=device)  # the graph's own pool: never kept for eager use
    if buf is None or buf.numel() < numel:
        # A normal tensor, even when first made during generation: an inference tensor could
        # not be written outside inference mode later.
        with torch.inference_mode(False):
            buf = _workspace[key] = torch.empty((numel,), dtype=dtype, device=device)
    return buf[:numel]


def dequantize_columns(w: Q8Weight, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
    """W^T[:, lo:hi] = qweight[:, lo:hi] * scales[k // group, lo:hi], as [K, hi - lo] in the reused buffer."""
    G, g, cols = w.n_groups, w.group, hi - lo
    out = _buffer(w.device, dtype, w.k * cols).view(G, g, cols)
    scales = w.scales[:, None, lo:hi]
    if dtype == torch.float64:
        scales = scales.double()  # else the product rounds to float32 first (it is float32 or narrower otherwise)
    torch.mul(w.qweight[:, lo:hi].view(G, g, cols), scales, out=out)
    return out.view(w.k, cols)


def q8_linear_torch(x: torch.Tensor, w: Q8Weight) -> torch.Tensor:
    """``x [..., K] -> [..., N]`` by dequantize-then-matmul, in x's dtype, N in column chunks that
    keep the scratch buffer at most WORKSPACE_ELEMS."""
    chunk = max(64, (WORKSPACE_ELEMS // max(1, w.k)) // 64 * 64)
    if w.n <= chunk:
        return x @ dequantize_columns(w, 0, w.n, x.dtype)
    y = torch.empty((*x.shape[:-1], w.n), dtype=x.dtype, device=x.device)
    for lo in range(0, w.n, chunk):
        hi = min(w.n, lo + chunk)
        y[..., lo:hi] = x @ dequantize_columns(w, lo, hi, x.dtype)
    return y


def q8_linear(x: torch.Tensor, w: Q8Weight) -> torch.Tensor:
    """The linear the CUDA backend calls for a q8 entry: ``x [T, K] -> [T, N]`` in x's dtype.

    T == 1 on a GPU goes through the kernel; prefill (T > 1), CPU tensors, or a kernel that
    did not build take the torch path (the last says so once, as a KestrelNote).
    """
    if EXTENSION.built is not None and x.shape[0] == 1 and x.is_cuda:  # the hot path: the op checks the rest itself
        return torch.ops.kestrel.q8_gemv(x, w.qweight, w.scales, w.group, w.n, 0, None)
    global _said_fallback
    if x.is_cuda and x.numel() == w.k and x.dtype in (torch.float32, torch.bfloat16, torch.float16):
        try:
            return q8_gemv(x, w)
        except KernelNotBuilt as exc:
            if not _said_fallback:
                _said_fallback = True
                warnings.warn(f"{exc}; q8 runs on the pure-torch path", KestrelNote, stacklevel=2)
    return q8_linear_torch(x, w)


# --- for benchmarks (times nothing itself) --------------------------------------------------
@attrs.frozen
class GemvCase:
    """A ready q8 GEMV: ``run()`` does one product; ``bytes_moved`` is what it must read and write."""

    weight: Q8Weight
    x: torch.Tensor
    run: Callable[[], torch.Tensor]
    bytes_moved: int
    path: str


def gemv_case(n: int, k: int, group: int = 128, dtype: torch.dtype = torch.bfloat16, device="cuda", seed: int = 0,
              path: str = "kernel", splits: int = 0) -> GemvCase:
    """Random q8 weights ``[n, k]`` and one input row on ``device``; ``path``: "kernel" (with
    ``splits`` as in q8_gemv) or "torch".

    For effective bandwidth: bytes_moved / seconds, next to the same run's device copy bandwidth.
    """
    gen = torch.Generator(device=device).manual_seed(seed)  # drawn and quantized where they run
    qweight, scales = quant.quantize(torch.randn((n, k), generator=gen, device=device), group)
    w = Q8Weight.from_tensors(qweight, scales, n, group, device=device)
    x = torch.randn((1, k), generator=gen, device=device).to(dtype)
    item = torch.empty((), dtype=dtype).element_size()
    return GemvCase(w, x, gemv_runner(x, w, path, splits), w.nbytes + (k + n) * item, path)


def gemv_runner(x: torch.Tensor, w: Q8Weight, path: str = "kernel", splits: int = 0) -> Callable[[], torch.Tensor]:
    """One product ``x @ W^T`` as a call: "kernel" (``splits`` as in q8_gemv) or "torch"."""
    if path == "kernel":
        load_kernel()
        return lambda: q8_gemv(x, w, splits=splits)
    if path == "torch":
        return lambda: q8_linear_torch(x, w)
    raise ValueError(f"path must be 'kernel' or 'torch', got {path!r}")
