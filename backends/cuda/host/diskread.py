"""The host tier's cold path: ``O_DIRECT`` reads of checkpoint byte spans into aligned host buffers.

A read bypasses the page cache: it neither needs the file's pages to be resident nor leaves them
behind, so a model larger than host RAM streams from disk without the kernel caching what it read.

``O_DIRECT`` wants the file offset, the length and the memory address each a multiple of the
device's alignment. A span ``[offset, offset + nbytes)`` (a tensor's ``TensorInfo.start/end``) is
therefore read as its aligned superset ``[floor(offset), ceil(offset + nbytes))`` into a buffer of
``span_bytes(offset, nbytes)`` bytes that starts on an aligned address (``aligned_empty``), and the
view of exactly the span's bytes within it is returned. The file's last block may run past its end:
the short read there is expected; a short read that leaves any of the span's bytes unread means a
truncated file.

Alignment: 4096 bytes by default. That is a multiple of every logical block size met in practice
(512 and 4096; ``O_DIRECT``'s true requirement), and the page size, so that a buffer is also what a
DMA wants. ``os.statvfs().f_bsize`` is the filesystem's block size, not the device's requirement, so
it is not used; where Linux reports the requirement (``statx`` ``STATX_DIOALIGN``, Linux 6.1+,
``dio_alignment``) a larger one wins, and an ``alignment`` asked for (512, say, on a 512-byte
device) is checked against it.

``Reader`` keeps several reads in flight on a thread pool (``os.preadv`` releases the GIL); a large
span is cut into ``chunk``-sized pieces so that several threads fill one big buffer. Each
``DirectFile`` and ``Reader`` counts the bytes it read from disk (``bytes_read``: the aligned
supersets, less what lay past the file's end) and its ``preadv`` calls (``reads``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import struct
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Sequence

import torch

from kestrel_core.errors import CheckpointError, KestrelError

ALIGN = 4096
MIN_ALIGN = 512  # the smallest logical block size of a block device
CHUNK = 8 * 2**20  # the piece of a large span one thread reads
HAVE_O_DIRECT = hasattr(os, "O_DIRECT")
REFUSED = (
    "the filesystem refuses O_DIRECT (EINVAL; tmpfs before Linux 6.6, some overlay and FUSE mounts do); "
    "move the checkpoint to a disk filesystem such as ext4 or xfs, or read it through the page cache"
)

# struct statx (linux/stat.h): the mask at 0, stx_dio_mem_align and stx_dio_offset_align at 152 (u32 each).
_STATX_DIOALIGN = 0x2000
_AT_FDCWD = -100
_STATX_SIZE = 256
_DIO_OFFSET = 152


def _check_alignment(alignment: int) -> int:
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < MIN_ALIGN or alignment & (alignment - 1):
        raise KestrelError(f"O_DIRECT alignment must be a power of two >= {MIN_ALIGN} bytes, got {alignment!r}; use {ALIGN}")
    return alignment


def _floor(n: int, alignment: int) -> int:
    return n // alignment * alignment


def round_up(n: int, alignment: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``alignment`` (a page by default: where a DMA, and O_DIRECT, want a buffer)."""
    return -(-n // alignment) * alignment


def span_bytes(offset: int, nbytes: int, alignment: int = ALIGN) -> int:
    """The bytes a buffer needs to read ``[offset, offset + nbytes)``: its aligned superset (0 for an empty span)."""
    if nbytes <= 0:
        return 0
    return round_up(offset + nbytes, alignment) - _floor(offset, alignment)


def aligned_empty(nbytes: int, alignment: int = ALIGN, pin_memory: bool | None = False) -> torch.Tensor:
    """``nbytes`` of uninitialised host memory (torch.uint8) starting on a multiple of ``alignment``.

    ``pin_memory=True`` page-locks it, which needs torch with CUDA and a visible GPU (a CPU-only
    torch cannot pin); ``None`` pins where it can. A pinned block is allocated at its exact size
    first (cudaHostAlloc returns page-aligned memory, and torch's pinned allocator rounds a block up
    to a power of two, so over-allocating could double it); CPU memory is over-allocated by
    ``alignment`` and the aligned view returned (the view keeps the whole block alive).
    """
    _check_alignment(alignment)
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise KestrelError(f"aligned_empty needs a byte count >= 0, got {nbytes!r}")
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    elif pin_memory and not torch.cuda.is_available():
        raise KestrelError(
            "pin_memory=True needs torch with CUDA and a visible GPU (torch.cuda.is_available() is False); "
            "pass pin_memory=False (or None: pin where possible)"
        )
    if pin_memory:
        raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if raw.data_ptr() % alignment == 0:
            return raw
        del raw
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8, pin_memory=bool(pin_memory))
    skip = -raw.data_ptr() % alignment
    return raw[skip : skip + nbytes]


def dio_alignment(path: str | os.PathLike) -> int | None:
    """The alignment Linux reports for ``O_DIRECT`` on ``path`` (statx STATX_DIOALIGN, Linux 6.1+), or None.

    The larger of the memory and the file-offset alignment; None where the kernel, the C library or
    the filesystem does not report it (or reports that the file cannot do O_DIRECT at all: 0).
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        statx = libc.statx
    except (OSError, AttributeError):
        return None
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    if statx(_AT_FDCWD, os.fsencode(os.fspath(path)), 0, _STATX_DIOALIGN, buf) != 0:
        return None
    (mask,) = struct.unpack_from("<I", buf.raw, 0)
    if not mask & _STATX_DIOALIGN:
        return None
    mem, off = struct.unpack_from("<II", buf.raw, _DIO_OFFSET)
    return max(mem, off) or None


def cannot_open(path: Path, exc: OSError) -> CheckpointError:
    return CheckpointError(f"{path}: cannot open ({exc.strerror})")


def _probe_file(path: Path) -> bool:
    """Open ``path`` with O_DIRECT and read its first block; False where either is refused with EINVAL."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise CheckpointError(f"{path}: not a regular file; probe the checkpoint's file or its directory")
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise cannot_open(path, exc) from None
    try:
        alignment = max(ALIGN, dio_alignment(path) or 0)
        os.preadv(fd, [memoryview(aligned_empty(alignment, alignment).numpy())], 0)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise KestrelError(f"{path}: read at offset 0 failed ({exc.strerror}); check the disk") from None
    finally:
        os.close(fd)
    return True


def direct_io_supported(path: str | os.PathLike) -> bool:
    """Whether ``O_DIRECT`` reads work on ``path``'s filesystem, without raising where they do not.

    A file is opened and its first block read; a directory is probed through a regular file in it
    (a ``*.safetensors`` first), or a small temporary file written there when it has none. A path
    that cannot be opened at all (missing, no permission) still raises CheckpointError.
    """
    if not HAVE_O_DIRECT:
        return False
    path = Path(path)
    if not path.is_dir():
        return _probe_file(path)
    try:
        files = sorted(p for p in path.iterdir() if p.is_file())
    except OSError as exc:
        raise CheckpointError(f"cannot list {path} ({exc.strerror})") from None
    files.sort(key=lambda p: p.suffix != ".safetensors")
    if files:
        return _probe_file(files[0])
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".kestrel-odirect-") as tmp:
            tmp.write(b"\0" * ALIGN)
            tmp.flush()
            return _probe_file(Path(tmp.name))
    except OSError as exc:
        raise KestrelError(f"{path}: cannot write a probe file ({exc.strerror}); pass a file in the directory instead") from None


class DirectFile:
    """One file opened with ``O_DIRECT | O_RDONLY``: aligned span reads that bypass the page cache.

    ``alignment`` (default ``ALIGN``; 512 where the device's logical blocks are 512 bytes) applies
    to offsets, lengths and buffer addresses alike; one smaller than the kernel reports
    (``dio_alignment``) is refused. ``bytes_read`` and ``reads`` count what every read of this file
    took from disk; reads from several threads at once are safe (each is positional).
    """

    def __init__(self, path: str | os.PathLike, alignment: int | None = None):
        self.path = Path(path)
        if not HAVE_O_DIRECT:
            raise KestrelError(f"{self.path}: this platform has no O_DIRECT; read the checkpoint through the page cache")
        try:
            st = os.stat(self.path)
        except OSError as exc:
            raise cannot_open(self.path, exc) from None
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{self.path}: not a regular file; replace it with the safetensors file")
        reported = dio_alignment(self.path)
        if alignment is None:
            alignment = max(ALIGN, reported or 0)
        elif reported and _check_alignment(alignment) < reported:
            raise KestrelError(
                f"{self.path}: O_DIRECT on this device needs {reported}-byte alignment, not {alignment}; "
                f"pass alignment={reported} or leave it out"
            )
        self.alignment = _check_alignment(alignment)
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                raise KestrelError(f"{self.path}: {REFUSED}") from None
            raise cannot_open(self.path, exc) from None
        self.size = os.fstat(self.fd).st_size
        self.bytes_read = 0
        self.reads = 0
        self._lock = threading.Lock()

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def span_bytes(self, offset: int, nbytes: int) -> int:
        """The size of buffer ``read_span`` needs for ``[offset, offset + nbytes)`` at this file's alignment."""
        return span_bytes(offset, nbytes, self.alignment)

    def _slot(self, dst: torch.Tensor, offset: int, nbytes: int) -> tuple[torch.Tensor, int]:
        """``dst`` flattened, after checking it can take the span's aligned superset; and that superset's start."""
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise KestrelError(f"{self.path}: a read needs a file offset >= 0, got {offset!r}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise KestrelError(f"{self.path}: a read needs a byte count >= 0, got {nbytes!r}")
        if not isinstance(dst, torch.Tensor) or dst.dtype != torch.uint8 or dst.device.type != "cpu" or not dst.is_contiguous():
            what = f"{dst.dtype} on {dst.device}" if isinstance(dst, torch.Tensor) else type(dst).__name__
            raise KestrelError(
                f"an O_DIRECT read needs a contiguous torch.uint8 CPU tensor, got {what}; allocate it with aligned_empty()"
            )
        if dst.data_ptr() % self.alignment:
            raise KestrelError(
                f"the buffer starts at address {dst.data_ptr():#x}, not a multiple of {self.alignment} bytes as O_DIRECT "
                f"needs; allocate it with aligned_empty(nbytes, {self.alignment})"
            )
        need = self.span_bytes(offset, nbytes)
        if dst.numel() < need:
            raise KestrelError(
                f"the buffer holds {dst.numel()} bytes but reading [{offset}, {offset + nbytes}) needs {need} "
                f"(its {self.alignment}-aligned superset); size it with span_bytes({offset}, {nbytes})"
            )
        return dst.view(-1), _floor(offset, self.alignment)

    def _read_piece(self, buf: memoryview, base: int, lo: int, hi: int, need: int, also: Reader | None = None) -> int:
        """Read file bytes ``[lo, hi)`` (aligned) into ``buf[lo - base : hi - base]``; those below ``need`` must come.

        A read that stops short on an unaligned count, or returns nothing, has met the file's end.
        Returns the bytes read; they count on this file and on ``also`` (a Reader), if given.
        """
        at = lo
        calls = 0
        try:
            while at < hi:
                try:
                    got = os.preadv(self.fd, [buf[at - base : hi - base]], at)
                except OSError as exc:
                    if exc.errno == errno.EINVAL:
                        raise KestrelError(
                            f"{self.path}: O_DIRECT read at offset {at} refused (EINVAL): the device needs a larger "
                            f"alignment than {self.alignment} bytes; leave alignment out (the default is {ALIGN})"
                        ) from None
                    raise KestrelError(f"{self.path}: read at offset {at} failed ({exc.strerror}); check the disk") from None
                calls += 1
                at += got
                if got == 0 or at % self.alignment:
                    break
        finally:
            for counter in (self, also) if also is not None else (self,):
                with counter._lock:
                    counter.bytes_read += at - lo
                    counter.reads += calls
        if at < need:
            raise CheckpointError(
                f"{self.path}: truncated file: a read at offset {lo} needs bytes up to {need} but the file ends at "
                f"byte {at}; re-download or re-create it"
            )
        return at - lo

    def _pieces(self, offset: int, nbytes: int, chunk: int) -> list[tuple[int, int, int]]:
        """The aligned superset of a span cut into ``(lo, hi, need)`` pieces of at most ``chunk`` bytes."""
        if nbytes == 0:
            return []
        start, end = _floor(offset, self.alignment), round_up(offset + nbytes, self.alignment)
        want = offset + nbytes
        return [(lo, min(lo + chunk, end), min(lo + chunk, want)) for lo in range(start, end, chunk)]

    def read_span(self, dst: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
        """Read file bytes ``[offset, offset + nbytes)`` into ``dst``; the view of exactly those bytes within it.

        ``dst``: a contiguous torch.uint8 CPU tensor starting on an aligned address, of at least
        ``span_bytes(offset, nbytes)`` bytes (``aligned_empty``). Raises CheckpointError where the
        file ends before ``offset + nbytes``.
        """
        flat, start = self._slot(dst, offset, nbytes)
        if nbytes:
            buf = memoryview(flat.numpy())
            for lo, hi, need in self._pieces(offset, nbytes, round_up(CHUNK, self.alignment)):
                self._read_piece(buf, start, lo, hi, need)
        return flat[offset - start : offset - start + nbytes]


class PendingReads:
    """Reads in flight on a ``Reader``; ``result()`` waits for them all and returns each span's view."""

    def __init__(self, futures: list[Future], views: list[torch.Tensor]):
        self._futures = futures
        self._views = views

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def result(self) -> list[torch.Tensor]:
        """Each span's view, in order; the first failure is raised once every piece has stopped writing."""
        wait(self._futures)
        for f in self._futures:
            f.result()
        return self._views


class Reader:
    """Several ``O_DIRECT`` reads in flight on ``threads`` threads, each span cut into ``chunk``-byte pieces.

    ``submit`` starts reading spans into their slots and returns at once; ``read_spans`` waits too.
    ``bytes_read`` and ``reads`` count this reader's reads (every file's own counters count them as well).
    """

    def __init__(self, threads: int = 4, chunk: int = CHUNK):
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise KestrelError(f"a reader needs threads >= 1, got {threads!r}")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < MIN_ALIGN or chunk % MIN_ALIGN:
            raise KestrelError(f"a reader's chunk must be a positive multiple of {MIN_ALIGN} bytes, got {chunk!r}; use {CHUNK}")
        self.threads, self.chunk = threads, chunk
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kestrel-diskread") if threads > 1 else None
        self.bytes_read = 0
        self.reads = 0
        self._lock = threading.Lock()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _run(self, file: DirectFile, buf: memoryview, base: int, lo: int, hi: int, need: int) -> None:
        file._read_piece(buf, base, lo, hi, need, also=self)

    def submit(self, file: DirectFile, dsts: Sequence[torch.Tensor], spans: Sequence[tuple[int, int]]) -> PendingReads:
        """Start reading each ``(offset, nbytes)`` of ``spans`` into its ``dsts`` slot (as ``DirectFile.read_span``)."""
        if len(dsts) != len(spans):
            raise KestrelError(f"read_spans got {len(dsts)} buffers for {len(spans)} spans; pass one buffer a span")
        chunk = round_up(self.chunk, file.alignment)
        work, views = [], []
        for dst, (offset, nbytes) in zip(dsts, spans):
            flat, start = file._slot(dst, offset, nbytes)
            views.append(flat[offset - start : offset - start + nbytes])
            if nbytes:
                buf = memoryview(flat.numpy())
                work += [(buf, start, *piece) for piece in file._pieces(offset, nbytes, chunk)]
        futures: list[Future] = []
        for args in work:
            if self._pool is None:
                f: Future = Future()
                try:
                    self._run(file, *args)
                    f.set_result(None)
                except BaseException as exc:  # kept for result(), as a pool's future keeps it
                    f.set_exception(exc)
                futures.append(f)
            else:
                futures.append(self._pool.submit(self._run, file, *args))
        return PendingReads(futures, views)

    def read_spans(self, file: DirectFile, dsts: Sequence[torch.Tensor], spans: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
        """Read every span into its slot concurrently; each span's view, in order."""
        return self.submit(file, dsts, spans).result()


def read_spans(
    file: DirectFile, dsts: Sequence[torch.Tensor], spans: Sequence[tuple[int, int]], threads: int = 4, chunk: int = CHUNK
) -> list[torch.Tensor]:
    """``Reader(threads, chunk).read_spans(file, dsts, spans)`` on a pool made for this one call."""
    with Reader(threads, chunk) as reader:
        return reader.read_spans(file, dsts, spans)


def sequential_read_rate(
    path: str | os.PathLike, nbytes: int | None = None, threads: int = 4, chunk: int = CHUNK
) -> float:
    """Bytes a second that ``O_DIRECT`` reads of ``path`` deliver: its first ``nbytes`` (default the whole file),
    read in ``chunk``-byte pieces in file order with ``threads`` reads in flight, each thread into its own buffer.

    The disk ceiling for the cold path, measured on the checkpoint's own filesystem (on tmpfs it
    measures memory instead: there O_DIRECT is a plain copy).
    """
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise KestrelError(f"sequential_read_rate needs threads >= 1, got {threads!r}")
    with DirectFile(path) as f:
        total = f.size if nbytes is None else min(nbytes, f.size)
        if total <= 0:
            raise KestrelError(f"{f.path}: nothing to read ({f.size} bytes in the file, nbytes={nbytes}); pass a non-empty file")
        chunk = round_up(max(chunk, f.alignment), f.alignment)
        pieces = f._pieces(0, total, chunk)
        errors: list[BaseException] = []

        def worker(mine: list[tuple[int, int, int]]) -> None:
            buf = memoryview(aligned_empty(chunk, f.alignment).numpy())
            try:
                for lo, hi, need in mine:
                    f._read_piece(buf, lo, lo, hi, need)
            except BaseException as exc:  # re-raised in the caller
                errors.append(exc)

        workers = [threading.Thread(target=worker, args=(pieces[i::threads],)) for i in range(min(threads, len(pieces)))]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        elapsed = time.perf_counter() - t0
        if errors:
            raise errors[0]
        return f.bytes_read / max(elapsed, 1e-9)
