"""Qwen3-MoE: presets, the per-expert checkpoint layout, residency units, the routing math, and runs on cpu_ref.

tests/test_reference.py checks the runner's logits and ids against an independent float64 decoder.
"""

from __future__ import annotations

import shutil

import attrs
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from cli_helpers import WEIGHTS, fails, gen
from kestrel_core import load
from kestrel_core.cli import main
from kestrel_core.errors import PluginError
from kestrel_core.hookspecs import hookimpl
from kestrel_core.engine.plan import Advice
from kestrel_core.engine.model import expert_mlp, route, sparse_mlp
from kestrel_core.formats.tensor_table import all_specs, expert_specs, unit_specs
from kestrel_core.tools.presets import preset_config, write_checkpoint


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return write_checkpoint(preset_config("tiny-moe"), tmp_path_factory.mktemp("moe") / "tiny-moe")


@pytest.fixture
def moe_copy(tiny_moe, tmp_path):
    return shutil.copytree(tiny_moe, tmp_path / "tiny-moe")


def test_tiny_moe_has_one_dense_layer_and_experts_elsewhere():
    cfg = preset_config("tiny-moe")
    assert [cfg.moe_layer(layer) for layer in range(4)] == [False, True, True, True]
    specs = all_specs(cfg)
    assert "model.layers.0.mlp.gate_proj.weight" in specs  # the dense layer's MLP
    assert "model.layers.0.mlp.gate.weight" not in specs and "model.layers.0.mlp.experts.0.up_proj.weight" not in specs
    assert specs["model.layers.1.mlp.gate.weight"] == (8, 64)  # the router
    assert specs["model.layers.1.mlp.experts.7.down_proj.weight"] == (64, 32)
    assert "model.layers.1.mlp.gate_proj.weight" not in specs


def test_units_are_each_layer_and_each_expert():
    cfg = preset_config("tiny-moe")
    units = unit_specs(cfg)
    keys = [u.key for u in units]
    assert keys[:2] == [(0,), (1,)] and keys[2:10] == [(1, e) for e in range(8)]
    assert len(keys) == 4 + 3 * 8
    assert set(units[1].tensors) == {"q", "k", "v", "o", "router"}  # attention and router: one unit
    assert units[2].tensors == expert_specs(cfg, 1, 0)
    assert set(units[0].tensors) == {"q", "k", "v", "o", "gate", "up", "down"}  # the dense layer


def test_the_30b_shape_is_about_61_gb_and_layers_cut_only_the_depth():
    full = preset_config("qwen3-30b-a3b")
    n = sum(int(torch.Size(s).numel()) for s in all_specs(full).values()) * 2
    assert 60e9 < n < 62e9 and full.num_experts == 128 and full.num_experts_per_tok == 8
    cut = preset_config("qwen3-30b-a3b", layers=4)
    assert cut.num_hidden_layers == 4
    per_layer = lambda cfg: {k: v for k, v in all_specs(cfg).items() if k.startswith("model.layers.3.")}  # noqa: E731
    assert per_layer(cut) == per_layer(full)


def test_make_model_layers_is_checked(tmp_path, capsys):
    fails(["make-model", "--preset", "tiny-moe", "--layers", "5", "--out", str(tmp_path / "x")], capsys,
          "--layers must be 1..4 for preset tiny-moe")
    assert main(["make-model", "--preset", "tiny-moe", "--layers", "2", "--out", str(tmp_path / "two")]) == 0
    assert "(2 of 4 layers" in capsys.readouterr().out


def test_a_moe_checkpoint_is_read_and_checked(tiny_moe):
    with load(tiny_moe) as model:
        assert model.config.is_moe and len(model.units) == 4 + 3 * 8


def test_a_missing_expert_is_named(moe_copy, capsys):
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    tensors = load_file(str(moe_copy / WEIGHTS))
    del tensors[name]
    save_file(tensors, str(moe_copy / WEIGHTS))
    fails(gen(moe_copy), capsys, "missing tensor", name)


def _reference(x, router, experts, k, norm):
    """Every expert on every token, weighted by a mask of the top k: no grouping, no index_add."""
    probs = torch.softmax(x @ router.T, dim=-1)
    top = torch.topk(probs, k, dim=-1)
    weight = torch.zeros_like(probs).scatter(1, top.indices, top.values)
    if norm:
        weight = weight / weight.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e, w in enumerate(experts):
        out += weight[:, e : e + 1] * ((F.silu(x @ w["gate"].T) * (x @ w["up"].T)) @ w["down"].T)
    return out


@pytest.mark.parametrize("norm", [True, False])
def test_sparse_mlp_matches_the_dense_reference(norm):
    cfg = attrs.evolve(preset_config("tiny-moe"), norm_topk_prob=norm)
    g = torch.Generator().manual_seed(3)
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    x = torch.randn((5, H), generator=g, dtype=torch.float64)
    router = torch.randn((E, H), generator=g, dtype=torch.float64)
    experts = [{"gate": torch.randn((I, H), generator=g, dtype=torch.float64) / H**0.5,
                "up": torch.randn((I, H), generator=g, dtype=torch.float64) / H**0.5,
                "down": torch.randn((H, I), generator=g, dtype=torch.float64) / I**0.5} for _ in range(E)]
    asked = []

    def weights_of(e):
        asked.append(e)
        return experts[e]

    w, chosen = route(x, router, cfg)
    assert chosen.shape == (5, 2) and torch.allclose(w.sum(-1), torch.ones(5, dtype=torch.float64)) == norm
    got = sparse_mlp(x, w, chosen, weights_of)
    assert torch.allclose(got, _reference(x, router, experts, cfg.num_experts_per_tok, norm), rtol=1e-12, atol=1e-12)
    assert sorted(asked) == sorted(set(chosen.flatten().tolist()))  # each routed expert asked for once


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_mlp_sums_a_chunk_as_one_expert_at_a_time_did_bitwise(dtype):
    """Many tokens (a prompt chunk) grouped by one sort: each expert sees its tokens in token order and adds into the
    output in expert order, bitwise what a ``torch.nonzero`` an expert gave."""
    g = torch.Generator().manual_seed(5)
    E, H, I, k, T = 16, 32, 24, 4, 97
    x = torch.randn((T, H), generator=g).to(dtype)
    experts = [{"gate_up": (torch.randn((2 * I, H), generator=g) / H**0.5).to(dtype),
                "down": (torch.randn((H, I), generator=g) / I**0.5).to(dtype)} for _ in range(E)]
    chosen = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    chosen[chosen == 7] = 3  # an expert no token routes to, and a token routed to 3 twice in no slot order
    chosen = torch.sort(chosen, dim=1, descending=True).values  # not ascending: slots are not in expert order
    w = torch.softmax(torch.randn((T, k), generator=g), -1).to(dtype)
    want = torch.zeros_like(x)
    for e in torch.unique(chosen).tolist():
        tokens, slot = torch.nonzero(chosen == e, as_tuple=True)
        want.index_add_(0, tokens, expert_mlp(x[tokens], experts[e]) * w[tokens, slot, None])
    asked = []
    got = sparse_mlp(x, w, chosen, lambda e: asked.append(e) or experts[e])
    assert torch.equal(got, want)
    assert asked == sorted(set(chosen.flatten().tolist())) and 7 not in asked
    used = torch.unique(chosen).tolist()
    assert torch.equal(sparse_mlp(x, w, chosen, experts.__getitem__, used=used), want)
    asked.clear()  # an expert fetched and routed to by no token (past the largest routed) adds nothing
    got = sparse_mlp(x, w, chosen, lambda e: asked.append(e) or experts[e % E], used=[*used, E + 1])
    assert torch.equal(got, want) and asked == [*used, E + 1]


# --- runs on cpu_ref -------------------------------------------------------------------

PROMPT = [5, 17, 42, 99, 3]


def generate(model_dir, **settings):
    with load(model_dir) as model, model.open(**settings) as run:
        return run.generate(prompt_ids=PROMPT, max_new_tokens=8, stop_at_eos=False), run.counters.snapshot()


class Routed:
    """Records what each sparse layer routed to; may evict every other resident expert of the layer."""

    def __init__(self, evict_others=False):
        self.seen: list[tuple[str, int, list[int]]] = []
        self.evict_others = evict_others

    @hookimpl
    def on_experts_routed(self, window, layer, experts, phase):
        self.seen.append((phase, layer, list(experts)))
        if self.evict_others:
            return Advice(evict=[k for k in window.resident_units if len(k) == 2 and k[0] == layer and k[1] not in experts])
        return None


def test_ids_are_identical_across_keep_policy_and_allocator(tiny_moe):
    ref, _ = generate(tiny_moe, keep="off")
    for settings in [dict(keep=1), dict(keep=2), dict(keep=4), dict(keep=2, policy="pinned_set"),
                     dict(keep=2, policy="future_evicting"), dict(keep=3, policy="belady"),
                     dict(keep=1, allocator="free")]:
        got, _ = generate(tiny_moe, **settings)
        assert got.token_ids == ref.token_ids, settings


def test_the_router_decides_which_experts_are_fetched(tiny_moe, register_plugin):
    routed = register_plugin(Routed(), "routed")
    result, counters = generate(tiny_moe, keep=4)  # a window over every layer: nothing is evicted
    k = preset_config("tiny-moe").num_experts_per_tok
    decode = [s for s in routed.seen if s[0] == "decode"]
    assert len(decode) == 3 * 7 and all(len(e) == k for _, _, e in decode)  # one token: k experts a sparse layer
    prefill = [s for s in routed.seen if s[0] == "prefill"]
    assert [layer for _, layer, _ in prefill] == [1, 2, 3]
    # Every layer unit, then each expert the first time it is routed to: never one nobody routed to.
    distinct = {(layer, e) for _, layer, experts in routed.seen for e in experts}
    assert counters["layer_uploads"] == 4 + len(distinct) < 4 + 3 * 8
    assert result.per_token[-1]["layer_uploads"] == len({(lay, e) for _, lay, ex in decode[-3:] for e in ex} - {
        (lay, e) for _, lay, ex in routed.seen[:-3] for e in ex})


def test_a_prefill_uploads_each_routed_expert_once(tiny_moe, register_plugin):
    routed = register_plugin(Routed(), "routed")
    with load(tiny_moe) as model, model.open(keep=4) as run:
        run.generate(prompt_ids=PROMPT * 4, max_new_tokens=1)  # 20 tokens: many route to the same experts
        uploads = run.counters.layer_uploads
    assert uploads == 4 + sum(len(experts) for _, _, experts in routed.seen)
    assert all(len(experts) <= 8 for _, _, experts in routed.seen)


def test_an_expert_policy_plugin_bounds_the_experts(tiny_moe, register_plugin):
    ref, loose = generate(tiny_moe, keep=4)
    register_plugin(Routed(evict_others=True), "routed-evict")
    got, tight = generate(tiny_moe, keep=4)
    assert got.token_ids == ref.token_ids  # residency changes no result
    assert tight["peak_resident_entries"] < loose["peak_resident_entries"]
    assert tight["layer_evictions"] > 0 == loose["layer_evictions"]


def test_evicting_a_routed_expert_is_refused(tiny_moe, register_plugin, capsys):
    class Greedy:
        @hookimpl
        def on_experts_routed(self, window, layer, experts, phase):
            return Advice(evict=[(layer, experts[0])])

    register_plugin(Greedy(), "greedy")
    with pytest.raises(PluginError, match=r"asked to evict expert unit \(1, \d+\), which layer 1 has just routed to"):
        generate(tiny_moe, keep=2)
