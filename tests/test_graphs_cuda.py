"""The captured decode step on a real GPU: graph and eager agree bitwise, and the pitfalls are handled.

Skips without a GPU.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kestrel_core.config import KestrelConfig
from kestrel_core.engine.run import Model
from kestrel_core.errors import KestrelNote
from kestrel_core.hookspecs import hookimpl
from kestrel_core.tools.presets import preset_config, write_checkpoint
from kestrel_core.engine.plan import Advice
from kestrel_core.tools.quantize import quantize_checkpoint

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GEN = dict(max_new_tokens=10, stop_at_eos=False)
PROMPT = [3, 14, 15, 92, 65]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_checkpoint(preset_config("tiny"), tmp_path_factory.mktemp("graphs") / "tiny", seed=1)
    with Model(path) as m:
        yield m


@pytest.fixture(scope="module")
def q8_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs-q8")
    path = write_checkpoint(preset_config("tiny"), root / "tiny", seed=1)
    quantize_checkpoint(path, root / "q8", group=32)
    with Model(root / "q8") as m:
        yield m


def run(model, gen=GEN, keep_logits=False, **flags):
    cfg = KestrelConfig().override(backend__name="cuda", **flags)
    with model.open(cfg) as r:
        return r.generate(prompt_ids=PROMPT, keep_logits=keep_logits, **gen)


def settings(L):
    keeps = sorted({1, 2, L // 2, L - 1, L})
    for policy, keep, prefetch in itertools.product(["asymmetric", "pinned_set"], keeps, [0, 1]):
        yield dict(residency__policy=policy, residency__keep=keep, backend__prefetch=prefetch)
    yield dict(residency__keep="off")
    for keep in (1, L):
        yield dict(residency__keep=keep, residency__allocator="free", backend__prefetch=1)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_graph_and_eager_give_identical_ids(model, dtype):
    ref = run(model, residency__keep="off", backend__graphs="off", backend__dtype=dtype).token_ids
    for flags in settings(model.n_layers):
        graph = run(model, backend__dtype=dtype, **flags)
        eager = run(model, backend__dtype=dtype, backend__graphs="off", **flags)
        assert graph.token_ids == eager.token_ids == ref, flags
        assert graph.per_token == eager.per_token, flags
        assert eager.steps["eager"] == 9
        if flags.get("residency__allocator") != "free":  # fresh buffers every token: nothing repeats
            assert graph.steps["replayed"] >= 6, (flags, graph.steps)


def test_q8_graph_and_eager_give_identical_ids(q8_model):
    ref = run(q8_model, residency__keep="off", backend__graphs="off").token_ids
    for flags in [dict(residency__keep="off"), dict(residency__keep=1, backend__prefetch=1),
                  dict(residency__keep=3), dict(residency__policy="pinned_set", residency__keep=2, backend__prefetch=1)]:
        graph = run(q8_model, **flags)
        assert graph.token_ids == ref, flags
        assert graph.steps["replayed"] >= 6, (flags, graph.steps)


def test_a_replayed_step_computes_bitwise_what_the_eager_one_does(model):
    for flags in [dict(residency__keep="off"), dict(residency__keep=1, backend__prefetch=1)]:
        graph = run(model, keep_logits=True, **flags)
        eager = run(model, keep_logits=True, backend__graphs="off", **flags)
        assert graph.steps["replayed"] >= 6
        assert all(torch.equal(a, b) for a, b in zip(graph.logits, eager.logits)), flags


def test_the_pool_allocates_nothing_after_the_first_decoded_token_in_graph_mode(model):
    for keep, prefetch in [(1, 0), (1, 1), (2, 2), (model.n_layers - 1, 1)]:
        r = run(model, residency__keep=keep, backend__prefetch=prefetch)
        assert r.steps["replayed"] >= 6
        assert [p["allocations"] for p in r.per_token[1:]] == [0] * (len(r.per_token) - 1), (keep, prefetch)
        assert all(p["layer_uploads"] > 0 for p in r.per_token)  # and every replayed step streams


def test_sampling_draws_the_same_ids_in_graph_mode(model):
    gen = dict(max_new_tokens=10, stop_at_eos=False, temperature=0.8, seed=11)
    graph = run(model, gen, residency__keep=2, backend__prefetch=1)
    eager = run(model, gen, residency__keep=2, backend__prefetch=1, backend__graphs="off")
    assert graph.token_ids == eager.token_ids and graph.steps["replayed"] >= 6


class EvictEveryFourth:
    """Every fourth token, evict layer 1 at layer 3's boundary: those steps fall back to eager."""

    @hookimpl
    def on_layer_advance(self, window, layer, phase):
        if phase == "decode" and layer == 3 and window.token % 4 == 0:
            return Advice(evict=[1])
        return None


def test_eager_steps_between_replays_order_their_uploads(model, register_plugin):
    """Events recorded inside a capture are never waited on eagerly; the eager steps between replays
    (with a side stream refilling buffers the graph read) still compute the same ids."""
    gen = dict(max_new_tokens=16, stop_at_eos=False)
    ref = run(model, gen, residency__keep="off", backend__graphs="off").token_ids
    register_plugin(EvictEveryFourth(), "every-fourth")
    for keep, prefetch in [(model.n_layers, 1), (3, 1), (4, 2)]:  # layer 1 still resident at layer 3
        r = run(model, gen, residency__keep=keep, backend__prefetch=prefetch)
        assert r.token_ids == ref, (keep, prefetch)
        assert r.steps["eager"] >= 3 and r.steps["replayed"] >= 3, (keep, prefetch, r.steps)


class SwapLastTwo:
    """At token 5: evict the last two layers at layer 0's boundary and fetch the last before the one before it, so
    the pool hands them each other's buffers; after that every plan is idle again, as it was before."""

    def __init__(self, n_layers):
        self.a, self.b = n_layers - 2, n_layers - 1

    @hookimpl
    def on_layer_advance(self, window, layer, phase):
        if phase == "decode" and window.token == 5 and layer == 0:
            return Advice(evict=[self.a, self.b])
        if phase == "decode" and window.token == 5 and layer == self.a - 1:
            return Advice(prefetch=[self.b, self.a])
        return None


def test_a_graph_whose_buffers_changed_hands_is_not_replayed(model, register_plugin):
    """The graph captured before the swap reads the old buffers: a step that reads other buffers is captured anew."""
    gen = dict(max_new_tokens=12, stop_at_eos=False)
    ref = run(model, gen, residency__keep="off", backend__graphs="off").token_ids
    register_plugin(SwapLastTwo(model.n_layers), "swap")
    r = run(model, gen, residency__keep=model.n_layers)
    assert r.token_ids == ref
    assert r.step_modes[3:7] == ["replayed", "eager", "eager", "captured"], r.step_modes


def test_an_unpinned_host_copy_is_never_captured(model):
    cfg = KestrelConfig().override(backend__name="cuda", residency__keep=1)
    ref = run(model, residency__keep=1, backend__graphs="off").token_ids
    with model.open(cfg) as r:
        pinned = r.backend._host
        r.backend._host = {source: t.clone() for source, t in pinned.items()}  # pageable copies
        assert not r.backend._host[(0,), "qkv"].is_pinned()
        try:
            with pytest.warns(KestrelNote, match="not pinned, so the decode step cannot be captured"):
                result = r.generate(prompt_ids=PROMPT, **GEN)
        finally:
            r.backend._host = pinned
    assert result.token_ids == ref
    assert result.steps == {"eager": 9, "captured": 0, "replayed": 0}


def test_a_compiled_layer_replays_what_it_computes_eagerly(model):
    """--compile runs the decode step's layer math through torch.compile; graph and eager still agree."""
    for flags in [dict(residency__keep="off"), dict(residency__keep=2, backend__prefetch=1)]:
        graph = run(model, keep_logits=True, backend__compile=True, **flags)
        eager = run(model, keep_logits=True, backend__compile=True, backend__graphs="off", **flags)
        assert graph.token_ids == eager.token_ids and graph.steps["replayed"] >= 6, flags
        assert all(torch.equal(a, b) for a, b in zip(graph.logits, eager.logits)), flags
        plain = run(model, keep_logits=True, **flags)
        # Fused kernels round differently: bf16 logits within the cross-backend tolerance of the unfused ones.
        rel = [float((a - b).norm() / b.norm()) for a, b in zip(graph.logits, plain.logits)]
        assert max(rel) < 3e-2, (flags, rel)
