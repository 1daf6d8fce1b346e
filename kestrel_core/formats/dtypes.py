"""The one dtype table: the names config and flags use, torch's and numpy's types, safetensors codes, sizes."""

from __future__ import annotations

import attrs
import numpy as np
import torch

from kestrel_core.errors import ConfigError


@attrs.frozen
class DType:
    name: str  # what kestrel.toml and --dtype say
    st: str  # the safetensors header code
    torch: torch.dtype
    numpy: type  # numpy's storage type (bfloat16 has none: its bits as uint16)
    itemsize: int


TABLE = (
    DType("float64", "F64", torch.float64, np.float64, 8),
    DType("float32", "F32", torch.float32, np.float32, 4),
    DType("float16", "F16", torch.float16, np.float16, 2),
    DType("bfloat16", "BF16", torch.bfloat16, np.uint16, 2),
    DType("int64", "I64", torch.int64, np.int64, 8),
    DType("int32", "I32", torch.int32, np.int32, 4),
    DType("int16", "I16", torch.int16, np.int16, 2),
    DType("int8", "I8", torch.int8, np.int8, 1),
    DType("uint8", "U8", torch.uint8, np.uint8, 1),
    DType("bool", "BOOL", torch.bool, np.bool_, 1),
)
BY_NAME = {d.name: d for d in TABLE}
BY_ST = {d.st: d for d in TABLE}
BY_TORCH = {d.torch: d for d in TABLE}
WEIGHT_NAMES = ("bfloat16", "float16", "float32")  # what a checkpoint's float weights may be stored as


def itemsize(dtype: torch.dtype) -> int:
    return BY_TORCH[dtype].itemsize


def compute_dtype(name: str, allowed: tuple[str, ...], who: str) -> torch.dtype:
    """A backend's compute dtype from its config name; one outside ``allowed`` is a ConfigError."""
    if name not in allowed:
        raise ConfigError(f"{who} computes in {', '.join(allowed)}, not {name!r}; set [backend] dtype or --dtype")
    return BY_NAME[name].torch
