"""New files (a trace, a report, a plot): checked before the work, written whole or not at all, never over a file.

The bytes go to a hidden temporary beside the target (``leftovers`` names it), are flushed to disk, and
the temporary is renamed to the target with a rename that fails if the target appeared meanwhile.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from kestrel_core.io import leftovers

from kestrel_core.io import renameat

from kestrel_core.io import signals
from kestrel_core.errors import ConfigError


def _exists(flag: str, path: Path) -> ConfigError:
    return ConfigError(f"{flag} {path} already exists; name a new file (kestrel never replaces one)")


def check_new(path: str | Path, flag: str, suffix: str | None = None) -> Path:
    """Refuse, before any work, a path that exists, lacks ``suffix``, or whose directory is missing or not writable."""
    path = Path(path)
    if suffix and path.suffix.lower() != suffix:
        raise ConfigError(f"{flag} {path}: the file must end in {suffix}; e.g. {flag} {path.with_suffix(suffix).name}")
    if path.exists() or path.is_symlink():
        raise _exists(flag, path)
    parent = path.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise ConfigError(f"{flag} {path}: {parent} {what}; create the directory or name a file in another")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: the directory {parent} is not writable; name a file in one you can write to")
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _link_into_place(tmp: Path, path: Path) -> None:
    """``tmp`` becomes ``path``, unless ``path`` exists (FileExistsError)."""
    if renameat.noreplace(tmp, path):
        return
    try:
        os.link(tmp, path)  # fails if the name exists; a filesystem without renameat2's flag mostly has links
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        if path.exists() or path.is_symlink():  # no links either (FAT, some FUSE): a check, then a plain rename
            raise FileExistsError(errno.EEXIST, "File exists", str(path)) from None
        os.rename(tmp, path)
        return
    tmp.unlink()


def write_new(path: str | Path, write: Callable[[BinaryIO], None], flag: str, suffix: str | None = None) -> Path:
    """Create ``path`` with what ``write(file)`` writes: whole or not at all, never over an existing file."""
    path = check_new(path, flag, suffix)
    leftovers.sweep(path.parent)
    try:
        fd, tmp = leftovers.temp_file(path.parent, path.name)
    except OSError as exc:
        raise ConfigError(f"cannot write {flag} {path}: {exc.strerror or exc}; name a file in a directory you can "
                          "write to") from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; the file is the user's, as any other they write
        with signals.deferred():
            _link_into_place(tmp, path)
    except FileExistsError:
        raise _exists(flag, path) from None
    except OSError as exc:
        hint = "free space or name a file on another disk" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else \
            "name a file in a directory you can write to"
        raise ConfigError(f"cannot write {flag} {path}: {exc.strerror or exc}; nothing was written: {hint}") from None
    finally:
        with signals.deferred(reraise=False):  # already interrupted or failed: a second Ctrl-C must not leave it
            leftovers.remove(tmp)
    return path


def write_text_new(path: str | Path, text: str, flag: str, suffix: str | None = None) -> Path:
    return write_new(path, lambda f: f.write(text.encode()), flag, suffix)
