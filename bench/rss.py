"""Measuring a checkpoint mapping's resident pages: the fault granule of a file system, and the page runs a window's
record says are mapped (for the RSS bounds that the tests assert and the benchmarks report)."""

from __future__ import annotations

import mmap
import os
import re
from pathlib import Path

from kestrel_core.formats.checkpoint import PAGE, Checkpoint, mapping_rss, merge_spans


def fault_granule(directory: str | os.PathLike) -> int:
    """The bytes one read fault maps of a file on ``directory``'s file system (fault-around, or a whole large
    page-cache folio): one page of a fresh 8 MiB file is touched and the mapping's RSS read. The file is removed."""
    path = Path(directory) / "granule-probe"
    path.write_bytes(os.urandom(8 * 2**20))
    try:
        with open(path, "rb") as fh:
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            mm[4 * 2**20 + 100]
            return max(PAGE, mapping_rss([str(path.resolve())]))
        finally:
            mm.close()
    finally:
        path.unlink()


def tensor_table(path) -> tuple[Checkpoint, list[str]]:
    """A checkpoint's tensor table and its files' resolved paths; the table is read and unmapped again (a mapping of
    ours would add to the RSS measured)."""
    ckpt = Checkpoint(path)
    ckpt.close()
    return ckpt, [str(f.path.resolve()) for f in ckpt.files.values()]


class ResidentRuns:
    """The stretches of a checkpoint's files that a window's record says are mapped: each file's header, every
    tensor in no unit (never evicted), and the tensors of the resident units, merged where they touch."""

    def __init__(self, ckpt: Checkpoint, unit_names: set[str]):
        self.ckpt = ckpt
        self.fixed = {f: [(0, min(t.start for t in f.tensors.values()))] for f in ckpt.files.values()}
        for name in ckpt.names():
            if name not in unit_names:
                info = ckpt.info(name)
                self.fixed[ckpt.file_of(name)].append((info.start, info.end))

    def of(self, names) -> tuple[list[tuple[int, int]], int, int]:
        """For the resident tensors ``names``: the merged runs, their bytes rounded out to whole pages, and the
        tensors' own bytes."""
        spans = {f: list(s) for f, s in self.fixed.items()}
        tensor_bytes = 0
        for name in names:
            info = self.ckpt.info(name)
            spans[self.ckpt.file_of(name)].append((info.start, info.end))
            tensor_bytes += info.nbytes
        runs = [run for s in spans.values() for run in merge_spans(s)]
        return runs, sum(-(-hi // PAGE) * PAGE - lo // PAGE * PAGE for lo, hi in runs), tensor_bytes


def process_memory(pid: int | str = "self") -> dict[str, int | None]:
    """A process's resident memory now (VmRSS) and its high-water mark (VmHWM), in bytes (None where unreadable)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {"rss_bytes": None, "peak_rss_bytes": None}
    kib = {k: int(v) * 1024 for k, v in re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", status, re.M)}
    return {"rss_bytes": kib.get("VmRSS"), "peak_rss_bytes": kib.get("VmHWM")}
