"""The static KV cache: per layer, K and V buffers of [slots, max_seq, n_kv_heads, head_dim], sized before any is filled.

A slot holds one sequence's keys and values; a batch of decoding sequences holds one slot each.
"""

from __future__ import annotations

import math

import attrs
import numpy as np
import torch

from kestrel_core.formats.dtypes import itemsize
from kestrel_core.errors import BudgetError
from kestrel_core.engine.host import meminfo
from kestrel_core.formats.modelconfig import ModelConfig


@attrs.define
class KVCache:
    """One layer's static K/V buffers: [slots, max_seq, n_kv_heads, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, cfg: ModelConfig, max_seq: int, dtype: torch.dtype, device, slots: int = 1) -> list["KVCache"]:
        shape = (slots, max_seq, cfg.num_key_value_heads, cfg.head_dim)
        return [cls(_zeros(shape, dtype, device), _zeros(shape, dtype, device)) for _ in range(cfg.num_hidden_layers)]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed buffer. In host memory it is zero pages the kernel maps as they are first written (calloc, which
    numpy's zeros uses for a large block, writes nothing), so a slot holds memory for the positions its sequences
    reached, not for ``max_seq``; torch.zeros would write every page at once."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = math.prod(shape) * itemsize(dtype)
    raw = torch.from_numpy(np.zeros(n + _ALIGN, dtype=np.uint8))
    at = -raw.data_ptr() % _ALIGN  # the first byte on a cache line, as torch's own allocator gives
    return raw[at:at + n].view(dtype).view(shape)


_ALIGN = 64


def kv_bytes(cfg: ModelConfig, max_seq: int, dtype: torch.dtype, slots: int = 1) -> int:
    return 2 * cfg.num_hidden_layers * slots * max_seq * cfg.kv_dim * itemsize(dtype)


def allocate_cache(cfg: ModelConfig, max_seq: int, dtype: torch.dtype, device: torch.device,
                   slots: int = 1, spare: int = 0) -> list[KVCache]:
    """A run's static KV cache of ``max_seq`` positions a slot and ``spare`` more that no sequence reaches (a parked
    row's); one that cannot be had is a BudgetError (without the fix: the door that asked for these sizes names its
    own settings), checked before touching host memory."""
    need = kv_bytes(cfg, max_seq + spare, dtype, slots)
    avail = meminfo().get("MemAvailable") if device.type == "cpu" else None
    too_big = BudgetError(
        f"the KV cache for {slots} x {max_seq:,} positions needs {need / 2**20:,.0f} MiB, more than {device} can give"
        f"{f' ({avail / 2**20:,.0f} MiB available)' if avail is not None else ''}"
    )  # the caller adds the fix, in its own words
    if avail is not None and need > avail:
        raise too_big  # zero-filling it would page the machine into the OOM killer
    try:
        return KVCache.allocate(cfg, max_seq + spare, dtype, device, slots)
    except (torch.cuda.OutOfMemoryError, MemoryError):
        raise too_big from None
    except RuntimeError as exc:
        if "alloc" not in str(exc).lower():
            raise
        raise too_big from None
