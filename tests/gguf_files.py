"""Small hand-made GGUF files for the reader's tests, and hand-written references to check it against.

``write_model`` writes a tiny llama / qwen3 / qwen3moe GGUF with gguf.GGUFWriter, its Q and K (llama) permuted
as llama.cpp's converter permutes them, and returns the Hugging Face tensors it stands for, computed here
independently of kestrel's reader: gguf's numpy dequantization (checked block by block against
``reference_dequantize`` below, a transcription of ggml's ``dequantize_row_*`` in ggml-quants.c, by
test_gguf) and the inverse of the converter's permutation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

T = GGMLQuantizationType
QK_K = 256


# --- ggml's block layouts, dequantized by hand --------------------------------------------
def _f16(b: np.ndarray) -> np.float32:
    return np.float32(np.frombuffer(bytes(b[:2]), dtype=np.float16)[0])


def _scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    """ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j from the 12 packed bytes."""
    if j < 4:
        return int(q[j]) & 63, int(q[j + 4]) & 63
    return (int(q[j + 4]) & 0xF) | ((int(q[j - 4]) >> 6) << 4), (int(q[j + 4]) >> 4) | ((int(q[j]) >> 6) << 4)


def _block_q8_0(b):
    d = _f16(b)
    return [d * np.float32(v) for v in b[2:34].view(np.int8)]


def _block_q4_0(b):
    d, qs, y = _f16(b), b[2:18], [None] * 32
    for j in range(16):
        y[j] = np.float32((int(qs[j]) & 0x0F) - 8) * d
        y[j + 16] = np.float32((int(qs[j]) >> 4) - 8) * d
    return y


def _block_q4_1(b):
    d, m, qs, y = _f16(b), _f16(b[2:]), b[4:20], [None] * 32
    for j in range(16):
        y[j] = np.float32(int(qs[j]) & 0x0F) * d + m
        y[j + 16] = np.float32(int(qs[j]) >> 4) * d + m
    return y


def _block_q5(b, at, offset):
    """dequantize_row_q5_0/q5_1's loop: qh at byte ``at``, the nibbles after it; (q - offset) * d, plus m for Q5_1."""
    d, qh, qs, y = _f16(b), int.from_bytes(bytes(b[at:at + 4]), "little"), b[at + 4:at + 20], [None] * 32
    m = _f16(b[2:]) if at == 4 else None
    for j in range(16):
        x0 = ((int(qs[j]) & 0x0F) | (((qh >> j) << 4) & 0x10)) - offset
        x1 = ((int(qs[j]) >> 4) | ((qh >> (j + 12)) & 0x10)) - offset
        y[j] = np.float32(x0) * d if m is None else np.float32(x0) * d + m
        y[j + 16] = np.float32(x1) * d if m is None else np.float32(x1) * d + m
    return y


def _block_q2_k(b):
    """dequantize_row_q2_K's loop: scales[16], qs[64], d at 80, dmin at 82."""
    d, dmin, y, is_ = _f16(b[80:]), _f16(b[82:]), [], 0
    for n in range(0, QK_K, 128):
        q = b[16 + n // 4:]
        for shift in (0, 2, 4, 6):
            for half in (0, 16):
                sc = int(b[is_])
                is_ += 1
                dl, ml = d * np.float32(sc & 0xF), dmin * np.float32(sc >> 4)
                y += [dl * np.float32((int(q[l + half]) >> shift) & 3) - ml for l in range(16)]
    return y


def _block_q3_k(b):
    """dequantize_row_q3_K's loop: hmask[32], qs[64], 12 bytes of scales, d at 108."""
    aux = [int.from_bytes(bytes(b[96 + 4 * i:100 + 4 * i]), "little") for i in range(3)] + [0]
    tmp, m1, m2 = aux[2], 0x03030303, 0x0F0F0F0F
    aux[2] = ((aux[0] >> 4) & m2) | (((tmp >> 4) & m1) << 4)
    aux[3] = ((aux[1] >> 4) & m2) | (((tmp >> 6) & m1) << 4)
    aux[0] = (aux[0] & m2) | (((tmp >> 0) & m1) << 4)
    aux[1] = (aux[1] & m2) | (((tmp >> 2) & m1) << 4)
    scales = np.frombuffer(b"".join(a.to_bytes(4, "little") for a in aux), dtype=np.int8)
    d_all, y, is_, m = _f16(b[108:]), [], 0, 1
    for n in range(0, QK_K, 128):
        q = b[32 + n // 4:]
        for shift in (0, 2, 4, 6):
            for half in (0, 16):
                dl = d_all * np.float32(int(scales[is_]) - 32)
                is_ += 1
                y += [dl * np.float32(((int(q[l + half]) >> shift) & 3) - (0 if int(b[l + half]) & m else 4))
                      for l in range(16)]
            m <<= 1
    return y


IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _block_iq4_nl(b):
    d, qs = _f16(b), b[2:18]
    return ([d * np.float32(IQ4_LEVELS[int(v) & 0xF]) for v in qs]
            + [d * np.float32(IQ4_LEVELS[int(v) >> 4]) for v in qs])


def _block_iq4_xs(b):
    """dequantize_row_iq4_xs's loop: d, scales_h (uint16), scales_l[4], qs[128]."""
    d, sh, y = _f16(b), int(b[2]) | (int(b[3]) << 8), []
    for ib in range(8):
        ls = ((int(b[4 + ib // 2]) >> 4 * (ib % 2)) & 0xF) | (((sh >> 2 * ib) & 3) << 4)
        dl = d * np.float32(ls - 32)
        qs = b[8 + 16 * ib:24 + 16 * ib]
        y += [dl * np.float32(IQ4_LEVELS[int(v) & 0xF]) for v in qs] + [dl * np.float32(IQ4_LEVELS[int(v) >> 4])
                                                                        for v in qs]
    return y


def _block_q4_k(b):
    d, dmin, scales, q = _f16(b), _f16(b[2:]), b[4:16], b[16:144]
    y, at, is_ = [], 0, 0
    for _ in range(0, QK_K, 64):
        sc, m = _scale_min_k4(is_, scales)
        d1, m1 = d * np.float32(sc), dmin * np.float32(m)
        sc, m = _scale_min_k4(is_ + 1, scales)
        d2, m2 = d * np.float32(sc), dmin * np.float32(m)
        y += [d1 * np.float32(int(q[at + l]) & 0xF) - m1 for l in range(32)]
        y += [d2 * np.float32(int(q[at + l]) >> 4) - m2 for l in range(32)]
        at += 32
        is_ += 2
    return y


def _block_q5_k(b):
    d, dmin, scales, qh, ql = _f16(b), _f16(b[2:]), b[4:16], b[16:48], b[48:176]
    y, at, is_, u1, u2 = [], 0, 0, 1, 2
    for _ in range(0, QK_K, 64):
        sc, m = _scale_min_k4(is_, scales)
        d1, m1 = d * np.float32(sc), dmin * np.float32(m)
        sc, m = _scale_min_k4(is_ + 1, scales)
        d2, m2 = d * np.float32(sc), dmin * np.float32(m)
        y += [d1 * np.float32((int(ql[at + l]) & 0xF) + (16 if int(qh[l]) & u1 else 0)) - m1 for l in range(32)]
        y += [d2 * np.float32((int(ql[at + l]) >> 4) + (16 if int(qh[l]) & u2 else 0)) - m2 for l in range(32)]
        at += 32
        is_ += 2
        u1 <<= 2
        u2 <<= 2
    return y


def _block_q6_k(b):
    ql, qh, sc, d = b[0:128], b[128:192], b[192:208].view(np.int8), _f16(b[208:210])
    y = [None] * QK_K
    for half in range(2):
        base, l0, h0, s0 = half * 128, half * 64, half * 32, half * 8
        for l in range(32):
            is_ = l // 16
            q1 = ((int(ql[l0 + l]) & 0xF) | (((int(qh[h0 + l]) >> 0) & 3) << 4)) - 32
            q2 = ((int(ql[l0 + l + 32]) & 0xF) | (((int(qh[h0 + l]) >> 2) & 3) << 4)) - 32
            q3 = ((int(ql[l0 + l]) >> 4) | (((int(qh[h0 + l]) >> 4) & 3) << 4)) - 32
            q4 = ((int(ql[l0 + l + 32]) >> 4) | (((int(qh[h0 + l]) >> 6) & 3) << 4)) - 32
            y[base + l] = d * np.float32(sc[s0 + is_]) * np.float32(q1)
            y[base + l + 32] = d * np.float32(sc[s0 + is_ + 2]) * np.float32(q2)
            y[base + l + 64] = d * np.float32(sc[s0 + is_ + 4]) * np.float32(q3)
            y[base + l + 96] = d * np.float32(sc[s0 + is_ + 6]) * np.float32(q4)
    return y


BLOCKS = {T.Q8_0: _block_q8_0, T.Q4_0: _block_q4_0, T.Q4_1: _block_q4_1, T.Q5_0: lambda b: _block_q5(b, 2, 16),
          T.Q5_1: lambda b: _block_q5(b, 4, 0), T.Q2_K: _block_q2_k, T.Q3_K: _block_q3_k, T.Q4_K: _block_q4_k,
          T.Q5_K: _block_q5_k, T.Q6_K: _block_q6_k, T.IQ4_NL: _block_iq4_nl, T.IQ4_XS: _block_iq4_xs}


def truth_dequantize(raw: np.ndarray, qtype, shape) -> np.ndarray:
    """What ``raw`` holds as float32, by the gguf package's own dequantizer (fast; ``reference_dequantize`` checks it)."""
    from gguf import quants

    raw = np.asarray(raw, dtype=np.uint8).reshape(-1)
    if qtype == T.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    block, size = GGML_QUANT_SIZES[qtype]
    rows = raw.reshape(-1, shape[-1] // block * size)
    return np.asarray(quants.dequantize(rows, qtype), dtype=np.float32).reshape(shape)


def reference_dequantize(raw: np.ndarray, qtype, shape) -> np.ndarray:
    """float32 ``shape`` from the bytes ``raw``, block by block as ggml's C reference does."""
    raw = np.asarray(raw, dtype=np.uint8).reshape(-1)
    if qtype == T.F32:
        return raw.view(np.float32).reshape(shape).copy()
    if qtype == T.F16:
        return raw.view(np.float16).astype(np.float32).reshape(shape)
    if qtype == T.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    _, size = GGML_QUANT_SIZES[qtype]
    out = [v for i in range(0, raw.size, size) for v in BLOCKS[qtype](raw[i : i + size])]
    return np.array(out, dtype=np.float32).reshape(shape)


def random_blocks(qtype, n_values: int, rng: np.random.Generator) -> np.ndarray:
    """Bytes of ``n_values`` values of ``qtype``: random quants, with finite f16 scales of a weight's size."""
    block, size = GGML_QUANT_SIZES[qtype]
    n = n_values // block
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)

    def half(lo, hi, signed=False):
        v = rng.uniform(lo, hi, size=n) * (rng.choice([-1, 1], size=n) if signed else 1)
        return v.astype(np.float16).view(np.uint8).reshape(n, 2)

    if qtype in (T.Q8_0, T.Q4_0, T.Q5_0, T.IQ4_NL):
        raw[:, 0:2] = half(0.001, 0.02, signed=True)
    elif qtype == T.IQ4_XS:
        raw[:, 0:2] = half(0.0001, 0.002, signed=True)
    elif qtype == T.Q2_K:
        raw[:, 80:82] = half(0.0001, 0.002)
        raw[:, 82:84] = half(0.0001, 0.002)
    elif qtype == T.Q3_K:
        raw[:, 108:110] = half(0.0001, 0.002, signed=True)
    elif qtype in (T.Q4_1, T.Q5_1):
        raw[:, 0:2] = half(0.001, 0.02)
        raw[:, 2:4] = half(0.01, 0.2, signed=True)
    elif qtype in (T.Q4_K, T.Q5_K):
        raw[:, 0:2] = half(0.0001, 0.002)
        raw[:, 2:4] = half(0.0001, 0.002)
    elif qtype == T.Q6_K:
        raw[:, 208:210] = half(0.0001, 0.002, signed=True)
    return raw.reshape(-1)


def encode(values: np.ndarray, qtype, rng: np.random.Generator) -> np.ndarray:
    """``values`` (float32, rows last) stored as ``qtype``: floats as they are, the 32-value types by gguf's quantizer,
    the k-quants as random blocks (gguf has no numpy quantizer for them: the test's truth is their dequantization)."""
    from gguf import quants

    if qtype == T.F32:
        return values.astype(np.float32)
    if qtype == T.F16:
        return values.astype(np.float16)
    if qtype in (T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
        return quants.quantize(values.astype(np.float32), qtype)
    rows = values.shape[-1]
    raw = random_blocks(qtype, values.size, rng)
    return raw.reshape(*values.shape[:-1], rows // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1])


# --- llama.cpp's converter ------------------------------------------------------------------
def llama_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, as it stands there."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --- a tiny byte-level BPE vocabulary ---------------------------------------------------------
def _bytes_to_unicode() -> list[str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n"]
TOKENS = SPECIALS + _bytes_to_unicode() + ["Ġt", "he", "Ġthe", "Ġa", "in", "<think>"]
TOKEN_TYPES = [3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS) - 1) + [4]
VOCAB = len(TOKENS)  # 265
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


# --- tiny models --------------------------------------------------------------------------
DIMS = {"hidden": 64, "heads": 4, "kv": 2, "head_dim": 16, "ff": 96, "layers": 2, "experts": 4, "top_k": 2, "expert_ff": 32}
# the types of the llama model's tensors: every type kestrel reads, somewhere
LLAMA_TYPES = {"token_embd": T.Q8_0, "attn_q": T.Q4_1, "attn_k": T.Q4_0, "attn_v": T.F16, "attn_output": T.BF16,
               "ffn_gate": T.Q8_0, "ffn_up": T.F32, "ffn_down": T.Q4_1, "output": T.F16}
# k-quants need rows of 256 values: a model of that width
K_DIMS = {**DIMS, "hidden": 256, "heads": 4, "kv": 2, "head_dim": 64, "ff": 256}
K_TYPES = {"token_embd": T.Q6_K, "attn_q": T.Q4_K, "attn_k": T.Q5_K, "attn_v": T.Q6_K, "attn_output": T.Q4_K,
           "ffn_gate": T.Q5_K, "ffn_up": T.Q6_K, "ffn_down": T.Q4_K, "output": T.Q6_K}


def model_metadata(arch: str, dims: dict = DIMS) -> dict:
    """The metadata keys llama.cpp's converter writes for such a model (general.architecture is the writer's)."""
    a = arch
    meta = {
        f"{a}.block_count": dims["layers"], f"{a}.context_length": 256, f"{a}.embedding_length": dims["hidden"],
        f"{a}.feed_forward_length": dims["ff"], f"{a}.attention.head_count": dims["heads"],
        f"{a}.attention.head_count_kv": dims["kv"], f"{a}.rope.freq_base": 10000.0,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-6, f"{a}.attention.key_length": dims["head_dim"],
        f"{a}.attention.value_length": dims["head_dim"], f"{a}.rope.dimension_count": dims["head_dim"],
        f"{a}.vocab_size": VOCAB,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": list(TOKENS),
        "tokenizer.ggml.merges": list(MERGES), "tokenizer.ggml.token_type": list(TOKEN_TYPES),
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.chat_template": CHAT_TEMPLATE,
    }
    if arch == "qwen3moe":
        meta.update({f"{a}.expert_count": dims["experts"], f"{a}.expert_used_count": dims["top_k"],
                     f"{a}.expert_feed_forward_length": dims["expert_ff"]})
    return meta


def model_tensors(arch: str, dims: dict = DIMS, types: dict = LLAMA_TYPES, tied: bool = False, seed: int = 0,
                  truth: bool = True):
    """(GGUF name -> (stored array, ggml type), Hugging Face name -> float32 truth) of a tiny model (no truth for a
    type kestrel does not read, or where ``truth`` is False)."""
    rng = np.random.default_rng(seed)
    h, hd, H, KV, ff = dims["hidden"], dims["head_dim"], dims["heads"], dims["kv"], dims["ff"]
    gguf_t: dict[str, tuple[np.ndarray, object]] = {}
    hf: dict[str, np.ndarray] = {}

    def put(gname, hname, shape, kind, permute_heads=None, scale=0.1):
        qtype = types.get(kind, T.F32)
        stored = encode((rng.standard_normal(shape) * scale).astype(np.float32), qtype, rng)
        gguf_t[gname] = (stored, qtype)
        if not truth or hname is None or qtype not in (T.F32, T.F16, T.BF16, *BLOCKS):
            return
        value = truth_dequantize(stored.view(np.uint8), qtype, shape)
        if permute_heads is not None:  # what is stored is the permuted weight: the HF one is its inverse
            order = llama_permute(np.arange(shape[0]), *permute_heads)
            inverse = np.argsort(order)
            value = value[inverse]
        hf[hname] = value

    put("token_embd.weight", "model.embed_tokens.weight", (VOCAB, h), "token_embd")
    put("output_norm.weight", "model.norm.weight", (h,), "norm", scale=1.0)
    if not tied:
        put("output.weight", "lm_head.weight", (VOCAB, h), "output")
    llama = arch == "llama"
    for n in range(dims["layers"]):
        p, q = f"blk.{n}.", f"model.layers.{n}."
        put(p + "attn_q.weight", q + "self_attn.q_proj.weight", (H * hd, h), "attn_q", (H, H) if llama else None)
        put(p + "attn_k.weight", q + "self_attn.k_proj.weight", (KV * hd, h), "attn_k", (H, KV) if llama else None)
        put(p + "attn_v.weight", q + "self_attn.v_proj.weight", (KV * hd, h), "attn_v")
        put(p + "attn_output.weight", q + "self_attn.o_proj.weight", (h, H * hd), "attn_output")
        put(p + "attn_norm.weight", q + "input_layernorm.weight", (h,), "norm", scale=1.0)
        put(p + "ffn_norm.weight", q + "post_attention_layernorm.weight", (h,), "norm", scale=1.0)
        if arch != "llama":
            put(p + "attn_q_norm.weight", q + "self_attn.q_norm.weight", (hd,), "norm", scale=1.0)
            put(p + "attn_k_norm.weight", q + "self_attn.k_norm.weight", (hd,), "norm", scale=1.0)
        if arch == "qwen3moe":
            E, ef = dims["experts"], dims["expert_ff"]
            put(p + "ffn_gate_inp.weight", q + "mlp.gate.weight", (E, h), "norm")
            for role, shape in (("gate", (E, ef, h)), ("up", (E, ef, h)), ("down", (E, h, ef))):
                gname = p + f"ffn_{role}_exps.weight"
                put(gname, None, shape, f"ffn_{role}")
                stored, qtype = gguf_t[gname]
                stack = truth_dequantize(stored.view(np.uint8), qtype, shape) if truth else []
                for e in range(len(stack)):
                    hf[q + f"mlp.experts.{e}.{role}_proj.weight"] = stack[e]
        else:
            put(p + "ffn_gate.weight", q + "mlp.gate_proj.weight", (ff, h), "ffn_gate")
            put(p + "ffn_up.weight", q + "mlp.up_proj.weight", (ff, h), "ffn_up")
            put(p + "ffn_down.weight", q + "mlp.down_proj.weight", (h, ff), "ffn_down")
    return gguf_t, hf


def write_gguf(path: Path, arch: str, meta: dict, tensors: dict) -> Path:
    """A GGUF of ``meta`` (python values, typed as the converter types them) and ``tensors`` (name -> (array, type))."""
    w = GGUFWriter(str(path), arch)
    for key, value in meta.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    for name, (arr, qtype) in tensors.items():
        if qtype in (T.F32, T.F16):
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, arr, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def write_model(path: Path, arch: str = "llama", dims: dict = DIMS, types: dict = LLAMA_TYPES, tied: bool = False,
                meta: dict | None = None, drop: tuple[str, ...] = (), seed: int = 0, truth: bool = True):
    """A tiny model GGUF; returns (path, Hugging Face truth). ``meta`` overrides keys (None removes one); ``drop``
    leaves tensors out."""
    tensors, hf = model_tensors(arch, dims, types, tied, seed, truth)
    m = model_metadata(arch, dims)
    for k, v in (meta or {}).items():
        if v is None:
            m.pop(k, None)
        else:
            m[k] = v
    for name in drop:
        tensors.pop(name)
    return write_gguf(path, arch, m, tensors), hf
