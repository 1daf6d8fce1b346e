"""The GGUF block kernels (backends/cuda/gguf_kernels.py) against kestrel's own dequantizer, ggml's bits.

Every type, bf16 and float32 x, M = 1, 2, 3, 8 and 64, an odd N, a K of a few blocks (several super-blocks for the
256-value types): the result against ``x.float() @ dequantize(W).T``, each row of a batch bitwise the one-row result
(batch invariance), and the dequantized values themselves (one-hot rows of x pick out single weights). Weights come
from real quantization (``gguf.quants.quantize``) where the gguf package quantizes the type (Q4_0, Q4_1, Q8_0), else
from random valid blocks (random scale bytes as finite f16, random quant bits).

Tolerance, every type and both dtypes: each output's error against the exact (float64) product is at most 1e-6 of
sum |x| |w| (a float32 sum's rounding grows with that; 3e-8 was seen in the interpreter), and ||y - ref|| / ||ref||
< 5e-6 against the float32 reference (3e-7 seen). bf16 x converts exactly to float32, so it is held to the same
bound. The weights are dequantized exactly: bitwise ggml's in the interpreter; on a GPU the compiler may fuse
``d * q + m`` into one rounding, so there within 1e-6 of the largest weight.

On a GPU they run for real; without one they run in Triton's interpreter where Triton is installed; elsewhere the
tests skip.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported

from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import quants as gguf_np  # noqa: E402

from kestrel_core.formats import gguf_quants  # noqa: E402
from backends.cuda import gguf_kernels  # noqa: E402

pytestmark = pytest.mark.skipif(gguf_kernels.available() is not None, reason="needs Triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
N = 37  # odd: the last program's outputs are part masked
K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K, T.IQ4_XS)  # 256-value super-blocks
QUANTIZED_BY_GGUF = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
TOL = 1e-6  # of sum |x| |w|, each output
TOL_NORM = 5e-6  # ||y - ref|| / ||ref||
SOLO_ROWS = (*range(8), 31, 63)  # rows run alone, each against every batch that holds it


def k_of(qtype) -> int:
    """3 super-blocks of 256, or 11 blocks of 32 (not whole chunks of 8 blocks: the last chunk is masked)."""
    return 3 * 256 if qtype in K_QUANTS else 11 * 32


def random_blocks(qtype, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Valid ``qtype`` blocks for [n, k]: random bytes, with each f16 scale a finite value of either sign."""
    values, nbytes = gguf_quants.block_geometry(qtype)
    blocks = rng.integers(0, 256, (n * k // values, nbytes), dtype=np.uint8)
    f16_at = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q2_K: (80, 82), T.Q3_K: (108,), T.IQ4_NL: (0,),
              T.IQ4_XS: (0,)}[qtype]  # d (and dmin)
    for at in f16_at:
        d = rng.uniform(1e-3, 1e-2, len(blocks)) * rng.choice([-1.0, 1.0], len(blocks))
        blocks[:, at:at + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


@functools.cache
def weight(qtype, n: int = N, k: int | None = None, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored bytes uint8 [n, row bytes] on DEVICE, dequantized float32 [n, k] on the CPU) of a ``qtype`` weight;
    another ``seed``, another weight of that shape."""
    k = k or k_of(qtype)
    rng = np.random.default_rng([int(qtype), n, k] + ([seed] if seed else []))
    if qtype in QUANTIZED_BY_GGUF:
        raw = gguf_np.quantize(rng.standard_normal((n, k)).astype(np.float32) / k**0.5, qtype)
    else:
        raw = random_blocks(qtype, n, k, rng)
    raw = torch.from_numpy(np.ascontiguousarray(raw))
    return raw.to(DEVICE), gguf_quants.dequantize(raw, qtype, (n, k))


def inputs(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def one_hot_rows(k: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [rows, k] on DEVICE with a single 1 a row, the columns it picks): y[m, n] = W[n, picks[m]]."""
    picks = torch.randperm(k, generator=torch.Generator().manual_seed(1))[:rows]
    x = torch.zeros(rows, k)
    x[torch.arange(rows), picks] = 1.0
    return x.to(DEVICE), picks


def check_against_reference(y: torch.Tensor, x: torch.Tensor, deq: torch.Tensor) -> None:
    x = x.cpu().double()
    exact = x @ deq.double().T
    scale = x.abs() @ deq.double().abs().T  # sum |x| |w|: what a float32 sum's rounding grows with
    err = (y.cpu().double() - exact).abs()
    assert bool((err <= TOL * scale + 1e-30).all()), f"worst {float((err / scale).max()):.3g} of sum |x||w|"
    ref = x.float() @ deq.T  # the stated reference: float32 x times the dequantized weight
    assert float((y.cpu() - ref).norm() / ref.norm()) < TOL_NORM


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("qtype", gguf_kernels.TYPES, ids=lambda t: t.name)
def test_batches_match_the_reference_and_each_row_run_alone(qtype, dtype):
    raw, deq = weight(qtype)
    k = deq.shape[1]
    x = inputs(64, k, dtype, seed=int(qtype))
    y64 = gguf_kernels.matmul(x, raw, qtype, N, k)
    assert y64.shape == (64, N) and y64.dtype == torch.float32
    check_against_reference(y64, x, deq)
    batches = {64: y64}
    for m in (2, 3, 8):
        batches[m] = gguf_kernels.matmul(x[:m], raw, qtype, N, k)
        assert torch.equal(batches[m], y64[:m])  # bitwise: the same rows of a larger batch
    for row in SOLO_ROWS:
        alone = gguf_kernels.gemv(x[row], raw, qtype, N, k)
        assert alone.shape == (N,)
        for m, y in batches.items():
            if row < m:
                assert torch.equal(y[row], alone), f"row {row} of M={m} is not the one-row result"
    check_against_reference(gguf_kernels.matmul(x[:1], raw, qtype, N, k), x[:1], deq)


@pytest.mark.parametrize("qtype", gguf_kernels.TYPES, ids=lambda t: t.name)
def test_dequantizes_as_ggml(qtype):
    """One-hot rows of x pick single weights out: y[m, n] = W[n, k_m], the dequantizer's float for float."""
    raw, deq = weight(qtype)
    k = deq.shape[1]
    x, picks = one_hot_rows(k, 64)
    y = gguf_kernels.matmul(x, raw, qtype, N, k).cpu()
    want = deq[:, picks].T
    if INTERPRETED or not torch.cuda.is_available():
        assert torch.equal(y, want)
    else:  # the compiler may fuse d * q + m into one rounding
        torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))


@pytest.mark.parametrize("qtype", QUANTIZED_BY_GGUF, ids=lambda t: t.name)
def test_whole_chunks_and_forced_plans(qtype):
    """K of whole chunks (no masked blocks), and plans forced off the default: each still the reference, and each
    row still its one-row result under the same plan."""
    k = 16 * 32
    raw, deq = weight(qtype, 20, k)
    x = inputs(5, k, torch.float32, seed=2)
    for block_n, split in ((None, None), (32, 1), (8, 2)):
        y = gguf_kernels.matmul(x, raw, qtype, 20, k, block_n=block_n, split=split)
        check_against_reference(y, x, deq)
        for row in (0, 4):
            assert torch.equal(y[row], gguf_kernels.gemv(x[row], raw, qtype, 20, k, block_n=block_n, split=split))


def test_float16_rows():
    raw, deq = weight(T.Q4_K)
    x = inputs(3, deq.shape[1], torch.float16, seed=3)
    check_against_reference(gguf_kernels.matmul(x, raw, T.Q4_K, N, deq.shape[1]), x, deq)


def test_more_than_64_rows_run_as_launches_of_64():
    raw, deq = weight(T.Q8_0)
    k = deq.shape[1]
    x = inputs(66, k, torch.bfloat16, seed=4)
    y = gguf_kernels.matmul(x, raw, T.Q8_0, N, k)
    check_against_reference(y, x, deq)
    assert torch.equal(y[64:], gguf_kernels.matmul(x[64:], raw, T.Q8_0, N, k))
    assert torch.equal(y[65], gguf_kernels.gemv(x[65], raw, T.Q8_0, N, k))


def test_the_plan_reads_only_the_weights_shape():
    """One plan for every M: the kernel's tile and K slices come from (type, N, K)."""
    bn, slices, per_slice = gguf_kernels.plan(T.Q4_K, 4096, 4096)
    assert bn == gguf_kernels.BLOCK_N and slices * per_slice >= 4096 // 256 > (slices - 1) * per_slice
    assert gguf_kernels.plan(T.Q4_K, 12288, 4096)[1] == 1  # enough programs along N: no slices, no epilogue
    assert gguf_kernels.plan(T.Q6_K, 37, 768) == (gguf_kernels.BLOCK_N, 3, 1)


def test_refuses_what_it_cannot_read():
    raw, deq = weight(T.Q4_0)
    k = deq.shape[1]
    x = inputs(1, k, torch.float32)
    with pytest.raises(ValueError, match="uint8"):
        gguf_kernels.matmul(x, raw[:-1], T.Q4_0, N, k)
    with pytest.raises(ValueError, match="x must be"):
        gguf_kernels.matmul(x[:, :32], raw, T.Q4_0, N, k)
    with pytest.raises(ValueError, match="no GGUF kernel"):
        gguf_kernels.matmul(x, raw, T.IQ2_XXS, N, k)
    with pytest.raises(ValueError, match="whole"):
        gguf_kernels.matmul(x[:, :k - 16], raw, T.Q4_0, N, k - 16)
