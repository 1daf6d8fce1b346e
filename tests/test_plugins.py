"""The plugin contract: meta-tests over the hook specs (datasette style), and fake plugins registered in fixtures."""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import json
from pathlib import Path

import pytest

from kestrel_core import hookspecs, plugins
from kestrel_core.config import KestrelConfig
from kestrel_core.engine.run import Model
from kestrel_core.errors import ConfigError, PluginError
from kestrel_core.hookspecs import hookimpl
from kestrel_core.engine.plan import Advice
from backends.cpu_ref.backend import CpuRefBackend

ROOT = Path(__file__).resolve().parent.parent
BUILTINS = {
    "backend": {"cpu_ref", "cuda"},
    "policy": {"asymmetric", "belady", "future_evicting", "pinned_set", "off"},
    "allocator": {"pool", "free"},
}


def hook_specs() -> dict:
    """name -> function for every hook spec in kestrel_core.hookspecs."""
    return {n: f for n, f in vars(hookspecs).items() if inspect.isfunction(f) and hasattr(f, "kestrel_spec")}


# --- meta-tests ------------------------------------------------------------------------

def test_the_specs_are_the_documented_set():
    assert set(hook_specs()) == {"on_layer_advance", "preload", "on_experts_routed", "alloc", "release", "register_drafters",
                                 "register_backends",
                                 "register_policies", "register_allocators", "register_expert_policies",
                                 "register_gates", "register_commands"}
    assert all(inspect.getdoc(f) for f in hook_specs().values()), "every hook has a docstring"


def _is_hookimpl(decorator: ast.expr) -> bool:
    """``@hookimpl``, ``@hookimpl(...)``, ``@hookspecs.hookimpl`` or ``@hookspecs.hookimpl(...)``."""
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (isinstance(target, ast.Name) and target.id == "hookimpl") or \
        (isinstance(target, ast.Attribute) and target.attr == "hookimpl")


def exercised_hooks(source: str) -> set[str]:
    """The hook names that the code in ``source`` really exercises, read from its syntax tree (so comments,
    strings and docstrings do not count): a function named after a hook and decorated with ``@hookimpl``, or
    a hook reached through a plugin manager's relay, ``<anything>.hook.<name>``."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(map(_is_hookimpl, node.decorator_list)):
            found.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "hook":
            found.add(node.attr)
    return found


def _tested_hooks() -> set[str]:
    return set().union(*(exercised_hooks(p.read_text()) for p in Path(__file__).parent.glob("test_*.py")))


@pytest.mark.parametrize("name", sorted(hook_specs()))
def test_every_hook_has_a_test(name):
    assert name in _tested_hooks(), f"no test implements (@hookimpl def {name}) or calls (pm.hook.{name}) the hook"


def test_exercised_hooks_counts_code_not_mentions():
    mentions = '''
"""A docstring naming alloc and release."""
# preload is tested elsewhere
NOTE = "on_layer_advance"
hook_names = ["register_gates"]

class Plain:
    def alloc(self, entry):  # named like a hook, but no @hookimpl
        return None

def test_x(alloc):
    alloc.release()
'''
    assert exercised_hooks(mentions) == set()
    code = '''
class Impl:
    @hookimpl
    def alloc(self, entry):
        return None

    @hookimpl(tryfirst=True)
    def preload(self, window):
        return ()

@hookspecs.hookimpl
def register_gates(register):
    pass

def test_y():
    plugins.pm.hook.release(entry=None, buffer=None)
'''
    assert exercised_hooks(code) == {"alloc", "preload", "register_gates", "release"}


@pytest.mark.parametrize("name", sorted(hook_specs()))
def test_every_hook_signature_is_in_the_plugin_guide(name):
    guide = ROOT / "docs" / "plugins.md"
    signature = f"{name}{inspect.signature(hook_specs()[name])}"
    assert guide.is_file() and signature in guide.read_text(), f"docs/plugins.md does not document {signature}"


def test_kestrel_plugins_lists_every_builtin_with_package_kestrel(capsys):
    from kestrel_core.cli import main

    assert main(["plugins", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    version = importlib.metadata.version("kestrel")
    for kind, names in BUILTINS.items():
        listed = {r["name"]: r for r in rows if r["kind"] == kind}
        assert names <= set(listed), (kind, sorted(listed))
        for name in names:
            assert (listed[name]["package"], listed[name]["version"]) == ("kestrel", version), listed[name]
    # Every plugin module the kestrel distribution declares is loaded, and only through the entry-point group.
    declared = {ep.name for ep in importlib.metadata.distribution("kestrel").entry_points if ep.group == "kestrel"}
    loaded = {name for name, _ in plugins.pm.list_name_plugin()}
    assert declared and declared <= loaded


# --- fake plugins ----------------------------------------------------------------------

GEN = dict(generation__max_new_tokens=5, generation__stop_at_eos=False)
PROMPT = [9, 8, 7, 6]


def run(model_dir, **flags):
    cfg = KestrelConfig().override(**{**GEN, **flags})
    with Model(model_dir) as model, model.open(cfg) as r:
        return r.generate(prompt_ids=PROMPT)


class KeepNothing:
    """A third-party policy: evict every layer but the one about to run."""

    name = "keep_nothing"
    windowed = True

    def __init__(self, n_layers, keep):
        self.n_layers, self.keep = n_layers, keep

    def peak_layers(self):
        return 1

    @hookimpl
    def preload(self, window):
        return ()

    @hookimpl
    def on_layer_advance(self, window, layer, phase):
        return Advice(evict=[l for l in window.resident if l != layer])


class ThirdPartyPolicies:
    @hookimpl
    def register_policies(self, register):
        register("keep_nothing", KeepNothing)


def test_a_third_party_policy_changes_behaviour(tiny_ckpt, register_plugin):
    with pytest.raises(PluginError, match="unknown policy 'keep_nothing'"):
        run(tiny_ckpt, residency__policy="keep_nothing", residency__keep=3)
    register_plugin(ThirdPartyPolicies(), "third-party-policies")
    reg = plugins.lookup("policies", "keep_nothing")
    assert reg.package == "(registered at run time)" and reg.factory is KeepNothing
    base = run(tiny_ckpt, residency__policy="asymmetric", residency__keep=3)
    fake = run(tiny_ckpt, residency__policy="keep_nothing", residency__keep=3)
    assert [p["layer_uploads"] for p in base.per_token] == [3] * 4
    assert [p["layer_uploads"] for p in fake.per_token] == [6] * 4
    assert fake.counters["peak_resident_bytes"] < base.counters["peak_resident_bytes"]
    assert fake.token_ids == base.token_ids


def test_a_name_registered_twice_is_an_error(register_plugin):
    class Again:
        @hookimpl
        def register_policies(self, register):
            register("asymmetric", KeepNothing)

    register_plugin(Again(), "again")
    with pytest.raises(PluginError, match="policy 'asymmetric' is registered twice"):
        plugins.registry("policies")


class RepeatLast:
    """A third-party drafter: proposes the last token ``k`` times (mostly wrong, which is the point)."""

    name = "repeat_last"

    def __init__(self, arg=None, run=None):
        self.k_seen = []

    def begin(self, prompt_ids):
        return self

    def propose(self, context, k):
        self.k_seen.append(k)
        return [context[-1]] * k, None

    def accepted(self, context):
        pass

    def close(self):
        pass


class ThirdPartyDrafters:
    @hookimpl
    def register_drafters(self, register):
        register("repeat_last", RepeatLast)


def test_a_third_party_drafter_is_found_by_name_and_changes_no_id(tiny_ckpt, register_plugin):
    from kestrel_core import load

    with load(tiny_ckpt) as model:
        with pytest.raises(ConfigError, match=r"draft 'repeat_last' names no registered drafter \(ngram\) and no model: "
                                              r"model 'repeat_last' is not a directory"):
            model.open(keep=1, draft="repeat_last")
        register_plugin(ThirdPartyDrafters(), "third-party-drafters")
        assert plugins.lookup("drafters", "repeat_last").factory is RepeatLast
        with model.open(keep=1) as r:
            plain = r.generate(prompt_ids=[1, 2, 3], max_new_tokens=10, stop_at_eos=False)
        with model.open(keep=1, draft="repeat_last", draft_tokens=3) as r:
            spec = r.generate(prompt_ids=[1, 2, 3], max_new_tokens=10, stop_at_eos=False)
    assert spec.token_ids == plain.token_ids
    s = spec.speculative
    assert s["passes"] >= 1 and s["drafted"] > 0 and s["kept"] == len(spec.token_ids) - 1


def test_a_drafter_name_registered_twice_is_an_error(register_plugin):
    class Again:
        @hookimpl
        def register_drafters(self, register):
            register("ngram", RepeatLast)

    register_plugin(Again(), "again")
    with pytest.raises(PluginError, match="drafter 'ngram' is registered twice"):
        plugins.registry("drafters")


def test_an_on_layer_advance_observer_sees_every_boundary(tiny_ckpt, register_plugin):
    seen = []

    class Observer:
        @hookimpl
        def on_layer_advance(self, window, layer, phase):
            seen.append((window.token, phase, layer, tuple(sorted(window.resident))))
            return None

    register_plugin(Observer(), "observer")
    r = run(tiny_ckpt, residency__policy="asymmetric", residency__keep=2)
    L = 6
    expected = [(0, "prefill", l) for l in range(L)] + [(t, "decode", l) for t in range(1, 5) for l in range(L)]
    assert [s[:3] for s in seen] == expected
    assert len(r.token_ids) == 5
    # What it sees is the window before that boundary's evictions: asymmetric keep=2 holds layers 4,5 into layer 0.
    assert seen[L][3] == (4, 5)


def test_a_misspelt_hook_fails_loudly(tiny_ckpt, register_plugin, capsys):
    from kestrel_core.cli import main

    class Misspelt:
        @hookimpl
        def on_layer_advnce(self, window, layer, phase):
            return None

    register_plugin(Misspelt(), "misspelt")
    with pytest.raises(PluginError, match="on_layer_advnce"):
        plugins.check_plugins()
    rc = main(["generate", "--model", str(tiny_ckpt), "--prompt-ids", "1,2", "--keep", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("kestrel: error:") and "on_layer_advnce" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "advice, message",
    [(lambda layer: "evict everything", "must return an Advice"),
     (lambda layer: Advice(evict=[layer]), "which is about to run"),
     (lambda layer: Advice(evict=[99]), "layers are 0..5"),
     (lambda layer: Advice(prefetch=[-1]), "layers are 0..5")],
)
def test_a_policy_breaking_the_contract_is_a_plugin_error(tiny_ckpt, register_plugin, advice, message):
    class Broken:
        @hookimpl
        def on_layer_advance(self, window, layer, phase):
            return advice(layer) if layer == 3 else None

    register_plugin(Broken(), "broken")
    with pytest.raises(PluginError, match=message):
        run(tiny_ckpt, residency__keep=2)


def test_preload_from_a_plugin_is_honoured_and_windowed_policies_preload_nothing(tiny_ckpt, register_plugin):
    first = {}

    class FirstBoundary:
        @hookimpl
        def on_layer_advance(self, window, layer, phase):
            first.setdefault("uploads", window.counters.layer_uploads)
            first.setdefault("resident", window.resident)

    register_plugin(FirstBoundary(), "first-boundary")
    run(tiny_ckpt, residency__keep=2)
    assert first == {"uploads": 0, "resident": frozenset()}  # windowed: no preload
    first.clear()
    run(tiny_ckpt, residency__keep="off")
    assert first == {"uploads": 6, "resident": frozenset(range(6))}  # off: everything up front
    first.clear()

    class WarmStart:
        @hookimpl
        def preload(self, window):
            return [4, 5]

    register_plugin(WarmStart(), "warm-start")
    run(tiny_ckpt, residency__keep=2)
    assert first == {"uploads": 2, "resident": frozenset({4, 5})}


class CountingBackend(CpuRefBackend):
    """A third-party backend: cpu_ref that counts the host-to-buffer fills it does."""

    name = "counting"
    fills = 0

    def fill(self, buffer, source):
        type(self).fills += 1
        super().fill(buffer, source)


class ThirdPartyBackend:
    @hookimpl
    def register_backends(self, register):
        register("counting", CountingBackend)


def test_a_third_party_backend_runs_the_same_model(tiny_ckpt, register_plugin):
    register_plugin(ThirdPartyBackend(), "third-party-backend")
    CountingBackend.fills = 0
    r = run(tiny_ckpt, backend__name="counting", residency__keep=1)
    assert CountingBackend.fills == r.counters["uploads"] > 0
    assert r.token_ids == run(tiny_ckpt, residency__keep=1).token_ids


class Bump:
    """A third-party allocator: never reuses, never frees until the run ends (counts what it handed out)."""

    name = "bump"
    deterministic = False

    def __init__(self, counters, slots=0):
        self.counters, self.live = counters, []

    @hookimpl
    def alloc(self, entry):
        self.counters.allocations += 1
        buf = entry.factory.new_buffer(entry.geometry)
        self.live.append(buf)
        return buf

    @hookimpl
    def release(self, entry, buffer):
        pass  # keeps it in self.live: a leak on purpose, visible in the counters

    def drain(self):
        self.counters.frees += len(self.live)
        self.live.clear()


class ThirdPartyAllocators:
    @hookimpl
    def register_allocators(self, register):
        register("bump", Bump)


def test_a_third_party_allocator_answers_alloc_and_release(tiny_ckpt, register_plugin):
    register_plugin(ThirdPartyAllocators(), "third-party-allocators")
    r = run(tiny_ckpt, residency__keep=2, residency__allocator="bump")
    assert r.counters["allocations"] == r.counters["uploads"] and r.counters["pool_hits"] == 0
    assert r.counters["frees"] == 0  # releases went to the plugin, which kept them
    assert r.token_ids == run(tiny_ckpt, residency__keep=2).token_ids


class CountAllocations:
    """An observer of alloc and release: the run's allocator answers, and this plugin hears every request."""

    def __init__(self):
        self.allocs, self.releases = [], []

    @hookimpl
    def alloc(self, entry):
        self.allocs.append((entry.unit, entry.name))

    @hookimpl
    def release(self, entry, buffer):
        self.releases.append((entry.unit, entry.name, buffer))


@pytest.mark.parametrize("allocator", ["pool", "free"])
def test_an_observer_hears_every_alloc_and_release(tiny_ckpt, register_plugin, allocator):
    counter = register_plugin(CountAllocations(), "count-allocations")
    with Model(tiny_ckpt) as model, model.open(KestrelConfig().override(**GEN), keep=2, allocator=allocator) as r:
        result = r.generate(prompt_ids=PROMPT)
        before_close = len(counter.releases)
    c = result.counters
    assert len(counter.allocs) == c["uploads"] > 0  # one request an entry uploaded, whoever answered it
    assert before_close == c["evictions"] and len(counter.releases) == c["uploads"]  # closing releases the rest
    assert {u for u, _ in counter.allocs} == {(layer,) for layer in range(6)}
    if allocator == "pool":
        assert c["pool_hits"] > 0 and c["allocations"] < len(counter.allocs)  # it hears hits as well as real ones
    assert result.token_ids == run(tiny_ckpt, residency__keep=2).token_ids


def test_an_alloc_observer_cannot_hand_out_a_buffer(tiny_ckpt, register_plugin):
    class Answering:
        @hookimpl
        def alloc(self, entry):
            return object()

    register_plugin(Answering(), "answering")
    with pytest.raises(PluginError, match="observers return None.*--allocator"):
        run(tiny_ckpt, residency__keep=2)


def test_observers_of_one_run_are_its_own(tiny_ckpt):
    """``model.open(observers=...)``: heard by that run alone, checked as a plugin is."""
    mine = CountAllocations()
    with Model(tiny_ckpt) as model:
        with model.open(KestrelConfig().override(**GEN), keep=2, observers=[mine]) as r:
            r.generate(prompt_ids=PROMPT)
        heard = len(mine.allocs)
        with model.open(KestrelConfig().override(**GEN), keep=2) as r:
            r.generate(prompt_ids=PROMPT)
        assert heard > 0 and len(mine.allocs) == heard  # the second run does not reach it

        class Misspelt:
            @hookimpl
            def on_layer_advanse(self, window, layer, phase):
                pass

        with pytest.raises(PluginError, match="on_layer_advanse"):
            model.open(KestrelConfig(), observers=[Misspelt()])


def test_a_third_party_gate_is_registered_and_listed(register_plugin, capsys):
    from kestrel_core.cli import main

    gate = object()

    class ThirdPartyGates:
        @hookimpl
        def register_gates(self, register):
            register("always_no", gate)

    register_plugin(ThirdPartyGates(), "third-party-gates")
    assert plugins.lookup("gates", "always_no").factory is gate
    assert main(["plugins", "--json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out) if r["name"] == "always_no"]
    assert rows == [{"kind": "gate", "name": "always_no", "package": "(registered at run time)", "version": "-",
                     "plugin": "third-party-gates"}]
