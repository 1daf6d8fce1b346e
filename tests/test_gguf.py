"""The GGUF reader on small hand-made files: dequantization against ggml's reference, Q8_0 into kestrel's q8,
the tensors under Hugging Face names (llama's Q/K un-permuted), the config, tokenizer and chat template from the
metadata, the Checkpoint interface, and a one-line CheckpointError for each way a file can be wrong."""

from __future__ import annotations

import math
import os
import re

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import quants as gguf_quants

from kestrel_core.formats import gguf_quants as gq
from kestrel_core.formats import quant
from kestrel_core.formats.checkpoint import FAULT_GRANULE
from kestrel_core.errors import CheckpointError, ConfigError
from kestrel_core.formats.gguf import GGUFCheckpoint, is_gguf, unpermute_rows
from kestrel_core.formats.tensor_table import all_specs, validate_checkpoint
from tests.gguf_files import (DIMS, K_DIMS, K_TYPES, LLAMA_TYPES, T, TOKEN_TYPES, TOKENS, VOCAB, llama_permute,
                              model_metadata, model_tensors, random_blocks, reference_dequantize, write_gguf, write_model)

QUANTS = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS]
MOE_TYPES = {**LLAMA_TYPES, "ffn_gate": T.Q4_0, "ffn_up": T.Q8_0, "ffn_down": T.BF16}


@pytest.fixture
def open_ckpt():
    opened = []

    def _open(path):
        c = GGUFCheckpoint(path)
        opened.append(c)
        return c

    yield _open
    for c in opened:
        c.close()


# --- tensor types -----------------------------------------------------------------------
@pytest.mark.parametrize("qtype", QUANTS, ids=lambda t: t.name)
def test_dequantization_equals_ggml_reference_on_random_blocks(qtype):
    """kestrel's torch dequantizer against a hand transcription of ggml's C and against gguf's numpy port, bit for bit."""
    rng = np.random.default_rng(int(qtype))
    block, _ = GGML_QUANT_SIZES[qtype]
    shape = (3, max(block, 32) * 2)  # three rows of two blocks
    raw = random_blocks(qtype, math.prod(shape), rng)
    got = gq.dequantize(raw.reshape(-1), qtype, shape)
    want = reference_dequantize(raw, qtype, shape)
    assert got.dtype == torch.float32 and tuple(got.shape) == shape
    assert np.isfinite(want).all()
    assert np.array_equal(got.numpy(), want)
    assert np.array_equal(got.numpy(), gguf_quants.dequantize(raw.reshape(shape[0], -1), qtype))


def test_q8_0_repacks_into_kestrels_q8_layout_exactly():
    rng = np.random.default_rng(1)
    n, k = 70, 96  # n not a multiple of 64: pad columns
    raw = random_blocks(T.Q8_0, n * k, rng)
    qweight, scales = gq.q8_0_to_kestrel(raw, n, k)
    assert qweight.dtype == np.int8 and qweight.shape == (k, quant.pad_n(n))
    assert scales.dtype == np.float32 and scales.shape == (k // 32, quant.pad_n(n))
    assert not qweight[:, n:].any() and not scales[:, n:].any()
    got = quant.dequantize(torch.from_numpy(qweight), torch.from_numpy(scales), n, 32)
    assert torch.equal(got, gq.dequantize(raw, T.Q8_0, (n, k)))


def test_q8_of_a_checkpoint_tensor_equals_its_view_permuted_or_not(tmp_path, open_ckpt):
    path, _ = write_model(tmp_path / "m.gguf", types={**LLAMA_TYPES, "attn_q": T.Q8_0, "attn_k": T.Q8_0})
    c = open_ckpt(path)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                 "model.layers.0.mlp.gate_proj.weight", "model.embed_tokens.weight"):
        qweight, scales = c.q8(name)
        n = c.info(name).shape[0]
        assert torch.equal(quant.dequantize(qweight, scales, n, 32), c.view(name)), name
    with pytest.raises(CheckpointError, match="not a 2-D Q8_0 weight"):
        c.q8("model.layers.0.mlp.up_proj.weight")  # F32


# --- tensors under kestrel's names ---------------------------------------------------------
CASES = {
    "llama": ("llama", DIMS, LLAMA_TYPES),
    "qwen3": ("qwen3", DIMS, LLAMA_TYPES),
    "qwen3moe": ("qwen3moe", DIMS, MOE_TYPES),
    "llama-kquants": ("llama", K_DIMS, K_TYPES),
}


@pytest.mark.parametrize("case", CASES)
def test_every_tensor_equals_the_hugging_face_weight_it_stands_for(case, tmp_path, open_ckpt):
    arch, dims, types = CASES[case]
    path, hf = write_model(tmp_path / "m.gguf", arch, dims, types)
    c = open_ckpt(path)
    cfg = c.model_config()
    assert set(all_specs(cfg)) == set(hf)
    for name, truth in hf.items():
        assert name in c
        v = c.view(name)
        assert v.dtype in (torch.float32, torch.float16, torch.bfloat16)
        assert tuple(v.shape) == truth.shape == c.info(name).shape, name
        assert torch.equal(v.float(), torch.from_numpy(truth)), name
    validate_checkpoint(c, cfg)  # what Model runs on a safetensors checkpoint passes on this one unchanged
    assert quant.read_quant(c, cfg) is None


def test_llama_q_and_k_are_unpermuted_and_qwen3s_are_not(tmp_path, open_ckpt):
    for arch, permuted in (("llama", True), ("qwen3", False)):
        c = open_ckpt(write_model(tmp_path / f"{arch}.gguf", arch)[0])
        for role in ("q", "k"):
            assert c.info(f"model.layers.0.self_attn.{role}_proj.weight").permuted is permuted
        assert not c.info("model.layers.0.self_attn.v_proj.weight").permuted
    # the inverse of the converter's formula, for query (n_head) and key (n_head_kv) rows
    for rows, heads, kv in ((576, 9, 9), (192, 9, 3), (64, 4, 2)):
        w = np.arange(rows)
        stored = llama_permute(w, heads, kv)
        assert np.array_equal(stored[unpermute_rows(rows, kv if kv != heads else heads)], w)


def test_float_tensors_are_zero_copy_views_of_the_mapping(tmp_path, open_ckpt):
    c = open_ckpt(write_model(tmp_path / "m.gguf")[0])
    base = np.frombuffer(c._file._mm, dtype=np.uint8).ctypes.data
    for name, dtype in (("model.layers.0.mlp.up_proj.weight", torch.float32), ("model.layers.0.self_attn.v_proj.weight", torch.float16),
                        ("model.layers.0.self_attn.o_proj.weight", torch.bfloat16), ("model.norm.weight", torch.float32)):
        info, v = c.info(name), c.view(name)
        assert info.raw and v.dtype == dtype
        assert v.data_ptr() == base + info.start and v.numel() * v.element_size() == info.nbytes
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight"):
        info = c.info(name)
        assert not info.raw and info.dtype == "F32"  # dequantized (or un-permuted): new memory, float32
        assert info.nbytes < math.prod(info.shape) * 4


def test_experts_of_a_stack_are_slices_of_it(tmp_path, open_ckpt):
    c = open_ckpt(write_model(tmp_path / "m.gguf", "qwen3moe", types=MOE_TYPES)[0])
    stack = "model.layers.1.mlp.experts.up_exps"
    assert stack in c.names() and "model.layers.1.mlp.experts.2.up_proj.weight" not in c.names()
    assert c.info(stack).shape == (DIMS["experts"], DIMS["expert_ff"], DIMS["hidden"])
    whole = c.view(stack)
    spans = []
    for e in range(DIMS["experts"]):
        name = f"model.layers.1.mlp.experts.{e}.up_proj.weight"
        assert c.source(name) == stack
        assert torch.equal(c.view(name), whole[e])
        spans.append((c.info(name).start, c.info(name).end))
    assert spans[0][0] == c.info(stack).start and spans[-1][1] == c.info(stack).end
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # each expert its own contiguous bytes
    assert c.source("model.layers.1.mlp.gate.weight") == "model.layers.1.mlp.gate.weight"


def test_dequantizing_one_tensor_reads_only_its_own_bytes(tmp_path, open_ckpt):
    wide = {**DIMS, "hidden": 512, "heads": 8, "kv": 2, "head_dim": 64, "ff": 4096, "layers": 3}
    q8 = {k: T.Q8_0 for k in LLAMA_TYPES}
    c = open_ckpt(write_model(tmp_path / "wide.gguf", dims=wide, types=q8, truth=False)[0])
    size = c.files["wide.gguf"].size
    name = "model.layers.1.mlp.up_proj.weight"
    c.unmap_all()
    before = c.mapping_rss()
    c.view(name)
    touched = c.mapping_rss() - before
    assert 0 < touched <= c.info(name).nbytes + 2 * FAULT_GRANULE < size / 3, (touched, size)
    c.drop_around([name], keep=set())
    assert c.mapping_rss() <= before
    c.view(name)
    c.drop_pages([name])
    assert c.mapping_rss() - before <= 2 * FAULT_GRANULE  # what a fault mapped around it may stay; its own pages go


# --- config, tokenizer, chat template --------------------------------------------------------
def test_config_comes_from_the_metadata(tmp_path, open_ckpt):
    c = open_ckpt(write_model(tmp_path / "m.gguf", meta={"llama.rope.freq_base": 500000.0, "llama.context_length": 4096,
                                                          "llama.attention.layer_norm_rms_epsilon": 1e-5})[0])
    cfg = c.model_config()
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == ("llama", 2, 64, 4, 2, 16, 96, VOCAB)
    assert cfg.rope_theta == 500000.0 and cfg.max_position_embeddings == 4096
    assert cfg.rms_norm_eps == 1e-5  # the float32 in the file, read back as the decimal it was written from
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.tie_word_embeddings, cfg.rope_scaling) == (1, 2, False, None)
    assert c.config_dict()["model_type"] == "llama"
    assert c.metadata["llama.block_count"] == "2" and "tokenizer.ggml.tokens" not in c.metadata

    tied = open_ckpt(write_model(tmp_path / "tied.gguf", "qwen3", tied=True)[0])
    assert tied.model_config().tie_word_embeddings and tied.model_config().qk_norm
    assert "lm_head.weight" not in tied
    validate_checkpoint(tied, tied.model_config())


def test_moe_config_and_its_dense_layers(tmp_path, open_ckpt):
    c = open_ckpt(write_model(tmp_path / "m.gguf", "qwen3moe", types=MOE_TYPES,
                              meta={"qwen3moe.expert_weights_norm": False})[0])
    cfg = c.model_config()
    assert (cfg.model_type, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == ("qwen3_moe", 4, 2, 32)
    assert cfg.norm_topk_prob is False and cfg.mlp_only_layers == ()
    assert open_ckpt(write_model(tmp_path / "n.gguf", "qwen3moe", types=MOE_TYPES)[0]).model_config().norm_topk_prob

    # layer 0 dense (an ffn_gate/up/down, no router): kestrel's mlp_only_layers
    tensors, _ = model_tensors("qwen3moe", DIMS, MOE_TYPES)
    dense, _ = model_tensors("qwen3", DIMS, LLAMA_TYPES)
    for role in ("gate_inp", "gate_exps", "up_exps", "down_exps"):
        del tensors[f"blk.0.ffn_{role}.weight"]
    for role in ("gate", "up", "down"):
        tensors[f"blk.0.ffn_{role}.weight"] = dense[f"blk.0.ffn_{role}.weight"]
    c = open_ckpt(write_gguf(tmp_path / "mixed.gguf", "qwen3moe", model_metadata("qwen3moe"), tensors))
    assert c.model_config().mlp_only_layers == (0,) and not c.model_config().moe_layer(0)
    validate_checkpoint(c, c.model_config())


def test_llama3_rope_scaling_from_rope_freqs(tmp_path, open_ckpt):
    hd, theta = DIMS["head_dim"], 500000.0
    freqs = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    factors = []
    for f in freqs:  # convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors, factor 8
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4.0:
            factors.append(1.0)
        elif wavelen > 8192 / 1.0:
            factors.append(8.0)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / 8.0 + smooth))
    tensors, _ = model_tensors("llama")
    tensors["rope_freqs.weight"] = (np.array(factors, dtype=np.float32), T.F32)
    meta = {**model_metadata("llama"), "llama.rope.freq_base": theta}
    c = open_ckpt(write_gguf(tmp_path / "l3.gguf", "llama", meta, tensors))
    rs = c.model_config().rope_scaling
    assert rs["rope_type"] == "llama3" and rs["factor"] == 8.0
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    assert torch.allclose(c.model_config().inv_freq(), inv / torch.tensor(factors, dtype=torch.float64), rtol=1e-6)
    validate_checkpoint(c, c.model_config())

    tensors["rope_freqs.weight"] = (np.linspace(1, 3, hd // 2, dtype=np.float32), T.F32)
    with pytest.raises(CheckpointError, match="rope_freqs.weight' is not Llama 3 rope scaling"):
        GGUFCheckpoint(write_gguf(tmp_path / "bad.gguf", "llama", meta, tensors))


def test_tokenizer_from_the_metadata(tmp_path, open_ckpt):
    c = open_ckpt(write_model(tmp_path / "m.gguf")[0])
    tok = c.tokenizer()
    assert tok.encode(" the") == [TOKENS.index("Ġthe")]
    assert tok.encode("<|im_start|>user") == [1] + tok.encode("user")  # a control token is one id
    assert tok.encode("<think>") == [TOKENS.index("<think>")]  # so is a user-defined one
    assert TOKEN_TYPES[TOKENS.index("<think>")] == 4
    for text in ("the cat in the hat", "naïve café: 日本語, emoji 🙂\n\ttabs  and   spaces", "<|im_start|>a<|im_end|>\n", "1234 + 0.5"):
        assert tok.decode(tok.encode(text)) == text
    stream = tok.stream()
    ids = tok.encode("🙂 ok")
    assert "".join(stream.push(i) for i in ids) + stream.finish() == "🙂 ok"
    assert c.hf_tokenizer().get_vocab_size() == VOCAB
    assert c.special_tokens() == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}


def test_eos_ids_and_chat_template(tmp_path, open_ckpt):
    c = open_ckpt(write_model(tmp_path / "m.gguf", meta={"tokenizer.ggml.eot_token_id": 0})[0])
    assert c.eos_ids() == frozenset({2, 0})
    text = c.chat_template().render([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    bare = open_ckpt(write_model(tmp_path / "bare.gguf", meta={"tokenizer.chat_template": None})[0])
    with pytest.raises(ConfigError, match="no chat template"):
        bare.chat_template()


def test_tokenizer_kestrel_cannot_build_names_the_key(tmp_path, open_ckpt):
    c = open_ckpt(write_model(tmp_path / "m.gguf", meta={"tokenizer.ggml.pre": "deepseek-coder"})[0])
    with pytest.raises(CheckpointError, match="tokenizer.ggml.pre is 'deepseek-coder'"):
        c.tokenizer()
    c = open_ckpt(write_model(tmp_path / "spm.gguf", meta={"tokenizer.ggml.model": "llama"})[0])
    with pytest.raises(CheckpointError, match="tokenizer.ggml.model is 'llama'"):
        c.tokenizer()
    none = {k: None for k in ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                              "tokenizer.ggml.token_type", "tokenizer.ggml.pre")}
    assert open_ckpt(write_model(tmp_path / "ids.gguf", meta=none)[0]).tokenizer() is None


def test_is_gguf(tmp_path):
    path, _ = write_model(tmp_path / "m.gguf")
    other = tmp_path / "model.bin"
    other.write_bytes(path.read_bytes()[:64])
    assert is_gguf(path) and is_gguf(other) and not is_gguf(tmp_path)
    (tmp_path / "x.txt").write_text("hello")
    assert not is_gguf(tmp_path / "x.txt")


# --- a file that is wrong: one line naming the field and the fix ---------------------------------
def _patched_type(path, name: str, new_type: int):
    """Overwrite the ggml type of tensor ``name`` in the header (name, n_dims, dims, type, offset)."""
    data = bytearray(path.read_bytes())
    key = len(name).to_bytes(8, "little") + name.encode()
    at = data.index(key) + len(key)
    n_dims = int.from_bytes(data[at : at + 4], "little")
    at += 4 + 8 * n_dims
    data[at : at + 4] = new_type.to_bytes(4, "little")
    path.write_bytes(bytes(data))
    return path


def _bad(tmp_path, kind):
    p = tmp_path / "bad.gguf"
    if kind == "truncated":
        path, _ = write_model(p)
        os.truncate(path, path.stat().st_size - 100)
        return path
    if kind == "truncated header":
        path, _ = write_model(p)
        os.truncate(path, 200)
        return path
    if kind == "not gguf":
        p.write_bytes(b"PK\x03\x04" + b"\0" * 100)
        return p
    if kind == "unknown architecture":
        tensors, _ = model_tensors("llama")
        return write_gguf(p, "phi3", model_metadata("phi3"), tensors)
    if kind == "unknown type":
        return _patched_type(write_model(p)[0], "blk.0.ffn_up.weight", 99)
    if kind == "unsupported type":
        return write_model(p, dims=K_DIMS, types={**K_TYPES, "ffn_up": T.IQ2_XXS})[0]
    if kind == "missing tensor":
        return write_model(p, drop=("blk.1.ffn_down.weight",))[0]
    if kind == "wrong shape":
        return write_model(p, meta={"llama.feed_forward_length": 128})[0]
    if kind == "vocabulary vs embedding":
        return write_model(p, meta={"tokenizer.ggml.tokens": TOKENS[:-1], "tokenizer.ggml.token_type": TOKEN_TYPES[:-1]})[0]
    if kind == "vocab_size vs embedding":
        return write_model(p, meta={"llama.vocab_size": 300})[0]
    if kind == "missing metadata":
        return write_model(p, meta={"llama.block_count": None})[0]
    if kind == "unused tensor":
        tensors, _ = model_tensors("llama")
        tensors["blk.0.attn_q_norm.weight"] = (np.ones(16, np.float32), T.F32)
        return write_gguf(p, "llama", model_metadata("llama"), tensors)
    if kind == "unknown tensor":
        tensors, _ = model_tensors("llama")
        tensors["blk.0.attn_sinks.weight"] = (np.ones(4, np.float32), T.F32)
        return write_gguf(p, "llama", model_metadata("llama"), tensors)
    if kind == "kv heads":
        return write_model(p, meta={"llama.attention.head_count_kv": 3})[0]
    if kind == "rope scaling":
        return write_model(p, meta={"llama.rope.scaling.type": "yarn"})[0]
    raise AssertionError(kind)


BAD = {
    "truncated": "tensor 'blk.1.ffn_down.weight' ends at byte .* the file is truncated",
    "truncated header": r"the header declares 21 metadata keys, more than the 176 bytes left in the file hold.* truncated or corrupt",
    "not gguf": r"not a GGUF file \(it starts with b'PK",
    "unknown architecture": "general.architecture is 'phi3', which kestrel does not run; supported: llama, qwen3, qwen3moe",
    "unknown type": "tensor 'blk.0.ffn_up.weight' has ggml type 99, .* re-quantize",
    "unsupported type": "tensor 'blk.0.ffn_up.weight' is of type IQ2_XXS, which kestrel does not read; supported: F32, F16, BF16, Q8_0",
    "missing tensor": r"missing tensor 'blk.1.ffn_down.weight' \(model.layers.1.mlp.down_proj.weight\)",
    "wrong shape": r"tensor 'blk.0.ffn_gate.weight' has shape \[96, 64\] \(GGUF ne \[64, 96\]\) but the metadata implies \[128, 64\]",
    "vocabulary vs embedding": "tokenizer.ggml.tokens has 264 tokens but token_embd.weight has 265 rows; the vocabulary disagrees",
    "vocab_size vs embedding": "metadata llama.vocab_size=300 but token_embd.weight has 265 rows",
    "missing metadata": "metadata has no llama.block_count",
    "unused tensor": r"1 tensor\(s\) that a llama model of this metadata does not use \('blk.0.attn_q_norm.weight'\)",
    "unknown tensor": "tensor 'blk.0.attn_sinks.weight' is not one kestrel reads for a llama model",
    "kv heads": "num_key_value_heads=3 must divide .*num_key_value_heads is llama.attention.head_count_kv",
    "rope scaling": "llama.rope.scaling.type is 'yarn'",
}


@pytest.mark.parametrize("kind", BAD)
def test_a_bad_file_is_one_line_naming_the_field(kind, tmp_path):
    path = _bad(tmp_path, kind)
    with pytest.raises(CheckpointError) as err:
        GGUFCheckpoint(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(str(path)), message
    assert re.search(BAD[kind], message), message
