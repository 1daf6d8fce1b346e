"""kestrel quantize: write a q8 copy of a float checkpoint or a GGUF file, in the layout the device computes from;
or, with --type, a GGUF file of a float checkpoint in one of llama.cpp's types."""

from __future__ import annotations

from kestrel_core.io import progress
from kestrel_core.errors import ConfigError
from kestrel_core.formats.gguf_model import names_gguf
from kestrel_core.formats.gguf_types import TYPE_NAMES, parse_type
from kestrel_core.formats.quant import GROUP_SIZES
from kestrel_core.tools.quantize import quantize_checkpoint, quantize_to_gguf
from kestrel_core.io.jsonout import emit_json
from kestrel_core.commands.common import mib

HELP = ("write a q8 checkpoint (from a float checkpoint or a GGUF file): int8 weights with one f32 scale per group of "
        "input columns, in device layout "
        "(Mixture-of-Experts: attention and experts q8, routers kept float); "
        "or, with --type, a GGUF file of a float checkpoint (Q4_K_M, Q8_0, ...)")
# the q8 flags, which mean nothing to a GGUF (--type): each refused there rather than ignored
Q8_ONLY = {"group_size": "--group-size", "keep_lm_head": "--keep-lm-head", "device": "--device", "force": "--force"}


def add_arguments(p):
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="float Hugging Face model directory (config.json + *.safetensors), "
                        "or a name in the local Hugging Face cache such as Qwen/Qwen3-8B (never downloaded)")
    source.add_argument("--from", dest="gguf", metavar="FILE.gguf",
                        help="a GGUF file: at group 32 its Q8_0 weights are copied as they are, the others quantized "
                        "from their dequantized floats; its metadata's tokenizer and chat template come along")
    p.add_argument("--out", required=True, help="output directory, new or empty (a model.safetensors, config.json, "
                   "tokenizer files); with --type, a new .gguf file")
    p.add_argument("--type", metavar="TYPE",
                   help=f"write a GGUF file instead of a q8 directory: {' | '.join(TYPE_NAMES)} (q4_k_m: llama.cpp's "
                   "Q4_K_M mix, most weights Q4_K and some attn_v and ffn_down Q6_K; the others one type throughout). "
                   "From a float --model only")
    p.add_argument("--force", action="store_true", help="replace the model files of a non-empty --out as a whole")
    p.add_argument("--group-size", help=f"input columns per scale: {' | '.join(map(str, GROUP_SIZES))} (default 32)")
    p.add_argument("--keep-lm-head", action="store_true", help="keep lm_head in its original dtype (a tied model stays tied)")
    p.add_argument("--device", help="where to compute (default cpu; cuda is much faster on big models; the bytes are the same)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args) -> int:
    if args.type is not None:
        return _run_gguf(args)
    if args.gguf is not None and not names_gguf(args.gguf):
        raise ConfigError(f"--from {args.gguf}: not a GGUF file (a .gguf file, or one that starts with GGUF's magic); "
                          "quantize a Hugging Face directory with --model")
    with progress.shown(not args.json):
        summary = quantize_checkpoint(args.model or args.gguf, args.out, args.group_size or "32", args.keep_lm_head,
                                      device=args.device or "cpu", force=args.force)
    if args.json:
        emit_json(summary)
        return 0
    untied = " (untied from the embeddings)" if summary["untied"] else ""
    moe = (f" ({summary['experts']} of them experts'; {summary['float_routers']} routers kept float)"
           if summary["experts"] else "")
    copied = f" ({summary['copied']} of them the GGUF's Q8_0, copied as stored)" if summary["copied"] else ""
    print(
        f"wrote q8 group {summary['group_size']}, lm_head {summary['lm_head']}{untied}: {summary['quantized']} linear weights{moe}{copied}, "
        f"{mib(summary['source_bytes'])} -> {mib(summary['bytes'])} to {summary['out']}"
    )
    return 0


def _run_gguf(args) -> int:
    type_name = parse_type(args.type)
    if args.gguf is not None:
        raise ConfigError(f"--type writes a GGUF from a float Hugging Face directory (--model), not from --from "
                          f"{args.gguf}: re-quantizing a GGUF's rounded weights adds error to error; pass the float model "
                          "it came from with --model, or drop --type to convert the GGUF to q8")
    for attr, flag in Q8_ONLY.items():
        if getattr(args, attr):
            why = ("a GGUF --out is a new file, never a replaced one: name a new file" if attr == "force" else
                   "it sets q8's layout or where q8 is computed: drop it (GGUF blocks are computed on the CPU)")
            raise ConfigError(f"{flag} does not apply with --type {type_name}: {why}")
    with progress.shown(not args.json):
        summary = quantize_to_gguf(args.model, args.out, type_name)
    if args.json:
        emit_json(summary)
        return 0
    types = ", ".join(f"{n} {name}" for name, n in sorted(summary["types"].items(), key=lambda kv: -kv[1]))
    vocab = f"tokenizer {summary['tokenizer']}" if summary["tokenizer"] else "no tokenizer"
    template = ", chat template" if summary["chat_template"] else ""
    print(f"wrote GGUF {type_name.upper()} ({summary['architecture']}): {summary['tensors']} tensors ({types}), {vocab}"
          f"{template}, {mib(summary['source_bytes'])} -> {mib(summary['bytes'])} to {summary['out']}")
    return 0
