"""A layer's steps between its linears as fused Triton kernels (``FusedOps``, the cuda backend's ``layer_ops``): the
input RMSNorm; Qwen3's per-head q and k norms with the rotary embedding, one launch each of q and k; the residual add
with the post-attention norm; SiLU(gate) * up. In torch those are 45 small kernels a layer (bf16), each a launch a
decode step replays; here five.

Each is ``model.LayerOps``'s math, rounded where torch rounds (every product and sum of the compute dtype rounded to
it, the norm's mean of squares in float32), each row by itself in one program, so a row's result never depends on the
rows beside it or on how many there are. The bits differ from torch's kernels only in the float32 sum of squares'
order and in ``exp``'s last place, which ``tests/test_layer_ops.py`` bounds. Where the tensors' dtypes are mixed (a
norm weight in float32 beside bf16 activations) a step runs torch's ``LayerOps``; ``[backend] layer_ops`` picks.
"""

from __future__ import annotations

import functools

import torch

from kestrel_core.engine.model import TORCH_OPS, LayerOps
from kestrel_core.errors import ConfigError

from .triton_check import available

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    globals().update(tl=tl)  # the compiler resolves a jit function's names in this module's globals

    @triton.jit
    def norm_rows(x, xs, d, ds, w, h, y, D, eps, ADD: tl.constexpr, BLOCK: tl.constexpr):
        """Row r of x [R, D] (row stride xs): y = w * norm(x) in x's dtype; ADD: x + d first (d's row stride ds), that
        sum also written to h (contiguous)."""
        r = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK)
        ok = i < D
        v = tl.load(x + r * xs + i, mask=ok, other=0.0)
        if ADD:
            v = (v.to(tl.float32) + tl.load(d + r * ds + i, mask=ok, other=0.0).to(tl.float32)).to(v.dtype)
            tl.store(h + r * D + i, v, mask=ok)
        v32 = v.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(v32 * v32, axis=0) / D + eps)
        n = (v32 * inv).to(v.dtype).to(tl.float32)
        out = tl.load(w + i, mask=ok, other=0.0).to(tl.float32) * n
        tl.store(y + r * D + i, out.to(v.dtype), mask=ok)

    @triton.jit
    def head_rope(x, ts, hs, w, cos, sin, y, H, eps, NORM: tl.constexpr, HALF: tl.constexpr):
        """Head hh of row t of x [T, H, 2 HALF] (strides ts, hs): normed by w (NORM), then rotated by row t's cos and
        sin [T, 2 HALF] (the rotate-half convention), into y [T, H, 2 HALF] contiguous."""
        p = tl.program_id(0)
        t, hh = (p // H).to(tl.int64), p % H
        i = tl.arange(0, HALF)
        a = tl.load(x + t * ts + hh * hs + i)
        b = tl.load(x + t * ts + hh * hs + HALF + i)
        dt = a.dtype
        if NORM:
            a32, b32 = a.to(tl.float32), b.to(tl.float32)
            inv = 1.0 / tl.sqrt((tl.sum(a32 * a32, axis=0) + tl.sum(b32 * b32, axis=0)) / (2 * HALF) + eps)
            a = (tl.load(w + i).to(tl.float32) * (a32 * inv).to(dt).to(tl.float32)).to(dt)
            b = (tl.load(w + HALF + i).to(tl.float32) * (b32 * inv).to(dt).to(tl.float32)).to(dt)
        c1, c2 = tl.load(cos + t * 2 * HALF + i).to(tl.float32), tl.load(cos + t * 2 * HALF + HALF + i).to(tl.float32)
        s1, s2 = tl.load(sin + t * 2 * HALF + i).to(tl.float32), tl.load(sin + t * 2 * HALF + HALF + i).to(tl.float32)
        a32, b32 = a.to(tl.float32), b.to(tl.float32)
        lo = (a32 * c1).to(dt).to(tl.float32) + (-b32 * s1).to(dt).to(tl.float32)  # x * cos + rotate_half(x) * sin
        hi = (b32 * c2).to(dt).to(tl.float32) + (a32 * s2).to(dt).to(tl.float32)
        out = y + (t * H + hh) * 2 * HALF
        tl.store(out + i, lo.to(dt))
        tl.store(out + HALF + i, hi.to(dt))

    @triton.jit
    def silu_mul(g, gs, u, us, y, N, BLOCK: tl.constexpr):
        """Row r of SiLU(g) * u (row strides gs, us), columns in blocks of BLOCK, into y [R, N] contiguous."""
        r = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = i < N
        a = tl.load(g + r * gs + i, mask=ok, other=0.0)
        a32 = a.to(tl.float32)
        s = (a32 / (1.0 + tl.exp(-a32))).to(a.dtype).to(tl.float32)
        out = s * tl.load(u + r * us + i, mask=ok, other=0.0).to(tl.float32)
        tl.store(y + r * N + i, out.to(a.dtype), mask=ok)

    return norm_rows, head_rope, silu_mul


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """t as rows of its last dimension, unit-strided, and the rows' stride (t itself where that needs no copy)."""
    if t.stride(-1) != 1:
        return None
    flat = t.reshape(-1, t.shape[-1])  # a view where t's rows lie at one stride
    return flat, flat.stride(0)


class FusedOps(LayerOps):
    """``LayerOps`` in Triton kernels, for tensors of one dtype on one device (else torch's)."""

    @staticmethod
    def _same(*ts: torch.Tensor) -> bool:
        dt = ts[0].dtype
        return dt in DTYPES and all(t.dtype == dt and t.device == ts[0].device for t in ts)

    def rms_norm(self, x, weight, eps):
        return self._norm(x, None, weight, eps)[1]

    def add_rms_norm(self, h, delta, weight, eps):
        return self._norm(h, delta, weight, eps)

    def _norm(self, x, delta, weight, eps):
        d = x.shape[-1]
        fits = weight.shape == (d,) and weight.is_contiguous()  # else torch's (which says what is wrong)
        xr = _rows(x) if fits and self._same(x, weight, *(() if delta is None else (delta,))) else None
        dr = _rows(delta) if delta is not None and xr is not None else None
        if xr is None or (delta is not None and (dr is None or delta.shape != x.shape)):
            if delta is None:
                return None, TORCH_OPS.rms_norm(x, weight, eps)
            return TORCH_OPS.add_rms_norm(x, delta, weight, eps)
        (xf, xs), rows = xr, xr[0].shape[0]
        y = torch.empty((rows, d), dtype=x.dtype, device=x.device)
        h = torch.empty_like(y) if delta is not None else y
        if rows:
            df, ds = dr if dr is not None else (xf, xs)
            block = max(16, 1 << (d - 1).bit_length())
            _kernels()[0][(rows,)](xf, xs, df, ds, weight, h, y, d, float(eps), ADD=delta is not None, BLOCK=block,
                                   num_warps=min(16, max(1, block // 512)))  # 16 values a thread at most, to 8k
        shape = x.shape
        return (h.view(shape) if delta is not None else None), y.view(shape)

    def qk_norm_rope(self, q, k, q_norm, k_norm, cos, sin, eps):
        norms = () if q_norm is None else (q_norm, k_norm)
        D = q.shape[-1]
        if (not self._same(q, k, cos, sin, *norms) or D % 2 or D & (D - 1) or D < 32 or cos.shape != (q.shape[0], D)
                or not cos.is_contiguous() or not sin.is_contiguous() or sin.shape != cos.shape
                or any(not n.is_contiguous() or n.shape != (D,) for n in norms)
                or q.stride(-1) != 1 or k.stride(-1) != 1):
            return TORCH_OPS.qk_norm_rope(q, k, q_norm, k_norm, cos, sin, eps)
        out = []
        for x, w in ((q, q_norm), (k, k_norm)):
            T, H, _ = x.shape
            y = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
            if T * H:
                _kernels()[1][(T * H,)](x, x.stride(0), x.stride(1), w if w is not None else x, cos, sin, y, H,
                                        float(eps), NORM=w is not None, HALF=D // 2, num_warps=1)
            out.append(y)
        return out[0], out[1]

    def silu_mul(self, gate, up):
        g, u = _rows(gate), _rows(up)
        if not self._same(gate, up) or g is None or u is None or gate.shape != up.shape:
            return TORCH_OPS.silu_mul(gate, up)
        (gf, gs), (uf, us) = g, u
        rows, n = gf.shape
        y = torch.empty((rows, n), dtype=gate.dtype, device=gate.device)
        block = 1024
        if rows:
            _kernels()[2][(rows, -(-n // block))](gf, gs, uf, us, y, n, BLOCK=block, num_warps=4)
        return y.view(gate.shape)


def layer_ops(choice: str = "auto") -> LayerOps:
    """``[backend] layer_ops``: "auto", the fused kernels where Triton is installed, else torch's steps; "fused", the
    kernels or a ConfigError that says why not; "torch", torch's steps."""
    why = available()
    if choice == "fused" and why:
        raise ConfigError(f"layer_ops = 'fused' needs the fused kernels, which cannot run here ({why}); install Triton, "
                          "or set layer_ops = 'auto'")
    return TORCH_OPS if choice == "torch" or why else FusedOps()
