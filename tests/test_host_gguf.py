"""The host GGUF GEMV (backends/cpu_ref/host_gguf.py, csrc/host_gguf.cpp) against its numpy reference and against
the float32 product of kestrel's dequantized weight.

Every type (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), M = 1, 3, 8, an odd N, a K of several blocks (several
super-blocks for the K-quants, and a block count that is not a multiple of 4, so the accumulators' tail runs):

- the kernel against ``reference`` bitwise: x's quantization is the same float32 steps, the integer dots are exact,
  each block's float32 term is formed by the same products in the same order, and the build fuses no multiply-add
  (-ffp-contract=off), so there is no rounding for the two to differ by; tolerance 0;
- the scalar path (``isa="scalar"`` and $KESTREL_HOST_GGUF_ISA=scalar) bitwise the AVX2 path, and the AVX-512 one
  (512-bit maddubs and VNNI's dpwssd for the K-quants) bitwise both, for the same reasons, on every path the CPU has;
- against ``x @ dequantize(W).T`` in float32 within ``host_gguf.bound`` per output: x's quantization moves each
  value by at most max|x of its block| / 254 (with float16's rounding of q8_0's d, 1.001 of it), times |W|, plus 1e-5
  of sum |x| |W| for the float32 sums, plus for Q4_1/Q5_1 the float16 rounding of x's block sum s times |m|
  (``host_gguf.TOLERANCE``);
- bad input refused with one line, and a machine where the build fails says why.

Weights come from real quantization (``gguf.quants.quantize``) for the 32-value types, else from random valid blocks;
each type also from random valid blocks (every fifth bit, Q8_0's int8 -128, which quantization never writes and which
goes through maddubs' sign trick).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_np

from backends.cpu_ref import host_gguf
from kestrel_core.formats.gguf_quants import block_geometry, dequantize

why = host_gguf.usable()
pytestmark = pytest.mark.skipif(why is not None, reason=why or "")

N = 37  # odd
# 13 and 5 blocks: a tail past the 4 lanes
K = {t: 256 * 5 if t in host_gguf.K_QUANTS else 32 * 13 for t in host_gguf.TYPES}
QUANTIZED = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)  # the types gguf.quants quantizes


def random_blocks(qtype, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Valid ``qtype`` blocks for [n, k]: random bytes, with each f16 scale a finite value of either sign."""
    values, nbytes = block_geometry(qtype)
    blocks = rng.integers(0, 256, (n * k // values, nbytes), dtype=np.uint8)
    f16_at = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2),
              T.Q5_0: (0,), T.Q5_1: (0, 2)}[qtype]
    for at in f16_at:
        d = rng.uniform(1e-3, 1e-2, len(blocks)) * rng.choice([-1.0, 1.0], len(blocks))
        blocks[:, at:at + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def weight(qtype, n: int = N, k: int | None = None, seed: int = 0, quantized: bool = True) -> torch.Tensor:
    k = k or K[qtype]
    rng = np.random.default_rng([int(qtype), n, k, seed])
    if quantized and qtype in QUANTIZED:
        raw = gguf_np.quantize(rng.standard_normal((n, k)).astype(np.float32) / k**0.5, qtype)
    else:
        raw = random_blocks(qtype, n, k, rng)
    return torch.from_numpy(np.ascontiguousarray(raw))


def inputs(m: int, k: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[0, :40] = 0.0  # a block of zeros (d = 0) where the block is 32 values, part of one for the 256-value types
    x[-1, 3] = 50.0  # one block dominated by a single large value
    return x


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("qtype", list(host_gguf.TYPES), ids=lambda t: t.name)
def test_against_the_reference_and_the_float_product(qtype, m):
    k = K[qtype]
    raw = weight(qtype)
    x = inputs(m, k, seed=m)
    y = host_gguf.matmul(x, raw, qtype, N, k)
    assert y.shape == (m, N) and y.dtype == torch.float32
    assert torch.equal(y, host_gguf.reference(x, raw, qtype, N, k))
    assert torch.equal(y, host_gguf.matmul(x, raw, qtype, N, k, isa="scalar"))
    want = x @ dequantize(raw.reshape(-1), qtype, (N, k)).T
    err = (y - want).abs()
    assert (err <= host_gguf.bound(x, raw, qtype, N, k)).all(), float(err.max())
    # and not trivially: the error is the quantization's, a few % of the product's size at most (the outlier of 50
    # in x's last row coarsens its whole block: to 0.4 a step in a 256-value block of values about 1; 3.3% seen)
    assert float((y - want).norm() / want.norm()) < 5e-2


HAS = {"avx2": why is None and host_gguf.load().best_isa() == "avx2",
       "avx512": why is None and host_gguf.load().has_avx512()}


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("m", [1, 5, 8])
@pytest.mark.parametrize("qtype", list(host_gguf.TYPES), ids=lambda t: t.name)
def test_each_vector_path_is_the_scalar_paths_bits(qtype, m, isa):
    """m = 5 and 8: the K-quants' rows-at-once functions (4 rows a group) and the one-row tail beside them."""
    if not HAS[isa]:
        pytest.skip(f"this CPU has no {isa} path")
    k = K[qtype] * 3  # 15 super-blocks or 39 blocks: the lanes' tail again, over more blocks
    raw = weight(qtype, k=k, seed=3)
    x = inputs(m, k, seed=4)
    y = host_gguf.matmul(x, raw, qtype, N, k, isa=isa)
    assert torch.equal(y, host_gguf.matmul(x, raw, qtype, N, k, isa="scalar"))
    assert torch.equal(y, host_gguf.reference(x, raw, qtype, N, k))


def test_a_path_the_cpu_lacks_is_refused_in_one_line(monkeypatch):
    module = host_gguf.load()

    class Lacks:  # the built module, on a CPU with AVX2 and no AVX-512
        def __getattr__(self, name):
            return getattr(module, name)

        def best_isa(self):
            return "avx2"

        def has_avx512(self):
            return False

    monkeypatch.setattr(host_gguf, "load", lambda: Lacks())
    with pytest.raises(ValueError, match="avx512 path needs a CPU with AVX-512 F, BW, VL and VNNI") as info:
        host_gguf.which_isa("avx512")
    assert "\n" not in str(info.value)
    assert host_gguf.which_isa("avx2") == "avx2" and host_gguf.which_isa() == "avx2"


def test_random_q8_0_bytes_with_minus_128():
    raw = weight(T.Q8_0, quantized=False)
    assert (raw.numpy()[:, 2:34].view(np.int8) == -128).any()
    x = inputs(3, K[T.Q8_0])
    y = host_gguf.matmul(x, raw, T.Q8_0, N, K[T.Q8_0])
    assert torch.equal(y, host_gguf.reference(x, raw, T.Q8_0, N, K[T.Q8_0]))
    assert torch.equal(y, host_gguf.matmul(x, raw, T.Q8_0, N, K[T.Q8_0], isa="scalar"))


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("qtype", [t for t in QUANTIZED if t != T.Q8_0], ids=lambda t: t.name)
def test_random_blocks_of_the_quantized_types(qtype, isa):
    """Random bytes (every qh bit pattern, any m) where the other tests use quantize's blocks: each path, M = 5."""
    if isa != "scalar" and not HAS[isa]:
        pytest.skip(f"this CPU has no {isa} path")
    k = K[qtype] * 3
    raw = weight(qtype, k=k, seed=5, quantized=False)
    x = inputs(5, k, seed=6)
    y = host_gguf.matmul(x, raw, qtype, N, k, isa=isa)
    assert torch.equal(y, host_gguf.reference(x, raw, qtype, N, k))
    want = x @ dequantize(raw.reshape(-1), qtype, (N, k)).T
    assert ((y - want).abs() <= host_gguf.bound(x, raw, qtype, N, k)).all()


@pytest.mark.parametrize("qtype", list(host_gguf.TYPES), ids=lambda t: t.name)
def test_the_env_forces_the_scalar_path_and_each_row_is_its_own(qtype, monkeypatch):
    k = K[qtype]
    raw = weight(qtype, seed=1)
    x = inputs(8, k, seed=2)
    fast = host_gguf.matmul(x, raw, qtype, N, k, threads=2)
    monkeypatch.setenv(host_gguf.ISA_ENV, "scalar")
    assert host_gguf.which_isa() == "scalar"
    assert torch.equal(host_gguf.matmul(x, raw, qtype, N, k, threads=1), fast)
    monkeypatch.delenv(host_gguf.ISA_ENV)
    alone = torch.cat([host_gguf.matmul(x[i:i + 1], raw, qtype, N, k) for i in range(8)])
    assert torch.equal(alone, fast)


def test_bf16_x_and_a_numpy_weight():
    raw = weight(T.Q4_K)
    x = inputs(2, K[T.Q4_K]).to(torch.bfloat16)
    y = host_gguf.matmul(x, raw.numpy(), T.Q4_K, N, K[T.Q4_K])
    assert torch.equal(y, host_gguf.reference(x.float(), raw, T.Q4_K, N, K[T.Q4_K]))


def test_the_path_is_told_once(capsys, monkeypatch):
    monkeypatch.setattr(host_gguf, "_told", False)
    raw, x = weight(T.Q8_0), inputs(1, K[T.Q8_0])
    host_gguf.matmul(x, raw, T.Q8_0, N, K[T.Q8_0])
    host_gguf.matmul(x, raw, T.Q8_0, N, K[T.Q8_0])
    err = capsys.readouterr().err
    assert err.count("host GGUF kernel runs its") == 1 and host_gguf.which_isa() in err


@pytest.mark.parametrize("call, message", [
    (lambda raw, x: host_gguf.matmul(x, raw, T.Q3_K, N, 1280),
     "computes Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, not Q3_K"),
    (lambda raw, x: host_gguf.matmul(x, raw, T.Q4_K, N, 1000), "k a positive multiple of 256"),
    (lambda raw, x: host_gguf.matmul(x[:, :256], raw, T.Q4_K, N, 1280), "x must be a [M, 1280] tensor"),
    (lambda raw, x: host_gguf.matmul(x[0], raw, T.Q4_K, N, 1280), "x must be a [M, 1280] tensor"),
    (lambda raw, x: host_gguf.matmul(x.double(), raw, T.Q4_K, N, 1280), "float32, bfloat16 or float16"),
    (lambda raw, x: host_gguf.matmul(x, raw.view(torch.int8), T.Q4_K, N, 1280), "uint8 CPU tensor"),
    (lambda raw, x: host_gguf.matmul(x, raw[:-1], T.Q4_K, N, 1280), f"weight is {N * 5 * 144} bytes"),
    (lambda raw, x: host_gguf.matmul(x, raw, T.Q4_K, N + 1, 1280), "weight is"),
    (lambda raw, x: host_gguf.matmul(x, raw, T.Q4_K, N, 1280, isa="avx1024"),
     "isa is one of auto, scalar, avx2, avx512, not 'avx1024'"),
    (lambda raw, x: host_gguf.matmul(x, raw, T.Q4_K, N, 1280, threads=0), "threads must be a positive int"),
])
def test_bad_input_is_refused_in_one_line(call, message):
    raw, x = weight(T.Q4_K), inputs(2, K[T.Q4_K])
    with pytest.raises(ValueError) as info:
        call(raw, x)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_failed_build_says_why_in_one_line(monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("error: command 'c++' failed: No such file or directory")

    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setattr(cpp_extension, "load", broken)
    with pytest.raises(RuntimeError) as info:
        host_gguf.EXTENSION.build()
    text = str(info.value)
    assert "did not build" in text and "No such file or directory" in text and "C++ compiler" in text
    assert "\n" not in text
    # usable() reports the cached reason; matmul raises it
    monkeypatch.setattr(host_gguf.EXTENSION, "build", lambda: (_ for _ in ()).throw(RuntimeError(text)))
    host_gguf.EXTENSION.forget()
    try:
        assert host_gguf.usable() == text
        with pytest.raises(RuntimeError, match="did not build"):
            host_gguf.matmul(inputs(1, K[T.Q8_0]), weight(T.Q8_0), T.Q8_0, N, K[T.Q8_0])
    finally:
        monkeypatch.undo()
        host_gguf.EXTENSION.forget()  # the real build again for the tests after this one
