"""Safetensors checkpoints read through mmap: zero-copy tensor views and per-tensor page spans.

Layout of one file: 8-byte little-endian header length N, N bytes of JSON header,
then the data region; each tensor's ``data_offsets`` are relative to that region.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import warnings
from pathlib import Path

import attrs
import numpy as np
import torch

from .errors import CheckpointError

PAGE = mmap.PAGESIZE
# Largest header the reference implementation accepts (100 MB); bigger means a lying length.
MAX_HEADER = 100_000_000

# safetensors dtype -> (numpy storage dtype, torch dtype, itemsize)
DTYPES = {
    "F64": (np.float64, torch.float64, 8),
    "F32": (np.float32, torch.float32, 4),
    "F16": (np.float16, torch.float16, 2),
    "BF16": (np.uint16, torch.bfloat16, 2),
    "I64": (np.int64, torch.int64, 8),
    "I32": (np.int32, torch.int32, 4),
    "I16": (np.int16, torch.int16, 2),
    "I8": (np.int8, torch.int8, 1),
    "U8": (np.uint8, torch.uint8, 1),
    "BOOL": (np.bool_, torch.bool, 1),
}
FLOAT_DTYPES = ("F32", "F16", "BF16")
TORCH_TO_ST = {v[1]: k for k, v in DTYPES.items()}


@attrs.frozen
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class SafetensorsFile:
    """One mmap'd safetensors file, validated on open."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot open ({exc.strerror})") from None
        try:
            size = os.fstat(fd).st_size
            if size < 8:
                raise CheckpointError(f"{self.path}: truncated ({size} bytes, no header); re-download or re-create it")
            self.size = size
            self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self.metadata: dict[str, str] = {}
        self.tensors: dict[str, TensorInfo] = self._parse_header()

    def _parse_header(self) -> dict[str, TensorInfo]:
        (n,) = struct.unpack("<Q", self._mm[:8])
        if n > MAX_HEADER or 8 + n > self.size:
            raise CheckpointError(
                f"{self.path}: header claims {n} bytes but the file has {self.size}; "
                "the file is truncated or corrupt: re-download or re-create it"
            )
        try:
            header = json.loads(bytes(self._mm[8 : 8 + n]))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            why = exc.msg if isinstance(exc, json.JSONDecodeError) else exc.reason  # UnicodeDecodeError has no .msg
            raise CheckpointError(f"{self.path}: header is not valid JSON ({why}); the file is corrupt") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: header is not a JSON object; the file is corrupt")
        base = 8 + n
        out: dict[str, TensorInfo] = {}
        for name, spec in header.items():
            if name == "__metadata__":
                self.metadata = dict(spec or {})
                continue
            try:
                dtype, shape, (lo, hi) = spec["dtype"], tuple(spec["shape"]), spec["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{self.path}: header entry for {name!r} is malformed; the file is corrupt") from None
            if not (all(isinstance(d, int) and d >= 0 for d in shape) and isinstance(lo, int) and isinstance(hi, int)):
                raise CheckpointError(f"{self.path}: header entry for {name!r} is malformed; the file is corrupt")
            if dtype not in DTYPES:
                raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {dtype!r}")
            want = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype][2]
            if hi - lo != want or lo < 0:
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} spans {hi - lo} bytes but shape {list(shape)} of {dtype} needs {want}; the file is corrupt"
                )
            if base + hi > self.size:
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} ends at byte {base + hi} but the file has {self.size}; "
                    "the file is truncated: re-download or re-create it"
                )
            out[name] = TensorInfo(name, dtype, shape, base + lo, base + hi)
        return out

    def view(self, info: TensorInfo) -> torch.Tensor:
        """A zero-copy, read-only tensor over the mapping (touching it faults the pages in)."""
        np_dtype, torch_dtype, item = DTYPES[info.dtype]
        arr = np.frombuffer(self._mm, dtype=np_dtype, count=info.nbytes // item, offset=info.start)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we never write through it
            t = torch.from_numpy(arr)
        if info.dtype == "BF16":
            t = t.view(torch.bfloat16)
        return t.reshape(info.shape)

    def drop_pages(self, spans: list[tuple[int, int]]) -> None:
        """madvise(MADV_DONTNEED) on whole pages inside each span; the next touch reads them back."""
        for lo, hi in spans:
            start = -(-lo // PAGE) * PAGE
            stop = (hi // PAGE) * PAGE
            if stop > start:
                self._mm.madvise(mmap.MADV_DONTNEED, start, stop - start)

    def close(self) -> None:
        try:
            self._mm.close()
        except BufferError:
            pass  # views still alive; the mapping closes when they go


def merge_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


class Checkpoint:
    """All safetensors files of a Hugging Face model directory (one file or an indexed shard set)."""

    def __init__(self, model_dir: Path):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise CheckpointError(f"{index}: not a valid index (needs a 'weight_map' object)") from None
            if not (isinstance(weight_map, dict) and all(isinstance(f, str) for f in weight_map.values())):
                raise CheckpointError(f"{index}: not a valid index ('weight_map' must map tensor names to file names)")
            names = sorted(set(weight_map.values()))
        else:
            names = sorted(p.name for p in self.dir.glob("*.safetensors"))
            weight_map = None
        if not names:
            raise CheckpointError(f"{self.dir}: no *.safetensors files (make one with: kestrel make-model --preset tiny --out DIR)")
        self.files = {n: SafetensorsFile(self.dir / n) for n in names}
        self._where: dict[str, SafetensorsFile] = {}
        for f in self.files.values():
            for t in f.tensors:
                self._where[t] = f
        if weight_map is not None:
            for t, fname in weight_map.items():
                if t not in self._where:
                    raise CheckpointError(f"{index}: maps {t!r} to {fname} but that file has no such tensor; the shard set is incomplete")
        self.metadata = {k: v for f in self.files.values() for k, v in f.metadata.items()}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._where[name].tensors[name]
        except KeyError:
            raise CheckpointError(
                f"{self.dir}: missing tensor {name!r}; the checkpoint is incomplete or of another architecture"
            ) from None

    def view(self, name: str) -> torch.Tensor:
        return self._where[name].view(self.info(name))

    def file_of(self, name: str) -> SafetensorsFile:
        self.info(name)
        return self._where[name]

    def drop_pages(self, names: list[str]) -> None:
        by_file: dict[SafetensorsFile, list[tuple[int, int]]] = {}
        for n in names:
            info = self.info(n)
            by_file.setdefault(self._where[n], []).append((info.start, info.end))
        for f, spans in by_file.items():
            f.drop_pages(merge_spans(spans))

    def mapping_rss(self) -> int:
        """Resident bytes of this checkpoint's mappings, read from /proc/self/smaps."""
        return mapping_rss([str(f.path.resolve()) for f in self.files.values()])

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def mapping_rss(paths: list[str]) -> int:
    wanted = set(paths)
    total = 0
    current = False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):
                parts = line.split()
                current = len(parts) >= 6 and parts[5] in wanted
            elif current and first == "Rss:":
                total += int(line.split()[1]) * 1024
    return total
