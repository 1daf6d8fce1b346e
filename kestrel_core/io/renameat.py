"""Linux renameat2: swap two paths in one step, or rename without replacing what is there.

Each returns False where the system or the filesystem cannot (not Linux, an old kernel, a filesystem
without the flag), so that the caller takes its slower way; any other failure is an OSError.
"""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

_NOREPLACE, _EXCHANGE = 1, 2
_AT_FDCWD = -100
_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


def _renameat2(a: Path, b: Path, flags: int) -> bool:
    try:
        call = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if call(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), str(b))


def exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` (both must exist) atomically."""
    return _renameat2(a, b, _EXCHANGE)


def noreplace(src: Path, dst: Path) -> bool:
    """Rename ``src`` to ``dst``; FileExistsError if ``dst`` exists (even an empty directory)."""
    return _renameat2(src, dst, _NOREPLACE)
