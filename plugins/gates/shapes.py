"""Parameter counts from a ModelConfig: what a window streams, what stays resident, and the whole model."""

from __future__ import annotations

from kestrel_core.formats.modelconfig import ModelConfig


def n_moe_layers(cfg: ModelConfig) -> int:
    return sum(cfg.moe_layer(layer) for layer in range(cfg.num_hidden_layers))


def streamed_params(cfg: ModelConfig, layer: int) -> int:
    """Parameters of the layer's big matrices: what a window streams (a sparse layer: every expert and the router)."""
    h = cfg.hidden_size
    attn = cfg.q_dim * h + 2 * cfg.kv_dim * h + h * cfg.q_dim
    if not cfg.moe_layer(layer):
        return attn + 3 * h * cfg.intermediate_size
    return attn + cfg.num_experts * 3 * h * cfg.moe_intermediate_size + cfg.num_experts * h


def small_params(cfg: ModelConfig, layer: int) -> int:
    """Norms and biases of a layer: small, resident for the whole run."""
    n = 2 * cfg.hidden_size + (2 * cfg.head_dim if cfg.qk_norm else 0)
    if cfg.attention_bias:
        n += cfg.q_dim + 2 * cfg.kv_dim
    return n


def global_params(cfg: ModelConfig) -> int:
    """Embedding, lm_head (unless tied) and the final norm."""
    vh = cfg.vocab_size * cfg.hidden_size
    return vh * (1 if cfg.tie_word_embeddings else 2) + cfg.hidden_size


def param_count(cfg: ModelConfig) -> int:
    layers = range(cfg.num_hidden_layers)
    return global_params(cfg) + sum(streamed_params(cfg, i) + small_params(cfg, i) for i in layers)


def describe(cfg: ModelConfig) -> str:
    """One line: the type, the layers and KV shape, and the experts where there are some."""
    parts = [cfg.model_type, f"{cfg.num_hidden_layers} layers, {cfg.num_key_value_heads} kv heads x {cfg.head_dim}"]
    if cfg.is_moe:
        parts.append(f"MoE: {cfg.num_experts} experts, {cfg.num_experts_per_tok} per token")
    return ", ".join(parts)
