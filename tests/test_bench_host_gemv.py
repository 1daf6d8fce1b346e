"""bench host-gemv's gate for computing a missed expert on the host (``expert_gate``): its arithmetic on rows of
known times, and a small run on this CPU with the link rate given."""

from __future__ import annotations

import pytest

from backends.cpu_ref import host_gguf
from bench.scenarios import host_gemv
from tests.test_bench import run_scenario


def row(qtype, isa, n, k, ms, stored):
    return {"type": qtype, "isa": isa, "m": 1, "n": n, "k": k, "stored_bytes": stored, "summary": {"p50": ms}}


def test_the_gate_bounds_the_miss_phase_by_one_plus_link_over_host():
    rows = [row("Q4_K", "avx2", 768, 2048, 0.1, 884_736), row("Q4_K", "avx2", 2048, 768, 0.2, 884_736),
            row("Q4_K", "avx2", 768, 2048, 0.5, 884_736) | {"m": 8}]  # an M = 8 row is not the expert's time
    gate = host_gemv.expert_gate(rows, link_gbps=50.0, measured=False)
    (r,) = gate["rows"]
    nbytes = 3 * 884_736
    link_us = nbytes / 50.0 / 1e3
    host_us = (2 * 0.1 + 0.2) * 1e3 + (2048 * 6) / 50.0 / 1e3  # gate, up, down, and the rows crossing
    assert r["expert_bytes"] == nbytes and r["link_us"] == pytest.approx(link_us, abs=0.01)
    assert r["host_us"] == pytest.approx(host_us, abs=0.01)
    assert r["miss_phase_speedup_bound"] == pytest.approx(1 + link_us / host_us, abs=1e-4)
    assert gate["link_GBps"] == 50.0 and gate["link_measured_here"] is False
    # a type whose expert shapes did not run has no row
    assert host_gemv.expert_gate(rows[:1], link_gbps=50.0, measured=False)["rows"] == []


@pytest.mark.skipif(host_gguf.usable() is not None, reason=host_gguf.usable() or "")
def test_a_run_with_the_link_given_records_the_gate(tmp_path):
    rec = run_scenario(["host-gemv", "--types", "Q4_K", "--shapes", "qwen3-30b-a3b", "--rows", "1", "--reps", "3",
                        "--rotate-mib", "8", "--link-gbps", "55.3"], tmp_path)
    gate = rec["result"]["expert_gate"]
    (r,) = gate["rows"]
    assert gate["link_GBps"] == 55.3 and r["type"] == "Q4_K" and r["host_us"] > 0
    assert r["miss_phase_speedup_bound"] == pytest.approx(1 + r["link_us"] / r["host_us"], abs=1e-3)


@pytest.mark.skipif(host_gguf.usable() is not None, reason=host_gguf.usable() or "")
@pytest.mark.parametrize("bad", ["-1", "nan", "inf"])
def test_a_bad_link_rate_is_refused_in_one_line(tmp_path, capsys, bad):
    from bench.__main__ import main as bench

    assert bench(["host-gemv", "--types", "Q4_K", "--link-gbps", bad, "--out", str(tmp_path)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert any(line.count("--link-gbps: a GB/s of 0 (none) or more") for line in err), err
