"""The cuda backend's fused layer steps (``backends/cuda/layer_ops.py``) against torch's ``LayerOps``: run in Triton's
interpreter on the CPU (CI), on the GPU in the cuda suite. Each row of a batch is bitwise that row alone."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported

from backends.cuda import layer_ops  # noqa: E402
from kestrel_core.engine.model import TORCH_OPS  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(layer_ops.available() is not None, reason="needs Triton")

OPS = layer_ops.FusedOps()
DTYPES = [torch.bfloat16, torch.float32]


def randn(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 2).to(dtype).to(DEVICE)


# Triton's interpreter casts float32 to bfloat16 by truncation, where the GPU (and torch) round to nearest even: there,
# bfloat16 results are held to a few places more, and the residual's bits to its place (exact on the GPU)
TRUNCATES = DEVICE == "cpu"


def places(dtype):
    return 4 if TRUNCATES and dtype == torch.bfloat16 else 2


def close(got, want, dtype, n=None):
    """Within ``places`` of the dtype's last places of the largest magnitude: the float32 sum's order and exp's last
    place (and the interpreter's truncation)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    ulp = torch.finfo(dtype).eps * want.abs().max().float()
    assert (got.float() - want.float()).abs().max() <= (n or places(dtype)) * ulp, \
        (got.float() - want.float()).abs().max() / ulp


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norm_and_residual_norm_match_torch_row_by_row(dtype):
    x, d, w = randn(5, 96, dtype=dtype, seed=1), randn(5, 96, dtype=dtype, seed=2), randn(96, dtype=dtype, seed=3)
    close(OPS.rms_norm(x, w, 1e-6), TORCH_OPS.rms_norm(x, w, 1e-6), dtype)
    h, y = OPS.add_rms_norm(x, d, w, 1e-6)
    h0, y0 = TORCH_OPS.add_rms_norm(x, d, w, 1e-6)
    if TRUNCATES and dtype == torch.bfloat16:
        close(h, h0, dtype, 1)
    else:
        assert torch.equal(h, h0)  # the residual is one rounded add, as torch's
    close(y, y0, dtype)
    assert torch.equal(OPS.rms_norm(x[3:4], w, 1e-6), OPS.rms_norm(x, w, 1e-6)[3:4])  # a row is its own
    assert torch.equal(OPS.add_rms_norm(x[2:3], d[2:3], w, 1e-6)[1], y[2:3])


@pytest.mark.parametrize("norm", [True, False], ids=["qk-norm", "rope-only"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_head_norm_and_rope_match_torch_on_a_split_projection(dtype, norm):
    T, H, Hk, D = 3, 4, 2, 32
    qkv = randn(T, (H + 2 * Hk) * D, dtype=dtype, seed=4)  # the fused projection, split as the layer splits it
    q, k, _ = qkv.split((H * D, Hk * D, Hk * D), dim=-1)
    q, k = q.reshape(T, H, D), k.reshape(T, Hk, D)
    pos = torch.arange(7, 7 + T, dtype=torch.float64)[:, None] * (1e4 ** (-torch.arange(0, D, 2) / D))[None, :]
    emb = torch.cat((pos, pos), -1)
    cos, sin = emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)
    qn, kn = (randn(D, dtype=dtype, seed=5), randn(D, dtype=dtype, seed=6)) if norm else (None, None)
    got, want = OPS.qk_norm_rope(q, k, qn, kn, cos, sin, 1e-6), TORCH_OPS.qk_norm_rope(q, k, qn, kn, cos, sin, 1e-6)
    for g, w in zip(got, want):
        close(g, w, dtype)
    one = OPS.qk_norm_rope(q[1:2], k[1:2], qn, kn, cos[1:2], sin[1:2], 1e-6)
    assert torch.equal(one[0], got[0][1:2]) and torch.equal(one[1], got[1][1:2])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_matches_torch_on_a_chunked_projection(dtype):
    gate, up = randn(3, 2 * 1100, dtype=dtype, seed=7).chunk(2, dim=-1)  # past one block of columns
    got = OPS.silu_mul(gate, up)
    close(got, TORCH_OPS.silu_mul(gate, up), dtype)
    assert torch.equal(OPS.silu_mul(gate[2:3], up[2:3]), got[2:3])


def test_mixed_dtypes_take_torchs_steps():
    x, w = randn(2, 64, dtype=torch.bfloat16, seed=8), randn(64, dtype=torch.float32, seed=9)
    got = OPS.rms_norm(x, w, 1e-6)  # a float32 weight promotes, as in torch
    assert got.dtype == torch.float32 and torch.equal(got, TORCH_OPS.rms_norm(x, w, 1e-6))


def test_a_weight_of_another_length_is_not_read_past_its_end():
    """A norm weight whose length is not the row's goes to torch's steps, which refuse it, never past its end."""
    x, w = randn(2, 64, dtype=torch.float32, seed=10), randn(32, dtype=torch.float32, seed=11)
    with pytest.raises(RuntimeError):
        OPS.rms_norm(x, w, 1e-6)
