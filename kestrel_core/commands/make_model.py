"""kestrel make-model: write a Hugging Face-format checkpoint with seeded random weights."""

from __future__ import annotations

from kestrel_core.io import progress
from kestrel_core.tools.presets import DTYPES, PRESETS, preset_config, write_checkpoint
from kestrel_core.io.jsonout import emit_json

HELP = "write a real Hugging Face-format Qwen3/Llama/Qwen3-MoE checkpoint with seeded random weights"


def add_arguments(p):
    p.add_argument("--preset", required=True, help=f"one of: {', '.join(PRESETS)}")
    p.add_argument("--out", required=True, help="output directory: new or empty (see --force)")
    p.add_argument("--force", action="store_true", help="replace the model files of a non-empty --out as a whole")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights, 0..2**64-1 (default 0)")
    p.add_argument("--dtype", default="bfloat16", help=f"one of: {', '.join(DTYPES)}")
    p.add_argument("--layers", type=int, help="keep only the first N layers (per-layer shapes unchanged), e.g. to fit a disk")
    p.add_argument("--shard-mb", type=int, default=4096, help="split into shards of at most this many MiB (0: one file)")
    p.add_argument("--router-skew", type=float, default=0.0, metavar="S",
                   help="MoE presets: routers whose expert popularity follows about Zipf(S) (0: plain random routers, "
                        "which route almost uniformly)")
    p.add_argument("--device", default="cpu", help="where to draw the random numbers (cuda is much faster for big presets)")
    p.add_argument("--json", action="store_true", help="print what was written as JSON")


def run(args) -> int:
    cfg = preset_config(args.preset, args.dtype, args.layers)
    with progress.shown(not args.json):
        out = write_checkpoint(cfg, args.out, seed=args.seed, shard_mb=args.shard_mb, device=args.device,
                               force=args.force, router_skew=args.router_skew)
    files = sorted(p.name for p in out.iterdir())
    size = sum((out / f).stat().st_size for f in files if f.endswith(".safetensors"))
    if args.json:
        emit_json({"out": str(out), "preset": args.preset, "bytes": size, "files": files, "router_skew": args.router_skew})
    else:
        cut = f" of {PRESETS[args.preset]['num_hidden_layers']}" if args.layers else ""
        skew = f", router skew {args.router_skew:g}" if args.router_skew else ""
        print(f"wrote {args.preset} ({cfg.num_hidden_layers}{cut} layers, {size / 2**20:,.1f} MiB{skew}) to {out}")
    return 0
