"""A prompt's routed experts on the tensor cores (``backends/cuda/prompt_experts.py``), in Triton's interpreter on the
CPU: every expert of a layer in one launch a projection, and each token's result bitwise its own routing through its
experts one row at a time (``gguf_int8.matmul`` with K unsliced, the one-row kernels), whatever tokens share the
pass."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported

from gguf import GGMLQuantizationType as T  # noqa: E402

from backends.cuda import blocks, gguf_int8, gguf_kernels, prompt_experts  # noqa: E402
from tests.test_gguf_kernels import DEVICE, inputs, weight  # noqa: E402

pytestmark = pytest.mark.skipif(gguf_kernels.available() is not None, reason="needs Triton")
H, I = 512, 256  # noqa: E741 - hidden (two super-blocks: a default plan would slice K) and an expert's intermediate


def experts(n: int, down=T.Q6_K):
    """n experts' (gate_up [Q4_K gate rows, Q4_K up rows], down) BlockWeights on DEVICE, each its own bytes."""
    out = []
    for e in range(n):
        gu = weight(T.Q4_K, 2 * I, H, seed=1 + e)[0].reshape(-1).clone()
        dn = weight(down, H, I, seed=100 + e)[0].reshape(-1).clone()
        out.append((blocks.BlockWeight(gu, H, (("Q4_K", 2 * I),)), blocks.BlockWeight(dn, I, ((down.name, H),))))
    return out


def alone(x, weights, chosen, buffers, dtype):
    """One token at a time, each routed expert by itself through the one-row kernels (K unsliced, as the tiles run):
    expert_mlp's ops, then the routing weights' sum in routing order in float32."""
    out = []
    for t in range(x.shape[0]):
        acc = None
        for j, e in enumerate(chosen[t].tolist()):
            gu, dn = buffers[e]
            g = gguf_int8.matmul(x[t:t + 1], gu.segment(gu.segments[0])[: len(gu.raw) // 2], T.Q4_K, I, H,
                                 split=1).to(dtype)
            u = gguf_int8.matmul(x[t:t + 1], gu.segment(gu.segments[0])[len(gu.raw) // 2:], T.Q4_K, I, H,
                                 split=1).to(dtype)
            seg = dn.segments[0]
            y = gguf_int8.matmul(F.silu(g) * u, dn.segment(seg), seg.qtype, H, I, split=1).to(dtype)
            term = (y * weights[t, j]).float()
            acc = term if acc is None else acc + term
        out.append(acc.to(dtype))
    return torch.cat(out)


def test_every_expert_in_one_launch_is_each_token_through_its_experts_alone():
    dtype = torch.float32
    buffers = experts(4)  # gate and up Q4_K, down Q6_K: both tensor-core kernels
    x = inputs(5, H, dtype, seed=3)
    chosen = torch.tensor([[0, 3], [3, 1], [2, 0], [0, 3], [3, 0]], device=DEVICE)  # expert 0 and 3 have 4 rows
    weights = torch.rand(5, 2, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    used = sorted(set(chosen.reshape(-1).tolist()))
    got = prompt_experts.prompt_experts(x, weights, chosen, used, [buffers[e] for e in used])
    want = alone(x, weights, chosen, buffers, dtype)
    assert got.shape == (5, H) and got.dtype == dtype
    assert torch.equal(got, want)
    # a token beside others or alone: the same bits (its routing and values are all that count)
    for t in (1,):
        mine = sorted(set(chosen[t].tolist()))
        one = prompt_experts.prompt_experts(x[t:t + 1], weights[t:t + 1], chosen[t:t + 1], mine,
                                            [buffers[e] for e in mine])
        assert torch.equal(one[0], got[t]), t


def test_tiles_cut_each_experts_run_and_point_at_its_weight():
    grid = prompt_experts.tiles([3, 40, 0, 16], [100, 200, 300, 400], 16, "cpu")
    assert grid.tolist() == [[0, 3, 100], [3, 19, 200], [19, 35, 200], [35, 43, 200], [43, 59, 400]]


def test_it_takes_the_tensor_core_types_in_one_layout_only():
    assert prompt_experts.takes(experts(2))
    assert not prompt_experts.takes([])
    q4_0 = weight(T.Q4_0, 2 * I, H)[0].reshape(-1).clone()
    other = (blocks.BlockWeight(q4_0, H, (("Q4_0", 2 * I),)), experts(1)[0][1])
    assert not prompt_experts.takes([other])  # Q4_0 has no tensor-core kernel
    assert not prompt_experts.takes([experts(1)[0], experts(1, T.Q4_K)[0]])  # two layouts in one layer
    assert not prompt_experts.takes([(torch.zeros(2, 2), torch.zeros(2, 2))])  # float experts
