"""The grouped expert kernels (backends/cuda/grouped_experts.py) against the per-expert math, float and q8.

On a GPU they run for real; without one they run in Triton's interpreter where Triton is installed (it reads the same
int64 addresses as pointers, on the CPU); elsewhere the tests skip.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from kestrel_core.formats import quant

if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported

from backends.cuda import grouped_experts  # noqa: E402

pytestmark = pytest.mark.skipif(grouped_experts.available() is not None, reason="needs Triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
H, I, E, K = 128, 64, 6, 3  # noqa: E741


def q8_entry(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor, int]:
    """kestrel's q8 device layout of ``w`` [N, K] as one byte buffer, its dequantized weights, and its n_pad."""
    qweight, scales = quant.quantize(w, group)
    raw = torch.cat([qweight.view(torch.uint8).reshape(-1), scales.view(torch.uint8).reshape(-1)]).to(DEVICE)
    return raw, quant.dequantize(qweight, scales, w.shape[0], group), qweight.shape[1]


def reference(x, weights, ids, experts, dtype):
    out = torch.zeros(1, experts[0][1].shape[0], dtype=torch.float64)  # [1, H]: down's rows
    for slot, e in enumerate(ids[0].tolist()):
        gu, dn = (t.double() for t in experts[e])
        gate, up = F.linear(x.double(), gu).chunk(2, dim=-1)
        out += F.linear(F.silu(gate) * up, dn) * float(weights[0, slot])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_experts_match_the_per_expert_math(dtype):
    g = torch.Generator().manual_seed(0)
    experts = [(torch.randn(2 * I, H, generator=g) / H**0.5, torch.randn(H, I, generator=g) / I**0.5) for _ in range(E)]
    on_device = [(gu.to(DEVICE, dtype), dn.to(DEVICE, dtype)) for gu, dn in experts]
    table = torch.tensor([[gu.data_ptr(), dn.data_ptr()] for gu, dn in on_device], dtype=torch.int64, device=DEVICE)
    x = torch.randn(1, H, generator=g).to(DEVICE, dtype)
    ids = torch.tensor([[4, 0, 2]], device=DEVICE)
    weights = torch.tensor([[0.5, 0.3, 0.2]], device=DEVICE, dtype=dtype)
    run = grouped_experts.GroupedExperts(H, I, K, dtype, DEVICE)
    got = run(x, weights, ids, table).double().cpu()
    want = reference(x.cpu(), weights.cpu(), ids.cpu(), [(a.float(), b.float()) for a, b in on_device], dtype)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert float((got - want).norm() / want.norm()) < tol
    again = run(x, weights, ids, table).double().cpu()
    assert torch.equal(got, again)  # deterministic: no atomics, a fixed order


def test_q8_experts_match_their_dequantized_math():
    g = torch.Generator().manual_seed(1)
    entries, deq = [], []
    for _ in range(E):
        gu, gu_deq, npad_gu = q8_entry(torch.randn(2 * I, H, generator=g) / H**0.5)
        dn, dn_deq, npad_dn = q8_entry(torch.randn(H, I, generator=g) / I**0.5)
        entries.append((gu, dn))
        deq.append((gu_deq, dn_deq))
    table = torch.tensor([[gu.data_ptr(), dn.data_ptr()] for gu, dn in entries], dtype=torch.int64, device=DEVICE)
    x = torch.randn(1, H, generator=g).to(DEVICE)
    ids = torch.tensor([[1, 5, 3]], device=DEVICE)
    weights = torch.tensor([[0.2, 0.7, 0.1]], device=DEVICE)
    run = grouped_experts.GroupedExperts(H, I, K, torch.float32, DEVICE, q8=(32, npad_gu, npad_dn))
    got = run(x, weights, ids, table).double().cpu()
    want = reference(x.cpu(), weights.cpu(), ids.cpu(), deq, torch.float32)
    assert float((got - want).norm() / want.norm()) < 1e-4


def test_fetched_experts_are_the_tables_result():
    """Host-routed experts, by a table of their addresses in routing order: bitwise the table path's result."""
    g = torch.Generator().manual_seed(2)
    on_device = [(torch.randn(2 * I, H, generator=g).to(DEVICE), torch.randn(H, I, generator=g).to(DEVICE))
                 for _ in range(E)]
    table = torch.tensor([[gu.data_ptr(), dn.data_ptr()] for gu, dn in on_device], dtype=torch.int64, device=DEVICE)
    x = torch.randn(1, H, generator=g).to(DEVICE)
    ids = torch.tensor([[2, 5, 1]], device=DEVICE)
    weights = torch.tensor([[0.4, 0.35, 0.25]], device=DEVICE)
    run = grouped_experts.GroupedExperts(H, I, K, torch.float32, DEVICE)
    by_table = run(x, weights, ids, table).clone()
    if DEVICE.type == "cpu":
        pytest.skip("fetched() stages its table in pinned memory, which needs a GPU")
    assert torch.equal(by_table, run.fetched(x, weights, [on_device[e] for e in (2, 5, 1)]))


def _block_entry(qtypes_rows, k, g):
    """A GGUF block entry of parts (type, rows) of row width ``k`` (random valid blocks), its layout and its
    dequantized weight [sum rows, k]."""
    import numpy as np

    from kestrel_core.formats.gguf_quants import dequantize
    from kestrel_core.tools.presets import random_blocks_of

    raws, deqs = [], []
    for qtype, rows in qtypes_rows:
        raw = torch.from_numpy(random_blocks_of(qtype, rows, k, np.random.default_rng(int(g.seed()) % 2**32)))
        raws.append(raw.reshape(-1))
        deqs.append(dequantize(raw.reshape(-1), qtype, (rows, k)))
    layout = tuple((q.name, r) for q, r in qtypes_rows)
    return torch.cat(raws).to(DEVICE), layout, torch.cat(deqs)


@pytest.mark.parametrize("kind", ["one type", "gate and up apart"])
def test_gguf_block_experts_match_their_dequantized_math_and_the_fetched_path(kind):
    """Experts held as GGUF blocks (Q4_K gate and up, or Q4_K gate beside Q6_K up; Q6_K down), read through the table:
    the per-expert math on their dequantized weights, and bitwise what the fetched path gives on the same bytes."""
    from gguf import GGMLQuantizationType as T

    from backends.cuda.blocks import BlockWeight, layout_of_rows

    h, i = 512, 256  # whole 256-value super-blocks: two chunks of H (two slices), one of I
    g = torch.Generator().manual_seed(3)
    gu_parts = [(T.Q4_K, 2 * i)] if kind == "one type" else [(T.Q4_K, i), (T.Q6_K, i)]
    entries, deq = [], []
    for _ in range(E):
        gu, gu_layout, gu_deq = _block_entry(gu_parts, h, g)
        dn, dn_layout, dn_deq = _block_entry([(T.Q6_K, h)], i, g)
        entries.append((gu, dn))
        deq.append((gu_deq, dn_deq))
    table = torch.tensor([[gu.data_ptr(), dn.data_ptr()] for gu, dn in entries], dtype=torch.int64, device=DEVICE)
    x = torch.randn(1, h, generator=g).to(DEVICE)
    ids = torch.tensor([[5, 1, 3]], device=DEVICE)
    weights = torch.tensor([[0.2, 0.5, 0.3]], device=DEVICE)
    run = grouped_experts.GroupedExperts(h, i, K, torch.float32, DEVICE, blocks=True)
    layouts = (layout_of_rows([(q.name, r) for q, r in gu_parts]), dn_layout)
    got = run(x, weights, ids, table, layouts)
    want = reference(x.cpu(), weights.cpu(), ids.cpu(), deq, torch.float32)
    assert float((got.double().cpu() - want).norm() / want.norm()) < 1e-5
    buffers = [(BlockWeight(entries[e][0], h, layouts[0]), BlockWeight(entries[e][1], i, layouts[1]))
               for e in ids[0].tolist()]
    slots = torch.arange(K, device=DEVICE).view(1, K)
    fetched = torch.tensor([b.data_ptr() for pair in buffers for b in pair], dtype=torch.int64, device=DEVICE).view(K, 2)
    assert torch.equal(run(x, weights, slots, fetched, layouts), got)
