"""Small files read whole (config.json, kestrel.toml, a chat template, a trace): never more than a limit.

The size is checked with fstat before reading and the read itself stops one byte past the limit, so a
file that grows, a /proc file that reports size 0, or a FIFO cannot make kestrel read without end; a
FIFO, device or directory is refused (opened without blocking, so a FIFO cannot hang the open either).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kestrel_core.errors import ConfigError, KestrelError

MiB = 2**20


def read_bounded(path: str | Path, limit: int, what: str, fix: str, error: type[KestrelError] = ConfigError) -> bytes:
    """The bytes of regular file ``path``, refused above ``limit`` bytes; ``what`` names the file in errors
    (e.g. "--trace t.json"), ``fix`` says what to do about a file too large, ``error`` is the class raised."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise error(f"{what}: cannot read ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise error(f"{what}: cannot read (Is a directory)")
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block, a device (/dev/zero) never end
            raise error(f"{what}: cannot read (not a regular file: a FIFO or device); name a regular file")
        if st.st_size > limit:
            raise error(f"{what}: {st.st_size / MiB:,.1f} MiB, over the {limit / MiB:,.0f} MiB limit; {fix}")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(limit + 1 - size, 16 * MiB))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise error(f"{what}: over the {limit / MiB:,.0f} MiB limit (it grew while it was read); {fix}")
        return b"".join(chunks)
    except OSError as exc:
        raise error(f"{what}: cannot read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
