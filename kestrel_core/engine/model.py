"""The Qwen3 / Llama decoder's math, per layer (as in HF modeling_qwen3.py): pure functions of their weights.

What the weights are called and which tensors a checkpoint must hold: ``tensor_table``.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from kestrel_core.engine.kvcache import KVCache
from kestrel_core.formats.modelconfig import ModelConfig


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


#: The fewest keys a bounded decode step attends over (``key_bound``).
BOUND_FLOOR = 256


def key_bound(need: int, max_seq: int) -> int:
    """The keys a decode step over whole-cache masks attends over, where its rows need the first ``need``: ``need``
    rounded up to a power of two, at least ``BOUND_FLOOR``, at most ``max_seq``. A captured step is captured again only
    as the bound grows through these few sizes, and a short sequence in a long cache reads only the keys in use."""
    return min(max_seq, max(BOUND_FLOOR, 1 << max(0, need - 1).bit_length()))


@attrs.frozen
class Span:
    """One sequence's rows of a pass beyond the decode rows: ``T`` rows from ``row``, at positions ``start``.. of KV
    slot ``slot``: a prompt, or a chunk of one; or, ``verify``, a token and its drafts, which stand for decode steps."""

    slot: int
    row: int
    start: int
    T: int
    verify: bool = False


@attrs.frozen
class Attend:
    """Where a pass's rows sit: their KV slots and positions, their RoPE rows, and which cached keys each query sees.

    The first ``decode_rows`` rows are decode rows, row b the one token of KV slot ``first_slot`` + b (a pipeline's
    micro-batch starts past 0); they read their slots' whole
    static cache under a mask made from position tensors, so one captured graph serves every position. The rows after
    them are ``spans``, each one sequence's tokens, reading keys 0..start+T-1 of its slot, causally.
    """

    slots: torch.Tensor  # long [rows]: each row's KV slot, on the compute device
    positions: torch.Tensor  # long [rows]
    cos: torch.Tensor  # [rows, head_dim]
    sin: torch.Tensor
    decode_rows: int = 0
    decode_mask: torch.Tensor | None = None  # bool [decode_rows, max_seq]: the keys each decode row sees
    spans: tuple[Span, ...] = ()
    # Row-exact (a backend's ``row_exact``): every row attends alone over exactly the keys it sees, 0..its position (a
    # decode row, and each row of a span alike), so a token gets bitwise the same attention whether its pass carried
    # it alone, beside other sequences, in a prompt or in a drafted run, and reads only the positions in use, not
    # the whole static cache. ``live``: which decode rows move on; a parked one attends nothing (its row is dropped).
    key_positions: torch.Tensor | None = None
    live: tuple[bool, ...] | None = None
    # Row-exact rows read their positions on the host to slice the cache (``sliced``), unless the step may be captured:
    # then each reads the whole cache under a mask made on the device, in one formula for decode rows and spans alike.
    sliced: bool = False
    first_slot: int = 0

    @property
    def prompt_from(self) -> int | None:
        """The pass's first prompt row (None: it has none). A prompt's rows, and its chunks', come after every decode
        row and verify span, so a backend may compute them by other kernels than a decode row's
        (``Backend.prompt_linear``), each row's bits then following its kind and its values alone."""
        last = max((i for i, s in enumerate(self.spans) if s.verify), default=-1)  # the last verify span
        if last > 0 and any(not s.verify for s in self.spans[:last]):
            raise ValueError("a pass's prompt spans come after its verify spans, so that its prompt rows are its last")
        return self.spans[last + 1].row if last + 1 < len(self.spans) else None

    @classmethod
    def prefill(cls, rope: RopeTable, start: int, T: int, device, slot: int = 0,
                key_positions: torch.Tensor | None = None, sliced: bool = False) -> "Attend":
        """One sequence's ``T`` tokens at ``start`` of ``slot`` (row by row where ``key_positions`` is given)."""
        positions = torch.arange(start, start + T, device=device)
        slots = torch.full((T,), slot, dtype=torch.long, device=device)
        return cls(slots, positions, *rope.at(positions), spans=(Span(slot, 0, start, T),), key_positions=key_positions,
                   sliced=sliced)

    @classmethod
    def static(cls, rope: RopeTable, positions: torch.Tensor, slots: torch.Tensor, key_positions: torch.Tensor,
               spans: tuple[Span, ...] = (), span_positions: torch.Tensor | None = None,
               span_slots: torch.Tensor | None = None, row_exact: bool = False,
               live: torch.Tensor | None = None, sliced: bool = False, first_slot: int = 0,
               bound: int | None = None) -> "Attend":
        """Decode rows (row b: slot ``slots[b]`` = ``first_slot`` + b, at ``positions[b]``, long tensors on the
        device: nothing here reads the host, unless ``row_exact``, whose rows attend one at a time over their own
        keys), then optionally ``spans`` at ``span_positions`` of ``span_slots``; ``live``: the decode rows' live flags
        (row-exact: a parked row is skipped). ``bound``: the rows read only the first ``bound`` keys of their slots
        (the host holds every position they reach below it: ``key_bound``, or what a grown cache holds)."""
        sliced = row_exact and sliced
        if bound is not None:
            key_positions = key_positions[:bound]
        mask = None if sliced else key_positions[None, :] <= positions[:, None]
        rows = positions.shape[0]
        if spans:
            positions, slots = torch.cat((positions, span_positions)), torch.cat((slots, span_slots))
        return cls(slots, positions, *rope.at(positions), decode_rows=rows, decode_mask=mask, spans=spans,
                   key_positions=key_positions if row_exact else None,
                   live=tuple(bool(x) for x in live.tolist()) if sliced and live is not None else None, sliced=sliced,
                   first_slot=first_slot)

    @staticmethod
    def _alone(q_row: torch.Tensor, cache: KVCache, slot: int, upto: int, cfg: ModelConfig, scale: float) -> torch.Tensor:
        """One row's attention over keys 0..upto-1 of ``slot``: [1, q_dim]. Under a mask that hides nothing: without one,
        torch's CPU kernel takes a path that turns a NaN key into a finite output, and a poisoned weight would pass
        the non-finite check unseen."""
        seen = torch.ones((1, 1, 1, upto), dtype=torch.bool, device=q_row.device)
        out = F.scaled_dot_product_attention(q_row[None, :, None, :], cache.k[slot : slot + 1, :upto].transpose(1, 2),
                                             cache.v[slot : slot + 1, :upto].transpose(1, 2), attn_mask=seen,
                                             scale=scale, enable_gqa=True)
        return out.reshape(1, cfg.q_dim)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, cfg: ModelConfig) -> torch.Tensor:
        """Write the rows' K and V into their slots, and return each row's attention: [rows, q_dim]."""
        cache.k.index_put_((self.slots, self.positions), k)
        cache.v.index_put_((self.slots, self.positions), v)
        scale = cfg.head_dim**-0.5
        outs = []
        B, first = self.decode_rows, self.first_slot
        if B and self.sliced:  # row-exact: each decode row alone, over its keys 0..its position
            for b, pos in enumerate(self.positions[:B].tolist()):
                if self.live is not None and not self.live[b]:
                    outs.append(q.new_zeros((1, cfg.q_dim)))
                    continue
                outs.append(self._alone(q[b], cache, first + b, pos + 1, cfg, scale))
        elif B:
            S = self.decode_mask.shape[1]  # the whole cache, or the step's bound
            out = F.scaled_dot_product_attention(
                q[:B, :, None, :],  # [B, heads, 1, hd]
                cache.k[first:first + B, :S].transpose(1, 2),  # [B, kv_heads, S, hd]: SDPA groups the heads
                cache.v[first:first + B, :S].transpose(1, 2),
                attn_mask=self.decode_mask[:, None, None, :],
                scale=scale,
                enable_gqa=True,
            )
            outs.append(out.reshape(B, cfg.q_dim))
        for s in self.spans:
            if self.key_positions is not None and self.sliced:  # row-exact: each row as a decode row of its slot
                outs += [self._alone(q[s.row + r], cache, s.slot, s.start + r + 1, cfg, scale) for r in range(s.T)]
                continue
            if self.key_positions is not None:  # row-exact in a step that may be captured: the keys held, masked
                n = self.key_positions.shape[0]
                k_s = cache.k[s.slot : s.slot + 1, :n].transpose(1, 2)
                v_s = cache.v[s.slot : s.slot + 1, :n].transpose(1, 2)
                for r in range(s.T):
                    seen = (self.key_positions <= s.start + r)[None, None, None, :]
                    out = F.scaled_dot_product_attention(q[s.row + r][None, :, None, :], k_s, v_s, attn_mask=seen,
                                                         scale=scale, enable_gqa=True)
                    outs.append(out.reshape(1, cfg.q_dim))
                continue
            kv_len = s.start + s.T
            out = F.scaled_dot_product_attention(
                q[s.row : s.row + s.T].transpose(0, 1)[None],  # [1, heads, T, hd]
                cache.k[s.slot, :kv_len].transpose(0, 1)[None],
                cache.v[s.slot, :kv_len].transpose(0, 1)[None],
                attn_mask=_causal_mask(s.T, s.start, q.device) if s.T > 1 else None,
                scale=scale,
                enable_gqa=True,
            )[0]
            outs.append(out.transpose(0, 1).reshape(s.T, cfg.q_dim))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, head_dim]; cos/sin: [T, head_dim]
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


class LayerOps:
    """The row-wise steps of a layer between its linears, in torch: a backend may hand ``decoder_layer`` its own
    (``Backend.layer_ops``: fused kernels that compute the same math, each row by itself, so a row's result never
    depends on the rows beside it)."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    @staticmethod
    def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                     cos: torch.Tensor, sin: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, heads, head_dim] and k [T, kv_heads, head_dim]: each head normed (where the model norms them), then
        rotated by its row's position."""
        if q_norm is not None:
            q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    @staticmethod
    def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual h + delta, and its norm."""
        h = h + delta
        return h, rms_norm(h, weight, eps)

    @staticmethod
    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


TORCH_OPS = LayerOps()


def decoder_layer(
    h: torch.Tensor,  # [rows, hidden]: decode rows, then spans (``Attend``)
    w: dict[str, torch.Tensor],  # linear weights: q,k,v,o,gate,up,down or fused qkv / gate_up
    small: dict[str, torch.Tensor],  # norms and biases
    cache: KVCache,
    at: Attend,
    cfg: ModelConfig,
    linear=F.linear,
    experts=None,  # a sparse layer's experts after its router: experts(x, weights, chosen) -> their weighted sum
    ops: LayerOps = TORCH_OPS,  # the steps between the linears (a backend's fused kernels, or torch's)
) -> torch.Tensor:
    T = h.shape[0]
    eps = cfg.rms_norm_eps
    x = ops.rms_norm(h, small["input_norm"], eps)
    if "qkv" in w:
        q, k, v = linear(x, w["qkv"]).split((cfg.q_dim, cfg.kv_dim, cfg.kv_dim), dim=-1)
    else:
        q, k, v = linear(x, w["q"]), linear(x, w["k"]), linear(x, w["v"])
    if cfg.attention_bias:
        q, k, v = q + small["q_bias"], k + small["k_bias"], v + small["v_bias"]
    q = q.reshape(T, cfg.num_attention_heads, cfg.head_dim)
    k = k.reshape(T, cfg.num_key_value_heads, cfg.head_dim)
    v = v.reshape(T, cfg.num_key_value_heads, cfg.head_dim)
    q, k = ops.qk_norm_rope(q, k, small["q_norm"] if cfg.qk_norm else None, small["k_norm"] if cfg.qk_norm else None,
                            at.cos, at.sin, eps)
    h, x = ops.add_rms_norm(h, linear(at.attend(q, k, v, cache, cfg), w["o"]), small["post_norm"], eps)
    if "router" in w:
        weights, chosen = route(x, w["router"], cfg, linear)
        return h + experts(x, weights, chosen)  # where the experts are read from is the runner's: host or table
    if "gate_up" in w:
        gate, up = linear(x, w["gate_up"]).chunk(2, dim=-1)
    else:
        gate, up = linear(x, w["gate"]), linear(x, w["up"])
    return h + linear(ops.silu_mul(gate, up), w["down"])


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
    # Several tokens: their (token, slot) pairs sorted by expert, stably (each expert's in token order, as
    # ``torch.nonzero(experts == e)`` gives them), and every expert's count in one read: one host sync a layer, where
    # a nonzero an expert made one an expert (a prefill chunk's layer routes to most of them)
    k = experts.shape[1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens_of, slot_of = order // k, order % k
    counts = torch.bincount(flat, minlength=max(used) + 1 if used else 0).tolist()  # ``used`` may name one unrouted
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    for e in used if used is not None else [e for e, c in enumerate(counts) if c]:
        lo, hi = starts[e], starts[e + 1]
        tokens, slot = tokens_of[lo:hi], slot_of[lo:hi]
        y = expert_mlp(x[tokens], expert_weights(e), linear) * weights[tokens, slot, None]
        out.index_add_(0, tokens, y)
    return out
