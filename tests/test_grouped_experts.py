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
    out = torch.zeros(1, H, dtype=torch.float64)
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
