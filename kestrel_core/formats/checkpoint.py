"""Safetensors checkpoints read through mmap: zero-copy tensor views and per-tensor page spans.

Layout of one file: 8-byte little-endian header length N, N bytes of JSON header,
then the data region; each tensor's ``data_offsets`` are relative to that region.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
import warnings
from collections.abc import Iterable
from pathlib import Path

import attrs
import numpy as np
import torch

from kestrel_core.formats.dtypes import BY_NAME, BY_ST, WEIGHT_NAMES
from kestrel_core.io.mapped import PAGE, MappedFile
from kestrel_core.errors import CheckpointError
from kestrel_core.io.json_keys import TOO_MANY_DIGITS, RepeatedKey, unique_keys
from kestrel_core.formats.modelconfig import is_int, read_json, shown

FAULT_GRANULE = 2 * 2**20  # the most one read fault maps of a file: a PMD-sized page-cache folio
# Largest header the reference implementation accepts (100 MB); bigger means a lying length.
MAX_HEADER = 100_000_000
INDEX = "model.safetensors.index.json"
CORRUPT = "the file is corrupt: re-download or re-create it"

# safetensors dtype -> (numpy storage dtype, torch dtype, itemsize): views of the one table in dtypes.py
DTYPES = {d.st: (d.numpy, d.torch, d.itemsize) for d in BY_ST.values()}
FLOAT_DTYPES = tuple(BY_NAME[n].st for n in WEIGHT_NAMES)
TORCH_TO_ST = {d.torch: d.st for d in BY_ST.values()}

# The fused 3-D expert layout of transformers v5 (its Qwen3MoeExperts holds two stacked parameters):
#   model.layers.N.mlp.experts.gate_up_proj  [E, 2*I, H]: expert e's gate_proj is rows 0..I-1 of [e], up_proj rows I..2I-1
#   model.layers.N.mlp.experts.down_proj     [E, H, I]:   expert e's down_proj is [e]
# Each slice is [out, in]: transformers computes F.linear(x, gate_up_proj[e]).chunk(2, dim=-1) (x @ W.T)
# and F.linear(h, down_proj[e]), and its conversion mapping stacks the per-expert weights (dim 0) and
# concatenates gate before up (dim 1). Checked on transformers 5.17: its Qwen3MoeExperts parameters have
# these shapes, it loads such a file with the per-expert file's logits, and its save_pretrained writes
# the per-expert layout (the fused one comes from a saved state dict). The transposed [E, H, 2I] that
# some other models store is not read.
FUSED_GATE_UP = "model.layers.{layer}.mlp.experts.gate_up_proj"
FUSED_DOWN = "model.layers.{layer}.mlp.experts.down_proj"
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_PER_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


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

    @property
    def raw(self) -> bool:
        """The stored bytes are exactly the view's (always, in safetensors; not for a GGUF's quantized tensor)."""
        return True


class SafetensorsFile(MappedFile):
    """One mmap'd safetensors file, validated on open."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            # O_NONBLOCK: opening a FIFO must not hang; it is refused below as not a regular file.
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot open ({exc.strerror})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{self.path}: not a regular file; replace it with the safetensors file")
            size = st.st_size
            if size < 8:
                raise CheckpointError(f"{self.path}: truncated ({size} bytes, no header); re-download or re-create it")
            self.size = size
            super().__init__(self.path, fd)
        finally:
            os.close(fd)
        self.metadata: dict[str, str] = {}
        self.tensors: dict[str, TensorInfo] = self._parse_header()

    def _fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {what}; {CORRUPT}")

    def _parse_header(self) -> dict[str, TensorInfo]:
        (n,) = struct.unpack("<Q", self._mm[:8])
        if n > MAX_HEADER:  # not a truncation: no safetensors writer makes a header this large
            raise CheckpointError(f"{self.path}: header length {n:,} exceeds the {MAX_HEADER // 10**6} MB limit of the "
                                  f"safetensors format; {CORRUPT}")
        if 8 + n > self.size:
            raise CheckpointError(
                f"{self.path}: header claims {n} bytes but the file has {self.size}; "
                "the file is truncated or corrupt: re-download or re-create it"
            )
        try:
            header = json.loads(bytes(self._mm[8 : 8 + n]), object_pairs_hook=unique_keys)
        except RepeatedKey as exc:
            raise self._fail(f"header defines {exc.args[0]!r} twice") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            why = exc.msg if isinstance(exc, json.JSONDecodeError) else exc.reason  # UnicodeDecodeError has no .msg
            raise CheckpointError(f"{self.path}: header is not valid JSON ({why}); the file is corrupt") from None
        except ValueError:  # an integer past Python's 4300 digits
            raise CheckpointError(f"{self.path}: header holds {TOO_MANY_DIGITS}; the file is corrupt") from None
        except RecursionError:
            raise CheckpointError(f"{self.path}: header is not valid JSON (nested too deeply); the file is corrupt") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: header is not a JSON object; the file is corrupt")
        base = 8 + n
        out: dict[str, TensorInfo] = {}
        for name, spec in header.items():
            if name == "__metadata__":
                self.metadata = self._parse_metadata(spec)
            else:
                out[name] = self._parse_entry(name, spec, base)
        self._check_disjoint(out.values(), base)
        return out

    def _parse_metadata(self, spec) -> dict[str, str]:
        # The format says str -> str (the safetensors library refuses anything else); null is no metadata.
        if spec is None:
            return {}
        if not isinstance(spec, dict):
            raise self._fail(f"__metadata__ is {shown(spec)}, not a JSON object of strings")
        for key, value in spec.items():
            if not isinstance(value, str):
                raise self._fail(f"__metadata__[{key!r}] is {shown(value)}, not a string")
        return spec

    def _parse_entry(self, name: str, spec, base: int) -> TensorInfo:
        try:
            dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
        except (KeyError, TypeError):
            raise self._fail(f"header entry for {name!r} is malformed (needs dtype, shape, data_offsets)") from None
        # int64 like the format; bool is an int subclass in Python but not a JSON integer.
        if not (isinstance(shape, list) and all(is_int(d) and 0 <= d < 2**63 for d in shape)):
            raise self._fail(f"header entry for {name!r} is malformed (shape {shown(shape)} is not a list of non-negative int64 sizes)")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(o) for o in offsets)):
            raise self._fail(f"header entry for {name!r} is malformed (data_offsets {shown(offsets)} is not two integers)")
        if not (isinstance(dtype, str) and dtype in DTYPES):
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {shown(dtype)}; supported: {', '.join(DTYPES)}")
        lo, hi = offsets
        if lo < 0 or hi < lo:
            raise self._fail(f"tensor {name!r} has data_offsets {offsets}: they must satisfy 0 <= start <= end")
        want = math.prod(shape) * DTYPES[dtype][2]  # exact: numpy's int64 product wraps on huge dims
        if hi - lo != want:
            raise self._fail(f"tensor {name!r} spans {hi - lo} bytes but shape {shape} of {dtype} needs {want}")
        if base + hi > self.size:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} ends at byte {base + hi} but the file has {self.size}; "
                "the file is truncated: re-download or re-create it"
            )
        return TensorInfo(name, dtype, tuple(shape), base + lo, base + hi)

    def _check_disjoint(self, infos, base: int) -> None:
        """Two tensors over the same bytes (overlap or alias) mean a corrupt or hand-edited header."""
        prev = None
        for info in sorted((i for i in infos if i.nbytes), key=lambda i: (i.start, i.end)):
            if prev is not None and info.start < prev.end:
                how = "alias the same bytes" if (info.start, info.end) == (prev.start, prev.end) else "overlap"
                raise self._fail(
                    f"tensors {prev.name!r} (data_offsets [{prev.start - base}, {prev.end - base}]) and "
                    f"{info.name!r} ([{info.start - base}, {info.end - base}]) {how}"
                )
            if prev is None or info.end > prev.end:
                prev = info

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


def merge_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


class GranuleIndex:
    """Which tensors of one file overlap each ``granule``-sized stretch of it, built once: the tensors to keep around a
    drop are then found among those of the stretches dropped, not by a pass over every kept tensor (a Mixture-of-Experts
    model keeps thousands, and a drop comes with every expert's fill and eviction)."""

    def __init__(self, spans: Iterable[tuple[str, int, int]], granule: int):
        self.granule = granule
        self._at: dict[int, list[tuple[str, int, int]]] = {}
        for name, start, end in spans:  # an empty tensor holds no byte to keep
            for g in range(start // granule, -(-end // granule)) if start < end else ():
                self._at.setdefault(g, []).append((name, start, end))

    def kept(self, windows: list[tuple[int, int]], keep: set[str]) -> list[tuple[int, int]]:
        """The byte spans of the ``keep`` tensors that overlap the granule-aligned ``windows`` (merged and sorted)."""
        out, seen = [], set()
        for lo, hi in windows:
            for g in range(lo // self.granule, -(-hi // self.granule)):
                for name, start, end in self._at.get(g, ()):
                    if name in keep and name not in seen and start < hi and end > lo:
                        seen.add(name)
                        out.append((start, end))
        return merge_spans(out)


def _subtract(spans: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` less ``holes`` (both merged and sorted)."""
    out = []
    for lo, hi in spans:
        at = lo
        for a, b in holes:
            if b <= at or a >= hi:
                continue
            if a > at:
                out.append((at, a))
            at = max(at, b)
        if at < hi:
            out.append((at, hi))
    return out


class Checkpoint:
    """All safetensors files of a Hugging Face model directory (one file or an indexed shard set)."""

    def __init__(self, model_dir: Path):
        self.dir = Path(model_dir)
        try:
            listing = set(os.listdir(self.dir))
        except OSError as exc:
            raise CheckpointError(f"cannot list {self.dir} ({exc.strerror})") from None
        present = sorted(n for n in listing if n.endswith(".safetensors"))
        weight_map = self._read_index() if INDEX in listing else None
        # Read exactly the files the index names, or the one file: never whatever else lies around.
        if weight_map is None:
            if len(present) > 1:
                raise CheckpointError(
                    f"{self.dir}: {len(present)} *.safetensors files ({', '.join(present)}) but no {INDEX} "
                    "saying which hold the model; remove the stray files or add the index"
                )
            names = present
        else:
            names = sorted(set(weight_map.values()))
            # A shard the index names and the directory lacks first: a stray file beside it is its consequence.
            gone = [n for n in names if n not in listing]
            if gone:
                raise CheckpointError(f"{self.dir / INDEX}: names {gone[0]} but there is no such file; the shard set is incomplete")
            stray = [n for n in present if n not in names]
            if stray:
                raise CheckpointError(
                    f"{self.dir}: {INDEX} does not name {', '.join(stray)}; remove the stray file(s) or add their tensors to the index"
                )
        if not names:
            raise CheckpointError(f"{self.dir}: no *.safetensors files (make one with: kestrel make-model --preset tiny --out DIR)")
        self.files = {n: SafetensorsFile(self.dir / n) for n in names}
        self._where: dict[str, SafetensorsFile] = {}
        for fname, f in self.files.items():
            for t in f.tensors:
                if t in self._where:
                    raise CheckpointError(
                        f"{self.dir}: tensor {t!r} is defined in both {self._where[t].path.name} and {fname}; "
                        "remove the stale copy"
                    )
                if weight_map is not None and weight_map.get(t) != fname:
                    mapped = f"maps it to {weight_map[t]}" if t in weight_map else "does not list it"
                    raise CheckpointError(
                        f"{self.dir}: tensor {t!r} is in {fname} but {INDEX} {mapped}; fix the index or re-create the shards"
                    )
                self._where[t] = f
        for t, fname in (weight_map or {}).items():
            if t not in self._where:
                raise CheckpointError(f"{self.dir / INDEX}: maps {t!r} to {fname} but that file has no such tensor; the shard set is incomplete")
        self.metadata = {k: v for f in self.files.values() for k, v in f.metadata.items()}
        # per-expert name -> (the fused tensor it is a slice of, the slice's own TensorInfo)
        self._alias: dict[str, tuple[str, TensorInfo]] = self._fused_experts()
        self._granule_index: dict[tuple[str, int], GranuleIndex] = {}  # by (file, granule): ``drop_around``'s

    def _fused_experts(self) -> dict[str, tuple[str, TensorInfo]]:
        """Serve each expert of a fused 3-D layer (``FUSED_GATE_UP``, ``FUSED_DOWN``) under its per-expert name.

        A slice of one expert is contiguous in the file, so it is a TensorInfo of its own: ``view``
        maps it zero-copy and ``drop_pages`` drops the whole pages inside it. A fused tensor whose
        shape cannot be sliced (not 3-D, or an odd gate_up) is left unsliced: validate_checkpoint
        names it against config.json.
        """
        fused: dict[int, list[str]] = {}
        for name in self._where:
            m = _FUSED.fullmatch(name)
            if m:
                fused.setdefault(int(m.group(1)), []).append(name)
        if not fused:
            return {}
        for name in self._where:
            m = _PER_EXPERT.fullmatch(name)
            if m and int(m.group(1)) in fused:
                mine = [f for f in fused[int(m.group(1))] if f.endswith("down_proj") == (m.group(3) == "down")]
                raise CheckpointError(
                    f"{self.dir}: layer {m.group(1)} holds its experts in both layouts ({(mine or fused[int(m.group(1))])[0]!r} "
                    f"and {name!r}); keep either the fused tensors or the per-expert ones"
                )
        out: dict[str, tuple[str, TensorInfo]] = {}
        for layer, names in fused.items():
            for name in names:
                info = self._where[name].tensors[name]
                gate_up = name.endswith("gate_up_proj")
                if len(info.shape) != 3 or (gate_up and info.shape[1] % 2):
                    continue
                E, rows, cols = info.shape
                parts = {"gate": (0, rows // 2), "up": (rows // 2, rows)} if gate_up else {"down": (0, rows)}
                row_bytes = cols * DTYPES[info.dtype][2]
                for e in range(E):
                    for role, (lo, hi) in parts.items():
                        alias = f"model.layers.{layer}.mlp.experts.{e}.{role}_proj.weight"
                        start = info.start + (e * rows + lo) * row_bytes
                        out[alias] = (name, TensorInfo(alias, info.dtype, (hi - lo, cols), start, start + (hi - lo) * row_bytes))
        return out

    def _read_index(self) -> dict[str, str]:
        path = self.dir / INDEX
        index = read_json(path, CheckpointError)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{path}: not a valid index (needs a 'weight_map' object)")
        if not weight_map:
            raise CheckpointError(f"{path}: 'weight_map' is empty; it must map every tensor to its shard")
        for t, fname in weight_map.items():
            # A plain name in this directory: an index must not point the reader elsewhere.
            if not (isinstance(fname, str) and fname.endswith(".safetensors") and os.path.basename(fname) == fname):
                raise CheckpointError(
                    f"{path}: not a valid index ('weight_map' maps {t!r} to {shown(fname)}; "
                    "it must map tensor names to *.safetensors file names in this directory)"
                )
        return weight_map

    def __contains__(self, name: str) -> bool:
        return name in self._where or name in self._alias

    def names(self) -> list[str]:
        """The tensors the files hold (a fused expert tensor once, not its per-expert slices)."""
        return list(self._where)

    def source(self, name: str) -> str:
        """The stored tensor behind ``name``: itself, or the fused tensor it is a slice of."""
        return self._alias[name][0] if name in self._alias else name

    def info(self, name: str) -> TensorInfo:
        if name in self._alias:
            return self._alias[name][1]
        try:
            return self._where[name].tensors[name]
        except KeyError:
            raise CheckpointError(
                f"{self.dir}: missing tensor {name!r}; the checkpoint is incomplete or of another architecture"
            ) from None

    def view(self, name: str) -> torch.Tensor:
        """A zero-copy, read-only view of ``name`` (a per-expert name of a fused layer: its slice)."""
        return self.file_of(name).view(self.info(name))

    def file_of(self, name: str) -> SafetensorsFile:
        self.info(name)
        return self._where[self.source(name)]

    def drop_pages(self, names: list[str]) -> None:
        by_file: dict[SafetensorsFile, list[tuple[int, int]]] = {}
        for n in names:
            info = self.info(n)
            by_file.setdefault(self.file_of(n), []).append((info.start, info.end))
        for f, spans in by_file.items():
            f.drop_pages(merge_spans(spans))

    def drop_around(self, names: list[str], keep: set[str], granule: int = FAULT_GRANULE) -> None:
        """Drop the pages of the ``granule``-aligned stretches around ``names``, except those of the ``keep`` tensors.

        One read fault may map a whole large folio of page cache (up to 2 MiB), so touching a tensor
        can map its neighbours' pages too; this takes those out again while the tensors in ``keep``
        (the resident ones) stay mapped.
        """
        by_file: dict[SafetensorsFile, list[tuple[int, int]]] = {}
        for n in names:
            info = self.info(n)
            lo, hi = (info.start // granule) * granule, -(-info.end // granule) * granule
            by_file.setdefault(self.file_of(n), []).append((lo, hi))
        for f, windows in by_file.items():
            windows = merge_spans(windows)
            f.drop_pages(_subtract(windows, self._granules(f, granule).kept(windows, keep)))

    def _granules(self, f: SafetensorsFile, granule: int) -> GranuleIndex:
        """``f``'s tensors (a fused expert tensor and each expert's slice of it alike) by granule, made on first use."""
        key = (f.path.name, granule)
        index = self._granule_index.get(key)
        if index is None:
            names = [n for n, where in self._where.items() if where is f]
            names += [n for n, (src, _) in self._alias.items() if self._where[src] is f]
            index = self._granule_index[key] = GranuleIndex(((n, self.info(n).start, self.info(n).end)
                                                             for n in names), granule)
        return index

    def unmap_all(self) -> None:
        """Every page of every file out of the mapping (the page cache keeps them)."""
        for f in self.files.values():
            f.drop_pages([(0, f.size)])

    def mapping_rss(self) -> int:
        """Resident bytes of this checkpoint's mappings, read from /proc/self/smaps."""
        return mapping_rss([str(f.path.resolve()) for f in self.files.values()])

    def check_unchanged(self) -> None:
        """A CheckpointError where a mapped file changed under the run (``io.mapped``)."""
        for f in self.files.values():
            f.check()

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
