"""The cold-path reader (kestrel_core/diskread.py): O_DIRECT span reads equal the mapping's bytes exactly.

Every tensor of a float32 tiny checkpoint is read alone and concurrently, spans are cut unaligned at
both ends, the file's last tensor ends inside its last block, and a truncated file, a misaligned or
small buffer and a filesystem that refuses O_DIRECT each give one clear line.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
from pathlib import Path

import pytest
import torch

from backends.cuda.host import diskread
from kestrel_core.formats.checkpoint import Checkpoint
from backends.cuda.host.diskread import (
    ALIGN,
    DirectFile,
    Reader,
    aligned_empty,
    direct_io_supported,
    read_spans,
    sequential_read_rate,
    span_bytes,
)
from kestrel_core.errors import CheckpointError, KestrelError
from kestrel_core.tools.presets import preset_config, write_checkpoint


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory) -> Path:
    out = write_checkpoint(preset_config("tiny", "float32"), tmp_path_factory.mktemp("diskread") / "tiny")
    if not direct_io_supported(out):
        pytest.skip(f"the filesystem of {out} refuses O_DIRECT")
    return out


@pytest.fixture(scope="module")
def ckpt(ckpt_dir):
    c = Checkpoint(ckpt_dir)
    yield c
    c.close()


@pytest.fixture
def dfile(ckpt_dir):
    with DirectFile(ckpt_dir / "model.safetensors") as f:
        yield f


def mapped_bytes(ckpt: Checkpoint, name: str) -> torch.Tensor:
    return ckpt.view(name).reshape(-1).view(torch.uint8)


def infos(ckpt: Checkpoint):
    return sorted((ckpt.info(n) for n in ckpt.names()), key=lambda i: i.start)


def disk_bytes(size: int, spans) -> int:
    """What reading ``spans`` takes from disk: each aligned superset, clipped at the file's end."""
    return sum(min(-(-(o + n) // ALIGN) * ALIGN, size) - o // ALIGN * ALIGN for o, n in spans if n)


def test_span_bytes():
    assert span_bytes(0, 1) == ALIGN
    assert span_bytes(0, ALIGN) == ALIGN
    assert span_bytes(1, ALIGN) == 2 * ALIGN
    assert span_bytes(ALIGN - 1, 2) == 2 * ALIGN
    assert span_bytes(5, 0) == 0
    assert span_bytes(513, 10, alignment=512) == 512


def test_aligned_empty():
    for n in (0, 1, 4096, 10_000):
        t = aligned_empty(n)
        assert t.dtype == torch.uint8 and t.numel() == n and t.data_ptr() % ALIGN == 0
    assert aligned_empty(100, 512).data_ptr() % 512 == 0
    with pytest.raises(KestrelError, match="power of two"):
        aligned_empty(10, 1000)
    if torch.cuda.is_available():
        t = aligned_empty(10_000, pin_memory=True)
        assert t.is_pinned() and t.data_ptr() % ALIGN == 0
    else:
        with pytest.raises(KestrelError, match="pin_memory=False") as exc:
            aligned_empty(10, pin_memory=True)
        assert "\n" not in str(exc.value)
        assert not aligned_empty(10, pin_memory=None).is_pinned()


def test_read_span_every_tensor(ckpt, dfile):
    spans = []
    for info in infos(ckpt):
        dst = aligned_empty(dfile.span_bytes(info.start, info.nbytes))
        got = dfile.read_span(dst, info.start, info.nbytes)
        assert torch.equal(got, mapped_bytes(ckpt, info.name)), info.name
        assert got.data_ptr() == dst.data_ptr() + info.start % ALIGN  # a view into dst, not a copy
        spans.append((info.start, info.nbytes))
    assert dfile.bytes_read == disk_bytes(dfile.size, spans)


def test_last_tensor_ends_inside_the_last_block(ckpt, dfile):
    last = infos(ckpt)[-1]
    assert last.end == dfile.size and dfile.size % ALIGN  # the block runs past the end: a short read
    got = dfile.read_span(aligned_empty(dfile.span_bytes(last.start, last.nbytes)), last.start, last.nbytes)
    assert torch.equal(got, mapped_bytes(ckpt, last.name))
    assert dfile.bytes_read == dfile.size - last.start // ALIGN * ALIGN


def test_unaligned_spans_at_both_ends(ckpt_dir, dfile):
    raw = (ckpt_dir / "model.safetensors").read_bytes()
    size = len(raw)
    rng = random.Random(0)
    spans = [(1, 1), (ALIGN - 1, 2), (ALIGN - 3, ALIGN + 7), (0, size), (size - 1, 1), (size - ALIGN - 5, ALIGN + 5)]
    spans += [(o, rng.randrange(1, min(size - o, 3 * ALIGN) + 1)) for o in (rng.randrange(size - 1) for _ in range(40))]
    for offset, nbytes in spans:
        got = dfile.read_span(aligned_empty(span_bytes(offset, nbytes)), offset, nbytes)
        assert bytes(got.numpy()) == raw[offset : offset + nbytes], (offset, nbytes)
    assert dfile.read_span(aligned_empty(0), 17, 0).numel() == 0
    # a buffer larger than the span is fine; only its front is written
    big = aligned_empty(span_bytes(5, 10) + 3 * ALIGN)
    assert bytes(dfile.read_span(big, 5, 10).numpy()) == raw[5:15]


def test_concurrent_reads_share_one_buffer(ckpt, dfile):
    """Every tensor into its slot of one aligned buffer, big spans cut into pieces that several threads read."""
    items = infos(ckpt)
    spans = [(i.start, i.nbytes) for i in items]
    sizes = [dfile.span_bytes(o, n) for o, n in spans]
    slab = aligned_empty(sum(sizes))
    slots, at = [], 0
    for n in sizes:
        slots.append(slab[at : at + n])
        at += n
    with Reader(threads=4, chunk=2 * ALIGN) as reader:
        views = reader.read_spans(dfile, slots, spans)
        assert reader.bytes_read == disk_bytes(dfile.size, spans) == dfile.bytes_read
        assert reader.reads >= sum(-(-n // (2 * ALIGN)) for n in sizes) > len(spans)  # pieces, not spans
    for info, view in zip(items, views):
        assert torch.equal(view, mapped_bytes(ckpt, info.name)), info.name
    # the same through submit (reads in flight while the caller goes on), one thread, and the module helper
    with Reader(threads=1) as reader:
        pending = reader.submit(dfile, [aligned_empty(n) for n in sizes], spans)
        assert pending.done()
        assert all(torch.equal(v, mapped_bytes(ckpt, i.name)) for i, v in zip(items, pending.result()))
    got = read_spans(dfile, [aligned_empty(n) for n in sizes], spans, threads=3)
    assert all(torch.equal(v, mapped_bytes(ckpt, i.name)) for i, v in zip(items, got))
    with pytest.raises(KestrelError, match="one buffer a span"):
        read_spans(dfile, [aligned_empty(sizes[0])], spans[:2])


def test_alignment_512(ckpt, ckpt_dir):
    path = ckpt_dir / "model.safetensors"
    reported = diskread.dio_alignment(path)
    if reported and reported > 512:
        with pytest.raises(KestrelError, match=f"needs {reported}-byte alignment"):
            DirectFile(path, alignment=512)
        return
    with DirectFile(path, alignment=512) as f:
        assert f.alignment == 512
        for info in infos(ckpt)[:8]:
            dst = aligned_empty(f.span_bytes(info.start, info.nbytes), 512)
            assert torch.equal(f.read_span(dst, info.start, info.nbytes), mapped_bytes(ckpt, info.name))


def test_truncated_file(ckpt, ckpt_dir, tmp_path):
    path = Path(shutil.copy(ckpt_dir / "model.safetensors", tmp_path / "model.safetensors"))
    items = infos(ckpt)
    first, last = items[0], items[-1]
    os.truncate(path, first.start + first.nbytes // 2)
    with DirectFile(path) as f:
        # the tail of the file is gone: the last tensor's read stops short far from its end
        with pytest.raises(CheckpointError, match="truncated file") as exc:
            f.read_span(aligned_empty(f.span_bytes(last.start, last.nbytes)), last.start, last.nbytes)
        msg = str(exc.value)
        assert str(path) in msg and f"offset {last.start // ALIGN * ALIGN}" in msg and "\n" not in msg
        # a short read inside a span, on a reader's thread, comes back from result()
        with Reader(threads=4, chunk=ALIGN) as reader:
            with pytest.raises(CheckpointError, match="truncated file") as exc:
                reader.read_spans(f, [aligned_empty(f.span_bytes(first.start, first.nbytes))], [(first.start, first.nbytes)])
        assert str(path) in str(exc.value)
        # what lies before the cut still reads
        half = first.nbytes // 2
        got = f.read_span(aligned_empty(f.span_bytes(first.start, half)), first.start, half)
        assert torch.equal(got, mapped_bytes(ckpt, first.name)[:half])


def test_bad_buffers_are_refused(dfile):
    offset, nbytes = 100, 5000
    need = span_bytes(offset, nbytes)
    with pytest.raises(KestrelError, match="aligned_empty") as exc:
        dfile.read_span(aligned_empty(need + 1)[1:], offset, nbytes)
    assert "not a multiple of 4096" in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(KestrelError, match=rf"needs {need}.*span_bytes\(100, 5000\)"):
        dfile.read_span(aligned_empty(need - ALIGN), offset, nbytes)
    with pytest.raises(KestrelError, match="contiguous torch.uint8 CPU tensor"):
        dfile.read_span(aligned_empty(need).view(torch.int32), offset, nbytes)
    with pytest.raises(KestrelError, match="offset >= 0"):
        dfile.read_span(aligned_empty(need), -1, nbytes)
    with pytest.raises(KestrelError, match="power of two"):
        DirectFile(dfile.path, alignment=1000)


def test_open_errors(tmp_path):
    with pytest.raises(CheckpointError, match="cannot open"):
        DirectFile(tmp_path / "missing.safetensors")
    with pytest.raises(CheckpointError, match="not a regular file"):
        DirectFile(tmp_path)


def refusing_file() -> Path:
    """A regular file on a filesystem that refuses O_DIRECT: /dev/shm where tmpfs lacks it (Linux < 6.6), else procfs."""
    if Path("/dev/shm").is_dir():
        probe = Path("/dev/shm") / f"kestrel-diskread-{os.getpid()}"
        probe.write_bytes(b"\0" * 100)
        try:
            if not direct_io_supported(probe):
                return probe
        except KestrelError:
            pass
        probe.unlink()
    proc = Path("/proc/self/status")
    if proc.is_file() and not direct_io_supported(proc):
        return proc
    pytest.skip("no filesystem here refuses O_DIRECT (tmpfs has taken it since Linux 6.6)")


def test_refusal_is_one_line():
    path = refusing_file()
    try:
        with pytest.raises(KestrelError, match="refuses O_DIRECT") as exc:
            DirectFile(path)
        assert str(path) in str(exc.value) and "\n" not in str(exc.value)
        assert not isinstance(exc.value, CheckpointError)  # the file is fine; the filesystem is the problem
    finally:
        if path.parent == Path("/dev/shm"):
            path.unlink()


def test_refusal_where_open_gives_einval(dfile, monkeypatch):
    """The same message wherever the kernel says EINVAL to O_DIRECT, and the probe answers False there."""
    real_open = os.open

    def fake_open(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(diskread.os, "open", fake_open)
    assert direct_io_supported(dfile.path) is False
    assert direct_io_supported(dfile.path.parent) is False
    with pytest.raises(KestrelError, match="refuses O_DIRECT") as exc:
        DirectFile(dfile.path)
    assert "\n" not in str(exc.value) and str(dfile.path) in str(exc.value)


def test_direct_io_supported_probes_an_empty_directory(ckpt_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert direct_io_supported(empty) is True and not any(empty.iterdir())  # the probe file is gone again
    with pytest.raises(CheckpointError, match="cannot open"):
        direct_io_supported(tmp_path / "missing")


def test_sequential_read_rate(ckpt_dir):
    path = ckpt_dir / "model.safetensors"
    rate = sequential_read_rate(path, threads=2, chunk=64 * 1024)
    assert rate > 0 and isinstance(rate, float)
    assert sequential_read_rate(path, nbytes=10_000, threads=4) > 0
    with pytest.raises(KestrelError, match="threads >= 1"):
        sequential_read_rate(path, threads=0)
