"""Mixture-of-Experts on the cuda backend: invariance, the expert cache's allocations and bytes, cpu_ref agreement.

Tolerances (measured on tiny-moe, stated here so a regression shows): cuda float32 against
cpu_ref float32, greedy ids identical and logits within 1e-4 relative (L2), as for dense models.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kestrel_core import load
from kestrel_core.errors import BudgetError
from kestrel_core.hookspecs import hookimpl
from kestrel_core.tools.presets import preset_config, write_checkpoint

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPT = [5, 17, 42, 99, 3]
EXPERT_BF16 = 3 * 32 * 64 * 2  # one tiny-moe expert in cuda's bfloat16 buffers


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return write_checkpoint(preset_config("tiny-moe"), tmp_path_factory.mktemp("moe-cuda") / "tiny-moe", seed=3)


def generate(model_dir, tokens=12, keep_logits=False, **settings):
    """Routed on the host at each sparse layer (the table path has tests of its own: test_moe_table_cuda.py)."""
    settings.setdefault("backend", "cuda")
    settings.setdefault("expert_decode", "host")
    with load(model_dir) as model, model.open(**settings) as run:
        return run.generate(prompt_ids=PROMPT, max_new_tokens=tokens, stop_at_eos=False, keep_logits=keep_logits)


@pytest.mark.crosscheck
def test_float32_matches_cpu_ref(tiny_moe):
    cpu = generate(tiny_moe, backend="cpu_ref", dtype="float32", keep_logits=True)
    gpu = generate(tiny_moe, dtype="float32", keep_logits=True, expert_policy="expert_lru",
                   expert_budget_mb=3 * EXPERT_BF16 * 2 / 2**20, expert_prefetch=True)
    assert gpu.token_ids == cpu.token_ids
    a, b = torch.stack([x.double() for x in gpu.logits]), torch.stack([x.double() for x in cpu.logits])
    assert float((a - b).norm() / b.norm()) < 1e-4


def test_ids_identical_across_budget_policy_prefetch_and_allocator(tiny_moe):
    ref = generate(tiny_moe, keep="off")
    budgets = [2 * EXPERT_BF16, 5 * EXPERT_BF16, 24 * EXPERT_BF16]
    for policy, budget, prefetch, allocator in itertools.product(
            ["expert_lru", "expert_lfu"], budgets, [False, True], ["pool", "free"]):
        got = generate(tiny_moe, keep="off", expert_policy=policy, expert_budget_mb=budget / 2**20,
                       expert_prefetch=prefetch, allocator=allocator)
        assert got.token_ids == ref.token_ids, (policy, budget, prefetch, allocator)
    for keep, prefetch in ((1, 1), (2, 0), (2, 2)):  # whole-layer streaming, with the side stream or not
        got = generate(tiny_moe, keep=keep, prefetch=prefetch, expert_prefetch=bool(prefetch))
        assert got.token_ids == ref.token_ids, (keep, prefetch)
    assert ref.steps["eager"] == len(ref.per_token)  # the host routes every sparse layer: no step is captured


class StreamedBytes:
    """At every decode boundary: the bytes of resident streamed units."""

    def __init__(self):
        self.seen: list[int] = []

    @hookimpl
    def on_layer_advance(self, window, layer, phase):
        if phase == "decode":
            self.seen.append(window.resident_bytes)


@pytest.mark.parametrize("prefetch", [False, True])
def test_the_expert_cache_allocates_nothing_after_warm_up(tiny_moe, register_plugin, prefetch):
    watch = register_plugin(StreamedBytes(), "streamed-bytes")
    budget = 4 * EXPERT_BF16
    r = generate(tiny_moe, 24, keep="off", expert_policy="expert_lru", expert_budget_mb=budget / 2**20,
                 expert_prefetch=prefetch)
    steady = r.per_token[4:]
    assert sum(p["expert_misses"] for p in steady) > 0  # the cache does turn over
    assert sum(p["allocations"] for p in steady) == 0 and sum(p["frees"] for p in steady) == 0
    for p in r.per_token:  # only routed experts (and guesses) move
        assert p["layer_uploads"] == p["expert_misses"] + p["expert_prefetches"]
        assert p["bytes_uploaded"] == p["layer_uploads"] * EXPERT_BF16
    with load(tiny_moe) as model, model.open(backend="cuda", keep="off") as run:
        own = sum(u.nbytes for u in run.backend.units.own())
    guess = 2 * EXPERT_BF16 if prefetch else 0  # top-2: one layer's guesses
    # From the second decoded token on (a prefill fetches each expert its prompt routes to, once):
    assert max(watch.seen[4:]) <= own + budget + guess


def test_a_budget_too_small_for_the_experts_names_the_expert_policy(tmp_path):
    from kestrel_core.formats.modelconfig import parse_model_config
    from kestrel_core.tools.presets import PRESETS

    # 3 sparse layers x 16 experts of 768 KiB in bfloat16: 36 MiB of experts, the rest well under 1 MiB.
    cfg = parse_model_config(dict(PRESETS["tiny-moe"], torch_dtype="bfloat16", num_experts=16, moe_intermediate_size=2048))
    path = write_checkpoint(cfg, tmp_path / "wide-moe", seed=0)
    with load(path) as model:
        with pytest.raises(BudgetError, match="bound the experts with --expert-policy expert_lru --expert-budget-mb N"):
            model.open(backend="cuda", keep="off", budget_mb=16)
        with model.open(backend="cuda", keep="off", budget_mb=16, expert_policy="expert_lru", expert_budget_mb=4) as run:
            r = run.generate(prompt_ids=PROMPT, max_new_tokens=6, stop_at_eos=False)
        assert r.counters["peak_resident_bytes"] <= 16 * 2**20


@pytest.fixture(scope="module")
def tiny_moe_q8(tiny_moe, tmp_path_factory):
    from kestrel_core.tools.quantize import quantize_checkpoint

    out = tmp_path_factory.mktemp("moe-cuda-q8") / "tiny-moe-q8"
    quantize_checkpoint(tiny_moe, out, 32)
    return out


def test_q8_experts_run_under_the_expert_cache(tiny_moe_q8):
    ref = generate(tiny_moe_q8, keep="off")
    with load(tiny_moe_q8) as model, model.open(backend="cuda", keep="off") as run:
        units = run.backend.units
        assert {e.geometry.layout[0] for e in units[(1, 0)].entries} == {"q8"}  # gate_up and down stream as q8
        assert [e.name for e in units[(1,)].entries] == ["qkv", "o", "router"]
        assert units[(1,)].entries[2].geometry.layout == ()  # the router stays in float
        expert = units[(1, 0)].nbytes
    assert expert < EXPERT_BF16  # fewer bytes streamed an expert than bfloat16's
    for policy, n, prefetch in (("expert_lru", 3, False), ("expert_lfu", 5, True)):
        got = generate(tiny_moe_q8, keep="off", expert_policy=policy, expert_budget_mb=n * expert / 2**20,
                       expert_prefetch=prefetch)
        assert got.token_ids == ref.token_ids, (policy, n, prefetch)
        assert sum(p["expert_misses"] for p in got.per_token) > 0
    cpu = generate(tiny_moe_q8, backend="cpu_ref", tokens=1, keep_logits=True)
    gpu = generate(tiny_moe_q8, dtype="float32", tokens=1, keep_logits=True)
    a, b = gpu.logits[0].double(), cpu.logits[0].double()
    assert float((a - b).norm() / b.norm()) < 1e-3  # one q8 weight set, dequantized alike (float32 on both)
