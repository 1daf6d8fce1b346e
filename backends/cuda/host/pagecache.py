"""What of a checkpoint's file is in the page cache, and dropping it from there.

The host ring reads a part whose pages are all cached with buffered ``pread`` (the hot path) and
any other with ``O_DIRECT`` (the cold path), so it asks, piece by piece, whether a file range is
cached. ``range_cached`` asks the file with ``cachestat`` (Linux 6.5+), which counts the cached
pages of a range without a page-by-page lookup, where the kernel has it, and else ``mincore`` on
the range's mapped address (``bench/expert_staging_bench.py`` times both on a 3 MiB part).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from pathlib import Path

import numpy as np
import torch

from kestrel_core.errors import KestrelError

from .diskread import cannot_open

_libc = None  # libc for mincore, False where there is none
_SYS_CACHESTAT = {"x86_64": 451, "aarch64": 451}.get(platform.machine())  # the generic syscall table's number
_cachestat = None  # the syscall, False where the kernel has none


class _Range(ctypes.Structure):  # struct cachestat_range (linux/mman.h)
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):  # struct cachestat
    _fields_ = [(n, ctypes.c_uint64) for n in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


def _cachestat_fn():
    global _cachestat
    if _cachestat is None:
        _cachestat = False
        if _SYS_CACHESTAT is not None and platform.system() == "Linux":
            try:
                fn = ctypes.CDLL(None, use_errno=True).syscall
            except (OSError, AttributeError):
                return False
            fn.restype = ctypes.c_long
            fn.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
            _cachestat = fn
    return _cachestat


def cached_pages(fd: int, offset: int, nbytes: int) -> tuple[int, int] | None:
    """(pages of the file range ``[offset, offset + nbytes)`` in the page cache, pages the range spans), by
    ``cachestat``; None where the kernel has no ``cachestat`` (then it is not asked again) or it cannot count
    this file."""
    global _cachestat
    fn = _cachestat_fn()
    if not fn:
        return None
    if nbytes <= 0:
        return 0, 0
    page = os.sysconf("SC_PAGE_SIZE")
    first, last = offset // page, (offset + nbytes - 1) // page
    rng, st = _Range(first * page, (last - first + 1) * page), _Stat()
    if fn(_SYS_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(st), 0) != 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EPERM):  # no such syscall here, or a sandbox refuses it: never ask again
            _cachestat = False
            return None
        if err == errno.EOPNOTSUPP:  # a file it cannot count (hugetlbfs): ask the mapping
            return None
        raise KestrelError(f"cachestat on a checkpoint file failed ({os.strerror(err)}); check the file")
    return int(st.nr_cache), last - first + 1


def range_cached(fd: int, offset: int, nbytes: int, mapped_ptr: int | None = None) -> bool:
    """Whether every page of the file range is in the page cache: ``cachestat`` on ``fd``, else ``mincore`` on the
    range's mapped address ``mapped_ptr``; True where neither can tell (nothing would be read from disk knowingly)."""
    got = cached_pages(fd, offset, nbytes)
    if got is not None:
        return got[0] >= got[1]
    return mapped_ptr is None or resident_fraction(mapped_ptr, nbytes) == 1.0


def cached_fraction(t: torch.Tensor) -> float:
    """The share of a mapped tensor's pages that are in the page cache now (``mincore``); 1.0 where that cannot be told.

    A part wholly cached is copied from the mapping (the hot path); any other is read with
    ``O_DIRECT`` (the cold path), which neither needs its pages nor leaves them behind.
    """
    return resident_fraction(t.data_ptr(), t.numel() * t.element_size())


def resident_fraction(ptr: int, nbytes: int) -> float:
    """The share of the pages of the mapped range ``[ptr, ptr + nbytes)`` that are in the page cache now (``mincore``:
    a file mapping's pages count whether or not this process has touched them); 1.0 where that cannot be told."""
    global _libc
    if nbytes <= 0:
        return 1.0
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        except (OSError, AttributeError):
            _libc = False
    if not _libc:
        return 1.0
    page = os.sysconf("SC_PAGE_SIZE")
    lo = ptr // page * page
    n = -(-(ptr + nbytes - lo) // page)
    vec = (ctypes.c_ubyte * n)()
    if _libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(n * page), vec) != 0:
        return 1.0  # not a mapping (a copy in memory): nothing to read from disk
    return int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1)) / n  # bit 0: resident; the rest are reserved


def drop_cache(path: str | os.PathLike, sync: bool = False) -> None:
    """Drop ``path``'s clean pages from the page cache: ``posix_fadvise(POSIX_FADV_DONTNEED)`` over the whole file.

    Dirty pages (written and not yet on disk) stay: ``sync=True`` writes them back first (fdatasync).
    Pages a live mapping has mapped stay too: ``Checkpoint.drop_pages`` unmaps those.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise cannot_open(path, exc) from None
    try:
        if sync:
            os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError as exc:
        raise KestrelError(f"{path}: cannot drop its cached pages ({exc.strerror})") from None
    finally:
        os.close(fd)


def drop_checkpoint(ckpt, sync: bool = False) -> None:
    """Every page of a ``Checkpoint``'s files out of its mapping and then out of the page cache: the next read of
    any tensor goes to disk. Unmapping comes first, since the cache keeps a page a mapping holds."""
    ckpt.unmap_all()
    for f in ckpt.files.values():
        drop_cache(f.path, sync=sync)
