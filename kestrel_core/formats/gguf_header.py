"""A GGUF file's header, parsed and bounded: ``read_header(path)`` gives its metadata as Python values and its tensor
list, through ``gguf.GGUFReader`` (ggml-org's reader) with each count, length and read checked against the file's
size and ``MAX_KEYS``/``MAX_ARRAY``/``MAX_TENSORS`` before it is read, and metadata arrays and the tensor list
parsed in one pass (gguf's own loops over a declared length, so a hostile header would run it for hours). A file it
cannot parse is a ``HeaderProblem``, which ``GGUFCheckpoint`` words with the file's path."""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from kestrel_core.formats import gguf_quants as gq

CORRUPT = "the file is truncated or corrupt: re-download or re-create it"
# Bounds on what a header may declare, far above any real model's (about 50 keys, a vocabulary of 262k tokens,
# a few thousand tensors), so that a hostile count is refused before anything is read or allocated for it
MAX_KEYS, MAX_ARRAY, MAX_TENSORS = 2**12, 2**20, 2**17


@attrs.frozen
class Stored:
    """One tensor as the GGUF header lists it."""

    name: str
    qtype: Any  # gguf.GGMLQuantizationType
    ne: tuple[int, ...]  # GGUF order: ne[0] is the row
    start: int
    end: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))


class HeaderProblem(Exception):
    """A check inside the reader's parse; GGUFCheckpoint words it with the file's path."""


def read_header(path: Path):
    """(metadata {key: python value}, [Stored], file size) with gguf.GGUFReader; a file it cannot parse is a HeaderProblem."""
    import gguf
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    ARRAY, STRING = int(gguf.GGUFValueType.ARRAY), int(gguf.GGUFValueType.STRING)

    class Reader(gguf.GGUFReader):
        """gguf's reader, stopped at the first count, length or read that the file cannot hold: gguf's own loops over a
        declared length and reads past the end as empty arrays, so a hostile header would run it for hours."""

        _key = "the header"
        _sizes: dict = {}
        _pending: list[str] | None = None  # a string array just read, for _build_fields to file under its key

        def __init__(self, path):
            self.strings: dict[str, list[str]] = {}  # each string array's values, decoded as they were read
            super().__init__(path)

        def _need(self, end: int) -> None:
            """A HeaderProblem naming what is being read where it would end past the file."""
            if end > len(self.data):
                raise HeaderProblem(f"{self._key} runs past the end of the file (to byte {end:,} of {len(self.data):,}); {CORRUPT}")

        def _get(self, offset, dtype, count=1, override_order=None):
            size = self._sizes.get(dtype) or self._sizes.setdefault(dtype, np.dtype(dtype).itemsize)
            self._need(int(offset) + size * int(count))
            return super()._get(offset, dtype, count, override_order)

        def _counted(self, count, what: str, limit: int, offs: int, least: int) -> None:
            count, left = int(count), len(self.data) - offs  # a Python int: numpy's uint64 would wrap count * least
            if count > limit or count * least > left:
                raise HeaderProblem(f"the header declares {count:,} {what}, more than the {left:,} bytes left in the file "
                                    f"hold (or over the {limit:,} kestrel reads); {CORRUPT}")

        def _build_fields(self, offs, count):
            self._counted(count, "metadata keys", MAX_KEYS, offs, 8 + 4 + 1)
            for _ in range(int(count)):  # one at a time, so that an error names the key
                self._key = "a metadata key"
                n = int(self._get(offs, np.uint64)[0])
                key = bytes(self._get(offs + 8, np.uint8, n)).decode("utf-8", "replace")[:80]
                self._key = f"metadata {key if key.isprintable() else repr(key)}"  # one line, whatever the file holds
                offs = super()._build_fields(offs, 1)
                if self._pending is not None:
                    self.strings[next(reversed(self.fields))] = self._pending
                    self._pending = None
            self._key = "the header"
            return offs

        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type == ARRAY:
                itype = int(self._get(orig_offs, np.uint32)[0])
                n = int(self._get(orig_offs + 4, np.uint64)[0])
                if itype == ARRAY:
                    raise HeaderProblem(f"{self._key} is an array of arrays, which no model GGUF holds; {CORRUPT}")
                scalar = self.gguf_scalar_to_np.get(itype)
                least = 8 if itype == STRING else np.dtype(scalar).itemsize if scalar else 1
                left = len(self.data) - orig_offs - 12
                if n > MAX_ARRAY or n * least > left:
                    raise HeaderProblem(f"{self._key} declares {n:,} entries, more than the {left:,} bytes left in the file "
                                        f"hold (or over the {MAX_ARRAY:,} kestrel reads); {CORRUPT}")
                # read whole, not item by item as gguf does (two numpy arrays an item: 15 s and 1.6 GB for a 1M array)
                head = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
                if itype == STRING:
                    self._pending, end = self._string_array(orig_offs + 12, n)
                    return end - orig_offs, head, [], [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]
                if scalar is None:
                    raise HeaderProblem(f"{self._key} is an array of unknown type {itype}; {CORRUPT}")
                values = self._get(orig_offs + 12, scalar, n)
                return 12 + values.nbytes, [*head, values], [2], [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType(itype)]
            return super()._get_field_parts(orig_offs, raw_type)

        def _string_array(self, offs: int, n: int) -> tuple[list[str], int]:
            """``n`` GGUF strings from ``offs``, decoded in one pass; (the strings, the offset after them)."""
            size, out = len(self.data), []  # compared inline, _need called only to fail: a vocabulary is 10**5 strings
            with memoryview(self.data) as mv:
                for _ in range(n):
                    if offs + 8 > size:
                        self._need(offs + 8)
                    end = offs + 8 + struct.unpack_from("<Q", mv, offs)[0]
                    if end > size:
                        self._need(end)
                    try:
                        out.append(str(mv[offs + 8 : end], "utf-8"))
                    except UnicodeDecodeError:
                        raise HeaderProblem(f"{self._key} holds a string that is not UTF-8 (at byte {offs:,}); {CORRUPT}") from None
                    offs = end
            return out, offs

        def _build_tensor_info(self, offs, count):
            """The tensor list as (name, ne, ggml type, data offset) tuples, parsed in one pass (gguf makes six numpy arrays
            a tensor, and a ReaderTensor view of each: 5 s and 340 MiB for 65,536 tensors)."""
            self._counted(count, "tensors", MAX_TENSORS, offs, 8 + 4 + 4 + 8)
            infos = []
            with memoryview(self.data) as mv:
                for _ in range(int(count)):
                    self._key = "a tensor's name"
                    self._need(offs + 8)
                    n = struct.unpack_from("<Q", mv, offs)[0]
                    self._need(offs + 8 + n)
                    try:
                        name = str(mv[offs + 8 : offs + 8 + n], "utf-8")
                    except UnicodeDecodeError:
                        raise HeaderProblem(f"a tensor name is not UTF-8 (at byte {offs:,}); {CORRUPT}") from None
                    self._key, offs = f"tensor {name[:80]!r}", offs + 8 + n
                    self._need(offs + 4)
                    n_dims = struct.unpack_from("<I", mv, offs)[0]
                    if not 1 <= n_dims <= 4:
                        raise HeaderProblem(f"tensor {name[:80]!r} has {n_dims} dimensions; a GGUF tensor has 1 to 4; {CORRUPT}")
                    self._need(offs + 4 + 8 * n_dims + 12)
                    ne = list(struct.unpack_from(f"<{n_dims}Q", mv, offs + 4))
                    raw_type, at = struct.unpack_from("<IQ", mv, offs + 4 + 8 * n_dims)
                    infos.append((name, ne, raw_type, at))
                    offs += 4 + 8 * n_dims + 12
            self._key = "the header"
            return offs, infos

        def _build_tensors(self, start_offs, fields):
            """Each tensor checked and kept as a Stored (gguf's numpy views of them are not made: kestrel maps the file)."""
            size, spans, self.stored = len(self.data), [], []
            names = set()
            for name, ne, raw_type, rel in fields:
                at = start_offs + rel
                if name in names:
                    raise HeaderProblem(f"tensor {name!r} is listed twice; {CORRUPT}")
                names.add(name)
                if 0 in ne:
                    raise HeaderProblem(f"tensor {name!r} has a dimension of 0 (GGUF ne {ne}); {CORRUPT}")
                if rel % self.alignment:
                    raise HeaderProblem(f"tensor {name!r} starts at data byte {rel}, not a multiple of the file's "
                                        f"alignment {self.alignment}; {CORRUPT}")
                try:
                    qtype = GGMLQuantizationType(raw_type)
                except ValueError:
                    raise HeaderProblem(f"tensor {name!r} has ggml type {raw_type}, which gguf {gguf_version()} does not know; "
                                        f"re-quantize the model to one of {gq.SUPPORTED_NAMES}") from None
                block, size_of = GGML_QUANT_SIZES[qtype]
                if ne[0] % block:
                    raise HeaderProblem(f"tensor {name!r} has rows of {ne[0]} values, not a multiple of {qtype.name}'s block of "
                                        f"{block}; {CORRUPT}")
                end = at + math.prod(ne) // block * size_of
                if end > size:
                    raise HeaderProblem(f"tensor {name!r} ends at byte {end} but the file has {size}; the file is truncated: "
                                        "re-download or re-create it")
                spans.append((rel, end - start_offs, name))
                self.stored.append(Stored(name, qtype, tuple(ne), at, end))
            spans.sort()
            for (s0, e0, a), (s1, e1, b) in zip(spans, spans[1:]):
                if s1 < e0:
                    raise HeaderProblem(f"tensors {a!r} (data bytes {s0}-{e0}) and {b!r} (data bytes {s1}-{e1}) overlap; {CORRUPT}")

    Reader._build_tensors_fields = Reader._build_tensor_info  # its name in older gguf releases
    hooked = ("_get", "_build_fields", "_get_field_parts", "_build_tensors", "gguf_scalar_to_np")
    missing = [n for n in hooked if not hasattr(gguf.GGUFReader, n)]
    if missing or not any(hasattr(gguf.GGUFReader, n) for n in ("_build_tensor_info", "_build_tensors_fields")):
        raise HeaderProblem(f"the installed gguf {gguf_version()} reads headers through other internals than the ones kestrel "
                            f"checks ({', '.join(missing) or '_build_tensor_info'} is gone); install the gguf kestrel is "
                            "tested with: pip install 'gguf==0.19.0'")
    reader = Reader(path)
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # the reader's own header fields
            continue
        try:
            value = reader.strings[key] if key in reader.strings else _field_value(field, gguf.GGUFValueType)
        except UnicodeDecodeError:
            raise HeaderProblem(f"metadata {key if key.isprintable() else repr(key)} is not UTF-8 text; {CORRUPT}") from None
        if len(field.types) == 1 and field.types[0] == gguf.GGUFValueType.FLOAT32:
            value = float(str(np.float32(value)))  # 1e-05, as the config.json it came from said, not 9.99999974e-06
        meta[key] = value
    tensors = reader.stored
    size = len(reader.data)
    del reader  # its memmap goes with it: tensors are read through our own mapping
    return meta, tensors, size


def _field_value(field, kinds):
    """A metadata field as a python value (arrays as lists): ReaderField.contents(), which gguf < 0.16 lacks."""
    if not field.types:
        return None
    if field.types[0] == kinds.ARRAY:
        if field.types[-1] == kinds.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [v for i in field.data for v in field.parts[i].tolist()]
    if field.types[0] == kinds.STRING:
        return bytes(field.parts[-1]).decode("utf-8")
    return field.parts[-1].tolist()[0]


def gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "?"
