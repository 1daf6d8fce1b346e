"""Benefit gates (the plugins.gates package): the seed's arithmetic, a measured CPU run, the window's entry counts,
plugins, bad input, and the layering: the core imports no gate code."""

from __future__ import annotations

import ast
import json
import mmap
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from kestrel_core import plugins
from kestrel_core.cli import main
from kestrel_core.hookspecs import hookimpl
from kestrel_core.formats.tensor_table import all_specs
from kestrel_core.formats.modelconfig import parse_model_config, read_model_config
from kestrel_core.tools.presets import preset_config, write_checkpoint
from plugins.gates import BUILD, DONT_BUILD, REMEASURE, Evaluation, Gate, GateContext, GateOptions, Quantity, run_gate
from plugins.gates.memsampler import MemSampler, process_rss_bytes, reset_rss_high_water_mark
from plugins.gates.shapes import n_moe_layers, param_count

MiB, GiB = 2**20, 2**30

# Qwen3-30B-A3B's config.json as published (the fields that matter, and a few that don't).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "max_position_embeddings": 40960,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 151936, "eos_token_id": 151645, "bos_token_id": 151643,
}
SEED_TOTAL_MB, SEED_PEAK_MB = 32_607, 19_625


def _write_config(d, raw):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(raw))
    return d


@pytest.fixture
def moe_dir(tmp_path):
    return _write_config(tmp_path / "qwen3-30b-a3b", QWEN3_30B_A3B)  # config.json only: nobody downloaded it


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_checkpoint(preset_config("tiny"), tmp_path_factory.mktemp("tiny"), seed=0)


def _gate_json(capsys, *argv):
    rc = main(["gate", *argv, "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    return json.loads(out)


def _q(doc, key):
    return next(q for q in doc["quantities"] if q["key"] == key)


# --- the seed's arithmetic -----------------------------------------------------------------
def test_seed_kv_mirror_arithmetic_from_config_json(moe_dir, capsys):
    doc = _gate_json(capsys, "kv-paging", "--model", str(moe_dir), "--max-seq", "8192",
                     "--total-mb", str(SEED_TOTAL_MB), "--peak-mb", str(SEED_PEAK_MB))
    slot = _q(doc, "mirror_slot")
    assert slot["value"] == 48 * 8192 * (2 * 512 + 8 * 4) == 415_236_096
    assert slot["kind"] == "computed"
    assert round(slot["value"] / MiB) == 396
    assert doc["verdict"] == DONT_BUILD
    # "1.2% of a 32.6 GB card" against "12,982 MiB (39.8%) of headroom".
    assert round(_q(doc, "bound")["share_of_total"], 3) == 0.012
    headroom = _q(doc, "headroom")
    assert headroom["value"] == (SEED_TOTAL_MB - SEED_PEAK_MB) * MiB == 12_982 * MiB
    assert round(headroom["share_of_total"], 3) == 0.398
    assert 0.03 < doc["ratio"] < 0.031  # 396 / 12,982: far under the 10% rule
    # Config-only: the figures say where they came from.
    assert doc["mode"] == "config-only"
    assert doc["kinds"]["measured"] == []
    assert set(doc["kinds"]["given"]) == {"total", "peak", "max_seq"}
    assert {"mirror_slot", "mirror", "bound", "headroom"} <= set(doc["kinds"]["computed"])
    # The flip conditions the seed names: more concurrent states, and max_seq 40960.
    assert doc["flips_one_at_a_time"]["slots"] == [4, 8, 16]
    assert 40960 in doc["flips_one_at_a_time"]["max_seq"]
    assert doc["flips_one_at_a_time"]["card_gb"] and max(doc["flips_one_at_a_time"]["card_gb"]) <= 24
    assert all(c["verdict"] == DONT_BUILD and not c["flips"] for c in doc["flip_table"]
               if c["card_gb"] == 141 and c["slots"] == 1)


def test_seed_eight_slots_and_long_context(moe_dir):
    cfg = read_model_config(moe_dir)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim) == ("qwen3_moe", 48, 4, 128)
    assert cfg.is_moe and n_moe_layers(cfg) == 48
    assert 30.4e9 < param_count(cfg) < 30.6e9  # "30B-A3B": 30.5B parameters
    opts = dict(total_mb=SEED_TOTAL_MB, peak_mb=SEED_PEAK_MB)

    eight = run_gate(plugins.lookup("gates", "kv-paging").factory(),
                     GateContext(moe_dir, GateOptions(max_seq=8192, slots=8, **opts)))
    assert eight.quantity("mirror").value == 8 * 415_236_096
    assert round(eight.quantity("mirror").value / GiB, 2) == 3.09  # "eight slots take 3.09 GiB"
    assert eight.verdict == REMEASURE  # 3.1 GiB of a 12.7 GiB headroom: past the 10% rule

    long = run_gate(plugins.lookup("gates", "kv-paging").factory(),
                    GateContext(moe_dir, GateOptions(max_seq=40960, **opts)))
    slot = long.quantity("mirror_slot").value
    assert slot == 5 * 415_236_096 == 2_076_180_480
    # The seed's "about 1.98 GiB a slot" is 1,980 MiB (1.93 GiB): it wrote MiB/1000 as GiB.
    assert round(slot / MiB) == 1980
    assert round(slot / GiB, 2) == 1.93
    assert long.verdict == REMEASURE


def test_text_output_and_markdown_report(moe_dir, tmp_path, capsys):
    report = tmp_path / "gate.md"
    rc = main(["gate", "kv-paging", "--model", str(moe_dir), "--total-mb", str(SEED_TOTAL_MB),
               "--peak-mb", str(SEED_PEAK_MB), "--report", str(report)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "verdict: DON'T BUILD" in out
    assert "415,236,096 B" in out and "1.2%" in out and "39.8%" in out
    assert "card GB  slots 1" in out  # the flip table
    md = report.read_text()
    assert md.startswith("# gate kv-paging") and "| quantity | value | share of total | kind | source |" in md
    assert "**verdict: don't build**" in md


def test_l3_residency_same_verdict_path(moe_dir, capsys):
    doc = _gate_json(capsys, "l3-residency", "--model", str(moe_dir), "--total-mb", str(SEED_TOTAL_MB),
                     "--peak-mb", str(SEED_PEAK_MB))
    assert doc["verdict"] == DONT_BUILD  # the seed: "the same verdict covers device-side L3 residency"
    assert _q(doc, "bound")["value"] == 415_236_096  # the whole mirror, no fill discount


def test_fill_shrinks_the_kv_paging_bound(moe_dir):
    gate = plugins.lookup("gates", "kv-paging").factory()
    half = run_gate(gate, GateContext(moe_dir, GateOptions(fill=0.5, total_mb=SEED_TOTAL_MB, peak_mb=SEED_PEAK_MB)))
    assert half.quantity("bound").value == 415_236_096 // 2


def test_runner_kv_layout(moe_dir):
    gate = plugins.lookup("gates", "kv-paging").factory()
    r = run_gate(gate, GateContext(moe_dir, GateOptions(kv_layout="runner", backend="cuda")))
    # kestrel's KVCache: K and V of [max_seq, n_kv, head_dim] in bf16 on cuda.
    assert r.quantity("mirror_slot").value == 48 * 8192 * 2 * 512 * 2
    f32 = run_gate(plugins.lookup("gates", "kv-paging").factory(),
                   GateContext(moe_dir, GateOptions(kv_layout="float32")))
    assert f32.quantity("mirror_slot").value == 48 * 8192 * 2 * 512 * 4


def _independent_entries(layers, dense_layers, experts, resident):
    """keep=off entries counted by hand from the shape: a dense layer is cuda's qkv, o, gate_up, down (cpu_ref: q, k,
    v, o, gate, up, down); a sparse layer's own unit cuda's qkv, o, router (cpu_ref: q, k, v, o, router), and each
    expert cuda's gate_up, down (cpu_ref: gate, up, down)."""
    sparse = layers - dense_layers
    return {"cuda": dense_layers * 4 + sparse * (3 + 2 * experts) + resident,
            "cpu_ref": dense_layers * 7 + sparse * (5 + 3 * experts) + resident}


def test_qwen3_30b_a3b_preset_slot_and_entries_come_from_the_runners_config(tmp_path, capsys):
    from kestrel_core.engine.model import KVCache

    cfg = preset_config("qwen3-30b-a3b")
    d = _write_config(tmp_path / "qwen3-30b-a3b-preset", cfg.to_hf_dict())  # config.json only, as presets write it
    doc = _gate_json(capsys, "kv-paging", "--model", str(d), "--max-seq", "8192")
    # The int8 mirror slot: layers x max_seq x (2 kv_dim + 8 kv heads), kv_dim = kv heads x head_dim = 4 x 128.
    assert _q(doc, "mirror_slot")["value"] == 48 * 8192 * (2 * 4 * 128 + 8 * 4) == 415_236_096
    # The reference row is the runner's own KVCache at full reach, its positions and the spare row a parked slot writes
    # (Slots: allocate_cache(..., spare=1)), sized without allocating it (the meta device).
    kv = KVCache.allocate(read_model_config(d), 8192 + 1, torch.bfloat16, "meta")
    assert len(kv) == 48
    assert _q(doc, "runner_slot")["value"] == sum(c.k.nbytes + c.v.nbytes for c in kv) == 48 * 8193 * 2 * 512 * 2
    # Resident, counted by hand: embed, final norm, untied lm_head; per layer input/post norms and Qwen3's q/k norms.
    resident = 3 + 48 * 4
    want = _independent_entries(layers=48, dense_layers=0, experts=128, resident=resident)
    assert want == {"cuda": 48 * (3 + 2 * 128) + 195, "cpu_ref": 48 * (5 + 3 * 128) + 195}
    doc = _gate_json(capsys, "window", "--model", str(d))
    for backend in ("cuda", "cpu_ref"):
        q = _q(doc, f"entries_{backend}")
        assert q["value"] == want[backend], backend
        assert "kestrel_core.formats.tensor_table.unit_specs" in q["source"] and "195 resident" in q["source"]
    assert "48 layer units x 3 + 6144 expert units x 2" in _q(doc, "entries_cuda")["source"]
    assert "cuda layout: its fused entries" in _q(doc, "entries_cuda")["source"]
    assert "48 layer units x 5 + 6144 expert units x 3" in _q(doc, "entries_cpu_ref")["source"]
    assert (want["cuda"], want["cpu_ref"]) == (12_627, 18_867)


def test_window_config_only_moe_needs_the_window(moe_dir, capsys):
    doc = _gate_json(capsys, "window", "--model", str(moe_dir), "--total-mb", str(SEED_TOTAL_MB))
    assert doc["verdict"] == BUILD  # 61 GB of bf16 weights against a 30 GB budget
    assert _q(doc, "checkpoint")["kind"] == "computed"  # no weights on disk
    assert _q(doc, "budget")["value"] == SEED_TOTAL_MB * MiB - 2 * 2**30  # free less the cuda backend's reserve
    assert _q(doc, "entries_seed")["value"] == 48 * 5 + 1  # MoE: 5 per layer + lm_head
    # kestrel runs it: per layer its own unit (cuda qkv, o, router) and 128 experts (gate_up, down), + 195 resident.
    assert _q(doc, "entries_cuda")["value"] == 48 * (3 + 2 * 128) + 195
    # A q4 30B-A3B (the seed's) fits an 80 GB card: a flip on both variables.
    cell = next(c for c in doc["flip_table"] if c["card_gb"] == 80 and c["weight_dtype"] == "int4")
    assert cell["verdict"] == DONT_BUILD and cell["flips"]


def test_budget_env_override_is_the_cuda_backends(moe_dir, monkeypatch):
    monkeypatch.setenv("KESTREL_WCACHE_MB", "200000")
    r = run_gate(plugins.lookup("gates", "window").factory(), GateContext(moe_dir, GateOptions(total_mb=SEED_TOTAL_MB)))
    assert r.quantity("budget").value == 200_000 * MiB
    assert r.quantity("budget").source == "KESTREL_WCACHE_MB"
    assert r.verdict == DONT_BUILD


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_param_count_matches_kestrels_tensor_table(preset):
    cfg = preset_config(preset)
    assert param_count(parse_model_config(cfg.to_hf_dict())) == sum(torch.Size(s).numel() for s in all_specs(cfg).values())


# --- measured runs on the CPU ---------------------------------------------------------------
def _meminfo_total():
    for line in open("/proc/meminfo"):
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal")


def test_measured_cpu_run_sampled_peak_is_bounded(tiny_dir, capsys):
    rss_at_start = process_rss_bytes()
    doc = _gate_json(capsys, "kv-paging", "--model", str(tiny_dir), "--measure", "--backend", "cpu_ref",
                     "--period-ms", "20", "--max-new-tokens", "8")
    assert doc["mode"] == "measured"
    assert {"total", "peak", "process_sampled_peak", "process_exact_peak"} <= set(doc["kinds"]["measured"])
    mem = doc["measurements"][0]["memory"]
    assert mem["device"] == "cpu" and mem["samples"] >= 2
    # The kernel batches RSS counters per thread: allow 1 MiB of slack below the RSS we read.
    assert mem["sampled_peak_bytes"] >= rss_at_start - MiB
    assert mem["sampled_peak_bytes"] <= _meminfo_total()
    assert mem["peak_used_bytes"] <= mem["total_bytes"] <= _meminfo_total()
    assert mem["exact_peak_bytes"] >= mem["sampled_peak_bytes"] - MiB
    # layers x (tokens and the spare row) x 2 kv_dim x f32: the cache the run held
    assert doc["measurements"][0]["kv_bytes"] == 2 * 6 * (8 + 8 + 1) * 32 * 4
    assert doc["verdict"] == DONT_BUILD  # a 0.2 MiB mirror on a whole machine


def _fresh_touched_pages(nbytes: int) -> mmap.mmap:
    """Anonymous pages the kernel has just handed over, every one written.

    A Python bytes object may reuse memory the allocator already holds resident
    (a freed arena, a preloaded malloc), so it need not grow RSS at all; a fresh
    anonymous mapping always does once touched."""
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # small pages: the RSS counters move with every fault, not per 2 MiB
        mm.madvise(mmap.MADV_NOHUGEPAGE)
    page = mmap.PAGESIZE
    for off in range(0, nbytes, page):
        mm[off] = 1
    return mm


def _hold_for_samples(sampler: MemSampler, n: int, limit_s: float = 5.0) -> None:
    """Wait until the sampler's thread has taken n more samples (a loaded machine may starve it for a while)."""
    want = len(sampler.samples) + n
    deadline = time.monotonic() + limit_s
    while len(sampler.samples) < want and time.monotonic() < deadline:
        time.sleep(sampler.period_s)


@pytest.mark.slow  # the sampler thread must catch a peak held for a few of its periods
def test_sampler_sees_a_spike_and_reports_the_gap():
    with MemSampler("cpu", period_s=0.01) as s:
        start = s.samples[0].process_bytes
        spike = _fresh_touched_pages(64 * MiB)
        seen = process_rss_bytes()
        if seen < start + 60 * MiB:  # what is under test is the sampler, not the kernel's accounting
            spike.close()
            pytest.skip(f"64 MiB of fresh touched pages moved this process's own VmRSS by only "
                        f"{(seen - start) / MiB:+.1f} MiB: the kernel here does not report RSS promptly")
        _hold_for_samples(s, 3)
        spike.close()
        time.sleep(0.03)
    r = s.report
    assert r.samples >= 5
    assert r.sampled_peak_bytes >= start + 60 * MiB
    assert r.exact_peak_bytes >= start + 60 * MiB  # VmHWM keeps the spike after it is gone
    assert abs(r.gap_bytes) < 16 * MiB  # sampled every 10 ms, the 100 ms spike cannot be missed
    assert r.samples == len(s.samples)
    assert "apart by" in r.describe()


def test_sampler_resets_the_high_water_mark():
    big = b"\x01" * (128 * MiB)
    del big
    if not reset_rss_high_water_mark():
        pytest.skip("/proc/self/clear_refs is not writable here")
    with MemSampler("cpu", period_s=0.05) as s:
        pass
    assert s.report.exact_peak_bytes < s.report.start_process_bytes + 64 * MiB  # the earlier 128 MiB is forgotten


def test_window_measured_entries_match_kestrels_layout(tiny_dir, capsys):
    doc = _gate_json(capsys, "window", "--model", str(tiny_dir), "--measure", "--backend", "cpu_ref",
                     "--period-ms", "20", "--max-new-tokens", "4")
    # tiny: 6 layers, tied embeddings, Qwen3 q/k norms -> embed + norm + 6 x 4 norms = 26 resident entries.
    assert _q(doc, "entries_seed")["value"] == 6 * 9 + 1
    assert _q(doc, "entries_cuda")["value"] == 6 * 4 + 26
    assert _q(doc, "entries_cpu_ref")["value"] == 6 * 7 + 26
    run = _q(doc, "entries_run")
    assert run["kind"] == "measured" and run["value"] == 6 * 7 + 26
    assert _q(doc, "entries_check")["value"] == "matches"
    assert _q(doc, "params")["kind"] == "measured"  # the weights exist: read from safetensors headers
    assert doc["verdict"] == DONT_BUILD
    assert doc["summary"].startswith("don't turn the window on")
    assert _q(doc, "bytes_window")["value"] == 5 * 43_008 * 4  # keep=1: 5 of 6 layers' matrices in f32
    assert [m["keep"] for m in doc["measurements"]] == ["off", 1]


# tiny-moe: 4 layers, layer 0 dense, 8 experts; tied embeddings -> embed + norm + 4 x 4 norms = 18 resident.
# tiny-llama: 5 dense layers, untied, no q/k norms -> embed + norm + lm_head + 5 x 2 norms = 13 resident.
MEASURED_PRESETS = {"tiny-moe": _independent_entries(layers=4, dense_layers=1, experts=8, resident=2 + 4 * 4),
                    "tiny-llama": _independent_entries(layers=5, dense_layers=5, experts=0, resident=3 + 5 * 2)}


@pytest.fixture(scope="module", params=sorted(MEASURED_PRESETS))
def measured_preset(request, tmp_path_factory):
    name = request.param
    return name, write_checkpoint(preset_config(name, "float32"), tmp_path_factory.mktemp(name), seed=0)


def test_window_measured_entries_match_on_moe_and_dense_presets(measured_preset, capsys):
    # keep=off with no expert policy: preload makes every unit resident, experts included, so the peak is the count.
    name, d = measured_preset
    want = MEASURED_PRESETS[name]
    doc = _gate_json(capsys, "window", "--model", str(d), "--measure", "--backend", "cpu_ref",
                     "--period-ms", "20", "--max-new-tokens", "4")
    assert _q(doc, "entries_cpu_ref")["value"] == want["cpu_ref"]
    assert _q(doc, "entries_cuda")["value"] == want["cuda"]
    assert _q(doc, "entries_run")["value"] == want["cpu_ref"]
    assert _q(doc, "entries_check")["value"] == "matches"
    assert want == {"tiny-moe": {"cuda": 79, "cpu_ref": 112}, "tiny-llama": {"cuda": 33, "cpu_ref": 48}}[name]


def test_window_reads_a_q8_checkpoint_as_the_cache_holds_it(tiny_dir, tmp_path, capsys):
    out = tmp_path / "tiny-q8"
    assert main(["quantize", "--model", str(tiny_dir), "--out", str(out), "--json"]) == 0
    capsys.readouterr()
    doc = _gate_json(capsys, "window", "--model", str(out))
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    weights = _q(doc, "weights")
    assert weights["kind"] == "measured" and 0.9 * size < weights["value"] <= size  # q8 is stored in device layout
    assert _q(doc, "weight_dtype")["value"] == "int8"


def test_window_flips_when_the_budget_is_small(tiny_dir, capsys):
    # 291,840 parameters in f32 are 1.1 MiB: over a 1 MiB budget.
    doc = _gate_json(capsys, "window", "--model", str(tiny_dir), "--budget-mb", "1", "--weight-dtype", "float32")
    assert doc["verdict"] == BUILD
    doc = _gate_json(capsys, "window", "--model", str(tiny_dir), "--budget-mb", "1", "--weight-dtype", "bfloat16")
    assert doc["verdict"] == DONT_BUILD


# --- plugins --------------------------------------------------------------------------------
class _FakeGate(Gate):
    name = "fake-gate"
    title = "a third party's gate"
    formula = "layers x 1 MiB"
    against = "total memory"

    def collect(self, ctx):
        return [Quantity("layers_mib", "one MiB a layer", ctx.config.num_hidden_layers * MiB, "B", "computed",
                         "config.json"), ctx.total_memory()]

    def evaluate(self, ctx, point):
        bound = ctx.config.num_hidden_layers * MiB
        ratio, verdict = self.decide(bound, point["card_bytes"])
        return Evaluation(bound, point["card_bytes"], ratio, verdict)


class _FakeGatePlugin:
    @hookimpl
    def register_gates(self, register):
        register("fake-gate", _FakeGate)


@pytest.fixture
def fake_gate():
    plugins.load_plugins()
    plugins.pm.register(_FakeGatePlugin(), name="fake-gate-plugin")
    try:
        yield
    finally:
        plugins.pm.unregister(name="fake-gate-plugin")


def test_third_party_gate_shows_in_list_and_runs(fake_gate, moe_dir, capsys):
    assert main(["gate", "--list"]) == 0
    out = capsys.readouterr().out
    assert "fake-gate" in out and "a third party's gate" in out and "(registered at run time)" in out
    for builtin in ("kv-paging", "l3-residency", "window"):
        assert builtin in out
    doc = _gate_json(capsys, "fake-gate", "--model", str(moe_dir), "--total-mb", "1000")
    assert doc["verdict"] == DONT_BUILD and doc["bound_bytes"] == 48 * MiB
    assert any(c["flips"] for c in doc["flip_table"]) is False  # 48 MiB is under 10% of every card


def test_gate_list_json_names_the_built_ins(capsys):
    assert main(["gate", "--list", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["kv-paging"]["flip_variables"] == ["card_gb", "slots", "max_seq"]
    assert rows["window"]["package"] == "kestrel"
    assert "fake-gate" not in rows  # unregistered after its test


def test_a_non_gate_registration_is_refused(moe_dir, capsys):
    class Bad:
        @hookimpl
        def register_gates(self, register):
            register("bad-gate", dict)

    plugins.pm.register(Bad(), name="bad-gate-plugin")
    try:
        assert main(["gate", "bad-gate", "--model", str(moe_dir)]) == 2
        assert "not a plugins.gates.Gate" in capsys.readouterr().err
        assert main(["gate", "--list"]) == 0  # the broken one is listed as broken, the others still show
        out = capsys.readouterr().out
        assert "bad-gate" in out and "broken:" in out and "kv-paging" in out
    finally:
        plugins.pm.unregister(name="bad-gate-plugin")


# --- bad input: one line, exit 2 ------------------------------------------------------------------
def _error(capsys, *argv):
    rc = main(["gate", *argv])
    err = capsys.readouterr().err
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kestrel: error: "), err
    return lines[0]


def test_missing_config_field(tmp_path, capsys):
    raw = dict(QWEN3_30B_A3B)
    del raw["num_hidden_layers"]
    d = _write_config(tmp_path / "m", raw)
    line = _error(capsys, "kv-paging", "--model", str(d))
    assert "missing field 'num_hidden_layers'" in line and "kv-paging" in line
    raw = dict(QWEN3_30B_A3B)
    del raw["head_dim"], raw["hidden_size"]
    d = _write_config(tmp_path / "n", raw)
    assert "missing field 'hidden_size'" in _error(capsys, "l3-residency", "--model", str(d))


@pytest.mark.parametrize("max_seq", ["0", "-8"])
def test_non_positive_max_seq(moe_dir, capsys, max_seq):
    assert "--max-seq must be a positive" in _error(capsys, "kv-paging", "--model", str(moe_dir), "--max-seq", max_seq)


def test_unknown_gate_lists_the_available(moe_dir, capsys):
    line = _error(capsys, "kv-pagin", "--model", str(moe_dir))
    assert "unknown gate 'kv-pagin'" in line and "kv-paging, l3-residency, window" in line


@pytest.mark.parametrize("argv, says", [
    (["kv-paging", "--max-seq", "50000"], "max_position_embeddings=40960"),
    (["kv-paging", "--slots", "0"], "--slots"),
    (["kv-paging", "--fill", "1.5"], "--fill"),
    (["kv-paging", "--peak-mb", "40000", "--total-mb", "32607"], "above --total-mb"),
    (["window", "--measure"], "--measure runs the model, so it needs the weights"),
])
def test_other_bad_input(moe_dir, capsys, argv, says):
    assert says in _error(capsys, argv[0], "--model", str(moe_dir), *argv[1:])


def test_measure_needs_weights(tmp_path, capsys):
    d = _write_config(tmp_path / "cfg-only", preset_config("tiny").to_hf_dict())
    assert "needs the weights" in _error(capsys, "window", "--model", str(d), "--measure")


def test_not_json_config(tmp_path, capsys):
    d = tmp_path / "broken"
    d.mkdir()
    (d / "config.json").write_text("{not json")
    assert "not valid JSON" in _error(capsys, "window", "--model", str(d))


# --- the GPU path: runs where a GPU is visible, skips cleanly elsewhere ------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.slow  # timed by time.sleep: the sampler thread must catch a peak held for tens of ms
@pytest.mark.cuda
@cuda
def test_gpu_sampler_sees_an_allocation():
    with MemSampler("cuda", period_s=0.01) as s:
        x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        time.sleep(0.1)
        del x
    r = s.report
    assert r.exact_peak_bytes >= 256 * MiB  # torch.cuda.max_memory_reserved
    assert 0 < r.sampled_peak_bytes <= r.total_bytes
    # Device-wide use (NVML) includes the CUDA context, so it sits above torch's own reserve.
    assert r.sampled_peak_bytes >= r.exact_peak_bytes - 8 * MiB


@pytest.mark.cuda
@cuda
def test_gpu_window_measured_entries(tiny_dir, capsys):
    doc = _gate_json(capsys, "window", "--model", str(tiny_dir), "--measure", "--backend", "cuda",
                     "--period-ms", "20", "--max-new-tokens", "4")
    assert _q(doc, "entries_run")["value"] == _q(doc, "entries_cuda")["value"] == 6 * 4 + 26
    # The free memory measured before the run less the reserve, as the backend computes it (other processes may move it a little).
    assert abs(_q(doc, "budget_run")["value"] - _q(doc, "budget")["value"]) <= 64 * MiB
    assert doc["measurements"][0]["memory"]["device"].startswith("cuda")


@pytest.mark.cuda
@cuda
def test_gpu_window_measured_entries_on_moe_and_dense_presets(measured_preset, capsys):
    name, d = measured_preset
    doc = _gate_json(capsys, "window", "--model", str(d), "--measure", "--backend", "cuda",
                     "--period-ms", "20", "--max-new-tokens", "4")
    assert _q(doc, "entries_run")["value"] == _q(doc, "entries_cuda")["value"] == MEASURED_PRESETS[name]["cuda"]
    assert _q(doc, "entries_check")["value"] == "matches"


class _FakeNvml:
    """Just enough of pynvml for the probe: one device, found by its UUID."""

    class NVMLError(Exception):
        pass

    def __init__(self, used):
        self.used, self.shut = used, False

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid != "GPU-1234-abcd":
            raise self.NVMLError("not found")
        return "handle0"

    def nvmlDeviceGetMemoryInfo(self, handle):
        assert handle == "handle0"
        return types.SimpleNamespace(total=80 * GiB, used=self.used, free=80 * GiB - self.used)


def _fake_cuda(monkeypatch, reserved):
    props = types.SimpleNamespace(uuid="1234-abcd", pci_bus_id=1, pci_device_id=0, pci_domain_id=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda i=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda i=None: reserved)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=None: (70 * GiB, 80 * GiB))


@pytest.mark.slow  # the sampler thread must catch a peak held for a few of its periods
def test_gpu_probe_logic_with_a_fake_nvml(monkeypatch):
    """The NVML path cannot run without a GPU; this drives its logic through fakes."""
    nvml = _FakeNvml(used=3 * GiB)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    _fake_cuda(monkeypatch, reserved=2 * GiB)
    with MemSampler("cuda", period_s=0.01) as s:
        nvml.used = 5 * GiB  # a peak the sampler must see
        _hold_for_samples(s, 2)
        nvml.used = 4 * GiB
    r = s.report
    assert r.device == "cuda:0" and "NVML" in r.sampled_source
    assert (r.sampled_peak_bytes, r.total_bytes, r.min_available_bytes) == (5 * GiB, 80 * GiB, 75 * GiB)
    assert r.exact_peak_bytes == 2 * GiB and r.gap_bytes == -3 * GiB  # NVML sees the context and more
    assert nvml.shut


def test_gpu_probe_falls_back_without_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    _fake_cuda(monkeypatch, reserved=GiB)
    with MemSampler("cuda:0", period_s=0.01) as s:
        pass
    r = s.report
    assert "mem_get_info" in r.sampled_source and r.sampled_peak_bytes == 10 * GiB
    assert any("nvidia-ml-py is not installed" in n for n in r.notes)


@pytest.mark.parametrize("make, says", [
    (lambda d: d / "absent", "does not exist"),
    (lambda d: (d / "file.json").write_text("{}") and d / "file.json", "is a file, not a directory"),
    (lambda d: (d / "cfgdir" / "config.json").mkdir(parents=True) or d / "cfgdir", "cannot read (Is a directory)"),
    (lambda d: (d / "empty").mkdir() or d / "empty", "config.json: missing"),
])
def test_bad_model_paths_are_one_line_naming_the_gate(tmp_path, capsys, make, says):
    line = _error(capsys, "window", "--model", str(make(tmp_path)))
    assert line.startswith("kestrel: error: gate window: ") and says in line


# --- the layering: gates are a plugin package, the core knows none of it ----------------------------
def test_gate_is_a_plugin_command_and_the_gates_are_listed(capsys):
    assert main(["plugins", "--json"]) == 0
    rows = {(r["kind"], r["name"]): r for r in json.loads(capsys.readouterr().out)}
    for key in [("command", "gate"), ("gate", "kv-paging"), ("gate", "l3-residency"), ("gate", "window")]:
        assert rows[key]["package"] == "kestrel" and rows[key]["plugin"] == "gates", rows.get(key)
    assert plugins.lookup("commands", "gate").factory.__name__ == "plugins.gates.command"


def test_the_core_imports_no_gate_code():
    core = Path(plugins.__file__).parent
    for path in core.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any("gate" in n or "memsampler" in n for n in names), (path, names)
