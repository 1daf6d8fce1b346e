"""The CUDA C++ GGUF kernel (backends/cuda/gguf_cuda.py, csrc/gguf_gemv.cuh) for Q4_K and Q6_K.

On a GPU: against kestrel's dequantizer (ggml's bits) in float64, within the float kernels' bound (each output within
1e-6 of sum |x| |w|, test_gguf_kernels' tolerance); every row of every batch (1 to 66 rows: launches of 8) bitwise
that row alone; a weight at an unaligned address (the word-shifting reads) bitwise the aligned one; each forced warp
count within the bound; ``gguf_kernels.matmul`` running it for these types; a CUDA graph replaying it. Without a GPU:
what it says and refuses.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from backends.cuda import gguf_cuda, gguf_kernels
from kestrel_core.formats import gguf_quants
from tests.test_gguf_kernels import check_against_reference, random_blocks

GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
N = 37  # odd: the last block's rows are part masked


def weight(qtype, n: int, k: int, seed: int = 0):
    rng = np.random.default_rng([int(qtype), n, k, seed])
    raw = torch.from_numpy(np.ascontiguousarray(random_blocks(qtype, n, k, rng)))
    return raw.cuda() if GPU else raw, gguf_quants.dequantize(raw, qtype, (n, k))


def inputs(m: int, k: int, dtype, seed: int = 0) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return x.cuda() if GPU else x


@pytest.fixture(scope="module")
def built():
    if not GPU:
        pytest.skip("needs a CUDA GPU")
    why = gguf_cuda.usable()
    if why:
        pytest.fail(why)  # a GPU with torch's CUDA: the kernel must build


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("qtype", gguf_cuda.TYPES, ids=lambda t: t.name)
def test_rows_match_the_reference_and_each_row_alone(built, qtype, dtype):
    k = 12 * 256  # 48 units of 64 values: threads take more than one
    raw, deq = weight(qtype, N, k)
    x = inputs(66, k, dtype, seed=int(qtype))
    y = gguf_cuda.matmul(x, raw, qtype, N, k)
    check_against_reference(y, x, deq)
    alone = torch.cat([gguf_cuda.matmul(x[i:i + 1], raw, qtype, N, k) for i in range(66)])
    assert torch.equal(y, alone)  # bitwise, whatever rows ran beside it
    for m in (2, 3, 5, 8, 9, 17):
        assert torch.equal(gguf_cuda.matmul(x[:m], raw, qtype, N, k), alone[:m]), m


@needs_gpu
@pytest.mark.parametrize("qtype", gguf_cuda.TYPES, ids=lambda t: t.name)
def test_one_hot_rows_read_single_weights(built, qtype):
    k = 3 * 256
    raw, deq = weight(qtype, N, k)
    picks = torch.randperm(k, generator=torch.Generator().manual_seed(1))[:8]
    x = torch.zeros(8, k)
    x[torch.arange(8), picks] = 1.0
    y = gguf_cuda.matmul(x.cuda(), raw, qtype, N, k).cpu()
    want = deq[:, picks].T
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))


@needs_gpu
@pytest.mark.parametrize("offset", [1, 2, 4, 8])
@pytest.mark.parametrize("qtype", gguf_cuda.TYPES, ids=lambda t: t.name)
def test_any_address_gives_the_same_bits(built, qtype, offset):
    k = 4 * 256
    raw, _ = weight(qtype, N, k)
    x = inputs(3, k, torch.bfloat16)
    buf = torch.zeros(raw.numel() + 64, dtype=torch.uint8, device="cuda")
    moved = buf[offset:offset + raw.numel()].view(raw.shape)
    moved.copy_(raw)
    assert moved.data_ptr() % 16 == offset % 16
    assert torch.equal(gguf_cuda.matmul(x, moved, qtype, N, k), gguf_cuda.matmul(x, raw, qtype, N, k))


@needs_gpu
@pytest.mark.parametrize("warps", gguf_cuda.WARPS)
@pytest.mark.parametrize("qtype", gguf_cuda.TYPES, ids=lambda t: t.name)
def test_forced_warps_and_a_long_row(built, qtype, warps):
    k = 64 * 256  # 256 units: the shape's own plan takes 4 warps
    raw, deq = weight(qtype, 9, k)
    x = inputs(4, k, torch.float32, seed=3)
    y = gguf_cuda.matmul(x, raw, qtype, 9, k, warps=warps)
    check_against_reference(y, x, deq)
    assert torch.equal(y[2], gguf_cuda.matmul(x[2:3], raw, qtype, 9, k, warps=warps)[0])


@needs_gpu
@pytest.mark.parametrize("qtype", gguf_cuda.TYPES, ids=lambda t: t.name)
def test_the_float_kernels_run_it_for_these_types(built, qtype):
    k = 2 * 256
    raw, _ = weight(qtype, N, k)
    x = inputs(2, k, torch.bfloat16)
    ours = gguf_cuda.matmul(x, raw, qtype, N, k)
    assert torch.equal(gguf_kernels.matmul(x, raw, qtype, N, k), ours)
    triton = gguf_kernels.matmul(x, raw, qtype, N, k, impl="triton")
    torch.testing.assert_close(triton, ours, rtol=1e-5, atol=1e-5 * float(ours.abs().max()))


@needs_gpu
def test_a_cuda_graph_replays_it(built):
    k = 4 * 256
    raw, _ = weight(T.Q4_K, N, k)
    x = inputs(1, k, torch.bfloat16)
    out = torch.empty(1, N, device="cuda")
    gguf_cuda.matmul(x, raw, T.Q4_K, N, k, out=out)  # warm: built and loaded
    want = out.clone()
    out.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gguf_cuda.matmul(x, raw, T.Q4_K, N, k, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def test_refuses_what_it_does_not_compute():
    raw, _ = weight(T.Q4_K, 4, 256)
    with pytest.raises(ValueError, match="computes Q4_K, Q6_K, not Q8_0"):
        gguf_cuda.matmul(inputs(1, 256, torch.float32), raw, T.Q8_0, 4, 256)
    with pytest.raises(ValueError, match="impl must be"):
        gguf_kernels.matmul(inputs(1, 256, torch.float32), raw, T.Q4_K, 4, 256, impl="fast")
    if GPU and gguf_cuda.usable() is None:
        with pytest.raises(ValueError, match="warps must be one of"):
            gguf_cuda.matmul(inputs(1, 256, torch.float32), raw, T.Q4_K, 4, 256, warps=3)


@pytest.mark.skipif(GPU, reason="the message of a machine without a GPU")
def test_without_a_gpu_it_says_why_and_the_float_kernels_keep_to_triton(monkeypatch):
    assert gguf_cuda.usable() == "the CUDA GGUF kernel needs a CUDA GPU and a CUDA build of torch"
    assert not gguf_cuda.takes(torch.zeros(1, 256), T.Q4_K, 256)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        gguf_kernels.matmul(torch.zeros(1, 256), weight(T.Q4_K, 4, 256)[0], T.Q4_K, 4, 256, impl="cuda")


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("KESTREL_GGUF_CUDA", "0")
    gguf_cuda.EXTENSION.forget()
    try:
        assert gguf_cuda.usable() == "the CUDA GGUF kernel is turned off (KESTREL_GGUF_CUDA=0)"
        if GPU:
            assert not gguf_cuda.takes(torch.zeros(1, 256, device="cuda"), T.Q4_K, 256)
    finally:
        monkeypatch.undo()
        gguf_cuda.EXTENSION.forget()  # decided again (and built where it runs) for the tests after this one


def test_a_failed_build_says_why_in_one_line(monkeypatch):
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setattr(cpp_extension, "load", lambda *a, **kw: (_ for _ in ()).throw(OSError("nvcc: not found")))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    with pytest.raises(RuntimeError) as info:
        gguf_cuda.EXTENSION.build()
    text = str(info.value)
    assert text.startswith("the CUDA GGUF kernel did not build (OSError: nvcc: not found); it needs nvcc")
    assert "\n" not in text


@needs_gpu
@pytest.mark.parametrize("rows", [1, 3, 12])
def test_an_entry_writes_each_segments_columns_in_x_dtype(built, rows):
    """q (Q4_K), k (Q4_K) and v (Q6_K) as one entry: each segment's columns straight into a bfloat16 output, bitwise
    the float32 products of the segments rounded once, and each row its own alone."""
    from backends.cuda import blocks

    k = 4 * 256
    parts = [(T.Q4_K, 40), (T.Q6_K, 24)]
    raws = [weight(q, n, k, seed=i)[0].reshape(-1) for i, (q, n) in enumerate(parts)]
    w = blocks.BlockWeight(torch.cat(raws), k, blocks.layout_of_rows([(q.name, n) for q, n in parts]))
    x = inputs(rows, k, torch.bfloat16, seed=5)
    y = blocks.block_linear(x, w)
    assert y.shape == (rows, 64) and y.dtype == torch.bfloat16
    want = torch.cat([gguf_cuda.matmul(x, raw, q, n, k) for raw, (q, n) in zip(raws, parts)], dim=1)
    assert torch.equal(y, want.to(torch.bfloat16))
    assert torch.equal(blocks.block_linear(x[-1:], w), y[-1:])


def test_a_gpu_where_it_cannot_build_says_so_once(monkeypatch):
    import warnings

    from kestrel_core.errors import KestrelNote

    class OnDevice:  # an activation on a CUDA device, as far as ``takes`` looks
        is_cuda = True

    monkeypatch.setattr(gguf_cuda, "_said", False)
    monkeypatch.setattr(gguf_cuda, "usable", lambda: "the CUDA GGUF kernel did not build (OSError: nvcc: not found)")
    with pytest.warns(KestrelNote, match=r"did not build \(OSError: nvcc: not found\); Q4_K and Q6_K run on the slower"):
        assert not gguf_cuda.takes(OnDevice(), T.Q4_K, 256)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the second product says nothing
        assert not gguf_cuda.takes(OnDevice(), T.Q6_K, 256)
        assert not gguf_cuda.takes(OnDevice(), T.Q8_0, 256)  # a type it does not compute: not its business


@needs_gpu
def test_the_plan_follows_the_shape_and_the_chunk(built):
    """Warps from K alone (a row's bits depend on them); rows a block by the chunk (they change no bits)."""
    assert [gguf_cuda.plan(k)[0] for k in (2048, 4096, 12288, 16384)] == [1, 1, 2, 4]
    assert [gguf_cuda.plan(4096, m, T.Q6_K)[1] for m in (1, 2, 4, 8)] == [4, 2, 2, 1]
    assert [gguf_cuda.plan(4096, m, T.Q4_K)[1] for m in (1, 2, 4, 8)] == [4, 2, 2, 4]  # 5-8 rows: one-row launches
