"""The decode step's graph path, on the CPU: when a step repeats, the capture and the fallback.

``Replaying`` is cpu_ref with a capture that records the step as a CUDA graph does: every tensor
operation it ran, with the tensors it read and wrote (``Tape``). A replay runs those operations
again on the same tensors, writing each result into the memory the capture's result held, and
runs no Python of the step: no planning, no plan execution, nothing read from the host. A value
the step took from the host while capturing stays what it was then, and a step that reads a
tensor's value on the host cannot be captured at all. The CUDA graphs themselves are tested in
test_graphs_cuda.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from backends.cpu_ref.backend import CpuRefBackend
from cli_helpers import fails, gen
from kestrel_core import load
from kestrel_core.hookspecs import hookimpl
from kestrel_core.engine import model as model_math
from kestrel_core.engine.plan import Advice

from conftest import PROMPT, run_once


class Tape(TorchDispatchMode):
    """Every aten operation run under it, with its arguments and its outputs (a CUDA graph's kernels, on the CPU)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []
        self.ran = False  # the capture ran the step: the replay that follows a capture is that run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:  # .item(), .tolist(), bool(t): a host read
            raise RuntimeError("the step reads a tensor's value on the host, which a graph cannot hold")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out

    def replay(self) -> None:
        if self.ran:  # a CUDA capture runs nothing and its first replay runs the step; here the capture ran it
            self.ran = False
            return
        for func, args, kwargs, out in self.ops:
            fresh = func(*args, **kwargs)
            for old, new in zip(tree_flatten(out)[0], tree_flatten(fresh)[0]):
                if isinstance(old, torch.Tensor) and not _same_memory(old, new):
                    old.copy_(new)  # as a graph's replay overwrites the memory its capture's result held


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.storage_offset() == b.storage_offset()
            and a.shape == b.shape and a.stride() == b.stride())


class Replaying(CpuRefBackend):
    name = "replaying"
    captures = True
    log: list[str] = []

    def capture(self, step, plans):
        self.log.append("capture")
        tape = Tape()
        try:
            with tape:
                step()
        except RuntimeError:
            return None  # as cuda's capture: the step runs eagerly instead
        tape.ran = True
        return tape

    def replay(self, graph):
        self.log.append("replay")
        graph.replay()


class ReplayingPlugin:
    @hookimpl
    def register_backends(self, register):
        register("replaying", Replaying)


@pytest.fixture
def replaying(register_plugin):
    register_plugin(ReplayingPlugin(), "replaying-backend")
    Replaying.log = []
    return Replaying


def both(model_dir, **flags):
    """(graphs auto, graphs off) on the replaying backend."""
    auto, _ = run_once(model_dir, "replaying", **flags)
    off, _ = run_once(model_dir, "replaying", backend__graphs="off", **flags)
    return auto, off


@pytest.mark.parametrize("policy, keep", [("asymmetric", "off"), ("asymmetric", 2), ("asymmetric", 1),
                                          ("pinned_set", 2), ("future_evicting", 3), ("asymmetric", 6)])
def test_a_repeating_step_is_captured_once_then_replayed(tiny_ckpt, replaying, policy, keep):
    auto, off = both(tiny_ckpt, residency__policy=policy, residency__keep=keep, generation__max_new_tokens=10)
    assert auto.token_ids == off.token_ids
    assert auto.per_token == off.per_token and auto.counters == off.counters  # planning is the same either way
    assert off.steps == {"eager": 9, "captured": 0, "replayed": 0}
    assert auto.steps["captured"] == 1 and auto.steps["replayed"] >= 6, auto.steps
    assert sum(auto.steps.values()) == 9
    assert all(p["layer_uploads"] > 0 for p in auto.per_token) == (keep not in ("off", 6))  # replays stream too


def test_cpu_ref_runs_every_step_eagerly(tiny_ckpt):
    result, _ = run_once(tiny_ckpt, residency__keep=2, generation__max_new_tokens=8)
    assert result.steps == {"eager": 7, "captured": 0, "replayed": 0}


def test_fresh_buffers_are_never_replayed(tiny_ckpt, replaying):
    """The free allocator makes new buffers every token: no step repeats, and no token is planned ahead."""
    auto, off = both(tiny_ckpt, residency__keep=2, residency__allocator="free")
    assert auto.token_ids == off.token_ids
    assert auto.steps["eager"] == 5 and replaying.log == []


def test_a_window_that_never_repeats_runs_eagerly(tiny_ckpt, replaying):
    auto, off = both(tiny_ckpt, residency__policy="belady", residency__keep=3, generation__max_new_tokens=8)
    assert auto.token_ids == off.token_ids
    assert auto.steps == {"eager": 7, "captured": 0, "replayed": 0}


class EvictEveryFourth:
    """An observer that, every fourth token, evicts layer 1 at layer 3's boundary: that token's plan and
    the next one's (layer 1 comes back) differ from the steady state, which then returns."""

    def __init__(self):
        self.seen = 0

    @hookimpl
    def on_layer_advance(self, window, layer, phase):
        self.seen += phase == "decode"
        if phase == "decode" and layer == 3 and window.token % 4 == 0:
            return Advice(evict=[1])
        return None


def test_a_step_whose_plan_changes_runs_eagerly_then_the_graph_resumes(tiny_ckpt, replaying, register_plugin):
    plain, _ = run_once(tiny_ckpt, "replaying", residency__keep=6, generation__max_new_tokens=14)
    observer = register_plugin(EvictEveryFourth(), "every-fourth")
    auto, off = both(tiny_ckpt, residency__keep=6, generation__max_new_tokens=14)
    assert auto.token_ids == off.token_ids == plain.token_ids  # residency changes no result
    assert auto.per_token == off.per_token
    assert [p["layer_uploads"] for p in auto.per_token] == [0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1]
    # Tokens 4, 8 and 12 plan an eviction and the next ones a fetch: those run eagerly. The pool hands
    # layer 1 its old buffer back, so the steady state is the captured one again, and replays resume.
    assert auto.steps == {"eager": 7, "captured": 1, "replayed": 5}
    assert observer.seen == 2 * 13 * 6  # both runs, every decode boundary, replayed or not


class StreamLastFromToken5:
    """From token 5 on, evict layer 5 at layer 0's boundary: a new steady state, one upload a token."""

    @hookimpl
    def on_layer_advance(self, window, layer, phase):
        if phase == "decode" and layer == 0 and window.token >= 5:
            return Advice(evict=[5])
        return None


def test_a_new_repeating_plan_is_captured_anew(tiny_ckpt, replaying, register_plugin):
    plain, _ = run_once(tiny_ckpt, "replaying", residency__keep=6, generation__max_new_tokens=12)
    register_plugin(StreamLastFromToken5(), "stream-last")
    replaying.log.clear()
    auto, off = both(tiny_ckpt, residency__keep=6, generation__max_new_tokens=12)
    assert auto.token_ids == off.token_ids == plain.token_ids
    assert [p["layer_uploads"] for p in auto.per_token] == [0] * 4 + [1] * 7
    assert auto.steps == {"eager": 2, "captured": 2, "replayed": 7}, auto.steps
    assert replaying.log.count("capture") == 2


def test_end_of_sequence_a_step_late_drops_the_extra_step(tiny_copy, replaying):
    """Greedy steps are read a step late: the step launched past EOS leaves no trace in the result."""
    first, _ = run_once(tiny_copy, "replaying", residency__keep=2, generation__max_new_tokens=10)
    at = next(i for i in range(3, 10) if first.token_ids[i] not in first.token_ids[:i])  # a replayed step's token
    eos = first.token_ids[at]
    config = json.loads((tiny_copy / "config.json").read_text())
    config["eos_token_id"] = eos
    (tiny_copy / "config.json").write_text(json.dumps(config))
    replaying.log.clear()
    auto, off = both(tiny_copy, residency__keep=2, generation__max_new_tokens=10, generation__stop_at_eos=True)
    assert auto.token_ids == off.token_ids == first.token_ids[: at + 1]
    assert auto.counters == off.counters and auto.per_token == off.per_token
    assert len(auto.decode_ms) == at and sum(auto.steps.values()) == at and auto.steps["replayed"] >= 1
    assert replaying.log.count("replay") == auto.steps["replayed"] + auto.steps["captured"] + 1  # one step past EOS ran


def test_sampling_draws_the_same_ids_replayed(tiny_ckpt, replaying):
    auto, off = both(tiny_ckpt, residency__keep=2, generation__temperature=0.9, generation__seed=7,
                     generation__max_new_tokens=10)
    assert auto.token_ids == off.token_ids
    assert auto.steps["replayed"] >= 6


def test_logits_are_kept_for_replayed_steps(tiny_ckpt, replaying):
    auto, _ = run_once(tiny_ckpt, "replaying", keep_logits=True, residency__keep=2)
    off, _ = run_once(tiny_ckpt, "replaying", keep_logits=True, residency__keep=2, backend__graphs="off")
    assert auto.steps["replayed"] >= 3
    assert len(auto.logits) == len(auto.token_ids) == 6
    assert all((a == b).all() for a, b in zip(auto.logits, off.logits))


def test_graphs_must_be_auto_or_off(tiny_ckpt, tmp_path, capsys):
    fails(gen(tiny_ckpt, "--graphs", "on"), capsys, "graphs must be one of auto, off, got 'on'")
    toml = tmp_path / "kestrel.toml"
    toml.write_text('[backend]\ngraphs = "always"\n')
    fails(gen(tiny_ckpt, "--config", str(toml)), capsys, "graphs must be one of auto, off")


def test_generate_says_how_the_steps_ran(tiny_ckpt, replaying, capsys):
    from kestrel_core.cli import main

    assert main(["generate", "--model", str(tiny_ckpt), "--backend", "replaying", "--keep", "2",
                 "--max-new-tokens", "8", "--ignore-eos", "--prompt-ids", ",".join(map(str, PROMPT))]) == 0
    out = capsys.readouterr().out
    assert "graphs=auto" in out
    assert "decode steps: 6 from a captured graph (1 captured), 1 eager" in out


class SwapLayers4And5:
    """At token 5: evict layers 4 and 5 at layer 0's boundary, and prefetch 5 before 4 at layer 3's, so the pool
    hands layer 5 the buffers layer 4 had and layer 4 those of layer 5. The plans then repeat again."""

    @hookimpl
    def on_layer_advance(self, window, layer, phase):
        if phase == "decode" and window.token == 5 and layer == 0:
            return Advice(evict=[4, 5])
        if phase == "decode" and window.token == 5 and layer == 3:
            return Advice(prefetch=[5, 4])
        return None


def test_a_stale_graph_fails_the_id_test(tiny_ckpt, replaying, register_plugin, monkeypatch):
    """After the swap every plan is idle again, as before it, yet layers 4 and 5 read each other's old buffers: the
    graph captured before the swap is stale. Keyed on the plans alone (the window's notes without the buffers each
    layer reads), it is replayed, reads layer 5's weights as layer 4's, and the stand-in's ids say so."""
    from kestrel_core.engine.residency import Window

    register_plugin(SwapLayers4And5(), "swap")
    auto, off = both(tiny_ckpt, residency__keep=6, generation__max_new_tokens=12)
    assert auto.token_ids == off.token_ids
    assert auto.step_modes[3:7] == ["replayed", "eager", "eager", "captured"]  # the swap, then a new graph

    def plans_only(self, plan, reads):
        self.signatures.append(plan.signature if plan.evict or plan.fetch else plan.layer)

    monkeypatch.setattr(Window, "_note", plans_only)
    stale, _ = run_once(tiny_ckpt, "replaying", residency__keep=6, generation__max_new_tokens=12)
    assert stale.step_modes[4:6] == ["eager", "replayed"]  # the old graph, replayed right after the swap
    assert stale.token_ids[:6] == off.token_ids[:6] and stale.token_ids != off.token_ids


def test_a_step_whose_key_bound_grew_is_captured_anew(tiny_ckpt, replaying, monkeypatch):
    """A captured step bakes in how many keys its attention reads (``key_bound``): with the floor at 1 the bound grows
    8, 16, 32, 45 over 40 tokens, and each bound's steps are captured once (a replay of a smaller bound's graph would
    drop keys), giving the ids and logits of a run whose every step reads the whole cache."""
    def generate(floor: int):
        monkeypatch.setattr(model_math, "BOUND_FLOOR", floor)
        with load(tiny_ckpt) as model, model.open(backend="replaying", dtype="float32") as run:
            return run.generate(prompt_ids=[5, 17, 42, 99, 3], max_new_tokens=40, stop_at_eos=False, keep_logits=True)

    whole, bounded = generate(1 << 20), generate(1)
    assert bounded.token_ids == whole.token_ids
    torch.testing.assert_close(torch.stack(bounded.logits), torch.stack(whole.logits), rtol=1e-5, atol=1e-5)
    assert whole.step_modes.count("captured") == 1
    assert bounded.step_modes.count("captured") == 4, bounded.step_modes
