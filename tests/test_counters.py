"""Exact counters: what each policy uploads per decoded token, what stays resident, and the peak."""

from __future__ import annotations

import json

import pytest

from kestrel_core.hookspecs import hookimpl
from plugins.allocators import Pool

ROLES = ("q", "k", "v", "o", "gate", "up", "down")


def arch(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def layer_elems(c: dict) -> int:
    """Elements of the seven streamed linear weights of one layer, from config.json."""
    h, i = c["hidden_size"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    return q * h + 2 * kv * h + h * q + 3 * i * h


def resident_elems(c: dict) -> int:
    """Embeddings, final norm, untied lm_head and the per-layer norms: never evicted."""
    h = c["hidden_size"]
    per_layer = 2 * h + (2 * c["head_dim"] if c["model_type"] == "qwen3" else 0)
    lm_head = 0 if c["tie_word_embeddings"] else c["vocab_size"] * h
    return c["vocab_size"] * h + h + lm_head + c["num_hidden_layers"] * per_layer


def decode_uploads(result) -> list[int]:
    return [p["layer_uploads"] for p in result.per_token]


@pytest.mark.parametrize("keep", [1, 2, 3, 5])
def test_future_evicting_uploads_every_layer_every_token(tiny_ckpt, run_model, backend, keep):
    L = arch(tiny_ckpt)["num_hidden_layers"]
    r, _ = run_model(tiny_ckpt, backend, residency__policy="future_evicting", residency__keep=keep)
    assert len(r.per_token) == 5
    assert decode_uploads(r) == [L] * 5
    assert [p["layer_evictions"] for p in r.per_token] == [L] * 5


@pytest.mark.parametrize("keep", [1, 2, 3, 5, 6])
def test_asymmetric_uploads_L_minus_keep_per_token(tiny_ckpt, run_model, backend, keep):
    L = arch(tiny_ckpt)["num_hidden_layers"]
    r, _ = run_model(tiny_ckpt, backend, residency__policy="asymmetric", residency__keep=keep)
    assert decode_uploads(r) == [L - keep] * 5
    # Prefill starts empty: every layer is uploaded once before the first token.
    assert r.counters["layer_uploads"] == L + 5 * (L - keep)


def test_off_preloads_everything_and_uploads_nothing_per_token(tiny_ckpt, run_model, backend):
    L = arch(tiny_ckpt)["num_hidden_layers"]
    r, _ = run_model(tiny_ckpt, backend, residency__keep="off")
    assert decode_uploads(r) == [0] * 5
    assert r.counters["layer_uploads"] == L and r.counters["layer_evictions"] == 0


@pytest.mark.parametrize("keep", [1, 2, 3, 4, 6])
def test_pinned_set_uploads_L_minus_P_plus_1(tiny_ckpt, run_model, backend, keep):
    L = arch(tiny_ckpt)["num_hidden_layers"]
    P = min(L, 2 * keep)
    r, _ = run_model(tiny_ckpt, backend, residency__policy="pinned_set", residency__keep=keep)
    assert decode_uploads(r) == [L - P + 1 if P < L else 0] * 5


@pytest.mark.parametrize("keep", [2, 3, 4, 5])
def test_pinned_set_moves_fewer_bytes_than_asymmetric_at_equal_peak(tiny_ckpt, run_model, backend, keep):
    L = arch(tiny_ckpt)["num_hidden_layers"]
    a, _ = run_model(tiny_ckpt, backend, residency__policy="asymmetric", residency__keep=keep)
    p, _ = run_model(tiny_ckpt, backend, residency__policy="pinned_set", residency__keep=keep)
    assert a.counters["peak_resident_bytes"] == p.counters["peak_resident_bytes"]
    a_bytes = [t["bytes_uploaded"] for t in a.per_token]
    p_bytes = [t["bytes_uploaded"] for t in p.per_token]
    layer = a_bytes[0] // (L - keep)  # bytes of one streamed layer on this backend
    P = min(L, 2 * keep)
    saved_layers = (L - keep) - (L - P + 1 if P < L else 0)
    assert saved_layers >= 1
    assert all(x - y == saved_layers * layer for x, y in zip(a_bytes, p_bytes)), (a_bytes, p_bytes)


def test_keep_1_pinned_set_equals_asymmetric(tiny_ckpt, run_model, backend):
    a, _ = run_model(tiny_ckpt, backend, residency__policy="asymmetric", residency__keep=1)
    p, _ = run_model(tiny_ckpt, backend, residency__policy="pinned_set", residency__keep=1)
    assert [t["bytes_uploaded"] for t in a.per_token] == [t["bytes_uploaded"] for t in p.per_token]


@pytest.mark.parametrize("policy", ["asymmetric", "future_evicting", "pinned_set"])
@pytest.mark.parametrize("allocator", ["pool", "free"])
def test_evictions_balance_uploads(tiny_ckpt, run_model, backend, policy, allocator):
    r, final = run_model(tiny_ckpt, backend, residency__policy=policy, residency__keep=2, residency__allocator=allocator)
    for step in r.per_token:  # a steady window: each decoded token evicts what it uploads
        assert step["uploads"] == step["evictions"] and step["bytes_uploaded"] == step["bytes_evicted"]
    assert final["uploads"] == final["evictions"] > 0
    assert final["bytes_uploaded"] == final["bytes_evicted"]
    assert final["allocations"] == final["frees"] > 0  # no buffer outlives the run


@pytest.mark.parametrize("ckpt", ["tiny_ckpt", "tiny_llama_ckpt"])
def test_embeddings_and_lm_head_are_never_evicted(request, run_model, register_plugin, backend, ckpt):
    model_dir = request.getfixturevalue(ckpt)
    L = arch(model_dir)["num_hidden_layers"]
    released = []

    class Recording(Pool):
        """The pool, noting every buffer the window gives back."""

        def release(self, entry, buffer):
            released.append((entry.layer, entry.name))
            super().release(entry, buffer)

    class Registers:
        @hookimpl
        def register_allocators(self, register):
            register("recording", Recording)

    register_plugin(Registers(), "recording-allocator")
    r, final = run_model(model_dir, backend, residency__policy="future_evicting", residency__keep=1,
                         residency__allocator="recording")
    assert len(released) == final["evictions"] > 0
    assert {layer for layer, _ in released} == set(range(L))
    assert not [n for _, n in released if "embed" in n or "lm_head" in n or "norm" in n]
    # After the run every streamed entry is gone; what is left is exactly the never-evicted set.
    assert final["resident_bytes"] > 0
    assert final["resident_bytes"] == r.counters["resident_bytes"] - _streamed_now(r)


def _streamed_now(r) -> int:
    """Streamed bytes still resident when generate returned (released when the run closed)."""
    return r.counters["bytes_uploaded"] - r.counters["bytes_evicted"]


@pytest.mark.parametrize(
    "policy, keep, peak_layers",
    [("asymmetric", 1, 2), ("asymmetric", 2, 4), ("asymmetric", 3, 6), ("asymmetric", 5, 6),
     ("future_evicting", 1, 1), ("future_evicting", 3, 3), ("pinned_set", 2, 4), ("pinned_set", 1, 2),
     ("off", "off", 6)],
)
@pytest.mark.parametrize("ckpt", ["tiny_ckpt", "tiny_llama_ckpt"])
def test_peak_resident_bytes_formula_cpu_ref(request, run_model, ckpt, policy, keep, peak_layers):
    """cpu_ref holds float32 copies: peak = (never-evicted + peak layers x one layer) x 4 bytes."""
    model_dir = request.getfixturevalue(ckpt)
    c = arch(model_dir)
    peak_layers = min(peak_layers, c["num_hidden_layers"])
    r, final = run_model(model_dir, "cpu_ref", residency__policy=policy, residency__keep=keep)
    assert r.counters["peak_resident_bytes"] == 4 * (resident_elems(c) + peak_layers * layer_elems(c))
    assert final["resident_bytes"] == 4 * resident_elems(c)
    assert r.counters["bytes_uploaded"] == 4 * layer_elems(c) * r.counters["layer_uploads"]
    assert r.counters["uploads"] == len(ROLES) * r.counters["layer_uploads"]


def test_what_crossed_from_the_host_is_uploads_and_host_reads():
    from kestrel_core.engine.plan import bytes_streamed

    assert bytes_streamed({"bytes_uploaded": 3, "bytes_read_host": 5, "bytes_reread": 2}) == 8  # re-reads are uploads
