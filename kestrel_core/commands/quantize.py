"""kestrel quantize: write a q8 copy of a float checkpoint or a GGUF file, in the layout the device computes from."""

from __future__ import annotations

from kestrel_core.io import progress
from kestrel_core.errors import ConfigError
from kestrel_core.formats.gguf_model import names_gguf
from kestrel_core.formats.quant import GROUP_SIZES
from kestrel_core.tools.quantize import quantize_checkpoint
from kestrel_core.io.jsonout import emit_json
from kestrel_core.commands.common import mib

HELP = ("write a q8 checkpoint (from a float checkpoint or a GGUF file): int8 weights with one f32 scale per group of "
        "input columns, in device layout "
        "(Mixture-of-Experts: attention and experts q8, routers kept float)")


def add_arguments(p):
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="float Hugging Face model directory (config.json + *.safetensors), "
                        "or a name in the local Hugging Face cache such as Qwen/Qwen3-8B (never downloaded)")
    source.add_argument("--from", dest="gguf", metavar="FILE.gguf",
                        help="a GGUF file: at group 32 its Q8_0 weights are copied as they are, the others quantized "
                        "from their dequantized floats; its metadata's tokenizer and chat template come along")
    p.add_argument("--out", required=True, help="output directory, new or empty (a model.safetensors, config.json, tokenizer files)")
    p.add_argument("--force", action="store_true", help="replace the model files of a non-empty --out as a whole")
    p.add_argument("--group-size", default="32", help=f"input columns per scale: {' | '.join(map(str, GROUP_SIZES))} (default 32)")
    p.add_argument("--keep-lm-head", action="store_true", help="keep lm_head in its original dtype (a tied model stays tied)")
    p.add_argument("--device", default="cpu", help="where to compute (cuda is much faster on big models; the bytes are the same)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args) -> int:
    if args.gguf is not None and not names_gguf(args.gguf):
        raise ConfigError(f"--from {args.gguf}: not a GGUF file (a .gguf file, or one that starts with GGUF's magic); "
                          "quantize a Hugging Face directory with --model")
    with progress.shown(not args.json):
        summary = quantize_checkpoint(args.model or args.gguf, args.out, args.group_size, args.keep_lm_head,
                                      device=args.device, force=args.force)
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
