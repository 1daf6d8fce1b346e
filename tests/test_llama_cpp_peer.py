"""The bench's llama.cpp peer (bench/llama_cpp.py): llama-bench's and llama-batched-bench's output read as rows, kestrel's
rows paired with them, and ``stream --llama-cpp`` end to end on cpu_ref. The programs here are two small scripts that
print what llama.cpp's print (their formats copied from a real build's output) and note the file they were given: the
bench's side of the comparison is under test, not llama.cpp."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench import llama_cpp
from bench.errors import BenchError
from tests.test_bench import models, run_scenario  # noqa: F401 - models: the fixture

# llama-bench -o json: one test a phase (trimmed to the fields read; the real output has about 45)
BENCH_JSON = [
    {"build_commit": "0c1e570", "gpu_info": "", "model_type": "qwen3 ?B Q4_K - Medium", "model_size": 4225024,
     "n_gpu_layers": 99, "n_prompt": 16, "n_gen": 0, "avg_ts": 364.6, "samples_ns": [111084254, 27341799],
     "samples_ts": [144.035, 585.185]},
    {"build_commit": "0c1e570", "gpu_info": "", "model_type": "qwen3 ?B Q4_K - Medium", "model_size": 4225024,
     "n_gpu_layers": 99, "n_prompt": 0, "n_gen": 8, "avg_ts": 2881.9, "samples_ns": [2775988, 2776000, 2780000],
     "samples_ts": [2881.9, 2800.0, 2990.5]},
]
# llama-batched-bench --output-format jsonl: a header line of its own, then a row a batch
BATCHED_LINE = ('{"n_kv_max": 1024, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 0, "is_pp_shared": 0, '
                '"n_gpu_layers": 99, "n_threads": 2, "n_threads_batch": 2, "pp": 32, "tg": 16, "pl": %d, "n_kv": 48, '
                '"t_pp": 0.008349, "speed_pp": 3832.794434, "t_tg": 0.008328, "speed_tg": %f, "t": 0.016677, '
                '"speed": 2878.215576}')


def test_llama_bench_json_gives_a_row_a_phase_at_its_samples_median():
    text = "main: loading\n" + json.dumps(BENCH_JSON) + "\nllama_perf: done\n"
    rows = llama_cpp.parse_bench(text)
    assert [(r["phase"], r["rows"]) for r in rows] == [("prefill", 1), ("decode", 1)]
    assert rows[0]["tokens_per_s"] == pytest.approx((144.035 + 585.185) / 2)
    assert rows[1]["tokens_per_s"] == 2881.9 and rows[1]["samples_ts"] == [2881.9, 2800.0, 2990.5]


@pytest.mark.parametrize("text, why", [("no json here", "no JSON list"), ("[]", "no JSON list"),
                                        ('[{"n_prompt": 5}]', "lacks"),
                                        ('[{"n_prompt": 5, "n_gen": 5, "samples_ts": [1.0]}]', "no prefill-only")])
def test_llama_bench_output_it_cannot_read_is_one_line(text, why):
    with pytest.raises(BenchError, match=why):
        llama_cpp.parse_bench(text)


def test_batched_bench_lines_give_s_tg_a_batch():
    text = "\n".join(["main: n_kv_max = 1024", BATCHED_LINE % (1, 1921.2), "noise {", BATCHED_LINE % (8, 9000.5)])
    rows = llama_cpp.parse_batched(text)
    assert [(r["rows"], r["tokens_per_s"]) for r in rows] == [(1, pytest.approx(1921.2)), (8, pytest.approx(9000.5))]
    with pytest.raises(BenchError, match="no JSON rows"):
        llama_cpp.parse_batched("main: nothing")
    with pytest.raises(BenchError, match="not its JSON row"):
        llama_cpp.parse_batched('{"speed_tg": 1, broken')


def test_versus_pairs_each_phase_and_batch_with_its_target():
    ours = [{"phase": "decode", "rows": 1, "tokens_per_s": 250.0}, {"phase": "decode", "rows": 8, "tokens_per_s": 900.0},
            {"phase": "prefill", "rows": 1, "tokens_per_s": 5000.0}, {"phase": "decode", "rows": 64, "tokens_per_s": 1.0}]
    peer = [{"program": "llama-bench", "phase": "decode", "rows": 1, "tokens_per_s": 200.0},
            {"program": "llama-bench", "phase": "prefill", "rows": 1, "tokens_per_s": 6000.0},
            {"program": "llama-batched-bench", "phase": "decode", "rows": 1, "tokens_per_s": 199.0},
            {"program": "llama-batched-bench", "phase": "decode", "rows": 8, "tokens_per_s": 1000.0}]
    rows = llama_cpp.versus(ours, peer, shape="qwen3-8b", file_type="Q4_K_M", card="X")
    got = {(r["phase"], r["rows"]): r for r in rows}
    assert set(got) == {("decode", 1), ("decode", 8), ("prefill", 1)}  # B=64 has no twin: no row
    assert got["decode", 1]["ratio"] == 1.25 and got["decode", 1]["met"] and got["decode", 1]["target"] == 1.25
    assert got["decode", 1]["llama_cpp_program"] == "llama-bench"  # batch 1 against llama-bench's tg, not batched's
    assert got["decode", 8]["ratio"] == 0.9 and not got["decode", 8]["met"] and got["decode", 8]["target"] == 1.2
    assert got["prefill", 1]["target"] == 1.0 and not got["prefill", 1]["met"]
    assert all(set(r) >= {"shape", "file_type", "rows", "phase", "kestrel_tokens_per_s", "llama_cpp_tokens_per_s",
                          "ratio", "card"} for r in rows)


def fake_programs(folder: Path) -> Path:
    """llama-bench and llama-batched-bench as scripts printing llama.cpp's formats at the lengths asked, each noting its
    arguments in ARGS.<program> beside it."""
    folder.mkdir()
    bench = f'''#!{sys.executable}
import json, sys
a = sys.argv[1:]
open({str(folder / "ARGS.llama-bench")!r}, "w").write(json.dumps(a))
p, n = int(a[a.index("-p") + 1]), int(a[a.index("-n") + 1])
tests = {json.dumps(BENCH_JSON)}
tests[0]["n_prompt"], tests[1]["n_gen"] = p, n
print("load_backend: loaded CPU backend")
print(json.dumps(tests))
'''
    batched = f'''#!{sys.executable}
import json, sys
a = sys.argv[1:]
open({str(folder / "ARGS.llama-batched-bench")!r}, "w").write(json.dumps(a))
print("main: n_kv_max = 1024")
for b in a[a.index("-npl") + 1].split(","):
    print({BATCHED_LINE!r} % (int(b), 1000.0 * int(b)))
'''
    for name, text in (("llama-bench", bench), ("llama-batched-bench", batched)):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


def test_stream_sets_kestrels_gguf_rows_beside_the_peers_on_the_same_file(models, tmp_path):
    bins = fake_programs(tmp_path / "bin")
    rec = run_scenario(["stream", "--backend", "cpu_ref", "--preset", "tiny", "--tokens", "4", "--models", str(models),
                        "--gguf", "q4_k_m", "--rows", "none", "--llama-cpp", str(bins), "--llama-cpp-batches", "1,2",
                        "--llama-cpp-lengths", "16:8:32", "--layer-ops", "torch"], tmp_path)
    res = rec["result"]
    gguf_path = res["gguf"]["path"]
    for program in llama_cpp.PROGRAMS:  # the very file kestrel ran, at the lengths asked
        args = json.loads((bins / f"ARGS.{program}").read_text())
        assert args[args.index("-m") + 1] == gguf_path and args[args.index("-ngl") + 1] == "99"
    bench_args = json.loads((bins / "ARGS.llama-bench").read_text())
    assert bench_args[bench_args.index("-p") + 1] == "32" and bench_args[bench_args.index("-n") + 1] == "8"
    batched_args = json.loads((bins / "ARGS.llama-batched-bench").read_text())
    assert batched_args[batched_args.index("-npl") + 1] == "1,2"
    assert "rows" not in res  # --rows none: no bf16 rows
    labels = [r["label"] for r in res["gguf"]["rows"]]
    assert labels[:2] == ["q4_k_m off", "q4_k_m off, layer_ops torch"]  # --layer-ops: another off row, beside off
    ours = {(r["phase"], r["rows"]): r for r in res["gguf"]["llama_cpp"]["kestrel"]}
    assert set(ours) == {("decode", 1), ("decode", 2), ("prefill", 1)}
    assert ours["decode", 2]["first_ids_equal_solo"] and len(ours["decode", 1]["step_ms"]) >= 5
    assert ours["prefill", 1]["n_prompt"] == 32 and len(ours["prefill", 1]["prefill_ms"]) == 3
    # the layer ops they ran: the default setting, torch's ops on cpu_ref (the fused ones are cuda's)
    assert {(r["layer_ops"], r["layer_ops_ran"]) for r in ours.values()} == {("auto", "torch")}
    vs = {(r["phase"], r["rows"]): r for r in res["vs_llama_cpp"]}
    assert set(vs) == set(ours)
    assert vs["decode", 2]["llama_cpp_tokens_per_s"] == 2000.0
    assert vs["decode", 2]["ratio"] == pytest.approx(ours["decode", 2]["tokens_per_s"] / 2000.0)
    assert vs["decode", 1]["llama_cpp_tokens_per_s"] == 2881.9  # llama-bench's tg median, not batched's B=1
    assert all(r["file_type"] == "Q4_K_M" and r["card"].startswith("CPU") for r in vs.values())
    assert all(r["kestrel_kernels"] == "auto" for r in vs.values())  # the default: kestrel as a user runs it


@pytest.mark.parametrize("argv, why", [
    (["--llama-cpp", "/nonexistent"], "--gguf TYPE too"),
    (["--gguf", "q4_k_m", "--llama-cpp", "/nonexistent"], "no executable llama-bench or llama-batched-bench"),
    (["--gguf", "q4_k_m", "--llama-cpp", "/x", "--llama-cpp-batches", "8,64"], "batches from 1"),
    (["--gguf", "q4_k_m", "--llama-cpp", "/x", "--llama-cpp-lengths", "128:0:512"], "PROMPT:GEN:PREFILL"),
    (["--gguf", "q4_k_m", "--llama-cpp", "/x", "--llama-cpp-kernels", "float,fp4"], "each one of auto, float, int8"),
    (["--rows", "none"], "give --gguf TYPE"),
    (["--gguf", "q4_k_m", "--layer-ops", "torch,fast"], "--layer-ops: fast: each one of auto, fused, torch"),
    (["--layer-ops", "torch"], "give --gguf TYPE too"),
])
def test_stream_refuses_a_comparison_it_cannot_run_before_any_row(argv, why, tmp_path, capsys):
    from bench.__main__ import main as bench

    assert bench(["stream", "--backend", "cpu_ref", "--preset", "tiny", "--models", str(tmp_path / "models"),
                  "--out", str(tmp_path / "out"), *argv]) != 0
    err = capsys.readouterr().err.strip()
    assert why in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "models").exists()
