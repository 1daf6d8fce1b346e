"""A run owns its objects; the window plans each boundary in units and bytes; the Python API; the optimum."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kestrel_core import load
from kestrel_core.config import KestrelConfig
from kestrel_core.errors import ConfigError, PluginError
from kestrel_core.hookspecs import hookimpl
from kestrel_core.tools.optimum import min_bytes_by_pass
from kestrel_core.engine.plan import Advice
from kestrel_core.formats.units import EntrySpec, Geometry, Unit, UnitSpec, UnitTable

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "kestrel-plugin-example"
PROMPT = [5, 17, 42, 99, 3]


def settings(**kw):
    return dict(dict(max_new_tokens=6, stop_at_eos=False), **kw)


# --- a run owns its objects -------------------------------------------------------------

def test_two_open_runs_do_not_see_each_other(tiny_ckpt):
    """Interleaved generate calls of two open runs: each one's counters equal its solo run's."""
    model = load(tiny_ckpt)
    with model:
        solo = {}
        for policy in ("asymmetric", "future_evicting"):
            with model.open(policy=policy, keep=3) as run:
                solo[policy] = [run.generate(prompt_ids=PROMPT, **settings()) for _ in range(2)]
        with model.open(policy="asymmetric", keep=3) as a, model.open(policy="future_evicting", keep=3) as b:
            mixed = {"asymmetric": [], "future_evicting": []}
            for _ in range(2):
                mixed["asymmetric"].append(a.generate(prompt_ids=PROMPT, **settings()))
                mixed["future_evicting"].append(b.generate(prompt_ids=PROMPT, **settings()))
    for policy in solo:
        for alone, together in zip(solo[policy], mixed[policy]):
            assert together.token_ids == alone.token_ids
            assert together.counters == alone.counters, policy
    assert [p["layer_uploads"] for p in mixed["asymmetric"][0].per_token] == [3] * 5  # 6 layers, keep 3
    assert [p["layer_uploads"] for p in mixed["future_evicting"][0].per_token] == [6] * 5


def test_a_policy_missing_a_declared_member_is_named(tiny_ckpt, register_plugin):
    class NoPeak:
        name, keep, windowed = "no_peak", 2, True

        def __init__(self, n_layers, keep):
            pass

        def preload(self, window):
            return ()

        def on_layer_advance(self, window, layer, phase):
            return None

    class Registers:
        @hookimpl
        def register_policies(self, register):
            register("no_peak", NoPeak)

    register_plugin(Registers(), "no-peak")
    with load(tiny_ckpt) as model, pytest.raises(PluginError, match="policy 'no_peak' .NoPeak. lacks peak_layers"):
        model.open(policy="no_peak", keep=2)


# --- units and plans --------------------------------------------------------------------

def _table(sizes: list[int]) -> UnitTable:
    return UnitTable(Unit.of(UnitSpec((layer,), layer, {}), [EntrySpec("w", Geometry((n,), "u8", n, "cpu"), None)])
                     for layer, n in enumerate(sizes))


def test_units_add_real_bytes_when_layers_differ():
    table = _table([10, 40, 20, 30])
    assert table.layer_bytes == {0: 10, 1: 40, 2: 20, 3: 30}
    assert table.peak_bytes(2) == 70 and table.peak_bytes(4) == table.total_bytes == 100
    # The optimum at a byte budget: everything fits, or one layer streams through one layer's room.
    assert min_bytes_by_pass(table.layer_bytes, 100, 3) == [100, 0, 0]
    assert min_bytes_by_pass({0: 10, 1: 10, 2: 10, 3: 10}, 10, 3) == [40, 40, 40]
    # Room for 3 of 4 equal layers: a cyclic scan's MIN misses 4 layers every 3 passes.
    assert min_bytes_by_pass({0: 10, 1: 10, 2: 10, 3: 10}, 30, 7) == [40, 10, 10, 20, 10, 10, 20]
    # Bytes, not layers: 70 bytes hold the 40-byte layer and the 30-byte one, or three small ones.
    assert min_bytes_by_pass(table.layer_bytes, 70, 4) == [100, 60, 80, 60]  # pass 1 worked by hand: 40 + 20


def test_the_units_are_the_models_layers(tiny_ckpt):
    with load(tiny_ckpt) as model, model.open(keep=2) as run:
        units = run.backend.units
        assert sorted(units.units) == [(layer,) for layer in range(6)]
        assert [e.name for e in units[(0,)].entries] == ["q", "k", "v", "o", "gate", "up", "down"]
        assert units[(0,)].nbytes == sum(e.geometry.nbytes for e in units[(0,)].entries) == 43_008 * 4
        run.generate(prompt_ids=PROMPT, **settings())
        assert run.window.resident_units == {(4,), (5,)}  # asymmetric keep=2 ends with the last two


@pytest.mark.parametrize("policy, keep, repeats", [("asymmetric", 2, True), ("asymmetric", 1, True),
                                                   ("pinned_set", 2, True), ("future_evicting", 3, True),
                                                   ("belady", 3, False)])
def test_a_repeating_window_repeats_its_buffers(tiny_ckpt, policy, keep, repeats):
    """belady's window is periodic over L-1 tokens, not one: its plans differ from token to token."""
    seen = []

    class Watch:
        @hookimpl
        def on_layer_advance(self, window, layer, phase):
            if layer == 0 and phase == "decode":  # the token just finished: its plans, and buffers made or freed
                seen.append((tuple(window.last_signatures), window.counters.allocations + window.counters.frees))

    with load(tiny_ckpt) as model, model.open(policy=policy, keep=keep, allocator="pool", observers=[Watch()]) as run:
        result = run.generate(prompt_ids=PROMPT, **settings(max_new_tokens=8))
    assert all(p["layer_uploads"] > 0 for p in result.per_token)  # it streams, and yet
    same = [a == b for a, b in zip(seen[-4:], seen[-3:])]
    assert same == [repeats] * 3  # from token to token: the same units into the same buffers, none made or freed


def test_fresh_buffers_never_count_as_a_repeat(tiny_ckpt):
    with load(tiny_ckpt) as model, model.open(keep=2, allocator="free") as run:
        run.generate(prompt_ids=PROMPT, **settings())
        frees = run.window.counters.frees
        assert run.window.last_signatures and frees > 0  # fresh buffers every token: no two tokens' buffers compare


def test_advice_may_name_units(tiny_ckpt, register_plugin):
    class ByKey:
        @hookimpl
        def on_layer_advance(self, window, layer, phase):
            return Advice(evict=[key for key in window.resident_units if key[0] < layer])

    register_plugin(ByKey(), "by-key")
    with load(tiny_ckpt) as model, model.open(keep=6) as run:
        res = run.generate(prompt_ids=PROMPT, **settings())
    # Only layer 5 outlives its token (no later boundary evicts it); keep=6 alone would upload none.
    assert [p["layer_uploads"] for p in res.per_token] == [5] * 5


# --- the optimum ------------------------------------------------------------------------

def _mru():
    sys.path.insert(0, str(EXAMPLE))
    try:
        from kestrel_plugin_example import MostRecentlyUsed
    finally:
        sys.path.remove(str(EXAMPLE))
    return MostRecentlyUsed


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_belady_moves_no_more_bytes_than_any_policy_at_its_peak(tiny_ckpt, register_plugin, keep):
    mru = _mru()

    class Example:
        @hookimpl
        def register_policies(self, register):
            register("mru", mru)

    register_plugin(Example(), "example-policy")
    with load(tiny_ckpt) as model:
        def run(policy, k):
            with model.open(policy=policy, keep=k) as r:
                res = r.generate(prompt_ids=PROMPT, **settings(max_new_tokens=8))
            streamed_peak = res.counters["peak_resident_bytes"] - res.fixed_resident_bytes
            return sum(p["bytes_uploaded"] for p in res.per_token[1:]), streamed_peak, res.token_ids

        layer = 43_008 * 4  # bytes of one tiny layer in float32
        for policy in ("asymmetric", "pinned_set", "future_evicting", "mru"):
            moved, peak, ids = run(policy, keep)
            best, best_peak, best_ids = run("belady", peak // layer)  # the optimum at the same peak
            assert best_peak == peak and best_ids == ids
            assert best <= moved, (policy, keep, best, moved)
            if policy == "pinned_set" and moved:
                assert best < moved  # pinned_set is no optimum, whatever the README used to say


def test_sweep_reports_every_policy_against_belady(tiny_ckpt, capsys):
    import json

    from kestrel_core.cli import main

    assert main(["sweep", "--model", str(tiny_ckpt), "--keep", "2,4", "--policy", "asymmetric,belady,pinned_set",
                 "--max-new-tokens", "5", "--ignore-eos", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    by = {(r["policy"], r["keep"]): r for r in rows}
    assert by[("belady", 4)]["bytes_vs_min"] == 1.0 and by[("belady", 2)]["bytes_vs_min"] == 1.0
    assert by[("asymmetric", 2)]["bytes_vs_min"] > 1.0  # at asymmetric's peak (4 layers) MIN moves less
    assert by[("asymmetric", 2)]["min_bytes_per_token"] == by[("belady", 4)]["bytes_uploaded_per_token"]


# --- the Python API ---------------------------------------------------------------------

def test_the_python_api(tiny_ckpt):
    model = load(tiny_ckpt)
    with model.open(policy="asymmetric", keep=2, backend="cpu_ref") as run:
        res = run.generate(prompt_ids=[1, 2, 3], max_new_tokens=8)
        text = run.generate(prompt="hi", max_new_tokens=3, stop_at_eos=False)
    assert len(res.token_ids) <= 8 and res.ms_per_token > 0 and res.counters["layer_uploads"] > 0
    assert res.to_json()["token_ids"] == res.token_ids
    assert text.prompt_ids == list(b"hi") and text.text == model.tokenizer.decode(text.token_ids)
    with model.open(KestrelConfig(), residency={"policy": "pinned_set", "keep": 2}) as run:
        assert run.policy.name == "pinned_set" and run.policy.keep == 2
    model.close()


@pytest.mark.parametrize("kwargs, needle", [(dict(kepe=2), "unknown setting 'kepe'"),
                                            (dict(keep="two"), "keep must be"),
                                            (dict(policy=3), "policy must be str"),
                                            (dict(backend={"nme": "cuda"}), "unknown key(s) nme")])
def test_bad_settings_are_one_line_errors(tiny_ckpt, kwargs, needle):
    with load(tiny_ckpt) as model, pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        model.open(**kwargs)


def test_bad_generation_settings(tiny_ckpt):
    with load(tiny_ckpt) as model, model.open(keep=2) as run:
        with pytest.raises(ConfigError, match="unknown generation setting.s. max_tokens"):
            run.generate(prompt_ids=[1], max_tokens=3)
        with pytest.raises(ConfigError, match="max_new_tokens must be int"):
            run.generate(prompt_ids=[1], max_new_tokens="3")


def test_generation_stops_at_generation_configs_eos_too(tiny_copy):
    """Qwen3 lists its chat turn's end in generation_config.json, not config.json: generate stops there too."""
    import json

    from kestrel_core import load
    from kestrel_core.errors import ConfigError

    with load(tiny_copy) as model, model.open(backend="cpu_ref") as run:
        free = run.generate(prompt_ids=[1, 2, 3], max_new_tokens=8, stop_at_eos=False).token_ids
    stop = free[3]
    assert stop not in free[:3]  # the tiny preset's greedy ids: the fourth is new
    (tiny_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [256, stop]}))
    with load(tiny_copy) as model, model.open(backend="cpu_ref") as run:
        assert model.eos_ids == {256, stop}
        assert run.generate(prompt_ids=[1, 2, 3], max_new_tokens=8).token_ids == free[:4]
    (tiny_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": "end"}))
    with pytest.raises(ConfigError, match="generation_config.json: eos_token_id must be a token id"):
        load(tiny_copy)
