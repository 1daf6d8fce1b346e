"""kestrel make-model: write a Hugging Face-format checkpoint with seeded random weights, or (--type) the same
weights as one quantized GGUF file."""

from __future__ import annotations

from kestrel_core.errors import ConfigError
from kestrel_core.formats.gguf_types import TYPE_NAMES, parse_type
from kestrel_core.io import progress
from kestrel_core.tools.presets import DTYPES, PRESETS, preset_config, write_checkpoint, write_preset_gguf
from kestrel_core.io.jsonout import emit_json
from kestrel_core.commands.common import mib

HELP = ("write a real Hugging Face-format Qwen3/Llama/Qwen3-MoE checkpoint with seeded random weights, or (--type) "
        "the same weights as one quantized GGUF file")
SHARD_MB = 4096


def add_arguments(p):
    p.add_argument("--preset", required=True, help=f"one of: {', '.join(PRESETS)}")
    p.add_argument("--out", required=True, help="output directory: new or empty (see --force); with --type, a new "
                   ".gguf file")
    p.add_argument("--force", action="store_true", help="replace the model files of a non-empty --out as a whole")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights, 0..2**64-1 (default 0)")
    p.add_argument("--dtype", default="bfloat16", help=f"one of: {', '.join(DTYPES)}")
    p.add_argument("--layers", type=int, help="keep only the first N layers (per-layer shapes unchanged), e.g. to fit a disk")
    p.add_argument("--shard-mb", type=int, help=f"split into shards of at most this many MiB (0: one file; default "
                   f"{SHARD_MB})")
    p.add_argument("--router-skew", type=float, default=0.0, metavar="S",
                   help="MoE presets: routers whose expert popularity follows about Zipf(S) (0: plain random routers, "
                        "which route almost uniformly)")
    p.add_argument("--type", metavar="TYPE",
                   help=f"write the same weights as one GGUF file quantized to TYPE ({' | '.join(TYPE_NAMES)}; "
                        "case does not matter, e.g. Q4_K_M), as `kestrel quantize --type` would quantize the checkpoint")
    p.add_argument("--random-blocks", action="store_true",
                   help="with --type: draw each quantized tensor as random valid blocks of its type instead of quantizing "
                        "the random weights (the same tensors, types and bytes, written at the disk's speed: for "
                        "benchmarks of big presets)")
    p.add_argument("--device", default="cpu", help="where to draw the random numbers (cuda is much faster for big presets)")
    p.add_argument("--json", action="store_true", help="print what was written as JSON")


def run(args) -> int:
    cfg = preset_config(args.preset, args.dtype, args.layers)
    if args.type is not None:
        return _run_gguf(args, cfg)
    if args.random_blocks:
        raise ConfigError("--random-blocks draws a GGUF's quantized blocks; it needs --type (e.g. --type q4_k_m)")
    with progress.shown(not args.json):
        out = write_checkpoint(cfg, args.out, seed=args.seed, shard_mb=SHARD_MB if args.shard_mb is None else args.shard_mb,
                               device=args.device, force=args.force, router_skew=args.router_skew)
    files = sorted(p.name for p in out.iterdir())
    size = sum((out / f).stat().st_size for f in files if f.endswith(".safetensors"))
    if args.json:
        emit_json({"out": str(out), "preset": args.preset, "bytes": size, "files": files, "router_skew": args.router_skew})
    else:
        cut = f" of {PRESETS[args.preset]['num_hidden_layers']}" if args.layers else ""
        skew = f", router skew {args.router_skew:g}" if args.router_skew else ""
        print(f"wrote {args.preset} ({cfg.num_hidden_layers}{cut} layers, {size / 2**20:,.1f} MiB{skew}) to {out}")
    return 0


def _run_gguf(args, cfg) -> int:
    type_name = parse_type(args.type)
    if args.force:
        raise ConfigError(f"--force does not apply with --type {type_name}: a GGUF --out is a new file, never a replaced "
                          "one; name a new file")
    if args.shard_mb is not None:
        raise ConfigError(f"--shard-mb does not apply with --type {type_name}: a GGUF is one file; drop --shard-mb")
    with progress.shown(not args.json):
        summary = write_preset_gguf(cfg, args.out, type_name, args.preset, seed=args.seed, device=args.device,
                                    router_skew=args.router_skew, random_blocks=args.random_blocks)
    if args.json:
        emit_json({"preset": args.preset, "router_skew": args.router_skew, **summary})
        return 0
    cut = f" of {PRESETS[args.preset]['num_hidden_layers']}" if args.layers else ""
    types = ", ".join(f"{n} {name}" for name, n in sorted(summary["types"].items(), key=lambda kv: -kv[1]))
    print(f"wrote {args.preset} ({cfg.num_hidden_layers}{cut} layers) as GGUF {type_name.upper()}: {summary['tensors']} "
          f"tensors ({types}), {mib(summary['bytes'])} to {summary['out']}")
    return 0
