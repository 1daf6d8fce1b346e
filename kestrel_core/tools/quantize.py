"""``kestrel quantize``: write a q8 copy of a float checkpoint (the format: ``quant``), atomically; or, with
``--type``, a GGUF file of it (``quantize_to_gguf``; the format: ``formats.gguf_writer``).

From a GGUF file (``--from x.gguf``) at group 32, a Q8_0 weight is copied as it is stored (Q8_0 is q8 with group 32:
no rounding), and every other weight is quantized from its float32 dequantization; the config, tokenizer, chat
template and end-of-sequence ids of its metadata become the directory's config.json, tokenizer.json,
tokenizer_config.json and generation_config.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterator

import attrs
import torch

from kestrel_core.formats import hub

from kestrel_core.io import progress
from kestrel_core.formats.checkpoint import DTYPES, TORCH_TO_ST, Checkpoint
from kestrel_core.engine.devices import compute_device
from kestrel_core.engine.run import Model
from kestrel_core.formats.chat_template import TEMPLATE_FILE, TOKENIZER_CONFIG
from kestrel_core.formats.gguf import SUFFIX as GGUF_SUFFIX
from kestrel_core.formats.gguf_model import names_gguf
from kestrel_core.formats.gguf_types import parse_type
from kestrel_core.formats.gguf_writer import Source, write_gguf
from kestrel_core.formats.tokenizer import TOKENIZER_LIMIT
from kestrel_core.io.newfile import check_new
from kestrel_core.io.readfile import read_bounded
from kestrel_core.formats.gguf_quants import Q8_0_GROUP
from kestrel_core.formats.modelconfig import read_json
from kestrel_core.io.outdir import check_output, is_model_file, model_output
from kestrel_core.formats.quant import (GROUP_SIZES, LAYOUT, META_GROUP, META_LAYOUT, META_LM_HEAD, META_N_ALIGN, META_QUANT, META_UNTIED,
                    METHOD, N_ALIGN, AlreadyQuantizedError, GroupSizeError, QuantError, looks_quantized, pad_n, q8_names,
                    quantize, quantized_specs)
from kestrel_core.formats.tensor_table import all_specs

OUT_FILE = "model.safetensors"


def parse_group_size(value) -> int:
    try:
        group = int(value)
    except (TypeError, ValueError):
        group = None
    if group not in GROUP_SIZES:
        raise GroupSizeError(f"group size {value!r} is not supported; use one of {', '.join(map(str, GROUP_SIZES))}")
    return group


@attrs.frozen
class _Item:
    name: str
    dtype: str  # safetensors dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * DTYPES[self.dtype][2]


def quantize_checkpoint(
    model_dir: str | Path,
    out_dir: str | Path,
    group: int = 32,
    keep_lm_head: bool = False,
    device: str = "cpu",
    force: bool = False,
) -> dict:
    """Write a q8 copy of a float Hugging Face directory or of a GGUF file; returns a summary. Under
    ``progress.shown`` a bar counts the linear weights quantized."""
    group = parse_group_size(group)
    device = compute_device(device)
    gguf = names_gguf(model_dir)
    src = Path(model_dir) if gguf else hub.resolve(model_dir)  # a directory, or a name in the Hugging Face cache
    out = Path(out_dir)
    if src.is_dir() and out.exists() and out.resolve() == src.resolve():
        raise QuantError("--out must be a different directory from --model")
    check_output(out, force)  # before any work
    refuse_quantized(src)
    with Model(src) as model:
        cfg, ckpt = model.config, model.checkpoint
        if gguf:
            ckpt.chat_template_source()  # the template it would copy, refused now rather than after the weights
        q_lm_head = not keep_lm_head
        qspecs = quantized_specs(cfg, q_lm_head)
        bad = {name: k for name, (_, k) in qspecs.items() if k % group}
        if bad:
            name, k = next(iter(bad.items()))
            fits = [g for g in GROUP_SIZES if all(kk % g == 0 for _, kk in qspecs.values())]
            hint = f"use --group-size {' or '.join(map(str, fits))}" if fits else "no supported group size divides every K"
            raise GroupSizeError(f"group size {group} does not divide K={k} of {name!r} (in_features); {hint}")
        untie = q_lm_head and cfg.tie_word_embeddings
        # The q8 source of each quantized name: lm_head of a tied model is the embedding.
        source = {name: name for name in qspecs}
        if untie:
            source["lm_head.weight"] = "model.embed_tokens.weight"
        items: list[_Item] = []
        for name, (n, k) in qspecs.items():
            qname, sname = q8_names(name)
            items += [_Item(qname, "I8", (k, pad_n(n))), _Item(sname, "F32", (k // group, pad_n(n)))]
        floats = sorted(
            (_Item(name, ckpt.info(name).dtype, tuple(ckpt.info(name).shape)) for name in all_specs(cfg) if name not in qspecs),
            key=lambda it: (-DTYPES[it.dtype][2], it.name),  # widest first: every tensor stays aligned to its itemsize
        )
        items += floats
        copied = [name for name in qspecs if gguf and group == Q8_0_GROUP and ckpt.info(source[name]).ggml_type == "Q8_0"]
        metadata = {
            "format": "pt",
            META_QUANT: METHOD,
            META_GROUP: str(group),
            META_LM_HEAD: "q8" if q_lm_head else "full",
            META_N_ALIGN: str(N_ALIGN),
            META_LAYOUT: LAYOUT,
            META_UNTIED: "true" if untie else "false",
        }

        def tensors(bar) -> Iterator[torch.Tensor]:
            for name in qspecs:
                if name in copied:  # a GGUF's Q8_0 is q8 with group 32: its bytes, repacked
                    qweight, scales = ckpt.q8(source[name])
                else:  # IEEE division and rounding: the same bytes on any device, the GPU is just faster.
                    qweight, scales = quantize(ckpt.view(source[name]).to(device), group)
                yield qweight.cpu()
                yield scales.cpu()
                ckpt.drop_pages([source[name]])  # keep the reader's RSS to about one tensor on big models
                bar.update(1)
            for it in floats:
                yield ckpt.view(it.name)

        with model_output(out, force) as tmp:
            with progress.bar(len(qspecs), "quantize", "weight") as bar:
                write_safetensors(tmp / OUT_FILE, items, tensors(bar), metadata)
            raw = ckpt.config_dict() if gguf else read_json(src / "config.json")
            if untie:
                raw["tie_word_embeddings"] = False
            (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
            if gguf:
                write_gguf_side_files(model, tmp)
            else:
                for p in sorted(src.iterdir()):  # the tokenizer and generation files; the weights are new
                    if p.is_file() and is_model_file(p.name) and p.suffix != ".safetensors" and p.name not in (
                            "config.json", "model.safetensors.index.json"):
                        shutil.copyfile(p, tmp / p.name)
            written = (tmp / OUT_FILE).stat().st_size
        src_bytes = sum(f.size for f in ckpt.files.values())
    return {
        "out": str(out),
        "group_size": group,
        "lm_head": metadata[META_LM_HEAD],
        "untied": untie,
        "quantized": len(qspecs),
        "copied": len(copied),  # of them, a GGUF's Q8_0 weights copied as they are (0 for a float checkpoint)
        "experts": sum(".mlp.experts." in name for name in qspecs),  # of them, expert weights (0 for a dense model)
        "float_routers": sum(cfg.moe_layer(layer) for layer in range(cfg.num_hidden_layers)),  # kept in their dtype
        "source_bytes": src_bytes,
        "bytes": written,
    }


def refuse_quantized(src: Path) -> None:
    """A kestrel q8 directory is refused as a source: its weights are rounded already."""
    if src.is_dir() and any(src.glob("*.safetensors")):
        probe = Checkpoint(src)
        try:
            if probe.metadata.get(META_QUANT) or looks_quantized(probe):
                raise AlreadyQuantizedError(
                    f"{src} is already quantized ({META_QUANT}={probe.metadata.get(META_QUANT, '?')}); quantize the original float checkpoint"
                )
        finally:
            probe.close()


def quantize_to_gguf(model_dir: str | Path, out: str | Path, type_name: str) -> dict:
    """Write a float Hugging Face directory (or a name in the Hugging Face cache) as a new GGUF file ``out`` of
    ``type_name`` (``gguf_types.TYPE_NAMES``); returns ``write_gguf``'s summary and the source's bytes."""
    type_name = parse_type(type_name)
    if names_gguf(model_dir):
        raise QuantError(f"--type writes a GGUF from a float Hugging Face directory, and {model_dir} is a GGUF already: "
                         "re-quantizing its rounded weights adds error to error; pass the float model it came from "
                         "with --model (--from FILE.gguf converts a GGUF to q8, without --type)")
    src = hub.resolve(model_dir)
    check_new(out, "--out", GGUF_SUFFIX)  # before any work
    refuse_quantized(src)
    with Model(src) as model:
        summary = write_gguf(directory_source(model), out, type_name)
        summary["source_bytes"] = sum(f.size for f in model.checkpoint.files.values())
    return summary


def directory_source(model: Model) -> Source:
    """A Hugging Face directory as ``gguf_writer.Source``: its weights, tokenizer.json, tokenizer_config.json, chat
    template and end-of-generation ids, as kestrel reads them."""
    d, ckpt = Path(model.dir), model.checkpoint
    tokenizer = d / "tokenizer.json"
    text = None
    if model.tokenizer is not None and tokenizer.exists():
        text = read_bounded(tokenizer, TOKENIZER_LIMIT, str(tokenizer), "this is not a tokenizer.json").decode("utf-8")
    config_path = d / TOKENIZER_CONFIG
    config = read_json(config_path) if config_path.is_file() else {}
    # a "chat_template": null (as some tokenizer_config.json files hold) names none
    names_template = (d / TEMPLATE_FILE).exists() or (isinstance(config, dict) and config.get("chat_template") is not None)
    template = model.chat_template().source if names_template else None  # one kestrel cannot read is an error here
    return Source(model.config, ckpt.view, d.name, str(d), text, config if isinstance(config, dict) else {}, template,
                  frozenset(model.eos_ids), ckpt.drop_pages)


def write_gguf_side_files(model: Model, out: Path) -> None:
    """What a GGUF's metadata holds besides its config, as a Hugging Face directory holds it: tokenizer.json (where kestrel
    builds the tokenizer), tokenizer_config.json (its special tokens and chat template) and generation_config.json (the
    ids that end a generation, eos and end-of-turn)."""
    ckpt = model.checkpoint
    if model.tokenizer is not None:
        ckpt.hf_tokenizer().save(str(out / "tokenizer.json"))
    config = dict(ckpt.special_tokens())
    template = ckpt.chat_template_source()
    if template is not None:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": model.config.bos_token_id, "eos_token_id": sorted(model.eos_ids)}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def write_safetensors(path: Path, items: list[_Item], tensors: Iterator[torch.Tensor], metadata: dict[str, str]) -> None:
    """Stream tensors into one safetensors file in ``items`` order (the header is known up front).

    The header is compact sorted JSON padded with spaces to a 64-byte boundary, so the data
    region is aligned. Write it inside ``outdir.model_output``'s directory, which appears only when complete.
    """
    header: dict = {"__metadata__": dict(metadata)}
    at = 0
    for it in items:
        header[it.name] = {"dtype": it.dtype, "shape": list(it.shape), "data_offsets": [at, at + it.nbytes]}
        at += it.nbytes
    blob = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % 64)  # data starts 64-byte aligned in the file (and so every q8 entry)
    with open(path, "wb") as fh:
        fh.write(len(blob).to_bytes(8, "little"))
        fh.write(blob)
        for it, t in zip(items, tensors, strict=True):
            if TORCH_TO_ST[t.dtype] != it.dtype or tuple(t.shape) != it.shape:
                raise AssertionError(f"{it.name}: produced {t.dtype} {list(t.shape)}, header says {it.dtype} {list(it.shape)}")
            fh.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
