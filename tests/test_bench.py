"""The bench harness (``python -m bench``): its CPU scenarios run end to end on tiny presets and leave stamped records
that keep every step's time; a GPU scenario on a machine without one says so in one line; a record is never
overwritten; the stamp file stands in for git on a tree without ``.git`` and notices a changed tree."""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from bench import stamp as stamping
from bench.__main__ import main as bench
from bench.record import write_new
from bench.rows import from_result
from bench.stats import summary

ROOT = Path(__file__).resolve().parent.parent
HEX40 = re.compile(r"[0-9a-f]{40}")
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tmp_path_factory.mktemp("bench-models")


def run_scenario(argv: list[str], out: Path) -> dict:
    """Run ``python -m bench ARGV --out OUT`` in this process; its one record."""
    assert bench([*argv, "--out", str(out)]) == 0
    records = list(out.glob("*.json"))
    assert len(records) == 1, records
    assert re.fullmatch(rf"{argv[0]}_\d{{8}}T\d{{6}}Z\.json", records[0].name)
    assert not list(out.glob("*.partial")), "a finished run leaves no partial record"
    return json.loads(records[0].read_text())


def check_stamp(rec: dict, scenario: str) -> None:
    assert rec["format"] == 2 and rec["scenario"] == scenario and rec["complete"] is True and rec["error"] is None
    st = rec["stamp"]
    known = stamping.source()
    assert (st["commit"], st["stamp_source"]) == (known["commit"], known["stamp_source"])
    if known["stamp_source"] == "none":  # a copy of the tree with neither .git nor a stamp file (CI's fresh copy)
        assert st["commit"] is None and st["dirty"] is None
    else:
        assert HEX40.fullmatch(st["commit"]) and isinstance(st["dirty"], bool)
    assert st["command"].startswith(f"python -m bench {scenario} ")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", st["date_utc"])
    m = st["machine"]
    assert m["python"] and m["torch"] == torch.__version__ and m["cpus"] >= 1
    if Path("/proc/meminfo").exists():
        assert m["mem_total_bytes"] > 0 and m["cpu_model"]


def check_steps(r: dict) -> None:
    """A row keeps every decode step's time and mode, and summarises its steady steps with p10/p50/p90."""
    assert len(r["decode_ms"]) == len(r["step_modes"]) >= 2
    s = r["summary"]
    assert set(s) >= {"n", "p10", "p50", "p90"} and s["n"] == len(r["steady_steps"]) >= 1
    assert s["p10"] <= s["p50"] <= s["p90"]
    steady = [r["decode_ms"][i] for i in r["steady_steps"]]
    assert s["p50"] == pytest.approx(sorted(steady)[len(steady) // 2] if len(steady) % 2 else
                                     sum(sorted(steady)[len(steady) // 2 - 1:len(steady) // 2 + 1]) / 2)


def test_stream_on_cpu_ref_records_every_step_and_compares_ids(models, tmp_path):
    rec = run_scenario(["stream", "--backend", "cpu_ref", "--preset", "tiny", "--tokens", "6",
                        "--models", str(models), "--peers", ""], tmp_path)
    check_stamp(rec, "stream")
    rows = rec["result"]["rows"]
    assert [r["label"] for r in rows] == ["off", "asymmetric keep=1", "pinned_set keep=4"]
    for r in rows:
        check_steps(r)
        assert len(r["decode_ms"]) == 5 and r["steady_mode"] == "eager" and r["summary"]["n"] == 4
    assert rows[1]["bytes_uploaded_per_token"] > 0 and rows[0]["bytes_uploaded_per_token"] == 0
    assert all(r["ids_match_baseline"] for r in rows[1:]), "residency changes no id"
    assert rec["options"]["tokens"] == 6 and "out" not in rec["options"]


CPU_SCENARIOS = {
    "moe": ["--backend", "cpu_ref", "--preset", "tiny-moe", "--layers", "4", "--tokens", "6", "--warmup", "2",
            "--slow-tokens", "4", "--skew", "0", "--q8-group", "0", "--peers", ""],
    "moe-host-cost": ["--backend", "cpu_ref", "--preset", "tiny-moe", "--layers", "4", "--tokens", "6", "--warmup",
                      "2", "--rounds", "1", "--profile-tokens", "3"],
    "rss-window": ["--preset", "tiny", "--tokens", "3"],
    "rss-experts": ["--preset", "tiny-moe", "--layers", "4", "--tokens", "4", "--fractions", "0.25,0.5"],
    "host-fill": ["--preset", "tiny", "--rounds", "1", "--threads", "1"],
    "expert-staging": ["--preset", "tiny-moe", "--layers", "2", "--experts", "8", "--threads", "1"],
    "keep-auto": ["--backend", "cpu_ref", "--preset", "tiny", "--budgets", "0", "--tokens", "3"],
}


def rows_of(value):
    """Every dict in a result that has decode times (a row)."""
    if isinstance(value, dict):
        if "decode_ms" in value and "step_modes" in value:
            yield value
        for v in value.values():
            yield from rows_of(v)
    elif isinstance(value, list):
        for v in value:
            yield from rows_of(v)


@pytest.mark.parametrize("scenario", sorted(CPU_SCENARIOS))
def test_a_cpu_scenario_runs_end_to_end(scenario, models, tmp_path):
    rec = run_scenario([scenario, *CPU_SCENARIOS[scenario], "--models", str(models)], tmp_path)
    check_stamp(rec, scenario)
    rows = list(rows_of(rec["result"]))
    if scenario not in ("host-fill", "expert-staging"):  # those stage bytes; they run no generate
        assert rows, f"{scenario} recorded no decode row"
    for r in rows:
        check_steps(r)


def test_demo_records_kestrel_demo(models, tmp_path):
    rec = run_scenario(["demo", "--max-new-tokens", "2", "--cache-dir", str(models / "demo-cache")], tmp_path)
    check_stamp(rec, "demo")
    result = rec["result"]
    assert result["exit_code"] == 0 and result["invariance"]["identical"] is True
    assert {r["policy"] for r in result["rows"]} >= {"asymmetric", "pinned_set", "belady"}


def test_moe_on_cpu_ref_counts_hits_and_matches_off(models, tmp_path):
    rec = run_scenario(["moe", *CPU_SCENARIOS["moe"], "--models", str(models)], tmp_path)
    rows = rec["result"]["uniform"]["rows"]
    cache = [r for r in rows if r["expert_policy"]]
    # 3 budgets x 2 policies: on the table path (misses landed, or admitted a step later), and on the host path with
    # and without a guess
    assert len(cache) == 24 and all(0 <= r["hit_rate"] <= 1 for r in cache)
    assert {r["expert_decode"] for r in cache} == {"table", "table-twice", "host"}
    assert all(r["ids_match_baseline"] for r in rows), "an expert budget changes no id"
    assert rec["result"]["targets"]["every_row_ids_match_off"] is True
    for r in cache:  # the table re-reads what its steps read from host copies; the host path reads a miss once
        table = r["expert_decode"].startswith("table")
        assert (r["bytes_reread_per_token"] <= r["bytes_read_host_per_token"]) and (table or r["bytes_read_host_per_token"] == 0)
        assert r["bytes_streamed_per_token"] == pytest.approx(r["bytes_uploaded_per_token"] + r["bytes_read_host_per_token"])
    shares = rec["result"]["targets"]["table_reread_share"]
    assert set(shares) == {r["label"] for r in cache if r["expert_decode"] != "host"} and max(shares.values()) > 0
    for r in cache:
        if r["expert_decode"] == "table-twice":  # a step reads each miss from its host copy once, its admission again
            assert r["bytes_read_host_per_token"] == pytest.approx(r["expert_misses_per_token"] * r["expert_bytes"])
            assert r["expert_landed_per_token"] == 0
        if r["expert_decode"] == "table":  # each miss crosses once: landed in a slot (an upload) or read, not admitted
            assert r["bytes_reread_per_token"] == 0 and shares[r["label"]] == 0
            assert r["bytes_streamed_per_token"] == pytest.approx(r["expert_misses_per_token"] * r["expert_bytes"])
            assert r["bytes_read_host_per_token"] == pytest.approx(
                (r["expert_misses_per_token"] - r["expert_landed_per_token"]) * r["expert_bytes"])
        if r["expert_decode"] != "host":
            assert shares[r["label"]] == pytest.approx(r["bytes_reread_per_token"] / r["bytes_streamed_per_token"])
    landing = rec["result"]["targets"]["landing"]
    assert set(landing) == {r["label"] for r in cache if r["expert_decode"] == "table"}
    assert any(r["expert_landed_per_token"] > 0 for r in cache if r["expert_decode"] == "table")
    off = rows[0]  # cpu_ref holds the bf16 file's experts in float32: each budget is doubled
    assert off["budget_widening"] == 2.0
    assert {r["expert_budget_bytes"] for r in cache} == {g * 1024 * 2 * 2**20 for g in (2, 4, 8)}  # 4 of 4 layers


def test_moe_runs_its_uniform_rows_on_a_gguf(models, tmp_path):
    rec = run_scenario(["moe", *CPU_SCENARIOS["moe"], "--gguf", "q8_0", "--decode", "table,table-twice",
                        "--models", str(models)], tmp_path)
    assert rec["result"]["gguf"] == "q8_0" and rec["result"]["weight_bytes"] > 0
    rows = rec["result"]["uniform"]["rows"]
    assert {r["expert_decode"] for r in rows if r["expert_policy"]} == {"table", "table-twice"}
    assert rec["result"]["targets"]["every_row_ids_match_off"] is True
    assert rows[0]["label"] == "uniform off" and rows[0]["token_ids"] == rows[1]["token_ids"]


@pytest.mark.parametrize("extra, said", [
    (["--skew", "1.2"], "--gguf writes random blocks: the uniform rows only; set --skew to 0 or empty"),
    (["--gguf", "Q9"], "--gguf takes a GGUF type (q4_0, q4_1, q4_k, q4_k_m, q5_0, q5_1, q5_k, q6_k, q8_0), got 'Q9'"),
])
def test_moe_on_a_gguf_refuses_what_it_cannot_run_in_one_line(models, tmp_path, capsys, extra, said):
    argv = ["moe", *CPU_SCENARIOS["moe"], "--gguf", "q8_0", *extra, "--models", str(models), "--out", str(tmp_path)]
    assert bench(argv) != 0
    err = capsys.readouterr().err.strip()
    assert said in err and len(err.splitlines()) == 1, err


def test_moe_refuses_slow_rows_of_one_token_before_any_row(tmp_path, capsys):
    """A slow row times its decode steps after the first: one token leaves none, and the run failed on that row's
    figure after every other row had run; it is refused before any checkpoint is written."""
    assert bench(["moe", *CPU_SCENARIOS["moe"], "--slow-tokens", "1", "--models", str(tmp_path / "models"),
                  "--out", str(tmp_path / "out")]) == 2
    assert "--slow-tokens must be at least 2" in capsys.readouterr().err and not (tmp_path / "models").exists()


def batch_args(*argv: str):
    from bench.__main__ import parser_for
    from bench.scenarios import module

    return parser_for("batch", module("batch")).parse_args(list(argv))


def test_batch_refuses_a_max_seq_past_the_presets_positions_before_any_row(tmp_path, capsys):
    """The server would refuse it at its start, after the server rows before it had run: refused before a checkpoint
    is written, naming the preset's positions."""
    assert bench(["batch", "--preset", "demo", "--rows", "server", "--max-seqs", "256,4096",
                  "--models", str(tmp_path / "models"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--max-seqs 4,096 is past the demo preset's 2,048 positions" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "models").exists()



def test_batch_takes_a_max_seq_of_the_presets_whole_positions(tmp_path, monkeypatch, capsys):
    """2,048 on the demo preset (its max_position_embeddings) is taken: the run goes on to write its checkpoint."""
    from bench.scenarios import batch

    def reached(*a, **k):
        raise RuntimeError("reached the checkpoint")

    monkeypatch.setattr(batch.models, "ensure_preset", reached)
    with pytest.raises(RuntimeError, match="reached the checkpoint"):
        batch.run(batch_args("--preset", "demo", "--rows", "server", "--max-seqs", "256,2048"), None)


def test_keep_auto_sets_auto_beside_every_hand_picked_keep(models, tmp_path):
    rec = run_scenario(["keep-auto", *CPU_SCENARIOS["keep-auto"], "--models", str(models)], tmp_path)
    (entry,) = rec["result"]["budgets"]
    assert entry["auto"]["choice"]["keep"] == "off" and entry["auto"]["resolved"]["keep"] == "off"  # tiny fits whole
    labels = [r["label"] for r in entry["hand"]]
    assert labels[0] == "keep=off @ 0 MiB" and "keep=1 @ 0 MiB" in labels and len(labels) == len(set(labels))
    assert all(r["ids_match_baseline"] for r in entry["hand"])  # a keep changes no id
    best = min(entry["hand"], key=lambda r: r["summary"]["p50"])
    assert entry["best_hand"] == best["label"]
    assert entry["auto_over_best"] == pytest.approx(entry["auto"]["summary"]["p50"] / best["summary"]["p50"])


def test_moe_prefill_counts_what_each_prefill_streamed_beside_off(models, tmp_path):
    from bench.scenarios.moe_prefill import prompt_of

    rec = run_scenario(["moe-prefill", "--backend", "cpu_ref", "--preset", "tiny-moe", "--layers", "3", "--prompts",
                        "16,48", "--chunks", "16,32", "--budget-mib", "0.05", "--reps", "3", "--models", str(models)],
                       tmp_path)
    check_stamp(rec, "moe-prefill")
    result = rec["result"]
    expert = 3 * 64 * 32 * 4  # a tiny-moe expert in cpu_ref's float32 buffers
    assert [p["prompt_tokens"] for p in result["prompts"]] == [16, 48] and result["expert_budget_mib"] == 0.05
    for p in result["prompts"]:
        assert len(p["off"]) == len(p["cache"]) == 3 and p["ids_equal"]
        assert p["distinct_ids"] == len(set(prompt_of(p["prompt_tokens"], 512))) > p["prompt_tokens"] // 2
        assert all(r["streamed_bytes"] == 0 for r in p["off"])  # everything resident: the preload is not counted
        # two sparse layers: what both prefill layers streamed, counted from the first
        assert all(r["streamed_bytes"] == r["expert_misses"] * expert > 0 for r in p["cache"])
        assert p["cache_p50_ms"] == statistics.median(r["prefill_ms"] for r in p["cache"])
        assert p["off_p50_ms"] == statistics.median(r["prefill_ms"] for r in p["off"])
        assert p["cache_tokens_per_s"] == pytest.approx(p["prompt_tokens"] / p["cache_p50_ms"] * 1e3)
        assert "over_bound" not in p  # no pinned rate on cpu_ref: no bound
    chunks = result["chunks"]
    assert chunks["prompt_tokens"] == 48 and [c["chunk"] for c in chunks["rows"]] == [16, 32]
    for c in chunks["rows"]:
        assert len(c["ms"]) == 3 and len(c["token_ids"]) == 1  # one id, every repetition
        assert c["p50_ms"] == statistics.median(c["ms"])


def test_moe_prefill_bound_and_id_check(models, tmp_path, monkeypatch):
    from bench.scenarios import moe_prefill

    assert moe_prefill.over_bound(30.0, 2 * 10**9, 100.0, 10.0) == pytest.approx(1.0)  # 20 ms of bytes + 10 of off
    real = moe_prefill.prefill
    cache_rows = []

    def one_cache_row_differs(model, settings, prompt):
        out = real(model, settings, prompt)
        if "expert_policy" in settings:
            cache_rows.append(out)
            if len(cache_rows) == 2:  # the second repetition's cache row: another first id
                out["token_ids"] = [out["token_ids"][0] + 1]
        return out

    monkeypatch.setattr(moe_prefill, "prefill", one_cache_row_differs)
    rec = run_scenario(["moe-prefill", "--backend", "cpu_ref", "--preset", "tiny-moe", "--layers", "2", "--prompts",
                        "16", "--chunks", "", "--budget-mib", "0.05", "--reps", "2", "--models", str(models)],
                       tmp_path)
    (p,) = rec["result"]["prompts"]
    assert p["ids_equal"] is False and "chunks" not in rec["result"]


def test_moe_prefill_runs_on_a_gguf(models, tmp_path):
    rec = run_scenario(["moe-prefill", "--backend", "cpu_ref", "--preset", "tiny-moe", "--layers", "2", "--prompts",
                        "16", "--chunks", "", "--budget-mib", "0.05", "--reps", "2", "--gguf", "q8_0", "--models",
                        str(models)], tmp_path)
    assert rec["result"]["gguf"] == "q8_0" and rec["result"]["weight_bytes"] > 0
    (p,) = rec["result"]["prompts"]
    assert p["ids_equal"] is True


def test_bench_batch_counts_what_a_moe_batch_reads_from_host_copies(models, tmp_path):
    rec = run_scenario(["batch", "--preset", "tiny-moe", "--layers", "2", "--backend", "cpu_ref", "--keep", "off",
                        "--expert-policy", "expert_lru", "--expert-budget-mib", "0.05", "--batches", "1,4",
                        "--rows", "engine", "--prompts", "4", "--tokens", "5", "--models", str(models)], tmp_path)
    rows = rec["result"]["engine"]
    assert [r["batch"] for r in rows] == [1, 4] and all(r["ids_equal_one_at_a_time"] for r in rows)
    for r in rows:  # through the expert table a step reads its misses from host copies: they cross too
        assert r["bytes_streamed"] > r["bytes_uploaded"] > 0
        assert r["streamed_per_generated_token"] == pytest.approx(r["bytes_streamed"] / r["tokens"])
    ratio = rec["result"]["bytes_per_generated_token_over_b1"]
    assert ratio["1"] == 1.0 and ratio["4"] == pytest.approx(rows[1]["streamed_per_generated_token"]
                                                             / rows[0]["streamed_per_generated_token"])


def test_bench_batch_server_rows_record_the_servers_kv_cache_from_its_metrics(models, tmp_path):
    """Each server row keeps the server's memory once warm and after the row: its resident memory, and from its
    /metrics the KV cache's bytes (cpu_ref: every slot's positions and the park row, float32) and the device's peak
    (none on cpu_ref)."""
    pytest.importorskip("openai")
    from kestrel_core.engine.kvcache import kv_bytes
    from kestrel_core.tools.presets import preset_config

    rec = run_scenario(["batch", "--preset", "tiny", "--backend", "cpu_ref", "--keep", "off", "--rows", "server",
                        "--clients", "1,2", "--tokens", "3", "--repeats", "1", "--prompts", "2",
                        "--models", str(models)], tmp_path)
    rows = rec["result"]["server"]
    assert [r["clients"] for r in rows] == [1, 2]
    for r in rows:
        want = kv_bytes(preset_config("tiny"), r["max_seq"] + 1, torch.float32, 2)
        for when in ("after_warmup", "after_row"):
            got = r["server_memory"][when]
            assert got["kv_cache_bytes"] == want and got["device_peak_bytes"] is None and got["rss_bytes"] > 0


def test_bench_batch_runs_the_engine_rows_at_each_landing_setting_in_turn(models, tmp_path, monkeypatch):
    """--expert-landing on,off: a run of each, in the order given, every B warmed first (a 4-token batch at B) and the
    record's engine rows the first run's; landing changes what crosses, never an id."""
    from kestrel_core.engine.run import Run

    calls = []
    real = Run.generate_batch

    def spy(self, reqs, max_batch=8, **kw):
        reqs = list(reqs)
        calls.append((max_batch, {r["max_new_tokens"] for r in reqs}))
        return real(self, reqs, max_batch=max_batch, **kw)

    monkeypatch.setattr(Run, "generate_batch", spy)
    rec = run_scenario(["batch", "--preset", "tiny-moe", "--backend", "cpu_ref", "--keep", "off",
                        "--expert-policy", "expert_lru", "--expert-budget-mib", "0.2", "--batches", "1,4",
                        "--rows", "engine", "--prompts", "4", "--tokens", "5", "--expert-landing", "on,off",
                        "--models", str(models)], tmp_path)
    res = rec["result"]
    assert res["expert_landing"] == ["on", "off"]
    on, off = res["engine_by_landing"]
    assert (on["expert_landing"], off["expert_landing"]) == ("on", "off") and on["rows"] == res["engine"]
    assert on["ids_equal_first"] and off["ids_equal_first"]
    assert [r["batch"] for r in off["rows"]] == [1, 4]
    # cpu_ref lands misses too: with landing on fewer bytes are uploaded than with it off
    assert on["rows"][0]["bytes_uploaded"] < off["rows"][0]["bytes_uploaded"]
    # each run: a 4-token warm-up at each B, then the timed rows of 5 tokens at each B
    assert calls == [(1, {4}), (4, {4}), (1, {5}), (4, {5})] * 2


def test_bench_batch_refuses_a_landing_setting_without_an_expert_policy(tmp_path, capsys):
    """Without an expert policy there are no misses to land: --expert-landing is refused, not ignored, before any
    checkpoint is written."""
    assert bench(["batch", "--expert-landing", "off", "--rows", "engine", "--out", str(tmp_path / "out"),
                  "--models", str(tmp_path / "models")]) == 2
    assert "give --expert-policy" in capsys.readouterr().err and not (tmp_path / "models").exists()


def test_peers_say_when_they_are_not_installed(models, tmp_path):
    rec = run_scenario(["stream", "--backend", "cpu_ref", "--preset", "tiny", "--tokens", "5", "--peers", "transformers",
                        "--models", str(models)], tmp_path)
    row = rec["result"]["peers"]["transformers"]
    try:
        import transformers  # noqa: F401
    except ImportError:
        assert "not installed" in row["error"] and "pip install transformers" in row["error"]
    else:
        assert row["summary"]["n"] >= 1 and row["ids_compared"] == 5
    assert rec["result"]["peers"]["versions"]


GPU_ONLY = [["host-tier"], ["map-register"], ["ring-copy"], ["q8-gemv"], ["stream"], ["moe"], ["moe-host-cost"],
            ["host-fill", "--dma"], ["keep-auto"], ["expert-rows"],
            ["moe-prefill"]]


@NO_GPU
@pytest.mark.parametrize("argv", GPU_ONLY, ids=lambda a: " ".join(a))
def test_a_gpu_scenario_says_so_in_one_line(argv, capsys, tmp_path):
    assert bench([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"python -m bench {argv[0]}: needs a CUDA GPU" in err
    assert not list(tmp_path.iterdir()), "no record of a run that could not start"


@NO_GPU
def test_the_command_line_says_it_without_a_traceback():
    done = subprocess.run([sys.executable, "-m", "bench", "ring-copy"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "needs a CUDA GPU" in done.stderr


def test_help_lists_every_scenario(capsys):
    from bench.scenarios import SCENARIOS

    assert bench(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(re.search(rf"^  {re.escape(name)} ", out, re.M) for name in SCENARIOS)
    assert set(SCENARIOS) >= {"stream", "moe", "moe-host-cost", "host-tier", "host-fill", "expert-staging",
                              "map-register", "ring-copy", "q8-gemv", "rss-window", "rss-experts", "demo", "plot"}


@pytest.mark.parametrize("name", ["window-overhead", "profile", "peers"])
def test_a_retired_scenario_says_so_and_what_settled_it(name, capsys, tmp_path):
    from bench.legacy import RETIRED
    from bench.scenarios import SCENARIOS

    assert name in RETIRED and name not in SCENARIOS
    assert bench([name, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{name} is retired" in err and RETIRED[name] in err
    assert not list(tmp_path.iterdir())


def test_no_bench_module_edits_sys_path():
    offenders = [p.name for p in (ROOT / "bench").rglob("*.py") if "sys.path" in p.read_text()]
    assert not offenders


# --- records ------------------------------------------------------------------------------------------------------

def test_a_record_is_never_overwritten(tmp_path):
    path = tmp_path / "stream_20261205T000000Z.json"
    write_new(path, {"n": 1})
    with pytest.raises(FileExistsError):
        write_new(path, {"n": 2})
    assert json.loads(path.read_text()) == {"n": 1}
    assert [p.name for p in tmp_path.iterdir()] == [path.name], "no temp file left behind"


def test_a_run_that_fails_leaves_an_incomplete_record_with_its_error(models, tmp_path, monkeypatch):
    from bench.scenarios import rss_window

    def failing(*args, **kw):
        raise ValueError("a row failed")

    monkeypatch.setattr(rss_window, "row", failing)
    with pytest.raises(ValueError):  # the run starts, then fails
        bench(["rss-window", "--preset", "tiny", "--keeps", "1", "--models", str(models), "--out", str(tmp_path)])
    (path,) = tmp_path.glob("rss-window_*.json")
    rec = json.loads(path.read_text())
    assert rec["complete"] is False and rec["error"].startswith("ValueError")


# --- the stamp ----------------------------------------------------------------------------------------------------

@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A git repository of three files, committed, as the tree the stamp describes."""
    if shutil.which("git") is None:
        pytest.skip("needs git")
    root = tmp_path / "tree"
    (root / "bench" / "results").mkdir(parents=True)
    (root / "a.py").write_text("a = 1\n")
    (root / "b.txt").write_text("b\n")
    (root / ".gitignore").write_text("ignored.txt\n")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    env.pop("GIT_DIR", None)
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "x"]):
        subprocess.run(["git", *cmd], cwd=root, check=True, env=env)
    monkeypatch.delenv("GIT_DIR", raising=False)
    monkeypatch.setattr(stamping, "REPO", root)
    return root


def test_git_stamps_commit_and_dirty_but_not_the_results(repo):
    s = stamping.from_git()
    assert HEX40.fullmatch(s["commit"]) and s["dirty"] is False
    (repo / "bench" / "results" / "stream_20261205T000000Z.json").write_text("{}")
    (repo / "ignored.txt").write_text("x")
    assert stamping.from_git()["dirty"] is False, "a record written, or an ignored file, is no change to the code"
    (repo / "a.py").write_text("a = 2\n")
    assert stamping.from_git()["dirty"] is True


def test_git_dir_answers_for_a_tree_copied_without_git(repo, tmp_path, monkeypatch):
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git"))
    monkeypatch.setattr(stamping, "REPO", copy)
    assert stamping.from_git() is None, "the copy has no .git (and no repository above it)"
    monkeypatch.setenv("GIT_DIR", str(repo / ".git"))
    s = stamping.from_git()
    assert s["dirty"] is False and s["git_dir"] == str(repo / ".git")


def test_the_stamp_file_stands_in_for_git_and_sees_a_changed_tree(repo, tmp_path, monkeypatch):
    saved = stamping.write_stamp_file(repo / "bench" / "results" / ".stamp.json")
    assert saved["files"] == [".gitignore", "a.py", "b.txt"]
    copy = tmp_path / "copy"  # the tree as the GPU machine gets it: no .git
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git"))
    monkeypatch.setattr(stamping, "REPO", copy)
    monkeypatch.setattr(stamping, "git", lambda *args: None)
    stamp_file = copy / "bench" / "results" / ".stamp.json"
    s = stamping.from_stamp_file(stamp_file)
    assert s["commit"] == saved["commit"] and s["dirty"] is False and s["tree_matches_stamp"] is True
    (copy / "b.txt").write_text("changed\n")
    s = stamping.from_stamp_file(stamp_file)
    assert s["dirty"] is True and s["tree_matches_stamp"] is False and s["stamp_source"] == "stamp-file"
    (copy / "b.txt").write_text("b\n")
    (copy / "a.py").unlink()
    assert stamping.from_stamp_file(stamp_file)["dirty"] is True, "a file gone is a change"


def test_a_matching_stamp_file_beats_a_git_of_another_commit(repo, tmp_path, monkeypatch):
    """A copied tree may carry a .git of another commit: the stamp file that hashed this very tree is believed."""
    saved = stamping.write_stamp_file(repo / "bench" / "results" / ".stamp.json")
    monkeypatch.setattr(stamping, "REPO", repo)
    monkeypatch.setattr(stamping, "STAMP_FILE", repo / "bench" / "results" / ".stamp.json")
    monkeypatch.setattr(stamping, "from_git", lambda: {"commit": "0" * 40, "dirty": True, "stamp_source": "git"})
    s = stamping.source()
    assert (s["commit"], s["dirty"], s["stamp_source"]) == (saved["commit"], False, "stamp-file")
    (repo / "b.txt").write_text("changed\n")  # no longer the stamped tree: git's word, whatever it is
    assert stamping.source()["stamp_source"] == "git"


def test_without_git_or_a_stamp_file_the_record_says_it_does_not_know(tmp_path, monkeypatch):
    monkeypatch.setattr(stamping, "git", lambda *args: None)
    monkeypatch.setattr(stamping, "STAMP_FILE", tmp_path / "none.json")
    monkeypatch.setattr(stamping, "from_stamp_file", lambda path=tmp_path / "none.json": None)
    assert stamping.source() == {"commit": None, "dirty": None, "stamp_source": "none"}


# --- one summary function, and a graph row's steps apart ----------------------------------------------------------

def test_summary_gives_p10_p50_p90_and_n():
    s = summary(range(1, 11))
    assert (s["n"], s["p50"], s["min"], s["max"]) == (10, 5.5, 1, 10)
    assert s["p10"] == pytest.approx(1.9) and s["p90"] == pytest.approx(9.1)
    assert summary([3.0])["p10"] == summary([3.0])["p90"] == 3.0
    assert summary([])["n"] == 0 and summary([])["p50"] is None


def test_a_graph_row_reports_replayed_steps_apart_from_the_capture():
    per = [{"bytes_uploaded": b, "layer_uploads": 1, "allocations": 0, "frees": 0} for b in (9, 9, 5, 5, 5)]
    res = types.SimpleNamespace(prompt_ids=[1], token_ids=[1] * 6, prefill_ms=50.0, decode_ms=[30.0, 40.0, 8.0, 7.0, 9.0],
                                step_modes=["eager", "captured", "replayed", "replayed", "replayed"], per_token=per,
                                counters={"peak_resident_bytes": 1}, memory={"device_peak_bytes": 2},
                                fixed_resident_bytes=0, steps={"eager": 1, "captured": 1, "replayed": 3})
    r = from_result(res, "off", {"keep": "off"}, pinned_GBps=1.0)
    assert r["steady_mode"] == "replayed" and r["summary"]["n"] == 3 and r["summary"]["p50"] == 8.0
    assert r["captured_ms"] == [40.0] and r["eager_ms"] == [30.0]
    assert r["bytes_uploaded_per_token"] == 5 and r["per_mode"]["replayed"]["max"] == 9.0
    eager = from_result(types.SimpleNamespace(**{**vars(res), "step_modes": ["eager"] * 5}), "off", {})
    assert eager["steady_mode"] == "eager" and eager["summary"]["n"] == 4 and eager["captured_ms"] == []


@pytest.mark.parametrize("argv, says", [
    (["batch", "--clients", "1,x"], "argument --clients: 'x' is not a int"),
    (["batch", "--rows", "engine,nope"], "nope: give one or more of engine, server"),
    (["batch", "--batches", "0,4"], "argument --batches: 0 is below 1"),
    (["batch", "--expert-landing", "on,maybe"], "give on or off"),
    (["stream", "--backend", "cpu_ref", "--tokens", "0"], "--tokens must be at least 1, got 0"),
    (["speculative", "--repeats", "-2"], "--repeats must be at least 1, got -2"),
    (["moe", "--backend", "cpu_ref", "--layers", "0"], "--layers must be at least 1, got 0"),
    (["moe-prefill", "--backend", "cpu_ref", "--prompts", "16,0"], "argument --prompts: 0 is below 1"),
    (["moe-prefill", "--backend", "cpu_ref", "--chunks", "x"], "argument --chunks: 'x' is not a int"),
    (["moe-prefill", "--backend", "cpu_ref", "--reps", "0"], "--reps must be at least 1, got 0"),
    (["expert-rows", "--copy-plans", "16:4096"], "'16:4096': give GROUP:BLOCK:WARPS"),
    (["expert-rows", "--copy-plans", "16:4096:4,16:3000:4"], "'16:3000:4': each at least 1, BLOCK and WARPS powers"),
    (["expert-rows", "--copy-plans", "0:4096:4"], "'0:4096:4': each at least 1"),
    (["batch", "--keep", "abc"], "argument --keep: 'abc' is not a keep; --keep takes a layer count (1 or more) or off"),
    (["batch", "--keep", "0"], "argument --keep: '0' is not a keep"),
    (["pipeline", "--keep", "-1"], "argument --keep: '-1' is not a keep"),
    (["rss-window", "--keeps", "abc"], "argument --keeps: 'abc' is not a keep; --keeps takes a layer count"),
    (["rss-window", "--keeps", ","], "argument --keeps: no keeps"),
    (["real-model", "--keep", "1,auto"], "argument --keep: 'auto' is not a keep"),
    (["rss-window", "--tokens", str(10**21)], "--tokens must be at most 2**40, got 1000000000000000000000"),
    (["batch", "--tokens", str(2**40 + 1)], f"--tokens must be at most 2**40, got {2**40 + 1}"),
])
def test_a_bad_option_is_one_line_before_any_work(argv, says, capsys, tmp_path):
    """Counts below one and comma-separated values are refused as argparse refuses, before a checkpoint is written or a
    row runs, and no record is left (a record of rows of nothing would read as complete)."""
    with pytest.raises(SystemExit) as exc:
        bench([*argv, "--out", str(tmp_path), "--models", str(tmp_path / "models")]
              if argv[0] in ("batch", "stream", "moe", "rss-window") else [*argv, "--out", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())


def test_bench_demo_whose_kestrel_demo_fails_says_kestrels_line_alone(capsys, tmp_path):
    """kestrel demo refuses a --cache-dir under a file in its one line; the bench adds none (no JSON to read, no
    traceback), and its record says the run stopped."""
    (tmp_path / "file").write_text("x")
    assert bench(["demo", "--cache-dir", str(tmp_path / "file" / "sub"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kestrel: error: cannot write ") and err.count("\n") == 1, err
    (record,) = (tmp_path / "out").iterdir()
    rec = json.loads(record.read_text())
    assert rec["complete"] is False and "exited with code 2" in rec["error"]


def test_a_count_whose_zero_means_something_takes_it():
    from bench.__main__ import below_one, parser_for
    from bench.scenarios import module

    p = parser_for("moe", module("moe"))
    assert below_one(p, p.parse_args(["--warmup", "0", "--q8-group", "0"])) is None
    assert below_one(p, p.parse_args(["--tokens", "0"])) == "--tokens must be at least 1, got 0"


def test_a_signal_while_a_record_is_written_acts_after_it_and_leaves_no_temp_file(tmp_path, monkeypatch):
    """A timeout's SIGTERM (raised by ``python -m bench`` as an interrupt) in the middle of writing a record: the record
    is written whole, then the interrupt acts; no temp file of it is left in the results."""
    import signal

    from bench import record
    from kestrel_core.io import newfile

    real = newfile.write_text_new

    def interrupted(path, text, flag, suffix=None):
        signal.raise_signal(signal.SIGTERM)  # arrives while the record is being written
        return real(path, text, flag, suffix)

    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    monkeypatch.setattr(newfile, "write_text_new", interrupted)
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        with pytest.raises(KeyboardInterrupt):
            record.write_new(tmp_path / "r.json", {"rows": [1, 2]})
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert json.loads((tmp_path / "r.json").read_text()) == {"rows": [1, 2]}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
    with pytest.raises(FileExistsError, match="a record is never overwritten"):
        record.write_new(tmp_path / "r.json", {"rows": []})
