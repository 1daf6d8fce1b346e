"""kestrel make-model: write a Hugging Face-format checkpoint with seeded random weights."""

from __future__ import annotations

import sys

from ..presets import DTYPES, PRESETS, preset_config, write_checkpoint
from .common import emit_json

HELP = "write a real Hugging Face-format Qwen3/Llama checkpoint with seeded random weights"


def add_arguments(p):
    p.add_argument("--preset", required=True, help=f"one of: {', '.join(PRESETS)}")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", help=f"one of: {', '.join(DTYPES)}")
    p.add_argument("--shard-mb", type=int, default=4096, help="split into shards of at most this many MiB (0: one file)")
    p.add_argument("--device", default="cpu", help="where to draw the random numbers (cuda is much faster for big presets)")
    p.add_argument("--json", action="store_true")


def run(args) -> int:
    cfg = preset_config(args.preset, args.dtype)
    progress = None if args.json else (lambda m: print(m, file=sys.stderr, flush=True))
    out = write_checkpoint(cfg, args.out, seed=args.seed, shard_mb=args.shard_mb, device=args.device, progress=progress)
    files = sorted(p.name for p in out.iterdir())
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    if args.json:
        emit_json({"out": str(out), "preset": args.preset, "bytes": size, "files": files})
    else:
        print(f"wrote {args.preset} ({cfg.num_hidden_layers} layers, {size / 2**20:,.1f} MiB) to {out}")
    return 0
