"""Routing traces: kestrel generate --trace records them, kestrel replay runs expert policies over them offline."""

from __future__ import annotations

import json

import pytest

from cli_helpers import fails
from kestrel_core.tools import traces
from kestrel_core.cli import main
from kestrel_core.tools.presets import preset_config, write_checkpoint
from plugins.experts import ExpertLFU, ExpertLRU

from conftest import run_once

EXPERT_MB = 3 * 32 * 64 * 4 / 2**20  # one tiny-moe expert in cpu_ref's float32 layout


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return write_checkpoint(preset_config("tiny-moe"), tmp_path_factory.mktemp("traces") / "tiny-moe")


@pytest.fixture
def trace(tiny_moe, tmp_path, capsys):
    path = tmp_path / "trace.json"
    argv = ["generate", "--model", str(tiny_moe), "--prompt-ids", "5,17,42,99,3", "--max-new-tokens", "16",
            "--ignore-eos", "--trace", str(path)]
    assert main(argv) == 0
    capsys.readouterr()
    return path


def test_a_trace_holds_every_decision_point(trace):
    raw = json.loads(trace.read_text())
    assert raw["format"] == "kestrel-expert-trace" and raw["model"]["sparse_layers"] == [1, 2, 3]
    events = raw["events"]
    assert len(events) == 3 * 16  # the prefill and 15 decode steps, three sparse layers each
    assert all(len(e["experts"]) == 2 for e in events if e["phase"] == "decode")
    assert {e["phase"] for e in events[:3]} == {"prefill"}


@pytest.mark.parametrize("policy", ["expert_lru", "expert_lfu"])
@pytest.mark.parametrize("experts", [2, 4, 8])
def test_a_replay_counts_what_the_live_run_counted(tiny_moe, trace, policy, experts):
    """Routing does not depend on residency, so the offline replay sees the live run's decision points."""
    budget_mb = experts * EXPERT_MB
    live, _ = run_once(tiny_moe, prompt=[5, 17, 42, 99, 3], generation__max_new_tokens=16,
                       residency__expert_policy=policy, residency__expert_budget_mb=budget_mb)
    t = traces.read_trace(trace)
    cls = {"expert_lru": ExpertLRU, "expert_lfu": ExpertLFU}[policy]
    got = traces.replay(t, cls(budget=int(budget_mb * 2**20)))
    assert (got["hits"], got["misses"]) == (live.counters["expert_hits"], live.counters["expert_misses"])
    assert (got["bytes_read_host"], got["bytes_reread"]) == (live.counters["bytes_read_host"],
                                                              live.counters["bytes_reread"])


def test_the_offline_optimum_fetches_no_more_than_any_policy(trace):
    """Where every miss is admitted. (Where steps land their misses, the ring's room decides which are, so the
    optimum's eviction order is no longer a bound.)"""
    t = traces.read_trace(trace)
    assert t["model"]["landing"]
    t["model"]["landing"] = False
    for experts in (2, 3, 5, 8, 12):
        budget = int(experts * EXPERT_MB * 2**20)
        best = traces.replay(t, traces.ExpertBelady(budget, t["events"]))["bytes_fetched"]
        for cls in (ExpertLRU, ExpertLFU):
            assert best <= traces.replay(t, cls(budget=budget))["bytes_fetched"], (experts, cls.name)


def test_replay_prints_the_policy_against_the_optimum(trace, capsys):
    assert main(["replay", "--trace", str(trace), "--policy", "expert_lfu", "--expert-budget-mb", str(4 * EXPERT_MB)]) == 0
    out = capsys.readouterr().out
    assert "48 decision points, 15 decoded tokens" in out and "expert_lfu " in out and "expert_belady" in out
    assert "read by steps from host copies, of which" in out  # the trace's steps read the expert table
    assert main(["replay", "--trace", str(trace), "--policy", "expert_lru", "--expert-budget-mb", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["policy"] for r in rows] == ["expert_lru", "expert_belady"] and rows[0]["hit_rate"] > 0


def test_a_trace_never_replaces_a_file(tiny_moe, trace, capsys):
    before = trace.read_bytes()
    fails(["generate", "--model", str(tiny_moe), "--prompt-ids", "1,2", "--trace", str(trace)], capsys,
          "already exists; name a new file")
    assert trace.read_bytes() == before
    fails(["generate", "--model", str(tiny_moe), "--prompt-ids", "1,2", "--trace", str(trace.parent / "no" / "t.json")],
          capsys, "does not exist")


def test_a_dense_model_has_nothing_to_trace(tiny_ckpt, tmp_path, capsys):
    fails(["generate", "--model", str(tiny_ckpt), "--prompt-ids", "1,2", "--trace", str(tmp_path / "t.json")], capsys,
          "has no experts")
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("content, needle", [
    ("{", "not valid JSON"),
    ('{"format": "other"}', "not a kestrel expert trace"),
    ('{"format": "kestrel-expert-trace", "version": 9}', "trace version 9"),
    ('{"format": "kestrel-expert-trace", "version": 1, "model": {}}', "malformed"),
])
def test_a_bad_trace_is_one_line(tmp_path, capsys, content, needle):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    fails(["replay", "--trace", str(bad), "--policy", "expert_lru", "--expert-budget-mb", "1"], capsys, needle)


def test_replay_checks_its_budget_and_policy(trace, capsys):
    fails(["replay", "--trace", str(trace), "--policy", "expert_lru", "--expert-budget-mb", "0.01"], capsys,
          "below one token's routed experts")
    fails(["replay", "--trace", str(trace), "--policy", "lru", "--expert-budget-mb", "1"], capsys,
          "unknown expert policy 'lru'")


def test_replay_needs_a_budget_above_zero(trace, capsys):
    fails(["replay", "--trace", str(trace), "--policy", "expert_lru", "--expert-budget-mb", "0"], capsys,
          "--expert-budget-mb must be above 0, got 0")
