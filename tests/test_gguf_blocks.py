"""How the cuda backend holds a GGUF's quantized weights as the file's own blocks (backends/cuda/blocks.py), on the
CPU: which tensors are blocks, each entry's staged bytes (the stored blocks, rows in Hugging Face order, parts of
different types as segments), its geometry, and its product through the block kernels (in Triton's interpreter)
against the dequantized weights, each row of a batch bitwise its one-row result. On a GPU, the same in a run:
tests/test_gguf_blocks_cuda.py.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported

from backends.cuda import blocks, gguf_int8, gguf_kernels  # noqa: E402
from backends.cuda.layout import fusion  # noqa: E402
from kestrel_core import load  # noqa: E402
from kestrel_core.errors import CheckpointError  # noqa: E402
from kestrel_core.formats import gguf_quants  # noqa: E402
from kestrel_core.formats.gguf_model import block_tensors  # noqa: E402
from tests.test_gguf_int8 import exact as int8_exact  # noqa: E402
from tests.gguf_files import K_DIMS, K_TYPES, LLAMA_TYPES, T, write_model  # noqa: E402

# every linear a block type: q/k/v of three types (one segment each), gate Q5_K beside up Q6_K
BLOCK_TYPES = {**K_TYPES}
# 32-value types, attn_v and ffn_up float: qkv and gate_up mix blocks and floats
MIXED = {**LLAMA_TYPES, "attn_q": T.Q4_1, "attn_k": T.Q4_1, "attn_output": T.Q4_0, "ffn_down": T.Q8_0}
# the low-bit types of large MoE files: q Q3_K, k Q2_K, v IQ4_XS (qkv three segments), gate IQ4_XS beside up Q2_K
LOW = {**BLOCK_TYPES, "attn_q": T.Q3_K, "attn_k": T.Q2_K, "attn_v": T.IQ4_XS, "ffn_gate": T.IQ4_XS, "ffn_up": T.Q2_K}


@pytest.fixture(scope="module")
def k_model(tmp_path_factory):
    path, _ = write_model(tmp_path_factory.mktemp("blocks") / "k.gguf", dims=K_DIMS, types=BLOCK_TYPES)
    return path


def test_every_quantized_linear_is_a_block_tensor_and_floats_are_not(tmp_path, k_model):
    with load(k_model) as model:
        got = block_tensors(model.checkpoint, model.config, blocks.TYPES)
        names = {n for spec in model.units for role, (n, _) in spec.tensors.items()}
        assert set(got) == names | {"lm_head.weight"}
        q = got["model.layers.0.self_attn.q_proj.weight"]
        assert (q.qtype, q.n, q.k) == (T.Q4_K, K_DIMS["heads"] * K_DIMS["head_dim"], K_DIMS["hidden"])
        assert q.nbytes == gguf_kernels.stored_bytes(T.Q4_K, q.n, q.k)
        assert block_tensors(model.checkpoint, model.config, blocks.TYPES, skip={q.name}).keys() == got.keys() - {q.name}
    path, _ = write_model(tmp_path / "m.gguf", types=MIXED)
    with load(path) as model:
        got = block_tensors(model.checkpoint, model.config, blocks.TYPES)
        assert "model.layers.0.self_attn.v_proj.weight" not in got  # F16
        assert "model.layers.0.mlp.up_proj.weight" not in got  # F32
        assert "lm_head.weight" not in got  # F16
        assert got["model.layers.1.mlp.down_proj.weight"].qtype == T.Q8_0


def test_a_permuted_weights_blocks_dequantize_to_its_view(k_model):
    from kestrel_core.formats.gguf_quants import dequantize

    with load(k_model) as model:
        ckpt = model.checkpoint
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                     "model.layers.0.mlp.down_proj.weight"):
            raw = ckpt.blocks(name)
            qtype = T[ckpt.info(name).ggml_type]
            assert raw.dtype == torch.uint8 and raw.shape[0] == ckpt.info(name).shape[0]
            assert torch.equal(dequantize(raw.reshape(-1), qtype, ckpt.info(name).shape), ckpt.view(name)), name
        with pytest.raises(CheckpointError, match="not a 2-D weight of quantized blocks"):
            ckpt.blocks("model.norm.weight")


def test_layout_merges_consecutive_parts_of_one_type():
    from kestrel_core.formats.gguf_model import BlockTensor

    parts = [BlockTensor("a", T.Q4_K, 8, 256, 0), BlockTensor("b", T.Q4_K, 4, 256, 0), BlockTensor("c", T.Q6_K, 4, 256, 0)]
    assert blocks.layout_of(parts) == (("Q4_K", 12), ("Q6_K", 4))
    g = blocks.fused_geometry(parts, "cpu")
    assert g.nbytes == gguf_kernels.stored_bytes(T.Q4_K, 12, 256) + gguf_kernels.stored_bytes(T.Q6_K, 4, 256)
    assert blocks.is_block_geometry(g) and g != blocks.fused_geometry(parts[::-1], "cpu")
    with pytest.raises(ValueError, match="share K"):
        blocks.fused_geometry([parts[0], BlockTensor("d", T.Q4_K, 8, 512, 0)], "cpu")


needs_triton = pytest.mark.skipif(gguf_kernels.available() is not None, reason="needs Triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the interpreter runs on CPU tensors


def _entries(path):
    """(unit key, entry name, staged BlockWeight, the float weight it stands for) of every all-block entry."""
    with load(path) as model:
        ckpt = model.checkpoint
        held = block_tensors(ckpt, model.config, blocks.TYPES)
        out = []
        for spec in model.units:
            for name, roles in fusion(spec.tensors):
                parts = [held.get(spec.tensors[r][0]) for r in roles]
                if None in parts:
                    continue
                w = blocks.stage_blocks(ckpt, parts, pin_memory=False)
                want = torch.cat([ckpt.view(spec.tensors[r][0]).float() for r in roles])
                out.append((spec.key, name, w, want, parts))
        return out


@needs_triton
@pytest.mark.parametrize("which, int8", [("k", False), ("k", True), ("mixed", False), ("mixed", True), ("low", False)],
                         ids=["k-float", "k-int8", "mixed-float", "mixed-int8", "low-float"])  # low: no int8 kernel
def test_each_entry_computes_its_dequantized_product_and_rows_are_batch_invariant(which, int8, k_model, tmp_path):
    """On a GPU the kernels run compiled, which may fuse a dequantization's multiply-add: the bound holds there too.
    The int8 kernels' columns are held to their own arithmetic (x quantized), the float kernels' to x's product."""
    if which == "low":
        path = write_model(tmp_path / "low.gguf", dims=K_DIMS, types=LOW)[0]
    else:
        path = k_model if which == "k" else write_model(tmp_path / "m.gguf", types=MIXED)[0]
    entries = _entries(path)
    assert entries
    if which == "k":  # qkv is three types, gate_up two: segments, not one kernel call
        layouts = {name: w.layout for _, name, w, _, _ in entries}
        assert layouts["qkv"] == (("Q4_K", 64 * 4), ("Q5_K", 64 * 2), ("Q6_K", 64 * 2))
        assert layouts["gate_up"] == (("Q5_K", K_DIMS["ff"]), ("Q6_K", K_DIMS["ff"]))
    if which == "low":  # held as their blocks: three types in qkv, two in gate_up
        layouts = {name: w.layout for _, name, w, _, _ in entries}
        assert layouts["qkv"] == (("Q3_K", 64 * 4), ("Q2_K", 64 * 2), ("IQ4_XS", 64 * 2))
        assert layouts["gate_up"] == (("IQ4_XS", K_DIMS["ff"]), ("Q2_K", K_DIMS["ff"]))
    gen = torch.Generator().manual_seed(0)
    for key, name, w, want, parts in entries:
        assert w.geometry("cpu") == blocks.fused_geometry(parts, "cpu")
        assert w.nbytes == sum(p.nbytes for p in parts)  # the stored bytes, nothing added
        w, want = w.to(DEVICE), want.to(DEVICE)
        x = torch.randn(5, w.k, generator=gen).to(DEVICE)
        y = blocks.block_linear(x, w, int8)
        assert y.shape == (5, w.n) and y.dtype == torch.float32
        row = 0
        for seg in w.segments:  # each segment's columns: the int8 kernels' types against their own arithmetic
            cols, wseg = y[:, row:row + seg.n], want[row:row + seg.n]
            if int8 and seg.qtype in gguf_int8.TYPES and gguf_int8.aligned(w.segment(seg), seg.qtype):
                raw = w.segment(seg).cpu()
                deq = gguf_quants.dequantize(raw, seg.qtype, (seg.n, w.k))
                assert torch.equal(deq, wseg.cpu())  # the segment's blocks are the rows of its view
                ref, scale = int8_exact(seg.qtype, raw, deq, x)
            else:
                ref, scale = x.cpu().double() @ wseg.cpu().double().T, x.abs().cpu().double() @ wseg.abs().cpu().double().T
            assert bool(((cols.cpu().double() - ref).abs() <= 1e-6 * scale + 1e-12).all()), (key, name, seg.qtype.name)
            row += seg.n
        for m in range(5):
            assert torch.equal(blocks.block_linear(x[m:m + 1], w, int8)[0], y[m]), (key, name, m)
        assert blocks.block_linear(x[None, :2], w, int8).shape == (1, 2, w.n)  # leading dims kept
        xb = x.to(torch.bfloat16)
        assert blocks.block_linear(xb, w, int8).dtype == torch.bfloat16


def test_a_buffer_takes_only_its_own_layout():
    a = blocks.BlockWeight.empty(256, (("Q4_K", 4),))
    b = blocks.BlockWeight.empty(256, (("Q6_K", 4),))
    with pytest.raises(ValueError, match="block layout mismatch"):
        a.copy_(b)
    with pytest.raises(ValueError, match="uint8 vector"):
        blocks.BlockWeight(torch.zeros(3, dtype=torch.uint8), 256, (("Q4_K", 4),))
    c = blocks.new_block_buffer(a.geometry("cpu"), "cpu")
    a.raw.random_(0, 255)
    assert torch.equal(c.copy_(a).raw, a.raw)



@needs_triton
def test_a_pass_s_rows_take_the_kernels_of_their_kind(k_model):
    """``gguf_kernels = "auto"``: the rows before ``prompt_from`` (decode rows, verify spans) are bitwise the float
    kernels' rows, the rest (a prompt's) the int8 kernels', from 16 of them on the tensor cores: each row's bits
    follow its kind, whatever rows of either kind stand beside it."""
    gen = torch.Generator().manual_seed(1)
    entries = [e for e in _entries(k_model) if e[1] == "qkv"][:1]  # Q4_K, Q5_K and Q6_K segments
    assert entries
    for _, name, w, _, _ in entries:
        w = w.to(DEVICE)
        x = torch.randn(19, w.k, generator=gen).to(DEVICE)
        y = blocks.block_linear(x, w, False, prompt_from=3, prompt_int8=True)
        assert torch.equal(y[:3], blocks.block_linear(x[:3], w, False)), name
        prompt = blocks.block_linear(x[3:], w, True)  # 16 prompt rows: the tensor cores where the type has them
        assert torch.equal(y[3:], prompt), name
        assert not torch.equal(prompt, blocks.block_linear(x[3:], w, False)), name  # the two kinds do differ
        for m in (0, 1, 15):  # a prompt row alone, or beside fewer: the same bits
            assert torch.equal(blocks.block_linear(x[3 + m:4 + m], w, False, prompt_from=0, prompt_int8=True)[0],
                               prompt[m]), (name, m)
        assert torch.equal(blocks.block_linear(x, w, False, prompt_from=19, prompt_int8=True),
                           blocks.block_linear(x, w, False)), name  # no prompt row: the decode kernels alone
