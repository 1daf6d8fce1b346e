"""GGUF block weights on cuda: a linear held as the file's own blocks, uploaded as stored and computed by the
block kernels (``gguf_kernels``), never dequantized to the compute dtype.

An entry is one or more parts stacked along N (q, k and v; gate and up), as the float and q8 entries are. A
Q4_K_M file stores the parts of one entry in different types (attn_v or ffn_down at Q6_K in some layers, the
rest Q4_K), so an entry is a run of *segments*: consecutive parts of one type merge into one segment, and each
segment is that many rows of whole blocks of its type. Its bytes are the segments' stored bytes back to back in
one uint8 buffer, so an upload is one DMA of exactly the file's bytes and the bytes counted a token are the
stored ones. The geometry names every segment's type and rows, so a pooled buffer is reused only by an entry of
the same layout.

``block_linear`` runs one kernel launch a segment (up to 64 rows a launch; more rows run as further launches)
and writes each segment's columns of the output, through the float kernels (``gguf_kernels``; where every segment
is Q4_K or Q6_K and the CUDA C++ kernel runs, ``gguf_cuda`` writes each segment's columns straight into the output in
x's dtype, launches of up to 8 rows, no padding and no concatenation), or with ``[backend]
gguf_kernels = "int8"`` the int8 kernels (``gguf_int8``: x quantized per 32 values, int8 dot products, as llama.cpp's
decode GEMV) where a segment's address is whole words of its type. With ``gguf_kernels = "auto"`` (the default) a
pass's decode rows and verify spans take the float kernels and a prompt's rows the int8 ones (from 16 rows on the
tensor cores). The choice follows the setting, the segment's type and address and the row's kind, never the rows.
The kernel reduces each row in one order whatever the number of rows, and rows are padded to a power of two, or
to whole launches past 64 (at most 7 compiled variants a type): a row of a batch, a verify pass or a prompt chunk
gives the bits it gives alone, so ids are invariant across batch companions and keeps.
"""

from __future__ import annotations

from typing import Callable, Sequence

import attrs
import torch
from gguf import GGMLQuantizationType

from kestrel_core.formats.gguf_model import BlockTensor
from kestrel_core.formats.units import Geometry

from . import gguf_cuda, gguf_int8, gguf_kernels

DTYPE = "gguf-blocks"
TYPES = gguf_kernels.TYPES


@attrs.frozen
class Segment:
    """``n`` rows of ``qtype`` blocks, starting ``start`` bytes into the entry."""

    qtype: GGMLQuantizationType
    n: int
    start: int
    nbytes: int


def segments_of(layout: Sequence[tuple[str, int]], k: int) -> tuple[Segment, ...]:
    """The segments of an entry of row width ``k`` whose layout is ((type name, rows), ...)."""
    out, at = [], 0
    for name, n in layout:
        qtype = GGMLQuantizationType[name]
        nbytes = gguf_kernels.stored_bytes(qtype, n, k)
        out.append(Segment(qtype, n, at, nbytes))
        at += nbytes
    return tuple(out)


def rows_at(layout: Sequence[tuple[str, int]], row: int, n: int, k: int) -> tuple[GGMLQuantizationType, int]:
    """(type, byte offset) of rows ``row .. row + n`` of an entry of row width ``k`` laid out as ``layout``: rows that
    lie in one segment (a ValueError where they cross one)."""
    first = 0
    for seg in segments_of(layout, k):
        if first <= row and row + n <= first + seg.n:
            return seg.qtype, seg.start + gguf_kernels.stored_bytes(seg.qtype, row - first, k)
        first += seg.n
    raise ValueError(f"rows {row}..{row + n} cross a segment of {tuple(layout)}")


def layout_of(parts: Sequence[BlockTensor]) -> tuple[tuple[str, int], ...]:
    """((type name, rows), ...) of parts stacked along N, consecutive parts of one type merged."""
    return layout_of_rows([(p.qtype.name, p.n) for p in parts])


def layout_of_rows(parts: Sequence[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    """``layout_of`` from each part's (type name, rows)."""
    out: list[list] = []
    for name, n in parts:
        if out and out[-1][0] == name:
            out[-1][1] += n
        else:
            out.append([name, n])
    return tuple((name, n) for name, n in out)


class BlockWeight:
    """One entry ``W [n, k]`` as GGUF blocks: ``raw`` uint8 [nbytes], its segments back to back."""

    __slots__ = ("raw", "k", "n", "segments", "layout")

    def __init__(self, raw: torch.Tensor, k: int, layout: Sequence[tuple[str, int]]):
        self.layout = tuple((str(name), int(n)) for name, n in layout)
        self.segments = segments_of(self.layout, k)
        nbytes = sum(s.nbytes for s in self.segments)
        if raw.dtype != torch.uint8 or raw.dim() != 1 or raw.numel() != nbytes:
            raise ValueError(f"raw must be a uint8 vector of {nbytes} bytes")
        self.raw, self.k, self.n = raw, k, sum(s.n for s in self.segments)

    @classmethod
    def empty(cls, k: int, layout, device="cpu", pin_memory: bool = False, empty: Callable = torch.empty):
        nbytes = sum(s.nbytes for s in segments_of(layout, k))
        if pin_memory:
            raw = torch.empty((nbytes,), dtype=torch.uint8, pin_memory=True)
        else:
            raw = empty((nbytes,), dtype=torch.uint8, device=device)
        return cls(raw, k, layout)

    def segment(self, s: Segment) -> torch.Tensor:
        return self.raw[s.start:s.start + s.nbytes]

    # the tensor-like surface the upload flow uses
    def copy_(self, src: "BlockWeight", non_blocking: bool = False) -> "BlockWeight":
        if (src.k, src.layout) != (self.k, self.layout):
            raise ValueError(f"block layout mismatch: {src.layout} of k={src.k} into {self.layout} of k={self.k}")
        self.raw.copy_(src.raw, non_blocking=non_blocking)
        return self

    def data_ptr(self) -> int:
        return self.raw.data_ptr()

    def record_stream(self, stream) -> None:
        self.raw.record_stream(stream)

    def is_pinned(self) -> bool:
        return self.raw.is_pinned()

    def to(self, device) -> "BlockWeight":
        return BlockWeight(self.raw.to(device), self.k, self.layout)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def geometry(self, device) -> Geometry:
        return block_geometry(self.k, self.layout, device)


def block_geometry(k: int, layout, device) -> Geometry:
    nbytes = sum(s.nbytes for s in segments_of(layout, k))
    return Geometry((nbytes,), DTYPE, nbytes, str(device), (k, tuple(layout)))


def fused_geometry(parts: Sequence[BlockTensor], device) -> Geometry:
    """The device geometry of one entry of block parts stacked along N."""
    check_parts(parts)
    return block_geometry(parts[0].k, layout_of(parts), device)


def check_parts(parts: Sequence[BlockTensor]) -> None:
    if any(p.k != parts[0].k for p in parts):
        raise ValueError("fused block parts must share K")


def is_block_geometry(geometry: Geometry) -> bool:
    return geometry.dtype == DTYPE


def new_block_buffer(geometry: Geometry, device, empty: Callable = torch.empty) -> BlockWeight:
    """A device buffer for a block geometry; ``empty`` may be rawcuda.raw_empty (the ``free`` allocator)."""
    k, layout = geometry.layout
    return BlockWeight.empty(k, layout, device=device, empty=empty)


# --- host staging ----------------------------------------------------------------------------
def stage_blocks(ckpt, parts: Sequence[BlockTensor], pin_memory: bool = True,
                 alloc: Callable[[int], torch.Tensor] | None = None) -> BlockWeight:
    """One host entry: the parts' stored blocks, rows in Hugging Face order, back to back. ``alloc(nbytes)``, where
    given, supplies the bytes (a view of a ``PinnedArena``)."""
    check_parts(parts)
    layout = layout_of(parts)
    if alloc is not None:
        w = BlockWeight(alloc(sum(p.nbytes for p in parts)), parts[0].k, layout)
    else:
        w = BlockWeight.empty(parts[0].k, layout, pin_memory=pin_memory)
    at = 0
    for p in parts:
        src = ckpt.blocks(p.name).reshape(-1)
        w.raw[at:at + src.numel()].copy_(src)
        at += src.numel()
    return w


def load_resident_blocks(ckpt, t: BlockTensor, device) -> BlockWeight:
    """A never-evicted device copy (lm_head)."""
    return stage_blocks(ckpt, [t], pin_memory=False).to(device)


# --- the product -------------------------------------------------------------------------------
def block_linear(x: torch.Tensor, w: BlockWeight, int8: bool = False, prompt_from: int | None = None,
                 prompt_int8: bool | None = None) -> torch.Tensor:
    """``x [..., k] -> [..., n]`` in x's dtype: each segment's columns by the block kernel, summed in float32; ``int8``:
    the int8 kernels where a segment's address allows (``[backend] gguf_kernels``). With ``prompt_from``, the rows
    from there on (a prompt's: ``Attend.prompt_from``) run through the int8 kernels if ``prompt_int8`` (from 16 rows
    on the tensor cores), else the float ones: each row's bits follow its kind and its values, never the rows beside
    it, as every kernel here reduces a row in one order for any number of rows."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.k)
    m = x2.shape[0]
    if m and prompt_from is not None and prompt_int8 is not None and prompt_int8 != int8:
        at = min(max(prompt_from, 0), m)
        parts = [block_linear(rows, w, kind) for rows, kind in ((x2[:at], int8), (x2[at:], prompt_int8)) if len(rows)]
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(*lead, w.n)
    if m and not int8 and all(gguf_cuda.takes(x2, s.qtype, w.k) for s in w.segments):
        # every segment on the CUDA kernel: each writes its columns of the output in x's dtype, no padding, no cat
        y = torch.empty((m, w.n), dtype=x.dtype, device=x.device)
        col = 0
        for s in w.segments:
            gguf_cuda.matmul(x2, w.segment(s), s.qtype, s.n, w.k, out=y[:, col:col + s.n])
            col += s.n
        return y.reshape(*lead, w.n)
    top = gguf_kernels.MAX_ROWS
    rows = (1 << (m - 1).bit_length() if m <= top else -(-m // top) * top) if m else 0
    if rows != m:  # padding rows change no other row's bits; they bound the kernels compiled to 7 a type
        x2 = torch.cat([x2, x2.new_zeros((rows - m, w.k))])
    outs = [segment_matmul(x2, w.segment(s), s.qtype, s.n, w.k, int8) for s in w.segments]
    y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return y[:m].to(x.dtype).reshape(*lead, w.n)


def segment_matmul(x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType, n: int, k: int,
                   int8: bool) -> torch.Tensor:
    """One segment's product: with ``int8``, the int8 kernel where it computes the type and can read the segment's
    address as its words; else the float kernel. Each reduces a row in one order for any number of rows."""
    if int8 and qtype in gguf_int8.TYPES and gguf_int8.aligned(raw, qtype):
        return gguf_int8.matmul(x, raw, qtype, n, k)
    return gguf_kernels.matmul(x, raw, qtype, n, k)
