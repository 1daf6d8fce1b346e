"""Raw cudaMalloc/cudaFree through the CUDA runtime, bypassing PyTorch's caching allocator.

The ``free`` allocator must pay the real, device-synchronising cudaFree on every
eviction; PyTorch's cache would hide it. A buffer is a torch tensor over the raw
pointer (via ``__cuda_array_interface__``); cudaFree runs when its last view dies.
"""

from __future__ import annotations

import ctypes
import glob
import os

import torch

from kestrel_core.errors import BudgetError, KestrelError

_lib = None


def _cudart() -> ctypes.CDLL:
    global _lib
    if _lib is not None:
        return _lib
    roots = [os.path.dirname(torch.__file__)]
    try:
        import nvidia  # the CUDA wheels torch depends on

        roots += list(nvidia.__path__)
    except ImportError:
        pass
    patterns = ["lib/libcudart.so*", "*/lib/libcudart.so*", "**/libcudart.so*"]
    candidates = [p for r in roots for pat in patterns for p in glob.glob(os.path.join(r, pat), recursive=True)]
    candidates += ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        lib.cudaFree.argtypes = [ctypes.c_void_p]
        _lib = lib
        return lib
    raise KestrelError("cannot find libcudart for the 'free' allocator; use --allocator pool")


class RawBlock:
    """Owns one cudaMalloc'd block; frees it when garbage-collected."""

    live_bytes = 0
    peak_bytes = 0

    def __init__(self, nbytes: int, device_index: int):
        lib = _cudart()
        self.nbytes = nbytes
        self.ptr = ctypes.c_void_p()
        with torch.cuda.device(device_index):
            err = lib.cudaMalloc(ctypes.byref(self.ptr), ctypes.c_size_t(nbytes))
        if err == 2:  # cudaErrorMemoryAllocation
            raise BudgetError(
                f"CUDA out of memory allocating {nbytes / 2**20:.1f} MiB raw; lower --budget-mb (KESTREL_WCACHE_MB) or keep"
            )
        if err:
            raise KestrelError(f"cudaMalloc failed with CUDA error {err}")
        self.device_index = device_index
        RawBlock.live_bytes += nbytes
        RawBlock.peak_bytes = max(RawBlock.peak_bytes, RawBlock.live_bytes)
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (self.ptr.value, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }

    def __del__(self):
        if self.ptr:
            _cudart().cudaFree(self.ptr)  # synchronises the device: the cost we want visible
            RawBlock.live_bytes -= self.nbytes
            self.ptr = None


def raw_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    block = RawBlock(max(nbytes, 1), device.index or 0)
    flat = torch.as_tensor(block, device=device)  # keeps ``block`` alive as long as any view
    return flat[:nbytes].view(dtype).view(shape)
