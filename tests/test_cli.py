"""The kestrel command: generate, sweep, make-model, demo and their machine-readable output."""

from __future__ import annotations

import json
import sys


from kestrel_core.cli import main
from kestrel_core.hookspecs import hookimpl
from backends.cpu_ref.backend import CpuRefBackend


def cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def cli_json(capsys, *argv):
    rc, out, err = cli(capsys, *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


# --- generate --------------------------------------------------------------------------

def test_generate_json_has_ids_timings_and_counters(tiny_ckpt, capsys, run_model):
    out = cli_json(capsys, "generate", "--model", str(tiny_ckpt), "--prompt-ids", "5,17,42,99,3", "--keep", "2",
                   "--max-new-tokens", "6", "--ignore-eos")
    same, _ = run_model(tiny_ckpt, residency__keep=2)
    assert out["token_ids"] == same.token_ids and len(out["token_ids"]) == 6  # the generated ids only
    assert out["prompt_ids"] == [5, 17, 42, 99, 3]
    assert out["ms_per_token"] > 0 and out["prefill_ms"] > 0 and len(out["decode_ms"]) == 5
    assert out["peak_resident_bytes"] == out["counters"]["peak_resident_bytes"] > 0
    for key in ("uploads", "layer_uploads", "evictions", "bytes_uploaded", "bytes_evicted", "allocations",
                "pool_hits", "frees", "peak_resident_entries"):
        assert isinstance(out["counters"][key], int), key
    assert out["uploads_per_token"] == [4] * 5
    assert (out["policy"], out["keep"], out["allocator"], out["backend"]) == ("asymmetric", 2, "pool", "cpu_ref")
    assert out["memory"]["mapping_rss_bytes"] > 0


def test_generate_prints_a_readable_report(tiny_ckpt, capsys):
    rc, out, _ = cli(capsys, "generate", "--model", str(tiny_ckpt), "--prompt-ids", "1,2,3", "--keep", "1",
                     "--max-new-tokens", "3", "--ignore-eos")
    assert rc == 0
    report = out[out.rindex("token ids: "):]  # after the streamed text (the tokenizer's decode of these ids)
    lines = dict(line.split(": ", 1) for line in report.splitlines())
    assert len(lines["token ids"].split()) == 3
    assert "policy=asymmetric keep=1" in lines["setting"]
    assert lines["per decoded token (last)"].startswith("5 layers")


def test_generate_prints_text_with_a_tokenizer(tiny_ckpt, capsys):
    import tokenizers  # a core dependency: text is the main job
    out = cli_json(capsys, "generate", "--model", str(tiny_ckpt), "--prompt", "hello", "--max-new-tokens", "4",
                   "--ignore-eos")
    assert out["prompt_ids"] == list(b"hello")  # the preset's tokenizer is byte-level
    tok = tokenizers.Tokenizer.from_file(str(tiny_ckpt / "tokenizer.json"))
    assert out["text"] == tok.decode(out["token_ids"], skip_special_tokens=False)
    rc, plain, _ = cli(capsys, "generate", "--model", str(tiny_ckpt), "--prompt", "hello", "--max-new-tokens", "4",
                       "--ignore-eos")
    streamed, _, report = plain.rpartition("token ids: ")
    assert rc == 0 and out["text"] and streamed == out["text"] + "\n"  # the text streams first, then the report


def test_no_tokenizer_means_ids_only(tiny_copy, capsys):
    (tiny_copy / "tokenizer.json").unlink()
    out = cli_json(capsys, "generate", "--model", str(tiny_copy), "--prompt-ids", "1,2", "--max-new-tokens", "2")
    assert "text" not in out and len(out["token_ids"]) >= 1
    rc, _, err = cli(capsys, "generate", "--model", str(tiny_copy), "--prompt", "hi")
    assert rc == 2 and "needs a tokenizer" in err


def test_generate_says_on_stderr_when_the_model_ends_at_once(tiny_ckpt, capsys):
    """Its first token the end id (256, forced by a bias): the streamed text was empty and nothing said why."""
    base = ["generate", "--model", str(tiny_ckpt), "--prompt", "hi", "--max-new-tokens", "3"]
    note = "kestrel: note: the model ended at once (end of sequence): its first token was the end id 256"
    rc, out, err = cli(capsys, *base, "--logit-bias", "256:100")
    assert rc == 0 and out.startswith("token ids: 256\n") and err.count("\n") == 1 and err.startswith(note), err
    rc, out, err = cli(capsys, *base, "--logit-bias", "256:100", "--json")  # the note, and the JSON as ever
    ended = json.loads(out)
    assert rc == 0 and err.startswith(note) and ended["token_ids"] == [256] and ended["text"] == ""
    assert set(ended) == set(cli_json(capsys, *base))
    rc, _, err = cli(capsys, *base)  # a run that generates says nothing
    assert rc == 0 and "ended at once" not in err
    rc, _, err = cli(capsys, *base, "--logit-bias", "256:100", "--ignore-eos")  # the end id is a token like any
    assert rc == 0 and "ended at once" not in err


def test_generate_takes_max_seq_as_serve_does(tiny_ckpt, capsys):
    """generate had no --max-seq, though serve does: the same bound on the prompt and its tokens, the same checks."""
    from cli_helpers import fails

    base = ["generate", "--model", str(tiny_ckpt), "--prompt-ids", "1,2,3,4", "--ignore-eos"]
    out = cli_json(capsys, *base, "--max-seq", "8", "--max-new-tokens", "4")
    assert len(out["token_ids"]) == 4  # the prompt and its tokens fill the context exactly
    fails([*base, "--max-seq", "7", "--max-new-tokens", "4"], capsys,
          "this run's context is 7 tokens (--max-seq); the prompt takes 4 and 4 to generate (--max-new-tokens)")
    fails([*base, "--max-seq", "1"], capsys, "--max-seq must be at least 2 positions, got 1")
    fails([*base, "--max-seq", "513"], capsys, "--max-seq 513 is past", "512 positions (max_position_embeddings)")
    fails(["serve", "--model", str(tiny_ckpt), "--max-seq", "1"], capsys, "--max-seq must be at least 2 positions")
    fails(["generate", "--model", str(tiny_ckpt), "--prompts", "in.jsonl", "--out", "out.jsonl", "--max-seq", "64"],
          capsys, "drop --max-seq")


# --- sweep -----------------------------------------------------------------------------

def test_sweep_identical_ids_exit_0_with_a_verdict(tiny_ckpt, capsys):
    argv = ["sweep", "--model", str(tiny_ckpt), "--backend", "cpu_ref", "--keep", "1,2,3,off", "--policy", "asymmetric,pinned_set",
            "--allocator", "pool,free", "--max-new-tokens", "4", "--ignore-eos"]
    runs = 3 * 2 * 2 + 2  # keep=off runs once per allocator
    data = cli_json(capsys, *argv)
    assert data["invariance"]["identical"] is True and len(data["rows"]) == runs
    assert len({tuple(r["token_ids"]) for r in data["rows"]}) == 1
    keep2 = [c for c in data["pinned_vs_asymmetric"] if c["keep"] == 2 and c["allocator"] == "pool"]
    assert keep2 and keep2[0]["saved_fraction"] > 0
    assert keep2[0]["peak_resident_bytes"][0] == keep2[0]["peak_resident_bytes"][1]
    steady = [r["allocations_after_warmup"] for r in data["rows"] if r["allocator"] == "pool"]
    assert steady == [0] * len(steady)


def test_sweep_prints_the_table_and_the_verdict(tiny_ckpt, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)  # progress is for a person at a terminal
    rc, out, err = cli(capsys, "sweep", "--model", str(tiny_ckpt), "--backend", "cpu_ref", "--keep", "2,off", "--policy",
                       "asymmetric,pinned_set", "--max-new-tokens", "3", "--ignore-eos")
    assert rc == 0, err
    assert "invariance on cpu_ref: token ids identical across all 3 runs" in out
    assert "pinned_set vs asymmetric on cpu_ref at keep=2 (pool)" in out and "(25% fewer bytes)" in out
    assert out.count(" same\n") == 3 and "DIFF" not in out
    assert "sweep:" in err and "2/3" in err and "cpu_ref off keep=off pool" in err  # a bar of the runs, on stderr
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    rc, out, err = cli(capsys, "sweep", "--model", str(tiny_ckpt), "--keep", "2", "--max-new-tokens", "2")
    assert rc == 0 and err == ""  # not on a terminal: no progress, so an error would be the only line


class StaleRefill(CpuRefBackend):
    """A buggy backend: a layer uploaded a second time is filled from the next layer's weights.

    The ids it gives stay finite (another layer's weights are weights of the same kind), but they differ
    wherever the window re-uploads; keep=off uploads each layer once and stays right.
    """

    def __init__(self, ctx):
        super().__init__(ctx)
        self._seen = set()

    def fill_unit(self, fetch):
        layer = fetch.unit.layer
        again = layer in self._seen
        self._seen.add(layer)
        wrong = self.units.of_layer((layer + 1) % self.cfg.num_hidden_layers)[0] if again else fetch.unit
        for entry, buffer in zip(wrong.entries, fetch.buffers):
            self.fill(buffer, entry.source)


class StaleBackendPlugin:
    @hookimpl
    def register_backends(self, register):
        register("stale", StaleRefill)


def test_sweep_exits_1_when_ids_differ(tiny_ckpt, capsys, register_plugin):
    register_plugin(StaleBackendPlugin(), "stale-backend")
    argv = ["sweep", "--model", str(tiny_ckpt), "--backend", "stale", "--keep", "1,off", "--allocator", "pool",
            "--max-new-tokens", "5", "--ignore-eos"]
    rc, out, err = cli(capsys, *argv)
    assert rc == 1, err
    assert "invariance on stale: FAILED - ids differ from the first run in: off keep=off pool" in out
    assert "DIFF" in out
    rc, out, _ = cli(capsys, *argv, "--json")
    data = json.loads(out)
    assert rc == 1 and data["invariance"]["identical"] is False
    assert data["invariance"]["backends"]["stale"]["differing"] == ["off keep=off pool prefetch=0"]


def test_sweep_plot(tiny_ckpt, capsys, tmp_path):
    # matplotlib is in the test extra: the plot is always drawn here
    png = tmp_path / "curve.png"
    rc, _, err = cli(capsys, "sweep", "--model", str(tiny_ckpt), "--keep", "1,2,off", "--max-new-tokens", "3",
                     "--plot", str(png))
    assert rc == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- make-model and demo ---------------------------------------------------------------

def test_make_model_json(tmp_path, capsys, run_model):
    out_dir = tmp_path / "m"
    out = cli_json(capsys, "make-model", "--preset", "tiny-llama", "--out", str(out_dir), "--seed", "4")
    assert out["out"] == str(out_dir) and out["preset"] == "tiny-llama"
    assert set(out["files"]) == {p.name for p in out_dir.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert out["bytes"] == (out_dir / "model.safetensors").stat().st_size
    assert json.loads((out_dir / "config.json").read_text())["model_type"] == "llama"
    again = cli_json(capsys, "make-model", "--preset", "tiny-llama", "--out", str(tmp_path / "m2"), "--seed", "4")
    other = cli_json(capsys, "make-model", "--preset", "tiny-llama", "--out", str(tmp_path / "m3"), "--seed", "5")
    same_seed = (out_dir / "model.safetensors").read_bytes() == (tmp_path / "m2" / "model.safetensors").read_bytes()
    assert same_seed and again["bytes"] == other["bytes"]
    assert (out_dir / "model.safetensors").read_bytes() != (tmp_path / "m3" / "model.safetensors").read_bytes()
    r, _ = run_model(out_dir, residency__keep=1)
    assert len(r.token_ids) == 6


def test_make_model_unknown_preset(tmp_path, capsys):
    rc, _, err = cli(capsys, "make-model", "--preset", "huge", "--out", str(tmp_path / "x"))
    assert rc == 2 and "unknown preset 'huge'" in err and "tiny" in err


def test_demo_json_finishes_identical(tmp_path, capsys):
    from kestrel_core.tools.sweep import available_backends

    data = cli_json(capsys, "demo", "--cache-dir", str(tmp_path), "--max-new-tokens", "3")
    assert (tmp_path / "demo-qwen3" / "config.json").is_file()
    assert data["invariance"]["identical"] is True
    backends = set(available_backends(None))
    assert {r["backend"] for r in data["rows"]} == backends
    per_backend = 6 * 4 * 2 + 2  # 6 keeps x 4 policies x 2 allocators, and off x 2
    assert len(data["rows"]) == per_backend * len(backends)
    assert all(len(r["token_ids"]) == 3 for r in data["rows"])


def test_demo_reuses_its_cached_checkpoint(tmp_path, capsys, monkeypatch):
    from kestrel_core.io import progress
    from kestrel_core.commands.demo import ensure_demo_model

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)  # a person at a terminal hears of the write
    with progress.shown():
        path = ensure_demo_model(tmp_path / "demo-qwen3")
        assert f"demo: writing the demo checkpoint to {path}\n" in capsys.readouterr().err
        mtime = (path / "model.safetensors").stat().st_mtime_ns
        assert ensure_demo_model(path) == path
        assert capsys.readouterr().err == ""
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


def test_run_help_groups_its_flags_and_names_each_choice_and_default(register_plugin, capsys):
    class Extra:
        @hookimpl
        def register_policies(self, register):
            register("every_other_test", lambda n_layers, keep: None)

    register_plugin(Extra(), name="help-extra")
    assert main(["generate", "--help"]) == 0
    raw = capsys.readouterr().out
    titles = [line for line in raw.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert titles == ["options:", "model:", "residency:", "device (every backend):", "cuda:", "cpu_ref:",
                      "Mixture-of-Experts:", "generation:", "speculative decoding:"]
    groups = raw.split("\ncuda:\n")
    for flag in ("--dtype", "--devices", "--device "):  # cpu_ref takes them too: they were filed under cuda
        assert flag in groups[0].split("\ndevice (every backend):\n")[1] and flag not in groups[1], flag
    assert "--host-budget-mb" in groups[1].split("\ncpu_ref:\n")[0]
    out = " ".join(raw.split())
    assert "--policy POLICY residency policy: asymmetric, belady, every_other_test, future_evicting, off, pinned_set " \
           "(default asymmetric)" in out
    assert "--backend BACKEND backend: cpu_ref, cuda (default cpu_ref)" in out
    assert "--allocator ALLOCATOR weight-buffer allocator: free, pool (default pool)" in out
    assert "the expert policy: expert_lfu, expert_lru" in out and "'auto' (the default" in out
