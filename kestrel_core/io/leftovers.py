"""Temporary names that a later kestrel can prove orphaned, and their removal.

A writer builds its output under a hidden name beside the target and renames it into place. Kill -9
(or a power cut) cannot be handled in the moment, so the name itself says who wrote it: this host,
this boot, the writer's pid and the process's start time,

    .<target>.k<host:8 hex><boot:8 hex>-<pid>-<start>.<random>.kestrel-partial

and a later writer in the same directory removes every such name whose writer is gone (same host,
and another boot, or no live process with that pid and start time). A name from another host is
left alone: its writer cannot be seen from here (a directory shared over the network).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
import warnings
import zlib
from pathlib import Path

from kestrel_core.errors import KestrelNote

SUFFIX = ".kestrel-partial"
_NAME = re.compile(r"^\..*\.k(?P<host>[0-9a-f]{8})(?P<boot>[0-9a-f]{8})-(?P<pid>\d+)-(?P<start>\d+)\.[A-Za-z0-9_]+"
                   + re.escape(SUFFIX) + "$")
_STEM_CHARS = 80  # a long target name must not push the temporary name past NAME_MAX (255)


def _host() -> str:
    return f"{zlib.crc32(socket.gethostname().encode()):08x}"


def _boot() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip().replace("-", "")[:8].ljust(8, "0")
    except OSError:
        return "0" * 8  # no /proc: a process is then told alive by its pid alone


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot; 0 where /proc cannot say), or None if there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19])  # field 22; the command name may hold spaces and ')'
    except FileNotFoundError:
        return None
    except (OSError, ValueError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # someone else's process: alive
        pass
    return 0


def tag() -> str:
    """This process's part of a temporary name."""
    pid = os.getpid()
    return f"k{_host()}{_boot()}-{pid}-{start_time(pid) or 0}"


def _prefix(stem: str) -> str:
    return f".{stem[:_STEM_CHARS]}.{tag()}."


def temp_dir(parent: Path, stem: str) -> Path:
    """A new empty directory in ``parent``, named for ``stem`` (the target's name) and this process."""
    return Path(tempfile.mkdtemp(prefix=_prefix(stem), suffix=SUFFIX, dir=parent))


def temp_file(parent: Path, stem: str) -> tuple[int, Path]:
    """A new empty file in ``parent`` (its descriptor, open for writing, and its path)."""
    fd, path = tempfile.mkstemp(prefix=_prefix(stem), suffix=SUFFIX, dir=parent)
    return fd, Path(path)


def orphaned(name: str) -> bool:
    """Whether ``name`` is a kestrel temporary whose writer is provably gone."""
    m = _NAME.match(name)
    if not m or m["host"] != _host():
        return False
    if m["boot"] != _boot():
        return True  # this machine restarted since it was written
    now = start_time(int(m["pid"]))
    return now is None or (now != 0 and int(m["start"]) != 0 and now != int(m["start"]))  # gone, or the pid reused


def remove(path: Path) -> None:
    """A temporary file or directory, gone; no error if it already is."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        pass


def sweep(parent: Path) -> list[str]:
    """Remove what killed kestrel writers left in ``parent``; the names removed (each also noted)."""
    try:
        names = [e.name for e in os.scandir(parent) if e.name.endswith(SUFFIX)]
    except OSError:
        return []
    removed = []
    for name in names:
        if not orphaned(name):
            continue
        try:
            remove(Path(parent) / name)
        except OSError:
            continue  # not ours to fight over: e.g. a read-only directory; the writer reports its own error
        removed.append(name)
        warnings.warn(f"removed {Path(parent) / name}, left by a kestrel writer that was killed", KestrelNote,
                      stacklevel=2)
    return removed
