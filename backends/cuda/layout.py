"""The cuda backend's device layout: a unit's roles fused into the entries the math reads, each entry's geometry
(bf16, q8 or GGUF blocks), and what they weigh.

A dense layer is qkv, o, gate_up, down; a sparse layer's own unit qkv, o, router; an expert
gate_up, down. The window gate counts entries with the same function.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable

from kestrel_core.engine.fit import layers_peak
from kestrel_core.errors import ConfigError, KestrelNote
from kestrel_core.formats.dtypes import itemsize
from kestrel_core.formats.gguf_model import block_tensors
from kestrel_core.formats.tensor_table import global_specs, small_specs
from kestrel_core.formats.units import EntrySpec, Geometry

from . import blocks, q8

FUSED = (("qkv", ("q", "k", "v")), ("o", ("o",)), ("gate_up", ("gate", "up")), ("down", ("down",)),
         ("router", ("router",)))


def fusion(tensors: dict) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The entries of a unit with these roles (UnitSpec.tensors), in compute order: (entry name, roles)."""
    return tuple((name, roles) for name, roles in FUSED if all(r in tensors for r in roles))


def slot_entries(tensors: dict, held: dict | None = None) -> list:
    """The unit's entries as the host tier stages them (``SlotEntry``): each fused entry's shape and the
    checkpoint tensors stacked into it, in ``fusion`` order; an entry whose every part is in ``held`` (name ->
    ``BlockTensor``: the GGUF blocks the device holds) is staged as those blocks."""
    from backends.cuda.host.tier import SlotEntry

    held = held or {}
    out = []
    for name, roles in fusion(tensors):
        names = tuple(tensors[r][0] for r in roles)
        shape = (sum(tensors[r][1][0] for r in roles), tensors[roles[0]][1][1])
        parts = [held.get(n) for n in names]
        blocks = tuple((b.qtype.name, b.n) for b in parts) if all(b is not None for b in parts) else None
        out.append(SlotEntry(name, shape, names, blocks))
    return out


class DeviceLayout:
    """Each unit's entries as the cuda backend holds them, and what they weigh, computed from the checkpoint alone
    (the backend lays its units out with it, and ``keep = "auto"`` sizes a window with it before anything loads): an
    entry of q8 parts is q8, an entry of GGUF block parts is blocks (``blocks``), any other is the compute dtype. A
    block entry with a float part is served as floats, noted once (``dequantized_entries`` counts them)."""

    def __init__(self, ckpt, cfg, quant, dtype, device, note: bool = True):
        self.cfg, self.dtype, self.device, self.note = cfg, dtype, device, note
        self.q8 = quant.tensors if quant else {}
        self.blocks = block_tensors(ckpt, cfg, blocks.TYPES, skip=self.q8)  # a GGUF's quantized linears
        self.dequantized_entries: list[str] = []

    def block_parts(self, spec, name, roles):
        """The entry's parts as blocks, or None where it is served as floats."""
        parts = [self.blocks.get(spec.tensors[r][0]) for r in roles]
        if all(p is not None for p in parts):
            return parts
        if any(p is not None for p in parts):
            entry = f"{spec.key} {name}"
            if entry not in self.dequantized_entries:
                self.dequantized_entries.append(entry)
                if len(self.dequantized_entries) == 1 and self.note:
                    warnings.warn(f"unit {spec.key}: {name} fuses {', '.join(roles)}, of which only some are stored "
                                  f"as quantized blocks; such entries are dequantized to {self.dtype} on the host and "
                                  "stream at its width (memory_stats' gguf_dequantized_entries counts them)",
                                  KestrelNote, stacklevel=4)
        return None

    def entries(self, spec):
        """The unit's fused entries (``fusion``): the layout the host staging holds and the math reads."""
        tensors = spec.tensors
        for name, roles in fusion(tensors):
            parts = [self.q8.get(tensors[r][0]) for r in roles]
            block_parts = self.block_parts(spec, name, roles)
            if all(p is not None for p in parts):
                geometry = q8.fused_geometry(parts, self.device)
            elif any(p is not None for p in parts):
                raise ConfigError(f"unit {spec.key}: {name} fuses {', '.join(roles)}, of which only some are q8; "
                                  "re-quantize the checkpoint with kestrel quantize")
            elif block_parts is not None:
                geometry = blocks.fused_geometry(block_parts, self.device)
            else:
                shape = (sum(tensors[r][1][0] for r in roles), tensors[roles[0]][1][1])
                geometry = Geometry(shape, str(self.dtype), shape[0] * shape[1] * itemsize(self.dtype), str(self.device))
            yield EntrySpec(name, geometry, (spec.key, name))

    def global_bytes(self) -> int:
        """Embeddings, lm_head and the norms as the device holds them (a quantized lm_head stays quantized; a pipeline
        rank's part, the ones it uses: ``global_specs``), as cpu_ref counts what it holds for good."""
        item = itemsize(self.dtype)
        vh_bytes = self.cfg.vocab_size * self.cfg.hidden_size * item
        specs = global_specs(self.cfg)
        total = vh_bytes if "embed" in specs else 0
        if "lm_head" in specs:
            lm_head = self.q8.get("lm_head.weight") or self.blocks.get("lm_head.weight")
            total += lm_head.nbytes if lm_head is not None else vh_bytes
        if "norm" in specs:
            total += math.prod(specs["norm"][1]) * item
        return total + sum(math.prod(s) for layer in range(self.cfg.num_hidden_layers)
                           for _, s in small_specs(self.cfg, layer).values()) * item


def streamed_peak(units, residency, cfg) -> Callable[[int], int]:
    """The most streamed bytes n resident layers can hold (``fit.layers_peak``, over this layout's units)."""
    return layers_peak(list(units.layer_bytes.values()), [u.nbytes for u in units.own()],
                       [u.nbytes for u in units.experts()], residency, cfg)
