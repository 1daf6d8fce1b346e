"""``kestrel make-model``: real Hugging Face-format checkpoints with seeded random weights, or (``--type``) the same
weights as one GGUF file, quantized as ``kestrel quantize --type`` would quantize that checkpoint."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import zlib
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from safetensors import SafetensorError
from safetensors.torch import save_file

from kestrel_core.io import progress
from kestrel_core.engine.devices import compute_device
from kestrel_core.formats.dtypes import BY_NAME, WEIGHT_NAMES, itemsize
from kestrel_core.errors import ConfigError
from kestrel_core.formats.tensor_table import all_specs
from kestrel_core.formats.modelconfig import ModelConfig, parse_model_config
from kestrel_core.io.outdir import model_output
from kestrel_core.formats.gguf_writer import Source, write_gguf
from kestrel_core.formats.tokenizer import byte_chars

_QWEN3 = dict(model_type="qwen3", rms_norm_eps=1e-6, attention_bias=False, bos_token_id=None)

PRESETS: dict[str, dict] = {
    # For tests: small enough for a float64 reference.
    "tiny": dict(_QWEN3, vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=6,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                 rope_theta=10000.0, tie_word_embeddings=True, eos_token_id=256),
    # Llama path: no q/k norm, untied lm_head, Llama 3 RoPE scaling.
    "tiny-llama": dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=160,
                       num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                       max_position_embeddings=512, rope_theta=500000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, attention_bias=False, eos_token_id=256,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # The embedded default for `kestrel demo`.
    "demo": dict(_QWEN3, vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=2048,
                 rope_theta=1000000.0, tie_word_embeddings=True, eos_token_id=256),
    # About 320 MB in bf16: the preset the RSS bound is measured on.
    "small-300m": dict(_QWEN3, vocab_size=32768, hidden_size=1024, intermediate_size=3072, num_hidden_layers=10,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
                       rope_theta=1000000.0, tie_word_embeddings=True, eos_token_id=256),
    # Real shapes (for the GPU machine).
    # Qwen3-0.6B: the 8B's vocabulary, so it drafts for it (bench verify's draft model).
    "qwen3-0.6b": dict(_QWEN3, vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645),
    "qwen3-1.7b": dict(_QWEN3, vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645),
    "qwen3-8b": dict(_QWEN3, vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                     rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645),
    # Mixture-of-Experts (qwen3_moe). For tests: 8 experts, top-2, and layer 0 a dense MLP layer.
    "tiny-moe": dict(_QWEN3, model_type="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=160,
                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=True, eos_token_id=256,
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                     mlp_only_layers=[0], norm_topk_prob=True),
    # The Qwen3-30B-A3B shape: 48 layers of 128 experts (top-8), about 61 GB in bf16; --layers cuts the depth.
    "qwen3-30b-a3b": dict(_QWEN3, model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=False,
                          bos_token_id=151643, eos_token_id=151645, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True),
}

DTYPES = {name: BY_NAME[name].torch for name in WEIGHT_NAMES}
META_ROUTER_SKEW = "kestrel.router_skew"  # safetensors metadata of a checkpoint written with --router-skew


def preset_config(name: str, dtype: str = "bfloat16", layers: int | None = None) -> ModelConfig:
    """A preset's config; ``layers`` keeps only the first that many layers (every per-layer shape unchanged)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}")
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; available: {', '.join(DTYPES)}")
    raw = dict(PRESETS[name], torch_dtype=dtype)
    if layers is not None:
        full = raw["num_hidden_layers"]
        if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= full:
            raise ConfigError(f"--layers must be 1..{full} for preset {name} (its depth), got {layers!r}")
        raw["num_hidden_layers"] = layers
        if "mlp_only_layers" in raw:
            raw["mlp_only_layers"] = [layer for layer in raw["mlp_only_layers"] if layer < layers]
    return parse_model_config(raw, f"preset {name}")


def _init(name: str, shape: tuple[int, ...], cfg: ModelConfig, gen: torch.Generator, device) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen, device=device)
    if "embed_tokens" in name or name == "lm_head.weight":
        # Logit std ~2 after the final norm: a clear top choice, and varied text.
        return torch.randn(shape, generator=gen, device=device) * (2.0 / cfg.hidden_size**0.5)
    fan_in = shape[-1]
    return torch.randn(shape, generator=gen, device=device) * (1.5 / fan_in**0.5)


# --- --router-skew: expert popularity that follows Zipf -----------------------------------

# The noise of a random router's logits (std 1.5 on a normalized hidden state, from _init's 1.5/sqrt(fan_in))
# in units of a Gumbel scale: with Gumbel noise of scale b, a logit bias of -S*b*log(r+1) makes the
# router's first choice Zipf(S) (Gaussian noise of the same std is close).
_ROUTER_GUMBEL = 1.5 * math.sqrt(6) / math.pi


def _residual_rms(layer: int) -> float:
    """About the RMS of the residual stream of a random kestrel model before layer ``layer``'s MLP
    (measured on tiny, tiny-moe and demo: each block adds about the same variance, inputs being normalized)."""
    return math.sqrt(1.4 + 6.0 * layer)


def router_ranks(seed: int, layer: int, num_experts: int) -> list[int]:
    """Each expert's popularity rank (0: the most routed to) in sparse layer ``layer`` of a skewed router."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(f"router-skew.{layer}".encode())) % 2**64)
    order = torch.randperm(num_experts, generator=gen).tolist()  # order[r]: the expert at rank r
    ranks = [0] * num_experts
    for r, e in enumerate(order):
        ranks[e] = r
    return ranks


def skew_channel(seed: int, hidden: int) -> int:
    """The residual channel a skewed router reads its bias from."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(b"router-skew.channel")) % 2**64)
    return int(torch.randint(hidden, (1,), generator=gen))


def check_router_skew(cfg: ModelConfig, skew) -> float:
    if isinstance(skew, bool) or not isinstance(skew, (int, float)) or not math.isfinite(skew) or skew < 0:
        raise ConfigError(f"--router-skew must be a number >= 0 (0: the plain random router), got {skew!r}")
    if skew and not any(cfg.moe_layer(layer) for layer in range(cfg.num_hidden_layers)):
        what = "has no sparse layer" if cfg.is_moe else f"is dense ({cfg.model_type})"
        raise ConfigError(f"--router-skew needs a Mixture-of-Experts model but this one {what}: "
                          "drop --router-skew or pick a MoE preset such as tiny-moe")
    return float(skew)


def _apply_router_skew(name: str, t: torch.Tensor, cfg: ModelConfig, seed: int, skew: float) -> torch.Tensor:
    """Bend one freshly drawn float32 tensor so that routers prefer experts by a Zipf(skew) law.

    One residual channel ``d`` holds a constant: every embedding row has ``c`` there and no block
    writes it (row d of each o_proj, dense down_proj and expert down_proj is zero), so at every
    layer and token h[d] = c and the post-attention RMSNorm gives x[d] = c / rms(h) > 0 (its weight
    at d is 1). Column d of a sparse layer's router holds each expert's bias: x[d] and the router's
    noise both scale with 1 / rms(h), so bias / noise depends only on the RMS of the other channels,
    which ``_residual_rms`` estimates per layer; the bias is -skew * log(rank + 1) Gumbel scales there.
    The rest of the model is unchanged; with tied embeddings the constant shifts every output logit
    alike. Measured (tiny-moe, and a 24-layer variant): routing shares by rank close to Zipf(skew)'s.
    """
    h = cfg.hidden_size
    d = skew_channel(seed, h)
    c = 4.0 / math.sqrt(h)  # about two embedding stds: a channel as small as the others at layer 0
    parts = name.split(".")
    if name == "model.embed_tokens.weight":
        t[:, d] = c
    elif name.endswith(("self_attn.o_proj.weight", "down_proj.weight")):
        t[d, :] = 0.0
    elif parts[:2] == ["model", "layers"] and cfg.moe_layer(layer := int(parts[2])):
        if name.endswith("post_attention_layernorm.weight"):
            t[d] = 1.0
        elif name.endswith("mlp.gate.weight"):
            ranks = torch.tensor(router_ranks(seed, layer, cfg.num_experts), dtype=torch.float64)
            scale = _ROUTER_GUMBEL * _residual_rms(layer) / c
            t[:, d] = (-skew * scale * torch.log1p(ranks)).to(t.device, t.dtype)
    return t


def shard_plan(cfg: ModelConfig, shard_mb: int) -> list[list[str]]:
    """Tensor names of each file, in order: one file, or shards of at most ``shard_mb`` MiB (0: one file)."""
    if not isinstance(shard_mb, int) or isinstance(shard_mb, bool) or shard_mb < 0:
        raise ConfigError(f"--shard-mb must be a whole number >= 0 (0: one file), got {shard_mb!r}")
    item = itemsize(DTYPES[cfg.torch_dtype])
    limit = shard_mb * 2**20
    plan: list[list[str]] = [[]]
    size = 0
    for name, shape in all_specs(cfg).items():
        nbytes = int(torch.Size(shape).numel()) * item
        if limit and plan[-1] and size + nbytes > limit:
            plan.append([])
            size = 0
        plan[-1].append(name)
        size += nbytes
    return plan


def write_checkpoint(
    cfg: ModelConfig,
    out: Path,
    seed: int = 0,
    shard_mb: int = 0,
    device: str = "cpu",
    force: bool = False,
    flag: str = "--out",
    router_skew: float = 0.0,
    force_flag: str | None = "--force",
) -> Path:
    """Write config.json, *.safetensors (sharded above ``shard_mb``) and a byte-level tokenizer.json.

    The directory appears whole or not at all (``outdir.model_output``); a non-empty ``out`` is
    refused unless ``force`` (``force_flag`` is the flag that says so, None where the command has none).
    ``router_skew`` S > 0 (a MoE model only) draws routers whose first
    choice follows about Zipf(S) over a seeded per-layer ranking of the experts (``router_ranks``;
    see ``_apply_router_skew``); the safetensors metadata records it as ``kestrel.router_skew``.
    Under ``progress.shown`` a bar counts the bytes drawn.
    """
    out = Path(out)
    if not 0 <= seed < 2**64:
        raise ConfigError(f"--seed must be in 0..2**64-1, got {seed}")
    router_skew = check_router_skew(cfg, router_skew)
    metadata = {"format": "pt"}
    if router_skew:
        metadata[META_ROUTER_SKEW] = repr(router_skew)
    dev = compute_device(device)
    plan = shard_plan(cfg, shard_mb)
    dtype = DTYPES[cfg.torch_dtype]
    specs = all_specs(cfg)
    total = sum(int(torch.Size(s).numel()) for s in specs.values()) * itemsize(dtype)
    files = ["model.safetensors"] if len(plan) == 1 else [
        f"model-{k:05d}-of-{len(plan):05d}.safetensors" for k in range(1, len(plan) + 1)]
    with model_output(out, force, flag, force_flag) as tmp, progress.bar(total, "make-model", "B") as bar:
        for fname, names in zip(files, plan):
            tensors = {}
            for name in names:
                tensors[name] = draw(name, specs[name], cfg, seed, dev, router_skew)
                bar.update(tensors[name].numel() * tensors[name].element_size())
            bar.set_postfix_str(f"writing {fname}")
            _save(tensors, tmp / fname, metadata)
        if len(plan) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {name: fname for fname, names in zip(files, plan) for name in names}}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
        (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": cfg.eos_token_id, "do_sample": False}))
        (tmp / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer(cfg)))
    return out


def draw(name: str, shape: tuple[int, ...], cfg: ModelConfig, seed: int, device, router_skew: float) -> torch.Tensor:
    """The weights of tensor ``name``, as the checkpoint stores them (its own seeded generator, then the dtype)."""
    gen = torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**64)
    t = _init(name, shape, cfg, gen, device)
    if router_skew:
        t = _apply_router_skew(name, t, cfg, seed, router_skew)
    return t.to(DTYPES[cfg.torch_dtype]).cpu().contiguous()


def write_preset_gguf(cfg: ModelConfig, out: Path, type_name: str, name: str, seed: int = 0, device: str = "cpu",
                      router_skew: float = 0.0, flag: str = "--out", random_blocks: bool = False) -> dict:
    """Write the checkpoint ``write_checkpoint`` would write (same seed, dtype and router skew) as a new GGUF file
    ``out`` of ``type_name`` (``gguf_types.TYPE_NAMES``), through the writer ``kestrel quantize --type`` uses, drawing
    one tensor at a time: no directory is written first. With ``random_blocks`` each quantized tensor is random valid
    blocks of its type (``random_blocks``) instead of the quantized random weights: the same tensors, types and bytes,
    written at the disk's speed (quantizing runs at about 10 M values a second a core). Returns the writer's summary."""
    if not 0 <= seed < 2**64:
        raise ConfigError(f"--seed must be in 0..2**64-1, got {seed}")
    router_skew = check_router_skew(cfg, router_skew)
    dev = compute_device(device)
    specs = all_specs(cfg)
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
    source = Source(cfg, lambda tensor: draw(tensor, specs[tensor], cfg, seed, dev, router_skew), name, f"preset {name}",
                    json.dumps(byte_level_tokenizer(cfg)), end_ids=frozenset(i for i in eos if i is not None))
    blocks = None
    if random_blocks:
        def blocks(p):
            rows = math.prod(p.shape[:-1])
            return random_blocks_of(p.kind.qtype, rows, p.shape[-1], np.random.default_rng([seed, zlib.crc32(p.name.encode())]))
    summary = write_gguf(source, out, type_name, flag, blocks=blocks)
    summary["source_bytes"] = sum(int(torch.Size(s).numel()) for s in specs.values()) * itemsize(DTYPES[cfg.torch_dtype])
    return summary


# Each quantized type's f16 scale fields: (byte offset in the block, the largest weight they give over the scale).
# A random block draws its quant bits at random and each scale so that its weights span about +-WEIGHT_SPAN.
_SCALES = {"Q4_0": ((0, 8),), "Q4_1": ((0, 15), (2, -1)), "Q5_0": ((0, 16),), "Q5_1": ((0, 31), (2, -1)),
           "Q8_0": ((0, 127),), "Q4_K": ((0, 63 * 15), (2, 63)),
           "Q5_K": ((0, 63 * 31), (2, 63)), "Q6_K": ((208, 127 * 32),)}
WEIGHT_SPAN = 0.05


def random_blocks_of(qtype, rows: int, row_values: int, rng: np.random.Generator) -> np.ndarray:
    """``rows`` rows of ``row_values`` values as random valid ``qtype`` blocks: uint8 [rows, bytes a row], every quant
    bit random, every f16 scale positive and finite (a min negative), the weights within about +-WEIGHT_SPAN."""
    values, size = GGML_QUANT_SIZES[qtype]
    per_row = row_values // values
    b = rng.integers(0, 256, (rows * per_row, size), dtype=np.uint8)
    for at, span in _SCALES[qtype.name]:
        d = (rng.uniform(0.5, 1.0, len(b)) * WEIGHT_SPAN / span).astype(np.float16)
        b[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    return b.reshape(rows, per_row * size)


def _save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """safetensors' save_file, its I/O failures (a full disk) raised as the OSError they are, which
    ``model_output`` reports in one line; the library raises its own SafetensorError with the errno in the text."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as exc:
        m = re.search(r"I/O error: (.*?) \(os error (\d+)\)", str(exc))
        if not m:
            raise OSError(errno.EIO, " ".join(str(exc).split()), str(path)) from None
        raise OSError(int(m[2]), os.strerror(int(m[2])), str(path)) from None


def byte_level_tokenizer(cfg: ModelConfig) -> dict:
    """A Hugging Face tokenizer.json: ids 0..255 are bytes, 256 is <|endoftext|>; no merges."""
    table = byte_chars()
    vocab = {table[b]: b for b in range(256)}
    special = [{"id": 256, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                "rstrip": False, "normalized": False, "special": True}]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": special if cfg.vocab_size > 256 else [],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": []},
    }
