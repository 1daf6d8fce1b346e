"""The int8-activation GGUF kernels (backends/cuda/gguf_int8.py): x quantized per 32 values, int8 dot products.

Held to the exact product of the dequantized weight with the quantized x (what the kernel computes, up to float32
rounding: within 1e-6 of sum |x| |w| an output), and to the float product within what quantizing x costs; each row of
a batch bitwise the row alone (batches of 1 to 8, and 11 as two launches); ``dot4`` spelt out against numpy's bytes;
on a GPU the dp4a instruction against the spelt-out twin, bitwise. In Triton's interpreter without a GPU.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported

from gguf import GGMLQuantizationType as T  # noqa: E402

from kestrel_core.formats import gguf_quants  # noqa: E402
from backends.cuda import gguf_int8, gguf_kernels  # noqa: E402
from tests.test_gguf_kernels import DEVICE, N, inputs, one_hot_rows, weight  # noqa: E402

pytestmark = pytest.mark.skipif(gguf_kernels.available() is not None, reason="needs Triton")
TOL = 1e-6  # of sum |x^| |w|, each output, against the exact product with the quantized x


def half_away(r: torch.Tensor) -> torch.Tensor:
    return torch.sign(r) * torch.floor(r.abs() + 0.5)


def quantized(x: torch.Tensor, digits: int = gguf_int8.DIGITS) -> tuple[torch.Tensor, torch.Tensor]:
    """(x as the kernel quantizes it, dequantized: float64 [M, K]; x's exact float64 value) — d = max|x| / 127 a block
    of 32 (float32), q1 = x / d rounded half away from zero, and with two digits q2 = (x / d - q1) * 254 rounded, the
    value (q1 * 254 + q2) * (d / 254)."""
    x = x.cpu().double()
    b = x.reshape(x.shape[0], -1, 32).float()
    d = b.abs().amax(-1, keepdim=True) / 127
    r = torch.where(d > 0, b / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(b))  # float32, as the kernel
    q = half_away(r)
    if digits == 2:
        q = q * 254 + half_away((r - q) * 254)
        d = d / 254
    return (q.double() * d.double()).reshape(x.shape), x


def exact(qtype, raw: torch.Tensor, deq: torch.Tensor, x: torch.Tensor,
          digits: int = gguf_int8.DIGITS) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kernel's arithmetic in float64, sum |x^| |w| an output). A min's term takes x's exact sums: such a weight
    splits into d*q (meets x^) and the min (meets x), the second read off blocks whose quants are zeroed."""
    xhat, x64 = quantized(x, digits)
    w = deq.double()
    quants_at = {T.Q4_K: 16, T.Q5_K: 16, T.Q4_1: 4, T.Q5_1: 4}  # the types with a min: where their quant bytes start
    if qtype in quants_at:
        blocks = raw.cpu().clone().reshape(-1, gguf_quants.block_geometry(qtype)[1])
        blocks[:, quants_at[qtype]:] = 0
        mins = gguf_quants.dequantize(blocks.reshape(raw.shape), qtype, tuple(deq.shape)).double()
        want = xhat @ (w - mins).T + x64 @ mins.T
        scale = xhat.abs() @ (w - mins).abs().T + x64.abs() @ mins.abs().T
    else:
        want, scale = xhat @ w.T, xhat.abs() @ w.abs().T
    return want, scale


def check(y: torch.Tensor, qtype, raw, deq, x, digits: int = gguf_int8.DIGITS) -> float:
    """y against the kernel's exact arithmetic; its error against x's own product, relative (returned)."""
    want, scale = exact(qtype, raw, deq, x, digits)
    err = (y.cpu().double() - want).abs()
    assert bool((err <= TOL * scale + 1e-30).all()), f"worst {float((err / scale).max()):.3g} of sum |x^||w|"
    ref = x.cpu().double() @ deq.double().T
    rel = float((y.cpu().double() - ref).norm() / ref.norm())
    assert rel < (2e-2 if digits == 1 else 1e-4)  # one digit: about 0.5% here (random x and weights); two: about 2e-5
    return rel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("qtype", gguf_int8.TYPES, ids=lambda t: t.name)
def test_rows_match_the_exact_product_and_each_row_run_alone(qtype, dtype):
    raw, deq = weight(qtype)
    k = deq.shape[1]
    x = inputs(11, k, dtype, seed=int(qtype) + 7)
    y = gguf_int8.matmul(x, raw, qtype, N, k)  # 11 rows: launches of 8 and 3
    assert y.shape == (11, N) and y.dtype == torch.float32
    check(y, qtype, raw, deq, x)
    for m in (1, 2, 3, 5, 8):
        assert torch.equal(gguf_int8.matmul(x[:m], raw, qtype, N, k), y[:m])
    for row in (0, 3, 7, 8, 10):
        assert torch.equal(gguf_int8.matmul(x[row:row + 1], raw, qtype, N, k)[0], y[row]), f"row {row}"
    other = inputs(3, k, dtype, seed=99)  # different companions: row 0 unchanged
    assert torch.equal(gguf_int8.matmul(torch.cat([x[:1], other]), raw, qtype, N, k)[0], y[0])


@pytest.mark.parametrize("qtype", gguf_int8.TYPES, ids=lambda t: t.name)
def test_forced_plans_compute_the_same_product(qtype):
    k = 8 * 256
    raw, deq = weight(qtype, 20, k)
    x = inputs(3, k, torch.float32, seed=3)
    for block_n, sb, split in ((None, None, None), (8, 2, 1), (4, 4, 2), (16, 1, 3)):
        y = gguf_int8.matmul(x, raw, qtype, 20, k, block_n=block_n, sb=sb, split=split)
        check(y, qtype, raw, deq, x)
        assert torch.equal(y[2], gguf_int8.matmul(x[2:], raw, qtype, 20, k, block_n=block_n, sb=sb, split=split)[0])
        other_n = 32 if block_n != 32 else 16  # the outputs a program computes change no bit
        assert torch.equal(y, gguf_int8.matmul(x, raw, qtype, 20, k, block_n=other_n, sb=sb, split=split))


@pytest.mark.parametrize("qtype", gguf_int8.TYPES, ids=lambda t: t.name)
def test_one_digit_is_llama_cpps_quantization_and_two_digits_near_float(qtype):
    """One int8 digit a value (x to 1/254 of its block's largest, as llama.cpp's q8_1) costs about 100x the error of
    two: each against its own exact arithmetic, each row bitwise alone."""
    raw, deq = weight(qtype)
    k = deq.shape[1]
    x = inputs(3, k, torch.float32, seed=11)
    rel = {}
    for digits in (1, 2):
        y = gguf_int8.matmul(x, raw, qtype, N, k, digits=digits)
        rel[digits] = check(y, qtype, raw, deq, x, digits)
        assert torch.equal(gguf_int8.matmul(x[1:2], raw, qtype, N, k, digits=digits)[0], y[1])
    assert rel[2] * 30 < rel[1]
    with pytest.raises(ValueError, match="digits must be 1 or 2"):
        gguf_int8.matmul(x, raw, qtype, N, k, digits=3)


def test_one_hot_rows_pick_single_weights():
    """x with a single 1 a row quantizes exactly (d = 1/127, q = 127): y[m, n] = W[n, k_m] up to float32 rounding of
    d * sc * dx * 127 (a min meets x's exact sum)."""
    for qtype in gguf_int8.TYPES:
        raw, deq = weight(qtype)
        k = deq.shape[1]
        x, picks = one_hot_rows(k, 8)
        y = gguf_int8.matmul(x, raw, qtype, N, k).cpu()
        torch.testing.assert_close(y, deq[:, picks].T, rtol=1e-6, atol=1e-6 * float(deq.abs().max()))


def test_zero_rows_give_zero():
    raw, deq = weight(T.Q4_K)
    y = gguf_int8.matmul(torch.zeros(2, deq.shape[1], device=DEVICE), raw, T.Q4_K, N, deq.shape[1])
    assert not bool(y.any())


def test_dot4_spelt_out_is_the_signed_byte_dot_product():
    import triton
    import triton.language as tl

    global dot4  # Triton finds a called function in the caller's module globals
    gguf_int8._kernels()
    dot4 = gguf_int8.dot4

    @triton.jit
    def apply(a, b, c, out, ASM: tl.constexpr):
        i = tl.arange(0, 64)
        tl.store(out + i, dot4(tl.load(a + i), tl.load(b + i), tl.load(c + i), ASM))

    rng = np.random.default_rng(5)
    a, b, c = (torch.from_numpy(rng.integers(-2**31, 2**31, 64, dtype=np.int64).astype(np.int32)) for _ in range(3))
    c = c // 4  # room for the products' sum
    want = c.long() + (a.view(torch.int8).view(64, 4).long() * b.view(torch.int8).view(64, 4).long()).sum(1)
    for asm in ((False, True) if torch.cuda.is_available() else (False,)):
        out = torch.empty(64, dtype=torch.int32, device=DEVICE)
        apply[(1,)](a.to(DEVICE), b.to(DEVICE), c.to(DEVICE), out, ASM=asm)
        assert torch.equal(out.cpu().long(), want), f"asm={asm}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the dp4a instruction runs on a GPU")
@pytest.mark.parametrize("qtype", gguf_int8.TYPES, ids=lambda t: t.name)
def test_dp4a_is_bitwise_its_spelt_out_twin(qtype):
    raw, deq = weight(qtype, 64, 4 * 256)
    x = inputs(5, 4 * 256, torch.bfloat16, seed=6)
    y = gguf_int8.matmul(x, raw, qtype, 64, 4 * 256)
    assert torch.equal(y, gguf_int8.matmul(x, raw, qtype, 64, 4 * 256, asm=False))


def test_refuses_what_it_cannot_compute():
    with pytest.raises(ValueError, match="no GGUF kernel for BF16"):
        gguf_int8.matmul(inputs(1, 64, torch.float32), torch.zeros(N * 128, dtype=torch.uint8), T.BF16, N, 64)
    raw, deq = weight(T.Q4_K)
    with pytest.raises(ValueError, match="power of two"):
        gguf_int8.matmul(inputs(1, deq.shape[1], torch.float32), raw, T.Q4_K, N, deq.shape[1], sb=3)


# --- the expert table's routed pairs ----------------------------------------------------------------------------------

def expert_weights(qtype, experts: int, n: int, k: int):
    """Each expert's entry: [gate rows; up rows] of ``qtype`` blocks (2n rows of k, uint8), their dequantized floats,
    and the table [experts, 2] of entry addresses (column 0 the entry, column 1 the same entry: ``which`` picks)."""
    raws, deqs = [], []
    for e in range(experts):
        raw, deq = weight(qtype, 2 * n, k, seed=e)
        raws.append(raw.clone())
        deqs.append(deq)
    table = torch.tensor([[r.data_ptr(), r.data_ptr()] for r in raws], dtype=torch.int64, device=DEVICE)
    return raws, deqs, table


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q4_0, T.Q5_1], ids=lambda t: t.name)
def test_routed_pairs_compute_their_experts_rows_and_each_is_its_own(qtype):
    """Rows of a batch routed to k experts each through the table: every pair's sums are its expert's up rows (at
    their byte offset) times its row, and bitwise what the pair gives in a batch of one row (``single_runs``)."""
    from backends.cuda.grouped_experts import expert_runs

    n, kt = 20, 3
    k = 2 * 256 if qtype in (T.Q4_K, T.Q6_K) else 8 * 32
    raws, deqs, table = expert_weights(qtype, 5, n, k)
    ids = torch.tensor([[0, 3, 4], [3, 1, 0], [4, 0, 2], [2, 3, 1]], device=DEVICE)
    rows = ids.shape[0]
    x = inputs(rows, k, torch.float32, seed=5)
    slices = gguf_int8.expert_slices(qtype, k, 2)
    up_at = gguf_kernels.stored_bytes(qtype, n, k)  # the up rows follow the gate rows
    part = torch.empty((rows, slices, kt, n), dtype=torch.float32, device=DEVICE)
    gguf_int8.expert_matmul(x, expert_runs(ids), table, part, 1, up_at, qtype, n, k, x_per_slot=False)
    got = part.sum(1)
    for r in range(rows):
        for j in range(kt):
            e = int(ids[r, j])
            raw_up = raws[e][n:].contiguous()
            check(got[r, j][None], qtype, raw_up, deqs[e][n:], x[r:r + 1])
        alone = torch.empty((1, slices, kt, n), dtype=torch.float32, device=DEVICE)
        gguf_int8.expert_matmul(x[r:r + 1], gguf_int8.single_runs(ids[r]), table, alone, 1, up_at, qtype, n, k,
                                x_per_slot=False)
        assert torch.equal(alone[0], part[r]), f"row {r} alone differs from the batch"
    h = inputs(rows * kt, k, torch.float32, seed=6)  # x a pair (the down projection's input)
    part_h = torch.empty_like(part)
    gguf_int8.expert_matmul(h, expert_runs(ids), table, part_h, 0, 0, qtype, n, k, x_per_slot=True)
    for r in range(rows):
        for j in range(kt):
            e = int(ids[r, j])
            check(part_h[r, :, j].sum(0)[None], qtype, raws[e][:n].contiguous(), deqs[e][:n], h[r * kt + j:r * kt + j + 1])


def test_expert_parts_it_cannot_fill_are_refused():
    raws, deqs, table = expert_weights(T.Q4_K, 2, 4, 512)
    ids = torch.tensor([[0, 1]], device=DEVICE)
    with pytest.raises(ValueError, match="slices dividing 2 blocks"):
        gguf_int8.expert_matmul(inputs(1, 512, torch.float32), gguf_int8.single_runs(ids), table,
                                torch.empty((1, 3, 2, 4), device=DEVICE), 0, 0, T.Q4_K, 4, 512, x_per_slot=False)


@pytest.mark.parametrize("qtype", gguf_int8.MMQ_TYPES, ids=lambda t: t.name)
def test_many_rows_on_the_tensor_cores_are_bitwise_the_one_row_kernels(qtype):
    """From MMQ_ROWS rows a K-quant runs every row at once through int8 tl.dot (kquant_mmq): each row bitwise its
    result alone through the one-row kernels, at both digit counts and with K sliced."""
    k = 4 * 256
    raw, deq = weight(qtype, 37, k)
    x = inputs(gguf_int8.MMQ_ROWS + 17, k, torch.bfloat16, seed=8)
    for digits, split in ((2, None), (1, 2)):
        y = gguf_int8.matmul(x, raw, qtype, 37, k, digits=digits, split=split)
        check(y, qtype, raw, deq, x, digits)
        assert torch.equal(y, gguf_int8.matmul(x, raw, qtype, 37, k, digits=digits, split=split, mmq=False))
        for row in (0, 16, 32):
            assert torch.equal(gguf_int8.matmul(x[row:row + 1], raw, qtype, 37, k, digits=digits, split=split)[0], y[row])
    for tiles in ((64, 16, 8, 1), (16, 64, 4, 2)):  # another tile of rows and outputs: the same bits
        assert torch.equal(gguf_int8.matmul(x, raw, qtype, 37, k, mmq_plan=tiles), gguf_int8.matmul(x, raw, qtype, 37, k))
