"""The checkpoint's tensor table: which tensors config.json implies, how they group into residency units, and the
check that a checkpoint holds exactly those (as Hugging Face's Qwen3 / Llama / Qwen3-MoE write them)."""

from __future__ import annotations

import re
from typing import Mapping

from kestrel_core.formats.checkpoint import FLOAT_DTYPES, FUSED_DOWN, FUSED_GATE_UP, Checkpoint
from kestrel_core.errors import CheckpointError
from kestrel_core.formats.modelconfig import ModelConfig
from kestrel_core.formats.units import UnitSpec

# The seven streamed linear weights of a layer, in compute order.
LINEAR_ROLES = ("q", "k", "v", "o", "gate", "up", "down")
_HF = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


def linear_specs(cfg: ModelConfig, layer: int) -> dict[str, tuple[str, tuple[int, int]]]:
    """role -> (tensor name, [out, in]) for the streamed weights of one layer's own unit.

    A dense layer's unit holds its seven linear weights; a Mixture-of-Experts layer's holds the
    attention's four and the router (its experts are units of their own: ``expert_specs``).
    """
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes = {
        "q": (cfg.q_dim, h),
        "k": (cfg.kv_dim, h),
        "v": (cfg.kv_dim, h),
        "o": (h, cfg.q_dim),
        "gate": (i, h),
        "up": (i, h),
        "down": (h, i),
    }
    p = f"model.layers.{layer + cfg.first_layer}."
    if cfg.moe_layer(layer):
        out = {r: (p + f"{_HF[r]}.weight", shapes[r]) for r in ("q", "k", "v", "o")}
        out["router"] = (p + "mlp.gate.weight", (cfg.num_experts, h))
        return out
    return {r: (p + f"{_HF[r]}.weight", shapes[r]) for r in LINEAR_ROLES}


def expert_specs(cfg: ModelConfig, layer: int, expert: int) -> dict[str, tuple[str, tuple[int, int]]]:
    """role -> (tensor name, [out, in]) of one expert, in the per-expert layout transformers writes.

    A checkpoint in transformers v5's fused 3-D layout (``mlp.experts.gate_up_proj`` [E, 2I, H],
    ``mlp.experts.down_proj`` [E, H, I]) serves these same names: Checkpoint resolves each to a slice.
    """
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    p = f"model.layers.{layer + cfg.first_layer}.mlp.experts.{expert}."
    return {"gate": (p + "gate_proj.weight", (i, h)), "up": (p + "up_proj.weight", (i, h)),
            "down": (p + "down_proj.weight", (h, i))}


def unit_specs(cfg: ModelConfig) -> tuple[UnitSpec, ...]:
    """The residency units: a layer's own unit ``(layer,)``, and each expert of a sparse layer ``(layer, e)``."""
    units = []
    for layer in range(cfg.num_hidden_layers):
        units.append(UnitSpec((layer,), layer, linear_specs(cfg, layer)))
        if cfg.moe_layer(layer):
            units += [UnitSpec((layer, e), layer, expert_specs(cfg, layer, e)) for e in range(cfg.num_experts)]
    return tuple(units)


def small_specs(cfg: ModelConfig, layer: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Per-layer norms (and biases): small, kept resident for the whole run."""
    p = f"model.layers.{layer + cfg.first_layer}."
    out = {
        "input_norm": (p + "input_layernorm.weight", (cfg.hidden_size,)),
        "post_norm": (p + "post_attention_layernorm.weight", (cfg.hidden_size,)),
    }
    if cfg.qk_norm:
        out["q_norm"] = (p + "self_attn.q_norm.weight", (cfg.head_dim,))
        out["k_norm"] = (p + "self_attn.k_norm.weight", (cfg.head_dim,))
    if cfg.attention_bias:
        for r, dim in (("q", cfg.q_dim), ("k", cfg.kv_dim), ("v", cfg.kv_dim)):
            out[f"{r}_bias"] = (p + f"{_HF[r]}.bias", (dim,))
    return out


def global_specs(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Embeddings, final norm and lm_head: never evicted. A part of the model (a pipeline rank's) holds the ones it
    uses: the embeddings where it starts at layer 0 (or where they are its tied lm_head), the norm and lm_head where
    it ends at the last layer."""
    out = {}
    if cfg.first_layer == 0 or (cfg.head and cfg.tie_word_embeddings):
        out["embed"] = ("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
    if cfg.head:
        out["norm"] = ("model.norm.weight", (cfg.hidden_size,))
        if not cfg.tie_word_embeddings:
            out["lm_head"] = ("lm_head.weight", (cfg.vocab_size, cfg.hidden_size))
    return out


def all_specs(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    specs = {name: shape for name, shape in global_specs(cfg).values()}
    for unit in unit_specs(cfg):
        specs.update({n: s for n, s in unit.tensors.values()})
    for layer in range(cfg.num_hidden_layers):
        specs.update({n: s for n, s in small_specs(cfg, layer).values()})
    return specs


# Old HF checkpoints saved RoPE's non-persistent inverse frequencies; they are recomputed from config.json.
_IGNORED_SUFFIX = ".rotary_emb.inv_freq"


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def check_depth(ckpt: Checkpoint, cfg: ModelConfig) -> None:
    """config.json's num_hidden_layers against the layers the checkpoint's tensors name, before a per-layer table
    is built for it: a config that claims more layers than the weights hold is refused at the cost of one pass over
    the names. (A checkpoint with more layers than config.json says is found by the check that every tensor is used.)"""
    have = max((int(m[1]) for name in ckpt.names() if (m := _LAYER.match(name))), default=-1) + 1
    if cfg.num_hidden_layers > have:
        held = f"stop at layer {have - 1} ({have} layers)" if have else "name no layer (model.layers.N....)"
        raise CheckpointError(f"{ckpt.dir}: config.json says num_hidden_layers={cfg.num_hidden_layers:,}, but the "
                              f"checkpoint's tensors {held}; fix config.json, or complete the checkpoint")


def validate_checkpoint(ckpt: Checkpoint, cfg: ModelConfig, quantized: Mapping[str, tuple[str, ...]] = {}) -> None:
    """Every tensor config.json implies is present, of a float dtype, and of the right shape; no other is there.

    ``quantized``: each weight a quantized checkpoint stores in another form, and the tensors it stores it as
    (checked against their own layout by the quantization's reader).
    """
    check_depth(ckpt, cfg)
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    for layer in filter(cfg.moe_layer, range(cfg.num_hidden_layers)):  # the fused 3-D layout, where a layer has it
        fused = {FUSED_GATE_UP.format(layer=layer): (E, 2 * I, H), FUSED_DOWN.format(layer=layer): (E, H, I)}
        present = [n for n in fused if n in ckpt]
        for name in present:
            info = ckpt.info(name)
            if info.dtype not in FLOAT_DTYPES:
                raise CheckpointError(f"tensor {name!r} has dtype {info.dtype}; expected one of {', '.join(FLOAT_DTYPES)}")
            if tuple(info.shape) != fused[name]:
                raise CheckpointError(
                    f"tensor {name!r} has shape {list(info.shape)} but config.json implies {list(fused[name])}; "
                    "config.json and the weights do not match"
                )
        if len(present) == 1:
            gone = next(n for n in fused if n not in present)
            raise CheckpointError(f"{ckpt.dir}: missing tensor {gone!r} (layer {layer} has {present[0]!r}); the checkpoint is incomplete")
    specs = all_specs(cfg)
    for name, shape in specs.items():
        if name in quantized:
            continue  # stored in its quantized form, which its reader checked
        info = ckpt.info(name)
        if info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"tensor {name!r} has dtype {info.dtype}; expected one of {', '.join(FLOAT_DTYPES)}"
            )
        if tuple(info.shape) != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {list(info.shape)} but config.json implies {list(shape)}; "
                "config.json and the weights do not match"
            )
    used = {n for name in specs for n in quantized.get(name, (name,))}
    _check_all_used(ckpt, cfg, used)


def _check_all_used(ckpt: Checkpoint, cfg: ModelConfig, used: set[str]) -> None:
    """A tensor config.json does not account for means config.json describes another model."""
    used = used | {ckpt.source(n) for n in used}  # a fused expert tensor is used through its slices
    unused = sorted(n for n in ckpt.names() if n not in used and not n.endswith(_IGNORED_SUFFIX))
    if not unused:
        return
    if cfg.tie_word_embeddings and "lm_head.weight" in unused:
        fix = "config.json says tie_word_embeddings true but the checkpoint has its own lm_head.weight: set tie_word_embeddings false"
    else:
        fix = (f"config.json (model_type {cfg.model_type}, num_hidden_layers={cfg.num_hidden_layers}, "
               f"attention_bias={str(cfg.attention_bias).lower()}) does not describe these weights: fix config.json or remove the tensors")
    shown = ", ".join(unused[:3]) + (", ..." if len(unused) > 3 else "")
    raise CheckpointError(f"{ckpt.dir}: {len(unused)} tensor(s) that config.json does not use ({shown}); {fix}")
