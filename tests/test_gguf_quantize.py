"""Writing GGUF files: ``kestrel quantize --type`` and ``kestrel make-model --type``.

- The blocks: Q8_0, Q4_0 and Q4_1 equal the ``gguf`` package's quantizers byte for byte; Q4_K, Q5_K and Q6_K equal a
  loop-by-loop transcription of ggml's C reference (``quantize_row_q4_K_ref`` and the rest of ggml-quants.c, written
  out below) byte for byte, and dequantize (kestrel's ``gguf_quants``) within a relative RMSE bound per type.
- The files: a tiny Qwen3 and the tiny Llama, written in each type, open with ``kestrel_core.load`` and generate on
  cpu_ref; their tokenizer, end ids and chat template come back; every tensor reads back near the original (names,
  layouts and llama's q/k permutation); Q8_0's greedy ids are the float model's; Q4_K_M's types follow llama.cpp's rule.
- The command lines, and bad input as one-line errors (fallbacks as notes).
"""

from __future__ import annotations

import json
import shutil
import warnings

import numpy as np
import pytest
import torch
from gguf import GGUFReader, quants
from tokenizers import AddedToken, Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

from kestrel_core import load
from kestrel_core.cli import main
from kestrel_core.formats import gguf_quantize as gz
from kestrel_core.formats import gguf_quants as gq
from kestrel_core.formats.gguf import GGUFCheckpoint
from kestrel_core.formats.gguf_tokenizer import _QWEN2
from kestrel_core.formats.gguf_types import TYPE_NAMES, use_more_bits
from kestrel_core.formats.gguf_vocab import SAMPLE
from kestrel_core.errors import ConfigError
from kestrel_core.formats.modelconfig import parse_model_config
from kestrel_core.formats.tensor_table import all_specs
from kestrel_core.tools.presets import PRESETS, preset_config, write_checkpoint
from kestrel_core.tools.quantize import quantize_to_gguf
from cli_helpers import fails
from tests.gguf_files import _bytes_to_unicode

T = gq.T
f32 = np.float32
PROMPT = [5, 17, 42, 99, 3]


# --- ggml-quants.c, loop by loop ------------------------------------------------------------
# A straight transcription of the C, one float32 operation at a time (numpy float32 scalars), to hold the
# vectorised port against. GROUP_MAX_EPS, nearest_int, make_qkx2_quants, make_qx_quants, get_scale_min_k4 and
# quantize_row_q{4,5,6}_K_ref.

def c_nearest_int(v) -> int:
    val = f32(v) + f32(12582912.0)
    i = int(np.array([val], dtype=np.float32).view(np.int32)[0])
    return (i & 0x007FFFFF) - 0x00400000


def c_fp16(v) -> f32:
    return f32(np.float16(f32(v)))


def c_make_qkx2_quants(n, nmax, x, weights, rmin, rdelta, nstep):
    L, Laux = [0] * n, [0] * n
    mn, mx = x[0], x[0]
    sum_w = weights[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        w = weights[i]
        sum_w += w
        sum_x += w * x[i]
    if mn > 0:
        mn = f32(0)
    if mx == mn:
        return f32(0), -mn, [0] * n
    iscale = f32(nmax) / (mx - mn)
    scale = f32(1) / iscale
    best_error = f32(0)
    for i in range(n):
        l = c_nearest_int(iscale * (x[i] - mn))
        L[i] = max(0, min(nmax, l))
        diff = scale * f32(L[i]) + mn - x[i]
        diff = diff * diff
        best_error += weights[i] * diff
    for is_ in range(nstep + 1):
        iscale = (f32(rmin) + f32(rdelta) * f32(is_) + f32(nmax)) / (mx - mn)
        sum_l = sum_l2 = sum_xl = f32(0)
        for i in range(n):
            l = max(0, min(nmax, c_nearest_int(iscale * (x[i] - mn))))
            Laux[i] = l
            w = weights[i]
            sum_l += w * f32(l)
            sum_l2 += w * f32(l) * f32(l)
            sum_xl += w * f32(l) * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min = f32(0)
                this_scale = sum_xl / sum_l2
            cur_error = f32(0)
            for i in range(n):
                diff = this_scale * f32(Laux[i]) + this_min - x[i]
                diff = diff * diff
                cur_error += weights[i] * diff
            if cur_error < best_error:
                L = list(Laux)
                best_error, scale, mn = cur_error, this_scale, this_min
    return scale, -mn, L


def c_make_qx_quants(n, nmax, x):  # rmse_type 1, qw NULL
    mx = amax = f32(0)
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax, mx = ax, x[i]
    if amax < f32(1e-15):
        return f32(0), [0] * n
    L = [0] * n
    iscale = f32(-nmax) / mx
    sumlx = suml2 = f32(0)
    for i in range(n):
        l = max(-nmax, min(nmax - 1, c_nearest_int(iscale * x[i])))
        L[i] = l + nmax
        w = x[i] * x[i]
        sumlx += w * x[i] * f32(l)
        suml2 += w * f32(l) * f32(l)
    scale = sumlx / suml2 if suml2 != 0 else f32(0)
    best = scale * sumlx
    for is_ in range(-9, 10):
        if is_ == 0:
            continue
        iscale = -(f32(nmax) + f32(0.1) * f32(is_)) / mx
        sumlx = suml2 = f32(0)
        for i in range(n):
            l = max(-nmax, min(nmax - 1, c_nearest_int(iscale * x[i])))
            w = x[i] * x[i]
            sumlx += w * x[i] * f32(l)
            suml2 += w * f32(l) * f32(l)
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            for i in range(n):
                L[i] = nmax + max(-nmax, min(nmax - 1, c_nearest_int(iscale * x[i])))
            scale = sumlx / suml2
            best = scale * sumlx
    return scale, L


def c_get_scale_min_k4(j, q):
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def c_quantize_row_qk_ref(x, nmax, rmin, nstep):
    """quantize_row_q4_K_ref (nmax 15, rmin -1, nstep 20) or quantize_row_q5_K_ref (31, -0.5, 15), one super-block:
    (d, dmin, scales[12], L[256])."""
    L = [0] * 256
    mins, scales = [f32(0)] * 8, [f32(0)] * 8
    max_scale = max_min = f32(0)
    for j in range(8):
        xs = x[32 * j:32 * j + 32]
        sum_x2 = f32(0)
        for l in range(32):
            sum_x2 += xs[l] * xs[l]
        av_x = np.sqrt(sum_x2 / f32(32))
        weights = [av_x + abs(xs[l]) for l in range(32)]
        scales[j], mins[j], L[32 * j:32 * j + 32] = c_make_qkx2_quants(32, nmax, xs, weights, rmin, 0.1, nstep)
        if scales[j] > max_scale:
            max_scale = scales[j]
        if mins[j] > max_min:
            max_min = mins[j]
    inv_scale = f32(63) / max_scale if max_scale > 0 else f32(0)
    inv_min = f32(63) / max_min if max_min > 0 else f32(0)
    sc = [0] * 12
    for j in range(8):
        ls = min(63, c_nearest_int(inv_scale * scales[j]) & 0xFF)
        lm = min(63, c_nearest_int(inv_min * mins[j]) & 0xFF)
        if j < 4:
            sc[j], sc[j + 4] = ls, lm
        else:
            sc[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4)
            sc[j - 4] |= (ls >> 4) << 6
            sc[j] |= (lm >> 4) << 6
    d, dmin = c_fp16(max_scale / f32(63)), c_fp16(max_min / f32(63))
    for j in range(8):
        s, m = c_get_scale_min_k4(j, sc)
        dd = d * f32(s)
        if not dd:
            continue
        dm = dmin * f32(m)
        for ii in range(32):
            L[32 * j + ii] = max(0, min(nmax, c_nearest_int((x[32 * j + ii] + dm) / dd)))
    return max_scale / f32(63), max_min / f32(63), sc, L


def c_q4_k(x) -> bytes:
    d, dmin, sc, L = c_quantize_row_qk_ref(x, 15, -1.0, 20)
    q = []
    for j in range(0, 256, 64):
        q += [L[j + l] | (L[j + l + 32] << 4) for l in range(32)]
    return np.float16(d).tobytes() + np.float16(dmin).tobytes() + bytes(sc) + bytes(q)


def c_q5_k(x) -> bytes:
    d, dmin, sc, L = c_quantize_row_qk_ref(x, 31, -0.5, 15)
    qh, ql = [0] * 32, []
    m1, m2 = 1, 2
    for n in range(0, 256, 64):
        for j in range(32):
            l1, l2 = L[n + j], L[n + j + 32]
            if l1 > 15:
                l1 -= 16
                qh[j] |= m1
            if l2 > 15:
                l2 -= 16
                qh[j] |= m2
            ql.append(l1 | (l2 << 4))
        m1 <<= 2
        m2 <<= 2
    return np.float16(d).tobytes() + np.float16(dmin).tobytes() + bytes(sc) + bytes(qh) + bytes(ql)


def c_q6_k(x) -> bytes:
    L = [0] * 256
    scales = [f32(0)] * 16
    max_scale = max_abs_scale = f32(0)
    for ib in range(16):
        scales[ib], L[16 * ib:16 * ib + 16] = c_make_qx_quants(16, 32, x[16 * ib:16 * ib + 16])
        if abs(scales[ib]) > max_abs_scale:
            max_abs_scale, max_scale = abs(scales[ib]), scales[ib]
    if max_abs_scale < f32(1e-15):
        return bytes(210)
    iscale = f32(-128) / max_scale
    d = f32(1) / iscale
    sc = [min(127, c_nearest_int(iscale * scales[ib])) for ib in range(16)]
    sc = [((s & 0xFF) ^ 0x80) - 0x80 for s in sc]  # to int8_t
    for j in range(16):
        dd = c_fp16(d) * f32(sc[j])
        if not dd:
            continue
        for ii in range(16):
            L[16 * j + ii] = max(-32, min(31, c_nearest_int(x[16 * j + ii] / dd))) + 32
    ql, qh = [0] * 128, [0] * 64
    for half, j in enumerate((0, 128)):
        for l in range(32):
            q1, q2, q3, q4 = (L[j + l + k] & 0xF for k in (0, 32, 64, 96))
            ql[64 * half + l] = q1 | (q3 << 4)
            ql[64 * half + l + 32] = q2 | (q4 << 4)
            qh[32 * half + l] = ((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) | ((L[j + l + 64] >> 4) << 4)
                                 | ((L[j + l + 96] >> 4) << 6))
    return bytes(ql) + bytes(qh) + np.array(sc, dtype=np.int8).tobytes() + np.float16(d).tobytes()


C_REFERENCE = {T.Q4_K: c_q4_k, T.Q5_K: c_q5_k, T.Q6_K: c_q6_k}


def edge_rows(width: int, rng: np.random.Generator) -> np.ndarray:
    """Rows a quantizer may trip on: random, zeros, a constant of each sign, one outlier, all negative, values far
    below 1, a zero run inside noise, and exact ties of magnitude."""
    rows = [rng.standard_normal(width), rng.standard_normal(width) * 0.02, np.zeros(width), np.full(width, 0.37),
            np.full(width, -1.25), np.where(np.arange(width) == 7, 50.0, 0.01 * rng.standard_normal(width)),
            -np.abs(rng.standard_normal(width)), rng.standard_normal(width) * 1e-6]
    gap = rng.standard_normal(width)
    gap[16:80] = 0
    ties = rng.standard_normal(width)
    ties[3], ties[9] = 2.5, -2.5
    return np.stack(rows + [gap, ties]).astype(np.float32)


# --- the blocks ----------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1], ids=lambda t: t.name)
def test_32_value_blocks_equal_the_gguf_package(qtype):
    rng = np.random.default_rng(1)
    x = np.concatenate([edge_rows(256, rng), rng.standard_normal((6, 256)).astype(np.float32) * 3])
    assert np.array_equal(gz.quantize(x, qtype), quants.quantize(x, qtype))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_k_quants_equal_ggmls_reference_loop_by_loop(qtype):
    x = edge_rows(256, np.random.default_rng(2))
    got = gz.quantize(x, qtype)
    for row, block in zip(x, got):
        want = C_REFERENCE[qtype]([f32(v) for v in row])
        assert bytes(block) == want, f"{qtype.name} differs on row {row[:4]}..."


# relative RMSE (RMS error / RMS weight) of a standard-normal matrix, measured about 20% under each bound
RMSE_BOUND = {T.Q8_0: 0.007, T.Q4_0: 0.11, T.Q4_1: 0.095, T.Q5_0: 0.053, T.Q5_1: 0.047, T.Q4_K: 0.088, T.Q5_K: 0.045,
              T.Q6_K: 0.023}


@pytest.mark.parametrize("qtype", list(RMSE_BOUND), ids=lambda t: t.name)
def test_blocks_dequantize_close_to_the_weights(qtype):
    x = np.random.default_rng(3).standard_normal((64, 1024)).astype(np.float32)
    back = gq.dequantize(gz.quantize(x, qtype).reshape(-1), qtype, x.shape).numpy()
    assert np.sqrt(np.mean((back - x) ** 2)) / np.sqrt(np.mean(x ** 2)) < RMSE_BOUND[qtype]


def test_use_more_bits_is_llama_cpps():
    """llama.cpp: i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2, in C's integer arithmetic."""
    assert [i for i in range(28) if use_more_bits(i, 28)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]
    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]


# --- models --------------------------------------------------------------------------------------

def bpe_tokenizer(path) -> None:
    """A byte-level BPE tokenizer.json with merges, special tokens and Qwen2's split (NFC, single digits): ids 0-255
    the bytes, 256 <|endoftext|>, 257 <|im_start|>, 258 <|im_end|>, then merges' tokens and <think> (not special)."""
    byte_chars = _bytes_to_unicode()
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "a"), ("i", "n")]
    vocab = {c: i for i, c in enumerate(byte_chars)}
    for i, tok in enumerate(("<|endoftext|>", "<|im_start|>", "<|im_end|>", *(a + b for a, b in merges))):
        vocab[tok] = 256 + i
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_QWEN2), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    tok.save(str(path))


CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def give_chat_files(model_dir) -> None:
    """A real BPE tokenizer, a chat template and Qwen3's two end ids (end of turn and end of text)."""
    bpe_tokenizer(model_dir / "tokenizer.json")
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                                                                 "chat_template": CHAT_TEMPLATE}))
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [258, 256]}))


@pytest.fixture(scope="module")
def chat_ckpt(tiny_ckpt, tmp_path_factory):
    """tiny_ckpt (Qwen3, 6 layers, rows of 64 and 160) with give_chat_files."""
    d = shutil.copytree(tiny_ckpt, tmp_path_factory.mktemp("gq") / "tiny-chat")
    give_chat_files(d)
    return d


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory):
    """A Qwen3 whose rows are multiples of 256 (hidden 256, intermediate 512), 8 layers: no fallback to any type."""
    cfg = parse_model_config({**PRESETS["tiny"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8,
                              "head_dim": 64, "torch_dtype": "bfloat16"}, "test")
    d = write_checkpoint(cfg, tmp_path_factory.mktemp("gq") / "wide")
    give_chat_files(d)
    return d


@pytest.fixture(scope="module")
def written(chat_ckpt, tiny_llama_ckpt, wide_ckpt, tmp_path_factory):
    """(model, type) -> the GGUF written from it, made once on first use."""
    out, done = tmp_path_factory.mktemp("gq-out"), {}
    sources = {"qwen3": chat_ckpt, "llama": tiny_llama_ckpt, "wide": wide_ckpt}

    def get(model: str, type_name: str):
        if (model, type_name) not in done:
            path = out / f"{model}-{type_name}.gguf"
            with warnings.catch_warnings():  # notes of fallbacks: their wording is tested on the command line
                warnings.simplefilter("ignore")
                quantize_to_gguf(sources[model], path, type_name)
            done[model, type_name] = path
        return done[model, type_name]

    return get


def greedy(path, n: int = 6, **settings) -> list[int]:
    with load(path) as model, model.open(backend="cpu_ref", **settings) as run:
        return run.generate(prompt_ids=PROMPT, max_new_tokens=n, stop_at_eos=False).token_ids


@pytest.mark.parametrize("type_name", TYPE_NAMES)
@pytest.mark.parametrize("model", ["qwen3", "llama"])
def test_each_type_opens_and_generates(written, model, type_name):
    ids = greedy(written(model, type_name), 3)
    assert len(ids) == 3 and all(0 <= i < 512 for i in ids)


@pytest.mark.parametrize("model", ["qwen3", "llama"])
def test_every_tensor_reads_back_near_the_float_one(written, chat_ckpt, tiny_llama_ckpt, model):
    """Q8_0 everywhere (rows of 64 and 160 are whole blocks): each tensor the reader serves, by its Hugging Face name,
    is the original within Q8_0's rounding, so names, shapes and llama's q/k permutation are the converter's."""
    with load({"qwen3": chat_ckpt, "llama": tiny_llama_ckpt}[model]) as ref, load(written(model, "q8_0")) as got:
        # config.json again (the GGUF's eos is tokenizer_config.json's eos_token, as llama.cpp's converter takes it;
        # the ids that end a generation are the same set: test_the_tokenizer_end_ids_and_chat_template_come_back)
        same = {"torch_dtype": "bfloat16", "eos_token_id": ref.config.eos_token_id}
        assert got.config.to_hf_dict() | same == ref.config.to_hf_dict()
        assert got.eos_ids == ref.eos_ids
        for name in all_specs(ref.config):
            want, have = ref.checkpoint.view(name).float(), got.checkpoint.view(name)
            if want.dim() == 1:
                assert torch.equal(have, want), name  # norms are F32, the bf16 values exactly
            else:
                assert float((have - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()) < 0.01, name


@pytest.mark.parametrize("model", ["qwen3", "llama"])
def test_q8_0_greedy_ids_are_the_float_models(written, chat_ckpt, tiny_llama_ckpt, model):
    """Q8_0's rounding moves a logit by far less than the gap between the random model's top two (its embeddings give
    logits of std 2); the ids could part only where a step's top two are within that noise, which for these seeded
    weights none of the first six is. (Q4's noise is larger: those parted within three tokens here.) With
    ``host_kernels = "off"``: the default's host kernel also quantizes each linear's x to 8 bits, noise of its own
    (docs/gguf.md), which parts the qwen3 one at its third token here."""
    assert greedy(written(model, "q8_0"), host_kernels="off") == greedy({"qwen3": chat_ckpt, "llama": tiny_llama_ckpt}[model])


def test_the_tokenizer_end_ids_and_chat_template_come_back(written, chat_ckpt):
    with load(chat_ckpt) as ref, load(written("qwen3", "q4_k_m")) as got:
        assert got.checkpoint.value("tokenizer.ggml.pre") == "qwen2"  # found by its ids: NFC and single digits
        texts = [*SAMPLE, "<|im_start|>user\nthe cat<think><|im_end|>"]
        assert [got.tokenizer.encode(t) for t in texts] == [ref.tokenizer.encode(t) for t in texts]
        assert got.tokenizer.decode(list(range(265))) == ref.tokenizer.decode(list(range(265)))
        assert got.eos_ids == ref.eos_ids == {256, 258}
        messages = [{"role": "user", "content": "hi"}]
        assert got.chat_template().source == ref.chat_template().source == CHAT_TEMPLATE
        assert got.chat_template().render(messages) == ref.chat_template().render(messages)
        assert got.checkpoint.special_tokens() == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


def test_a_byte_level_tokenizer_without_merges_comes_back(written, tiny_llama_ckpt):
    """The presets' tokenizer.json has no merges: an empty tokenizer.ggml.merges (which gguf's writer refuses)."""
    with load(tiny_llama_ckpt) as ref, load(written("llama", "q8_0")) as got:
        assert got.checkpoint.value("tokenizer.ggml.merges") == []
        assert got.checkpoint.value("tokenizer.ggml.pre") == "gpt-2"  # llama.cpp's name for GPT-2's split
        assert [got.tokenizer.encode(t) for t in SAMPLE] == [ref.tokenizer.encode(t) for t in SAMPLE]
        assert got.eos_ids == ref.eos_ids == {256}


def _types(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}


def test_q4_k_m_follows_llama_cpps_rule(written):
    """8 layers: use_more_bits picks layers 0, 3, 6 and 7 for attn_v and ffn_down (Q6_K); the tied embedding is the
    output, Q6_K; every other weight Q4_K; norms F32."""
    types = _types(written("wide", "q4_k_m"))
    more = {0, 3, 6, 7}
    for name, qtype in types.items():
        layer = int(name.split(".")[1]) if name.startswith("blk.") else None
        if name.endswith("norm.weight"):
            want = "F32"
        elif name == "token_embd.weight" or (layer in more and ("attn_v." in name or "ffn_down." in name)):
            want = "Q6_K"
        else:
            want = "Q4_K"
        assert qtype == want, name
    assert sum(t == "Q6_K" for t in types.values()) == 1 + 2 * len(more)


def test_q4_k_m_of_an_untied_model_with_narrow_rows(written):
    """tiny-llama: rows of 64 (hidden) and 160 (ffn_down) split into no Q4_K block: the output is Q8_0 by the rule
    (its row is not a multiple of 256), the untied embedding Q4_K's fallback, attn_v/ffn_down of layers 0 and 4 (5
    layers: n/8 = 0, 7n/8 = 4, (i - 0) % 3 == 2 for 2) Q6_K's, Q8_0."""
    types = _types(written("llama", "q4_k_m"))
    assert types["output.weight"] == "Q8_0" and types["token_embd.weight"] == "Q5_0"
    assert {n for n, t in types.items() if t == "Q8_0"} == {"output.weight"} | {
        f"blk.{i}.{r}.weight" for i in (2, 4) for r in ("attn_v", "ffn_down")}
    assert types["rope_freqs.weight"] == "F32"


# the relative RMSE of every quantized weight of the wide model, against its bf16 values (measured about 20% below)
MODEL_RMSE = {"q8_0": 0.007, "q4_0": 0.11, "q4_1": 0.095, "q5_0": 0.053, "q5_1": 0.047, "q4_k": 0.088, "q5_k": 0.045, "q6_k": 0.023, "q4_k_m": 0.085}


@pytest.mark.parametrize("type_name", TYPE_NAMES)
def test_a_wide_model_in_each_type_keeps_its_types_and_reads_back_close(written, wide_ckpt, type_name):
    path = written("wide", type_name)
    types = set(_types(path).values())
    assert types == ({"F32", "Q4_K", "Q6_K"} if type_name == "q4_k_m" else {"F32", type_name.upper()})
    err = total = 0.0
    with load(wide_ckpt) as ref, GGUFCheckpoint(path) as got:
        for name in all_specs(ref.config):
            want = ref.checkpoint.view(name).float()
            if want.dim() == 2:
                err += float((got.view(name) - want).pow(2).sum())
                total += float(want.pow(2).sum())
    assert (err / total) ** 0.5 < MODEL_RMSE[type_name]
    assert len(greedy(path, 2)) == 2


def test_make_model_type_writes_what_quantize_type_writes(tmp_path, capsys):
    """The same tensors and keys (general.name apart) as quantizing the preset's directory."""
    assert main(["make-model", "--preset", "tiny-moe", "--out", str(tmp_path / "m.gguf"), "--type", "Q4_K_M",
                 "--seed", "3", "--router-skew", "1.0"]) == 0
    assert "as GGUF Q4_K_M" in capsys.readouterr().out
    write_checkpoint(preset_config("tiny-moe"), tmp_path / "d", seed=3, router_skew=1.0)
    assert main(["quantize", "--model", str(tmp_path / "d"), "--out", str(tmp_path / "d.gguf"), "--type", "q4_k_m"]) == 0
    types = _types(tmp_path / "m.gguf")  # 8 experts: llama.cpp's Mixtral rule (attn_output's Q5_K falls back to Q5_1)
    assert [types[f"blk.1.{r}.weight"] for r in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp")] == \
        ["Q5_0", "Q8_0", "Q8_0", "Q5_1", "F32"]
    a, b = GGUFReader(tmp_path / "m.gguf"), GGUFReader(tmp_path / "d.gguf")
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for x, y in zip(a.tensors, b.tensors):
        assert x.tensor_type == y.tensor_type and np.array_equal(x.data, y.data), x.name
    assert set(a.fields) == set(b.fields)
    assert greedy(tmp_path / "m.gguf", 3) == greedy(tmp_path / "d.gguf", 3)



def test_make_model_random_blocks_writes_the_same_tensors_types_and_bytes(tmp_path, capsys):
    """--random-blocks: every tensor, type and byte count of the quantized file, the floats themselves, and blocks
    that decode to finite weights within the stated span; the file runs."""
    from kestrel_core.formats.gguf_quants import dequantize
    from kestrel_core.tools.presets import WEIGHT_SPAN

    for name, extra in (("q.gguf", []), ("r.gguf", ["--random-blocks"])):
        assert main(["make-model", "--preset", "demo", "--layers", "2", "--out", str(tmp_path / name), "--type", "q4_k_m",
                     "--seed", "2", *extra]) == 0
    a, b = GGUFReader(tmp_path / "q.gguf"), GGUFReader(tmp_path / "r.gguf")
    assert [(t.name, t.tensor_type, t.n_bytes) for t in a.tensors] == [(t.name, t.tensor_type, t.n_bytes) for t in b.tensors]
    differ = 0
    for x, y in zip(a.tensors, b.tensors):
        if x.tensor_type.name in ("F32", "F16"):
            assert np.array_equal(x.data, y.data), x.name
            continue
        differ += not np.array_equal(x.data, y.data)
        w = dequantize(torch.from_numpy(np.ascontiguousarray(y.data).reshape(-1)), x.tensor_type,
                       tuple(int(d) for d in reversed(y.shape)))
        assert bool(torch.isfinite(w).all()) and float(w.abs().max()) <= 2 * WEIGHT_SPAN, x.name
    assert differ > 0 and {t.tensor_type.name for t in b.tensors} >= {"Q4_K", "Q6_K"}
    assert len(greedy(tmp_path / "r.gguf", 3)) == 3
    capsys.readouterr()
    assert main(["make-model", "--preset", "tiny", "--out", str(tmp_path / "d"), "--random-blocks"]) == 2
    assert "--random-blocks draws a GGUF's quantized blocks; it needs --type" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


# --- the command line -----------------------------------------------------------------------------

def test_quantize_type_prints_a_summary_and_notes_fallbacks(chat_ckpt, tmp_path, capsys):
    out = tmp_path / "t.gguf"
    assert main(["quantize", "--model", str(chat_ckpt), "--out", str(out), "--type", "Q4_K"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("wrote GGUF Q4_K (qwen3): 68 tensors (43 Q5_0, 25 F32), tokenizer qwen2, chat template")
    assert "kestrel: note: 43 tensor(s) written as Q5_0 instead of Q4_K (e.g. token_embd.weight): their rows (64, 160 " \
           "values) do not split into Q4_K's 256-value blocks; as llama.cpp does" in captured.err
    assert main(["quantize", "--model", str(chat_ckpt), "--out", str(tmp_path / "j.gguf"), "--type", "q8_0",
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["types"] == {"Q8_0": 43, "F32": 25} and summary["fallbacks"] == 0


def bad_inputs(tmp_path, chat_ckpt):
    q8 = tmp_path / "q8"
    gguf = tmp_path / "x.gguf"
    return {
        "an unknown type": (["--model", str(chat_ckpt), "--out", str(gguf), "--type", "q3_k"],
                            ["unknown --type 'q3_k'; use one of q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k, q4_k_m"]),
        "a GGUF source by --from": (["--from", str(gguf), "--out", str(tmp_path / "y.gguf"), "--type", "q4_0"],
                                    ["not from --from", "pass the float model it came from with --model"]),
        "a GGUF source by --model": (["--model", str(gguf), "--out", str(tmp_path / "y.gguf"), "--type", "q4_0"],
                                     ["is a GGUF already", "pass the float model it came from with --model"]),
        "a q8 source": (["--model", str(q8), "--out", str(tmp_path / "y.gguf"), "--type", "q4_0"],
                        ["is already quantized (kestrel.quant=q8); quantize the original float checkpoint"]),
        "an existing file": (["--model", str(chat_ckpt), "--out", str(gguf), "--type", "q4_0"],
                             ["already exists; name a new file"]),
        "not a .gguf name": (["--model", str(chat_ckpt), "--out", str(tmp_path / "y.bin"), "--type", "q4_0"],
                             ["the file must end in .gguf"]),
        "a q8 flag": (["--model", str(chat_ckpt), "--out", str(tmp_path / "y.gguf"), "--type", "q4_0",
                       "--group-size", "64"], ["--group-size does not apply with --type q4_0"]),
        "--force": (["--model", str(chat_ckpt), "--out", str(gguf), "--type", "q4_0", "--force"],
                    ["--force does not apply with --type q4_0", "never a replaced one"]),
    }


@pytest.mark.parametrize("case", ["an unknown type", "a GGUF source by --from", "a GGUF source by --model",
                                  "a q8 source", "an existing file", "not a .gguf name", "a q8 flag", "--force"])
def test_bad_input_is_one_line(case, chat_ckpt, written, tmp_path, capsys):
    shutil.copy(written("qwen3", "q8_0"), tmp_path / "x.gguf")
    assert main(["quantize", "--model", str(chat_ckpt), "--out", str(tmp_path / "q8")]) == 0
    capsys.readouterr()
    argv, needles = bad_inputs(tmp_path, chat_ckpt)[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    fails(["quantize", *argv], capsys, *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no temporary left


def test_make_model_type_bad_input_is_one_line(tmp_path, capsys):
    fails(["make-model", "--preset", "tiny", "--out", str(tmp_path / "a.gguf"), "--type", "q2_k"], capsys,
          "unknown --type 'q2_k'")
    fails(["make-model", "--preset", "tiny", "--out", str(tmp_path / "a.gguf"), "--type", "q8_0", "--shard-mb", "8"],
          capsys, "--shard-mb does not apply with --type q8_0")
    fails(["make-model", "--preset", "tiny", "--out", str(tmp_path), "--type", "q8_0"], capsys,
          "the file must end in .gguf")
    assert list(tmp_path.iterdir()) == []


def test_rope_scaling_a_gguf_cannot_carry_is_refused(tmp_path, capsys):
    cfg = preset_config("tiny-llama")
    raw = {**cfg.to_hf_dict(), "rope_scaling": {**cfg.rope_scaling, "high_freq_factor": 2.0}}
    d = write_checkpoint(parse_model_config(raw, "test"), tmp_path / "m")
    fails(["quantize", "--model", str(d), "--out", str(tmp_path / "m.gguf"), "--type", "q8_0"], capsys,
          "rope_scaling high_freq_factor is 2", "quantize it to q8 instead")


def test_a_tokenizer_a_gguf_cannot_carry_is_left_out_with_a_note(tiny_ckpt, tmp_path, capsys):
    d = shutil.copytree(tiny_ckpt, tmp_path / "wordpiece")
    HFTokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(str(d / "tokenizer.json"))
    assert main(["quantize", "--model", str(d), "--out", str(tmp_path / "w.gguf"), "--type", "q8_0"]) == 0
    captured = capsys.readouterr()
    assert "no tokenizer" in captured.out
    assert "kestrel: note: " in captured.err and "is a WordPiece tokenizer" in captured.err
    with load(tmp_path / "w.gguf") as model:
        assert model.tokenizer is None


def test_a_null_chat_template_is_none_and_the_model_still_quantizes(chat_ckpt, tmp_path):
    """A base model's tokenizer_config.json may hold "chat_template": null: no template, written without one."""
    from kestrel_core.tools.quantize import quantize_to_gguf

    d = shutil.copytree(chat_ckpt, tmp_path / "base")
    config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": None}))
    report = quantize_to_gguf(d, tmp_path / "base.gguf", "q8_0")
    with load(tmp_path / "base.gguf") as model:
        assert model.tokenizer is not None and report
        with pytest.raises(ConfigError, match="chat template"):
            model.chat_template()
