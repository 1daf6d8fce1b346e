"""A file a run maps read-only: its mapping, the page drops that give its pages back, and a watch on it (the size and
modification time it had when mapped, read again through its own descriptor before each step).

A mapping reads whatever the file holds now. A file truncated under it (``cp`` over a model file truncates it first)
faults the process with SIGBUS at the next touch of a page past the new end, which no Python handler can turn into an
error; one rewritten in place gives wrong weights without a word. Replacing the path (``mv``, an editor's save) leaves
the mapped file as it was, and is no change here.
"""

from __future__ import annotations

import mmap
import os

from kestrel_core.errors import CheckpointError

PAGE = mmap.PAGESIZE


class MappedFile:
    """``path`` mapped whole from the open descriptor ``fd`` (the caller closes ``fd``; the mapping and the watch keep
    their own hold on the file)."""

    def __init__(self, path, fd: int):
        self.path = path
        try:
            self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: cannot map ({getattr(exc, 'strerror', None) or exc})") from None
        self._fd = os.dup(fd)  # the mapped file itself, whatever its path names later
        st = os.fstat(self._fd)
        self._seen = (st.st_size, st.st_mtime_ns)

    def drop_pages(self, spans: list[tuple[int, int]]) -> None:
        """madvise(MADV_DONTNEED) on whole pages inside each span; the next touch reads them back."""
        size = len(self._mm)
        for lo, hi in spans:
            start = -(-lo // PAGE) * PAGE
            stop = size if hi >= size else (hi // PAGE) * PAGE  # the file's last page may be partial
            if stop > start:
                self._mm.madvise(mmap.MADV_DONTNEED, start, stop - start)

    def check(self) -> None:
        """A CheckpointError once the mapped file's size or modification time moved since it was mapped."""
        st = os.fstat(self._fd)
        size, mtime = self._seen
        if (st.st_size, st.st_mtime_ns) == (size, mtime):
            return
        how = (f"cut from {size:,} to {st.st_size:,} bytes" if st.st_size < size else
               f"grown from {size:,} to {st.st_size:,} bytes" if st.st_size > size else "rewritten in place")
        raise CheckpointError(f"{self.path} was {how} while this run mapped it: its weights are no longer the model "
                              "that loaded; stop the run and start it again on the file as it is (to replace a model "
                              "under a running process, write the new file beside it and rename it over)")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            self._mm.close()
        except BufferError:
            pass  # views still alive; the mapping closes when they go
