"""What of a file is in the page cache (kestrel_core/pagecache.py): cachestat and mincore agree, page by page."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

import numpy as np
import pytest

from backends.cuda.host import pagecache
from kestrel_core.errors import CheckpointError, KestrelError
from backends.cuda.host.pagecache import cached_pages, drop_cache, range_cached, resident_fraction

PAGE = os.sysconf("SC_PAGE_SIZE")
PAGES = 64


@pytest.fixture
def half_cached(tmp_path):
    """A file of 64 pages on disk with exactly pages 8-15 and 40 in the page cache; (fd, its mapping's address)."""
    path = tmp_path / "pages.bin"
    path.write_bytes(os.urandom(PAGES * PAGE))
    drop_cache(path, sync=True)
    fd = os.open(path, os.O_RDONLY)
    m = mmap.mmap(fd, PAGES * PAGE, prot=mmap.PROT_READ)
    view = np.frombuffer(m, dtype=np.uint8)
    addr = view.ctypes.data
    try:
        if resident_fraction(addr, PAGES * PAGE) > 0.0:
            pytest.skip("this filesystem keeps a file's pages cached after POSIX_FADV_DONTNEED")
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: exactly the pages read come in
        os.pread(fd, 8 * PAGE, 8 * PAGE)
        os.pread(fd, 1, 40 * PAGE + 100)
        if resident_fraction(addr, PAGES * PAGE) != 9 / PAGES:
            pytest.skip("the page cache did not take exactly the pages read")
        yield fd, addr
    finally:
        del view
        m.close()
        os.close(fd)


CASES = [  # (offset, nbytes, cached pages, pages spanned)
    (8 * PAGE, 8 * PAGE, 8, 8),
    (8 * PAGE + 1, 8 * PAGE - 2, 8, 8),  # unaligned, within the same pages
    (7 * PAGE + PAGE - 1, 2, 1, 2),  # the last byte of page 7 and the first of page 8
    (0, PAGES * PAGE, 9, PAGES),
    (40 * PAGE + 4000, 1, 1, 1),
    (41 * PAGE, 5 * PAGE, 0, 5),
]


@pytest.mark.parametrize("offset, nbytes, cached, spanned", CASES)
def test_cachestat_counts_the_cached_pages_of_a_range(half_cached, offset, nbytes, cached, spanned):
    fd, addr = half_cached
    got = cached_pages(fd, offset, nbytes)
    if got is None:
        pytest.skip("this kernel has no cachestat (Linux 6.5+)")
    assert got == (cached, spanned)
    assert range_cached(fd, offset, nbytes) == (cached == spanned)
    assert resident_fraction(addr + offset, nbytes) == cached / spanned  # mincore says the same


@pytest.mark.parametrize("offset, nbytes, cached, spanned", CASES)
def test_without_cachestat_the_mapping_is_asked(half_cached, monkeypatch, offset, nbytes, cached, spanned):
    fd, addr = half_cached
    monkeypatch.setattr(pagecache, "_cachestat", False)  # a kernel without the syscall
    assert cached_pages(fd, offset, nbytes) is None
    assert range_cached(fd, offset, nbytes, addr + offset) == (cached == spanned)
    assert range_cached(fd, offset, nbytes) is True  # nothing mapped to ask: nothing is read from disk knowingly


def fake_syscall(err: int, calls: list):
    def call(*args):
        calls.append(args)
        ctypes.set_errno(err)
        return -1
    return call


def test_a_kernel_without_cachestat_falls_back_to_mincore_for_good(half_cached, monkeypatch):
    fd, addr = half_cached
    calls: list = []
    monkeypatch.setattr(pagecache, "_cachestat", fake_syscall(errno.ENOSYS, calls))
    assert range_cached(fd, 41 * PAGE, PAGE, addr + 41 * PAGE) is False  # mincore: page 41 is not cached
    assert pagecache._cachestat is False and len(calls) == 1
    assert range_cached(fd, 8 * PAGE, PAGE, addr + 8 * PAGE) is True and len(calls) == 1


def test_a_file_cachestat_does_not_support_is_asked_through_its_mapping(half_cached, monkeypatch):
    fd, addr = half_cached
    calls: list = []
    monkeypatch.setattr(pagecache, "_cachestat", fake_syscall(errno.EOPNOTSUPP, calls))  # hugetlbfs says so
    assert range_cached(fd, 41 * PAGE, PAGE, addr + 41 * PAGE) is False
    assert range_cached(fd, 8 * PAGE, PAGE, addr + 8 * PAGE) is True
    assert len(calls) == 2  # still asked: another file may support it


def test_a_failing_cachestat_is_an_error_not_a_guess(half_cached, tmp_path):
    fd, _ = half_cached
    if cached_pages(fd, 0, PAGE) is None:
        pytest.skip("this kernel has no cachestat (Linux 6.5+)")
    closed = os.open(tmp_path / "pages.bin", os.O_RDONLY)
    os.close(closed)
    with pytest.raises(KestrelError, match="cachestat .*Bad file descriptor"):
        cached_pages(closed, 0, PAGE)


def test_drop_cache(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * PAGE)
    drop_cache(path)
    drop_cache(path, sync=True)
    with pytest.raises(CheckpointError, match="cannot open"):
        drop_cache(tmp_path / "missing")
