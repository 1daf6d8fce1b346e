"""The q8 GEMV kernel and the torch path on a GPU, against a float64 reference.

Skips without a GPU (conftest) and, for the kernel tests, when the kernel did not build here
("kernel not built": no nvcc, a mismatched CUDA, ...). Tolerance: relative error (Frobenius,
against the float64 product of the same int8 weights and scales and the same input values)
below 1e-3 with a float32 output. The kernel sums float32 x in float32 (about 1e-7 in the host
emulation) and bf16/f16 x as 16-bit integers against each 8-row maximum, exact for bf16 within
2^7 of it (tests/q8_gemv_host_check.cu bounds every column). A bf16 output rounds each value to
8 bits of mantissa, so it is held to 1e-2.
"""

from __future__ import annotations

import pytest
import torch

from kestrel_core.formats import quant

pytestmark = pytest.mark.cuda

# (n, k, group): N and K on and off the 128-column / 32-row tiles, and the 8B shapes.
SHAPES = [
    (1, 32, 32),
    (7, 64, 32),
    (130, 96, 32),
    (256, 256, 128),
    (999, 4160, 64),
    (2049, 384, 32),
    (4097, 1024, 128),
    (12288, 4096, 128),
    (4096, 12288, 128),
]


@pytest.fixture(scope="module")
def q8():
    from backends.cuda import q8 as mod

    try:
        mod.load_kernel()
    except mod.KernelNotBuilt as exc:
        pytest.skip(f"kernel not built: {exc}")
    return mod


def _case(n, k, group, seed=0, device="cuda"):
    from backends.cuda.q8 import Q8Weight

    gen = torch.Generator().manual_seed(seed * 7919 + n * 31 + k)
    qweight, scales = quant.quantize(torch.randn((n, k), generator=gen) * 0.05, group)
    ref_w = quant.dequantize(qweight, scales, n, group, torch.float64)  # [n, k], exact
    return Q8Weight.from_tensors(qweight, scales, n, group).to(device), ref_w.to(device), gen


def _rel(got, ref):
    return ((got.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_float64(q8, n, k, group, xdtype):
    w, ref_w, gen = _case(n, k, group)
    x = torch.randn((1, k), generator=gen).to("cuda", xdtype)
    ref = x.double() @ ref_w.T  # the same input values the kernel reads
    y = q8.q8_gemv(x, w, out_dtype=torch.float32)
    assert y.shape == (1, n) and y.dtype == torch.float32
    assert _rel(y, ref) < 1e-3
    yb = q8.q8_gemv(x, w)  # output in x's dtype
    assert yb.dtype == xdtype and _rel(yb, ref) < (1e-3 if xdtype == torch.float32 else 1e-2)


def test_kernel_is_deterministic_and_writes_only_n_columns(q8):
    w, ref_w, gen = _case(999, 4160, 64)
    x = torch.randn((4160,), generator=gen).to("cuda")  # a 1-D row works too
    y = torch.full((w.n_pad,), 7.0, device="cuda")
    torch.ops.kestrel.q8_gemv_out(x, w.qweight, w.scales, w.group, y[: w.n])
    assert (y[w.n :] == 7.0).all()
    again = q8.q8_gemv(x, w, out_dtype=torch.float32)
    assert torch.equal(y[: w.n], again)  # fixed-order reduction: bitwise the same
    assert again.shape == (999,) and _rel(again, ref_w @ x.double()) < 1e-3


@pytest.mark.parametrize("splits", [1, 2, 4, 8])
@pytest.mark.parametrize("n,k,group", [(130, 96, 32), (999, 4160, 64), (4096, 12288, 128)])
def test_every_split_count_matches_float64_and_repeats_bitwise(q8, n, k, group, splits):
    """Forced split-K counts: each cluster size sums its ranks in a fixed order."""
    w, ref_w, gen = _case(n, k, group, seed=splits)
    x = torch.randn((k,), generator=gen).to("cuda", torch.bfloat16)
    y = q8.q8_gemv(x, w, out_dtype=torch.float32, splits=splits)
    assert _rel(y, ref_w @ x.double()) < 1e-3
    assert torch.equal(y, q8.q8_gemv(x, w, out_dtype=torch.float32, splits=splits))
    col_blocks, used, per_split = q8.gemv_plan(w, splits)
    units = k // 32
    assert col_blocks == -(-w.n_pad // 128) and used <= min(splits, units) and used * per_split >= units
    assert used == splits or units < splits  # rounded down only when K has fewer units than splits


def test_auto_plan_aims_at_one_block_per_sm(q8):
    """The automatic split count: the most splits (up to 8) whose grid stays within one block per SM."""
    sms, peak, per_sm = q8.gemv_device_facts()
    assert sms == torch.cuda.get_device_properties(0).multi_processor_count
    assert peak > 0, "the driver did not report the memory clock or bus width"
    assert per_sm == 1
    for n, k in ((4096, 12288), (12288, 4096), (6144, 4096)):
        w, _, _ = _case(n, k, 64)
        col_blocks, splits, _ = q8.gemv_plan(w)
        if torch.cuda.get_device_capability()[0] < 9:
            assert splits == 1  # no clusters before sm_90
            continue
        assert col_blocks * splits <= max(sms, col_blocks), (n, k, splits)
        assert splits == 8 or col_blocks * splits * 2 > sms, (n, k, splits)


def test_bf16_input_within_2_pow_7_of_each_8_row_maximum_is_summed_exactly(q8):
    """x = j / 64 with 1 <= |j| <= 127 (or 0): every value is within 2^7 of any 8-row maximum, so
    the 16-bit integer sums are exact and only the float32 adds across units round."""
    w, ref_w, gen = _case(4096, 12288, 64)
    j = torch.randint(1, 128, (12288,), generator=gen) * (torch.randint(0, 2, (12288,), generator=gen) * 2 - 1)
    j[::13] = 0
    x = (j.double() / 64).to("cuda", torch.bfloat16)
    assert torch.equal(x.double().cpu() * 64, j.double())
    y = q8.q8_gemv(x, w, out_dtype=torch.float32)
    assert _rel(y, ref_w @ x.double()) < 1e-5


@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_input_gives_no_finite_output(q8, xdtype, bad):
    w, _, gen = _case(999, 4160, 64)
    x = torch.randn((4160,), generator=gen)
    x[1234] = bad
    y = q8.q8_gemv(x.to("cuda", xdtype), w, out_dtype=torch.float32)
    assert not torch.isfinite(y).any()


@pytest.mark.parametrize("splits", [-1, 9])
def test_split_count_out_of_range_is_refused(q8, splits):
    w, _, gen = _case(130, 96, 32)
    x = torch.randn((96,), generator=gen).to("cuda")
    with pytest.raises(ValueError, match=r"splits must be 0 \(auto\) or 1\.\.8"):
        q8.q8_gemv(x, w, splits=splits)


def test_input_on_another_device_is_refused(q8):
    w, _, gen = _case(130, 96, 32)
    with pytest.raises(ValueError, match="x is on cpu but the weights are on cuda"):
        q8.q8_gemv(torch.randn((96,), generator=gen), w)


def test_unaligned_input_view_is_copied_not_misread(q8):
    w, ref_w, gen = _case(256, 256, 128)
    buf = torch.randn((257,), generator=gen).to("cuda")
    x = buf[1:]  # starts 4 bytes past a 16-byte boundary
    assert x.data_ptr() % 16 != 0
    assert _rel(q8.q8_gemv(x, w, out_dtype=torch.float32), ref_w @ x.double()) < 1e-3


def test_kernel_captures_into_a_cuda_graph(q8):
    w, ref_w, gen = _case(4097, 1024, 128)
    x = torch.randn((1, 1024), generator=gen).to("cuda", torch.bfloat16)
    q8.q8_gemv(x, w)  # warm (plan cached) before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = q8.q8_gemv(x, w, out_dtype=torch.float32)
    x.copy_(torch.randn((1, 1024), generator=gen).to("cuda", torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(y, x.double() @ ref_w.T) < 1e-3


@pytest.mark.parametrize("n,k,group", SHAPES)
def test_torch_path_matches_float64_on_the_gpu(n, k, group):
    from backends.cuda import q8 as mod

    w, ref_w, gen = _case(n, k, group, seed=1)
    for T in (1, 7):
        x = torch.randn((T, k), generator=gen).to("cuda")
        y = mod.q8_linear_torch(x, w)
        assert y.shape == (T, n) and _rel(y, x.double() @ ref_w.T) < 1e-3
    xb = x.to(torch.bfloat16)
    assert _rel(mod.q8_linear_torch(xb, w), xb.double() @ ref_w.T) < 1e-2  # weights rounded to bf16 too


def test_q8_linear_dispatch(q8):
    w, ref_w, gen = _case(2049, 384, 32)
    one = torch.randn((1, 384), generator=gen).to("cuda", torch.bfloat16)
    assert torch.equal(q8.q8_linear(one, w), q8.q8_gemv(one, w))  # decode: the kernel
    many = torch.randn((5, 384), generator=gen).to("cuda", torch.bfloat16)
    assert torch.equal(q8.q8_linear(many, w), q8.q8_linear_torch(many, w))  # prefill: dequant + matmul
    assert _rel(q8.q8_linear(many, w), many.double() @ ref_w.T) < 1e-2


def test_pooled_buffer_upload_roundtrip(q8):
    """Pinned host staging -> a device buffer made from the geometry alone -> same product."""
    from backends.cuda.q8 import Q8Weight, new_q8_buffer

    host_w, ref_w, gen = _case(130, 96, 32, device="cpu")
    pinned = Q8Weight.from_tensors(host_w.qweight, host_w.scales, host_w.n, host_w.group, pin_memory=True)
    buf = new_q8_buffer(pinned.geometry("cuda:0"), torch.device("cuda", 0))
    buf.copy_(pinned, non_blocking=True)
    torch.cuda.synchronize()
    x = torch.randn((1, 96), generator=gen).to("cuda")
    assert buf.n == 130 and _rel(q8.q8_gemv(x, buf, out_dtype=torch.float32), x.double() @ ref_w.cuda().T) < 1e-3


def test_gemv_case_for_benchmarks(q8):
    case = q8.gemv_case(4096, 1024, group=128)
    y = case.run()
    assert y.shape == (1, 4096) and case.bytes_moved > case.weight.nbytes
    torch_case = q8.gemv_case(4096, 1024, group=128, path="torch")
    assert _rel(torch_case.run(), y.double()) < 1e-2
