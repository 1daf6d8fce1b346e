"""The Qwen3 / Llama decoder's math, per layer (as in HF modeling_qwen3.py): pure functions of their weights.

What the weights are called and which tensors a checkpoint must hold: ``tensor_table``.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from .kvcache import KVCache
from .modelconfig import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.to(torch.promote_types(dtype, torch.float32))  # at least float32; float64 stays float64
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


class RopeTable:
    """cos and sin of every position a run can reach, [max_seq, head_dim], computed once (in float64) per generation."""

    def __init__(self, cfg: ModelConfig, max_seq: int, dtype, device):
        inv = cfg.inv_freq().to(device)
        freqs = torch.arange(max_seq, device=device, dtype=torch.float64)[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, head_dim] for the HF rotate-half convention; ``positions`` is a long tensor on the device."""
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)


@attrs.frozen
class Attend:
    """Where a forward's tokens sit: their positions, their RoPE rows, and which cached keys each query sees.

    A decode step reads the whole static cache (``kv_len`` = its length) under a mask made from a
    position tensor, so one captured graph serves every position; prefill reads keys 0..start+T-1.
    """

    positions: torch.Tensor  # long [T] on the compute device
    cos: torch.Tensor  # [T, head_dim]
    sin: torch.Tensor
    kv_len: int  # keys 0..kv_len-1 of the cache are read
    mask: torch.Tensor | None  # bool [T, kv_len] (True: seen), or None: every one of the kv_len keys is seen

    @classmethod
    def prefill(cls, rope: RopeTable, start: int, T: int, device) -> "Attend":
        positions = torch.arange(start, start + T, device=device)
        return cls(positions, *rope.at(positions), start + T, _causal_mask(T, start, device) if T > 1 else None)

    @classmethod
    def static(cls, rope: RopeTable, position: torch.Tensor, key_positions: torch.Tensor) -> "Attend":
        """One token at ``position`` (a long [1] tensor) against the full cache: nothing here reads the host."""
        return cls(position, *rope.at(position), key_positions.numel(), (key_positions <= position)[None, :])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, head_dim]; cos/sin: [T, head_dim]
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


def decoder_layer(
    h: torch.Tensor,  # [T, hidden]
    w: dict[str, torch.Tensor],  # linear weights: q,k,v,o,gate,up,down or fused qkv / gate_up
    small: dict[str, torch.Tensor],  # norms and biases
    cache: KVCache,
    at: Attend,
    cfg: ModelConfig,
    linear=F.linear,
    experts=None,  # a sparse layer's experts after its router: experts(x, weights, chosen) -> their weighted sum
) -> torch.Tensor:
    T = h.shape[0]
    eps = cfg.rms_norm_eps
    x = rms_norm(h, small["input_norm"], eps)
    if "qkv" in w:
        q, k, v = linear(x, w["qkv"]).split((cfg.q_dim, cfg.kv_dim, cfg.kv_dim), dim=-1)
    else:
        q, k, v = linear(x, w["q"]), linear(x, w["k"]), linear(x, w["v"])
    if cfg.attention_bias:
        q, k, v = q + small["q_bias"], k + small["k_bias"], v + small["v_bias"]
    q = q.reshape(T, cfg.num_attention_heads, cfg.head_dim)
    k = k.reshape(T, cfg.num_key_value_heads, cfg.head_dim)
    v = v.reshape(T, cfg.num_key_value_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, small["q_norm"], eps)
        k = rms_norm(k, small["k_norm"], eps)
    q, k = apply_rope(q, at.cos, at.sin), apply_rope(k, at.cos, at.sin)
    cache.k.index_copy_(0, at.positions, k)
    cache.v.index_copy_(0, at.positions, v)
    attn = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # [1, heads, T, hd]
        cache.k[: at.kv_len].transpose(0, 1)[None],  # [1, kv_heads, S, hd]: SDPA groups the heads, nothing is repeated
        cache.v[: at.kv_len].transpose(0, 1)[None],
        attn_mask=at.mask,
        scale=cfg.head_dim**-0.5,
        enable_gqa=True,
    )[0]
    attn = attn.transpose(0, 1).reshape(T, cfg.q_dim)
    h = h + linear(attn, w["o"])
    x = rms_norm(h, small["post_norm"], eps)
    if "router" in w:
        weights, chosen = route(x, w["router"], cfg, linear)
        return h + experts(x, weights, chosen)  # where the experts are read from is the runner's: host or table
    if "gate_up" in w:
        gate, up = linear(x, w["gate_up"]).chunk(2, dim=-1)
    else:
        gate, up = linear(x, w["gate"]), linear(x, w["up"])
    return h + linear(F.silu(gate) * up, w["down"])


def _causal_mask(T: int, start: int, device) -> torch.Tensor:
    # Query i (absolute position start+i) sees keys 0..start+i.
    q_pos = torch.arange(start, start + T, device=device)[:, None]
    k_pos = torch.arange(start + T, device=device)[None, :]
    return k_pos <= q_pos


def route(x: torch.Tensor, router: torch.Tensor, cfg: ModelConfig, linear=F.linear) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and their weights, as Hugging Face's Qwen3MoeSparseMoeBlock routes.

    A softmax over every expert (in float32 at least), the top ``num_experts_per_tok``, renormalised
    to sum to 1 where ``norm_topk_prob``: (weights [T, k] in x's dtype, experts [T, k]).
    """
    logits = linear(x, router)
    probs = torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    weights, experts = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), experts


def expert_mlp(x: torch.Tensor, w: dict[str, torch.Tensor], linear=F.linear) -> torch.Tensor:
    if "gate_up" in w:  # a backend's fused layout
        gate, up = linear(x, w["gate_up"]).chunk(2, dim=-1)
    else:
        gate, up = linear(x, w["gate"]), linear(x, w["up"])
    return linear(F.silu(gate) * up, w["down"])


def sparse_mlp(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, expert_weights, linear=F.linear,
               used: list[int] | None = None) -> torch.Tensor:
    """sum over each token's routed experts of weight * expert(x), token group by expert group.

    ``expert_weights(e)`` gives expert e's weights: each routed expert is asked for once,
    whatever the number of tokens routed to it (a prefill uploads an expert at most once).
    ``used``, where the caller has it already: ``experts[0].tolist()`` for one token (its k
    experts in slot order), else ``torch.unique(experts).tolist()``.
    """
    out = torch.zeros_like(x)
    if x.shape[0] == 1:  # one token: each expert's weight is a view by slot, so there is no index lookup or host sync
        slots = used if used is not None else experts[0].tolist()
        for slot, e in sorted(enumerate(slots), key=lambda se: se[1]):  # in expert order, as the grouped path sums
            out += expert_mlp(x, expert_weights(e), linear) * weights[:, slot, None]
        return out
    for e in used if used is not None else torch.unique(experts).tolist():
        tokens, slot = torch.nonzero(experts == e, as_tuple=True)
        y = expert_mlp(x[tokens], expert_weights(e), linear) * weights[tokens, slot, None]
        out.index_add_(0, tokens, y)
    return out
