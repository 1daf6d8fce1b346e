"""The decode step's graph path, on the CPU: when a step repeats, the capture and the fallback.

``Replaying`` is cpu_ref with a capture that keeps the step and replays it by running it again,
with the same plans into the same buffers: what a CUDA graph does, minus the device. The
CUDA graphs themselves are tested in test_graphs_cuda.py.
"""

from __future__ import annotations

import json

import pytest

from backends.cpu_ref.backend import CpuRefBackend
from cli_helpers import fails, gen
from kestrel_core.hookspecs import hookimpl
from kestrel_core.plan import Advice

from conftest import PROMPT, run_once


class Replaying(CpuRefBackend):
    name = "replaying"
    captures = True
    log: list[str] = []

    def capture(self, step, plans):
        self.log.append("capture")
        return step

    def replay(self, graph):
        self.log.append("replay")
        graph()


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
