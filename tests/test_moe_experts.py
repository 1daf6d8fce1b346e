"""Expert policies: experts of a Mixture-of-Experts model under a byte budget (cpu_ref)."""

from __future__ import annotations

import pytest

from kestrel_core.tools.traces import TraceRecorder
from kestrel_core import load
from kestrel_core.errors import ConfigError, PluginError
from kestrel_core.hookspecs import hookimpl
from kestrel_core.tools.presets import preset_config, write_checkpoint
from plugins.experts import ExpertLFU, ExpertLRU

PROMPT = [5, 17, 42, 99, 3]
EXPERT = 3 * 32 * 64 * 4  # one tiny-moe expert in cpu_ref's float32 buffers: 24 KiB


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return write_checkpoint(preset_config("tiny-moe"), tmp_path_factory.mktemp("experts") / "tiny-moe")


def generate(model_dir, tokens=12, **settings):
    with load(model_dir) as model, model.open(**settings) as run:
        return run.generate(prompt_ids=PROMPT, max_new_tokens=tokens, stop_at_eos=False)


class ExpertBytes:
    """At every decode boundary: the bytes of resident experts."""

    def __init__(self):
        self.seen: list[int] = []

    @hookimpl
    def on_layer_advance(self, window, layer, phase):
        experts = {k: window.units[k].nbytes for k in window.resident_units if len(k) == 2}
        # the window's own running record of them agrees at every boundary
        assert dict(window.resident_experts) == experts and window.resident_expert_bytes == sum(experts.values())
        if phase == "decode":
            self.seen.append(sum(experts.values()))


@pytest.mark.parametrize("policy", ["expert_lru", "expert_lfu"])
@pytest.mark.parametrize("experts", [2, 4, 9])
@pytest.mark.parametrize("decode", ["table", "host"])
def test_ids_are_identical_and_the_budget_holds(tiny_moe, register_plugin, policy, experts, decode):
    ref = generate(tiny_moe, keep="off", expert_decode="host")
    watch = register_plugin(ExpertBytes(), "expert-bytes")
    budget_mb = experts * EXPERT / 2**20
    for keep in ("off", 2):
        got = generate(tiny_moe, keep=keep, expert_policy=policy, expert_budget_mb=budget_mb, expert_decode=decode)
        assert got.token_ids == ref.token_ids, keep
        # A prefill fetches every expert its tokens route to (each once), and the overshoot goes at each layer's
        # next decision point: in the first decode step where the host routes, a step later where it reads the
        # table (its routing is heard once the next step is on its way).
        settled = 4 if decode == "host" else 8
        assert max(watch.seen[settled:]) <= experts * EXPERT, keep
        for step in got.per_token:  # only routed experts move
            layers = 4 - 2 if keep == 2 else 0  # asymmetric keep=2 re-uploads two layer units a token
            if decode == "host":  # every expert upload is a miss, fetched before use
                assert step["layer_uploads"] == layers + step["expert_misses"]
            else:  # a miss was read from its host copy; what comes in after is the routed experts not yet resident
                assert 0 <= step["layer_uploads"] - layers <= 3 * 2
            assert step["expert_hits"] + step["expert_misses"] == 3 * 2  # three sparse layers, top-2
        watch.seen.clear()


def test_a_larger_budget_hits_more(tiny_moe):
    runs = [generate(tiny_moe, 16, expert_policy="expert_lru", expert_budget_mb=n * EXPERT / 2**20) for n in (2, 6, 24)]
    hits = [sum(p["expert_hits"] for p in r.per_token) for r in runs]
    assert hits[0] <= hits[1] < hits[2]
    everything = runs[2].counters  # every expert of the model fits: none is evicted, each is fetched once at most
    assert everything["layer_evictions"] == 0 and everything["expert_misses"] <= 3 * 8


class FakeWindow:
    def __init__(self, nbytes):
        self.resident_units: set = set()
        self.admits = True
        self.units = {(1, e): type("U", (), {"nbytes": nbytes})() for e in range(8)}

    @property
    def resident_experts(self):
        return {k: self.units[k].nbytes for k in self.resident_units}

    @property
    def resident_expert_bytes(self):
        return sum(self.resident_experts.values())


def _route(policy, window, experts):
    advice = policy.on_experts_routed(window, 1, experts, "decode")
    if advice:
        window.resident_units -= set(advice.evict)
    window.resident_units |= {(1, e) for e in experts}
    return sorted(advice.evict) if advice else []


def test_lru_and_lfu_choose_different_victims():
    for cls, victim in ((ExpertLRU, (1, 0)), (ExpertLFU, (1, 1))):
        policy, window = cls(budget=2 * 100), FakeWindow(100)
        for experts in ([0], [0], [0], [1]):  # 0 three times, then 1 once, most recently
            assert _route(policy, window, experts) == []
        assert _route(policy, window, [2]) == [victim], cls.name  # LRU drops 0 (older), LFU drops 1 (rarer)


@pytest.mark.parametrize("settings, needle", [
    (dict(expert_policy="expert_lru", expert_budget_mb=0.01), "below one token's routed experts: 2 x 24,576 bytes = 49,152 bytes (0.046875 MiB); raise --expert-budget-mb to at least 0.046875"),
    (dict(expert_policy="expert_lru"), "needs a budget: set --expert-budget-mb"),
    (dict(expert_budget_mb=1.0), "expert_budget_mb needs an expert policy"),
])
def test_bad_expert_settings_are_one_line(tiny_moe, settings, needle):
    with load(tiny_moe) as model, pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        model.open(**settings)


def test_an_unknown_expert_policy_lists_the_available(tiny_moe):
    with load(tiny_moe) as model, pytest.raises(PluginError, match="unknown expert policy 'lru'; available: expert_lfu, expert_lru"):
        model.open(expert_policy="lru", expert_budget_mb=1.0)


def test_the_unit_table_parts_into_the_experts_and_the_layers_own_units(tiny_moe):
    from kestrel_core.formats.units import is_expert

    with load(tiny_moe) as model, model.open(keep="off") as run:
        units, cfg = run.backend.units, model.config
        experts, own = units.experts(), units.own()
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.moe_layer(i)]
    assert [u.key for u in experts] == [(i, e) for i in moe_layers for e in range(cfg.num_experts)]
    assert own and not any(is_expert(u.key) for u in own)
    assert {u.layer for u in own} == set(range(cfg.num_hidden_layers))  # every layer keeps its own units
    assert sorted(map(str, (u.key for u in experts + own))) == sorted(map(str, units.units))


def test_a_dense_model_has_no_experts(tiny_ckpt):
    with load(tiny_ckpt) as model, pytest.raises(ConfigError, match="is for Mixture-of-Experts models"):
        model.open(expert_policy="expert_lru", expert_budget_mb=1.0)


class Fifo(ExpertLRU):
    """A plugin's expert policy: evict the expert fetched first (rank by first routing)."""

    name = "expert_fifo"

    def rank(self, key):
        self.first = getattr(self, "first", {})
        return (self.first.setdefault(key, self.clock), key)


class FifoPlugin:
    @hookimpl
    def register_expert_policies(self, register):
        register("expert_fifo", Fifo)


def test_a_plugin_registers_its_own_expert_policy(tiny_moe, register_plugin):
    register_plugin(FifoPlugin(), "fifo")
    ref = generate(tiny_moe, keep="off")
    got = generate(tiny_moe, keep="off", expert_policy="expert_fifo", expert_budget_mb=3 * EXPERT / 2**20)
    assert got.token_ids == ref.token_ids and got.counters["layer_evictions"] > 0


# --- speculative prefetch: layer l+1's router on layer l's hidden state -----------------------------

@pytest.fixture(scope="module")
def shared_router(tiny_moe, tmp_path_factory):
    """tiny-moe with layers 2 and 3 routing by layer 1's router: each guess is then exactly the layer before's routing."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("shared-router") / "m"
    out.mkdir()
    shutil.copy(tiny_moe / "config.json", out / "config.json")
    files = sorted(tiny_moe.glob("*.safetensors"))
    assert len(files) == 1
    tensors = load_file(files[0])
    for layer in (2, 3):
        tensors[f"model.layers.{layer}.mlp.gate.weight"] = tensors["model.layers.1.mlp.gate.weight"].clone()
    save_file(tensors, out / files[0].name)
    return out


def test_speculative_prefetch_changes_no_id(tiny_moe):
    ref = generate(tiny_moe, keep="off")
    for settings in (dict(keep="off"), dict(keep=2), dict(expert_policy="expert_lru", expert_budget_mb=3 * EXPERT / 2**20),
                     dict(expert_policy="expert_lfu", expert_budget_mb=5 * EXPERT / 2**20)):
        got = generate(tiny_moe, expert_prefetch=True, **settings)
        assert got.token_ids == ref.token_ids, settings
        c = got.counters
        assert c["expert_guessed"] > 0 and 0 <= c["expert_guess_hits"] <= c["expert_guessed"], settings
    off = generate(tiny_moe, keep="off", expert_policy="expert_lru", expert_budget_mb=3 * EXPERT / 2**20).counters
    assert off["expert_guessed"] == off["expert_prefetches"] == 0  # nothing is guessed with prefetch off


def test_recall_counts_the_routed_experts_the_guess_named(shared_router):
    recorder = TraceRecorder()
    with load(shared_router) as model, model.open(keep="off", expert_prefetch=True, observers=[recorder]) as run:
        r = run.generate(prompt_ids=PROMPT, max_new_tokens=8, stop_at_eos=False)
        trace = recorder.events
    routed = {(token, layer): set(experts) for phase, token, layer, experts in trace if phase == "decode"}
    tokens = sorted({t for t, _ in routed})
    assert len(tokens) == len(r.per_token) == 7
    # Layer 1 guesses layer 2 and layer 2 guesses layer 3 (layer 0 is dense; layer 3 is the last):
    # with one router, a guess is what the layer before routed to.
    want_hits = sum(len(routed[t, nxt] & routed[t, nxt - 1]) for t in tokens for nxt in (2, 3))
    assert r.counters["expert_guessed"] == len(tokens) * 2 * 2
    assert r.counters["expert_guess_hits"] == want_hits
    assert sum(p["expert_guess_hits"] for p in r.per_token) == want_hits  # no guess carries over a token


def test_prefetch_stays_within_the_budget_plus_one_layers_guess(tiny_moe, register_plugin):
    watch = register_plugin(ExpertBytes(), "expert-bytes")
    budget = 3 * EXPERT
    r = generate(tiny_moe, 16, keep="off", expert_policy="expert_lru", expert_budget_mb=budget / 2**20, expert_prefetch=True)
    assert r.counters["expert_prefetches"] > 0
    assert max(watch.seen[4:]) <= budget + 2 * EXPERT  # top-2: one layer's guesses over the budget at most
    for step in r.per_token:  # every expert upload is a routed miss or a prefetch
        assert step["layer_uploads"] == step["expert_misses"] + step["expert_prefetches"]


def test_expert_prefetch_on_a_dense_model_is_refused(tiny_ckpt):
    with load(tiny_ckpt) as model, pytest.raises(ConfigError, match="expert_prefetch is for Mixture-of-Experts models"):
        model.open(expert_prefetch=True)


def test_whole_layer_streaming_fetches_every_expert_with_its_layer(tiny_moe):
    ref = generate(tiny_moe, keep="off")
    routed = generate(tiny_moe, keep=1)
    whole = generate(tiny_moe, keep=1, expert_fetch="layer")
    assert whole.token_ids == routed.token_ids == ref.token_ids
    with load(tiny_moe) as model, model.open(keep=1) as run:
        units = run.backend.units
        layer_bytes = [units.layer_bytes[layer] for layer in range(4)]
    for step in whole.per_token:  # asymmetric keep=1: three layers come back each token, each with all its units
        assert step["expert_misses"] == 0 and step["expert_hits"] == 3 * 2
        assert step["bytes_uploaded"] in {sum(layer_bytes) - layer_bytes[k] for k in range(4)}
        sparse = 3 if step["bytes_uploaded"] == sum(layer_bytes[1:]) else 2  # whether the kept layer is the dense one
        assert step["layer_uploads"] == 3 + sparse * 8
    assert min(p["bytes_uploaded"] for p in whole.per_token) > max(p["bytes_uploaded"] for p in routed.per_token)


@pytest.mark.parametrize("settings", [dict(expert_policy="expert_lru", expert_budget_mb=1.0), dict(expert_prefetch=True)])
def test_whole_layer_streaming_leaves_nothing_to_choose(tiny_moe, settings):
    with load(tiny_moe) as model, pytest.raises(ConfigError, match="fetches every expert with its layer"):
        model.open(keep=1, expert_fetch="layer", **settings)


def test_an_unknown_expert_fetch_is_one_line(tiny_moe):
    with load(tiny_moe) as model, pytest.raises(ConfigError, match="expert_fetch must be one of routed, layer, got 'all'"):
        model.open(expert_fetch="all")
