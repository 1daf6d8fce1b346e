"""The runner against an independent float64 numpy decoder written here from the HF formulas.

Nothing from kestrel_core is used to compute the reference: weights are read straight from the
safetensors files (safetensors.numpy where numpy has the dtype; bf16, which numpy lacks, is
widened by hand from its 16 stored bits), config.json with json, and the math follows HF
``modeling_qwen3.py`` / ``modeling_llama.py`` / ``modeling_qwen3_moe.py`` and ``_compute_llama3_parameters``.

Tolerances, stated so a regression shows:
- cpu_ref computing in float32: every logit within 1e-4 of the reference, relative to the largest
  |logit| of that step (measured: 1.5e-6).
- cpu_ref computing in float64: within 2e-7 (measured: 4e-8, the float32 rounding of the logits the
  backend hands out; a float32 step anywhere inside, such as an RMSNorm upcasting "to float32",
  shows as about 6e-7).
- greedy ids identical to the reference's own greedy ids.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from kestrel_core.tools.presets import preset_config, write_checkpoint

PROMPT = [7, 300, 12, 45, 511, 2, 90, 128, 64, 33, 1, 250]  # 12 tokens: the prefill uses the causal mask
NEW = 8
TOL = {"float32": 1e-4, "float64": 2e-7}


# --- the independent reference ---------------------------------------------------------

def read_weights(model_dir: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        header.pop("__metadata__", None)
        if all(spec["dtype"] != "BF16" for spec in header.values()):
            out.update({k: v.astype(np.float64) for k, v in safetensors.numpy.load_file(path).items()})
            continue
        for name, spec in header.items():
            assert spec["dtype"] == "BF16", spec["dtype"]
            lo, hi = spec["data_offsets"]
            bits = np.frombuffer(raw, dtype="<u2", count=(hi - lo) // 2, offset=8 + n + lo)
            f32 = (bits.astype(np.uint32) << 16).view(np.float32)  # bf16 is the top half of a float32
            out[name] = f32.astype(np.float64).reshape(spec["shape"])
    return out


def ref_inv_freq(c: dict, scaled: bool = True) -> np.ndarray:
    d = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    inv = np.array([1.0 / (c["rope_theta"] ** (i / d)) for i in range(0, d, 2)])
    rs = c.get("rope_scaling")
    if not (scaled and rs):
        return inv
    assert rs["rope_type"] == "llama3"
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:  # high frequency: unchanged
            out.append(f)
        elif wavelen > old / low:  # low frequency: divided by the factor
            out.append(f / factor)
        else:  # in between: a linear blend of the two
            s = (old / wavelen - low) / (high - low)
            out.append((1 - s) * f / factor + s * f)
    return np.array(out)


def rms(x, w, eps):
    return w * (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps))


def rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def sparse(c: dict, layer: int) -> bool:
    """modeling_qwen3_moe's rule for a layer whose MLP is a Mixture-of-Experts block."""
    return (c.get("num_experts", 0) > 0 and layer not in c.get("mlp_only_layers", [])
            and (layer + 1) % c.get("decoder_sparse_step", 1) == 0)


def ref_sparse_mlp(W: dict, c: dict, p: str, x: np.ndarray) -> np.ndarray:
    """Qwen3MoeSparseMoeBlock, token by token: softmax over every expert, the top k, renormalised if asked."""
    k = c["num_experts_per_tok"]
    s = x @ W[p + "mlp.gate.weight"].T
    probs = np.exp(s - s.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        top = np.argsort(-probs[t], kind="stable")[:k]
        w = probs[t, top] / (probs[t, top].sum() if c.get("norm_topk_prob") else 1.0)
        for e, we in zip(top, w):
            q = f"{p}mlp.experts.{e}."
            g, u = x[t] @ W[q + "gate_proj.weight"].T, x[t] @ W[q + "up_proj.weight"].T
            out[t] += we * ((g / (1 + np.exp(-g)) * u) @ W[q + "down_proj.weight"].T)
    return out


def ref_logits(W: dict, c: dict, ids: list[int], scaled_rope: bool = True) -> np.ndarray:
    """Logits [T, vocab] of the whole sequence, no KV cache (full recompute)."""
    T, eps = len(ids), c["rms_norm_eps"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or c["hidden_size"] // nh
    qwen3 = c["model_type"] in ("qwen3", "qwen3_moe")
    ang = np.arange(T)[:, None] * ref_inv_freq(c, scaled_rope)[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None, :], np.sin(np.concatenate([ang, ang], -1))[:, None, :]
    causal = np.triu(np.ones((T, T), dtype=bool), 1)
    h = W["model.embed_tokens.weight"][ids]
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        x = rms(h, W[p + "input_layernorm.weight"], eps)
        q = (x @ W[p + "self_attn.q_proj.weight"].T).reshape(T, nh, hd)
        k = (x @ W[p + "self_attn.k_proj.weight"].T).reshape(T, nkv, hd)
        v = (x @ W[p + "self_attn.v_proj.weight"].T).reshape(T, nkv, hd)
        if qwen3:  # per-head RMSNorm over head_dim, before RoPE
            q = rms(q, W[p + "self_attn.q_norm.weight"], eps)
            k = rms(k, W[p + "self_attn.k_norm.weight"], eps)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        att = np.empty((T, nh, hd))
        for head in range(nh):
            kv = head // (nh // nkv)  # GQA: consecutive query heads share a kv head
            s = q[:, head] @ k[:, kv].T / math.sqrt(hd)
            s[causal] = -np.inf
            s = np.exp(s - s.max(-1, keepdims=True))
            att[:, head] = (s / s.sum(-1, keepdims=True)) @ v[:, kv]
        h = h + att.reshape(T, nh * hd) @ W[p + "self_attn.o_proj.weight"].T
        x = rms(h, W[p + "post_attention_layernorm.weight"], eps)
        if sparse(c, layer):
            h = h + ref_sparse_mlp(W, c, p, x)
            continue
        g, u = x @ W[p + "mlp.gate_proj.weight"].T, x @ W[p + "mlp.up_proj.weight"].T
        h = h + (g / (1 + np.exp(-g)) * u) @ W[p + "mlp.down_proj.weight"].T
    lm_head = W["model.embed_tokens.weight"] if c["tie_word_embeddings"] else W["lm_head.weight"]
    return rms(h, W["model.norm.weight"], eps) @ lm_head.T


def ref_greedy(W, c, prompt, n):
    ids, logits = list(prompt), []
    for _ in range(n):
        step = ref_logits(W, c, ids)[-1]
        logits.append(step)
        ids.append(int(np.argmax(step)))
    return ids[len(prompt):], np.stack(logits)


# --- the comparisons -------------------------------------------------------------------

@pytest.fixture(scope="module")
def f32_ckpts(tmp_path_factory):
    """float32 checkpoints: read by safetensors.numpy with no bf16 widening involved."""
    root = tmp_path_factory.mktemp("f32")
    return {p: write_checkpoint(preset_config(p, "float32"), root / p, seed=3) for p in ("tiny", "tiny-llama", "tiny-moe")}


@pytest.fixture(scope="module")
def tiny_moe_ckpt(tmp_path_factory):
    return write_checkpoint(preset_config("tiny-moe"), tmp_path_factory.mktemp("moe") / "tiny-moe")


def _model_dir(request, preset, stored):
    if stored == "float32":
        return request.getfixturevalue("f32_ckpts")[preset]
    return request.getfixturevalue({"tiny": "tiny_ckpt", "tiny-llama": "tiny_llama_ckpt", "tiny-moe": "tiny_moe_ckpt"}[preset])


def _worst(got: np.ndarray, want: np.ndarray) -> float:
    """Largest per-step error relative to that step's largest |logit|."""
    return float(np.max(np.abs(got - want).max(-1) / np.abs(want).max(-1)))


@pytest.mark.parametrize("stored", ["bfloat16", "float32"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-llama", "tiny-moe"])
@pytest.mark.parametrize("compute", ["float32", "float64"])
def test_logits_and_greedy_ids_match_reference(request, run_model, preset, stored, compute):
    model_dir = _model_dir(request, preset, stored)
    c = json.loads((model_dir / "config.json").read_text())
    W = read_weights(model_dir)
    want_ids, want_logits = ref_greedy(W, c, PROMPT, NEW)
    result, _ = run_model(model_dir, prompt=PROMPT, keep_logits=True, backend__dtype=compute,
                          residency__keep=2, generation__max_new_tokens=NEW)
    got = np.stack([t.double().numpy() for t in result.logits])
    assert got.shape == want_logits.shape == (NEW, c["vocab_size"])
    assert _worst(got[:1], want_logits[:1]) < TOL[compute], "prefill logits"
    assert _worst(got[1:], want_logits[1:]) < TOL[compute], "decode logits (KV cache)"
    assert result.token_ids == want_ids


def test_llama3_rope_scaling_matters_and_matches(tiny_llama_ckpt):
    """The scaled inverse frequencies agree with the core's, and leaving the scaling out would fail the test."""
    from kestrel_core.formats.modelconfig import read_model_config

    c = json.loads((tiny_llama_ckpt / "config.json").read_text())
    np.testing.assert_allclose(read_model_config(tiny_llama_ckpt).inv_freq().numpy(), ref_inv_freq(c), rtol=1e-12)
    assert not np.allclose(ref_inv_freq(c), ref_inv_freq(c, scaled=False))
    W = read_weights(tiny_llama_ckpt)
    gap = _worst(ref_logits(W, c, PROMPT, scaled_rope=False)[-1:], ref_logits(W, c, PROMPT)[-1:])
    assert gap > 100 * TOL["float32"], gap


def test_reference_sees_untied_lm_head_and_qk_norm(tiny_ckpt, tiny_llama_ckpt):
    """The two presets really exercise both branches of the reference."""
    qwen = json.loads((tiny_ckpt / "config.json").read_text())
    llama = json.loads((tiny_llama_ckpt / "config.json").read_text())
    assert qwen["tie_word_embeddings"] and "lm_head.weight" not in read_weights(tiny_ckpt)
    assert not llama["tie_word_embeddings"] and "lm_head.weight" in read_weights(tiny_llama_ckpt)
    assert any(k.endswith("q_norm.weight") for k in read_weights(tiny_ckpt))
    assert not any(k.endswith("q_norm.weight") for k in read_weights(tiny_llama_ckpt))
