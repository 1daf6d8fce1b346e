"""The checkpoints a bench runs on: preset-shaped random weights, written once and found again on a rerun, and
their q8 copies.

    path = ensure_preset(root, "qwen3-8b")                                  # root/qwen3-8b
    path = ensure_preset(root, "qwen3-30b-a3b", layers=8, router_skew=1.2)  # root/qwen3-30b-a3b-L8-zipf1.2
    q8 = ensure_q8(path, group=64)                                          # root/qwen3-8b-q8g64

A directory's name says everything it was written with, so a cached one is the checkpoint asked for; the writer
makes each directory whole or not at all, so an interrupted write leaves nothing to find.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from bench.log import log

DEFAULT_ROOT = Path(os.environ.get("KESTREL_BENCH_MODELS", "/tmp/kestrel-bench-models"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", type=Path, default=DEFAULT_ROOT,
                   help=f"where checkpoints are written and found again (default {DEFAULT_ROOT}, or $KESTREL_BENCH_MODELS)")


def add_gguf_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gguf", default="", help="run on a GGUF of the preset in this type (random valid blocks, e.g. "
                   "q4_k: the full depth where bf16 would not fit a device's disk)")


def ensure_model(root: Path, preset: str, layers: int | None, gguf: str = "") -> tuple[Path, int]:
    """The preset's checkpoint (``ensure_preset``), or with ``gguf`` a GGUF of that type (``ensure_gguf``; a type it
    does not know is refused in one line), and its weight bytes."""
    if not gguf:
        path = ensure_preset(root, preset, layers=layers)
        return path, weight_bytes(path)
    from bench.errors import BenchError
    from kestrel_core.formats.gguf_types import TYPE_NAMES

    if gguf not in TYPE_NAMES:
        raise BenchError(f"--gguf takes a GGUF type ({', '.join(sorted(TYPE_NAMES))}), got {gguf!r}")
    path = ensure_gguf(root, preset, gguf, layers=layers)
    return path, path.stat().st_size


def _device(device: str | None) -> str:
    if device:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def preset_dir_name(preset: str, dtype: str = "bfloat16", layers: int | None = None, router_skew: float = 0.0,
                    seed: int = 0) -> str:
    return (preset + ("" if dtype == "bfloat16" else f"-{dtype}") + (f"-L{layers}" if layers else "")
            + (f"-zipf{router_skew:g}" if router_skew else "") + (f"-seed{seed}" if seed else ""))


def ensure_preset(root: Path, preset: str, *, dtype: str = "bfloat16", layers: int | None = None,
                  router_skew: float = 0.0, seed: int = 0, shard_mb: int = 0, device: str | None = None) -> Path:
    """The preset's checkpoint under ``root``, written first where it is not there yet."""
    from kestrel_core.tools.presets import preset_config, write_checkpoint

    path = Path(root) / preset_dir_name(preset, dtype, layers, router_skew, seed)
    if not (path / "config.json").is_file():
        cfg = preset_config(preset, dtype, layers)
        log(f"writing {path}")
        write_checkpoint(cfg, path, seed=seed, shard_mb=shard_mb, device=_device(device), router_skew=router_skew)
    return path


def ensure_q8(src: Path, group: int, device: str | None = None) -> Path:
    """A q8 copy of ``src`` (group size ``group``) beside it, written first where it is not there yet."""
    from kestrel_core.tools.quantize import quantize_checkpoint

    out = Path(src).parent / f"{Path(src).name}-q8g{group}"
    if not (out / "config.json").is_file():
        log(f"quantizing {src} to {out} (group {group})")
        quantize_checkpoint(src, out, group, device=_device(device))
    return out


def ensure_gguf(root: Path, preset: str, type_name: str, layers: int | None = None) -> Path:
    """The preset as a GGUF of ``type_name`` with random valid blocks (``make-model --type T --random-blocks``) under
    ``root``, written first where it is not there yet."""
    from kestrel_core.tools.presets import preset_config, write_preset_gguf

    path = Path(root) / f"{preset_dir_name(preset, layers=layers)}-{type_name}.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        log(f"writing {path} (random {type_name} blocks)")
        write_preset_gguf(preset_config(preset, "bfloat16", layers), path, type_name, preset, random_blocks=True)
    return path


def weight_bytes(path: Path) -> int:
    """The bytes of a checkpoint's safetensors files."""
    return sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))
