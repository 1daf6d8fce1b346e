"""No silent wrong result, no traceback: bad settings, non-finite weights and misbehaving plugins while generating."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from kestrel_core.engine import kvcache
from kestrel_core.engine.runner import Runner
from kestrel_core.cli import main
from kestrel_core.errors import KestrelNote, PluginError
from kestrel_core.hookspecs import hookimpl
from kestrel_core.engine.plan import Advice
from cli_helpers import WEIGHTS, fails, gen


# --- names and settings are never dropped ----------------------------------------------

@pytest.mark.parametrize("command", ["generate", "sweep"])
def test_an_unknown_policy_is_an_error_even_with_keep_off(tiny_ckpt, capsys, command):
    argv = gen(tiny_ckpt, "--policy", "clairvoyant") if command == "generate" else [
        "sweep", "--model", str(tiny_ckpt), "--keep", "off", "--policy", "clairvoyant", "--max-new-tokens", "2"]
    fails(argv, capsys, "unknown policy 'clairvoyant'", "asymmetric")


def test_sweep_refuses_prefetch_on_cpu_ref_as_generate_does(tiny_ckpt, capsys):
    generate_err = fails(gen(tiny_ckpt, "--keep", "2", "--prefetch", "1"), capsys, "prefetch")
    sweep_err = fails(["sweep", "--model", str(tiny_ckpt), "--keep", "2", "--prefetch", "0,1", "--max-new-tokens", "2"],
                      capsys, "prefetch")
    assert sweep_err == generate_err


def test_prefetch_without_a_window_is_an_error(tiny_ckpt, capsys):
    fails(gen(tiny_ckpt, "--keep", "off", "--prefetch", "1"), capsys, "needs a window", "keep")


@pytest.mark.parametrize("device, needle", [("bogus", "'bogus' is not a device"), ("cuda", "cuda")])
def test_cpu_ref_does_not_ignore_a_device(tiny_ckpt, capsys, device, needle):
    fails(gen(tiny_ckpt, "--device", device), capsys, needle)


# --- non-finite weights ----------------------------------------------------------------

def poison(model_dir, name: str, value: float) -> None:
    tensors = load_file(str(model_dir / WEIGHTS))
    t = tensors[name].clone()
    t.view(-1)[:7] = value
    tensors[name] = t
    save_file(tensors, str(model_dir / WEIGHTS))


@pytest.mark.parametrize("name, value, where", [
    ("model.layers.3.mlp.down_proj.weight", float("nan"), "layer 3"),
    ("model.layers.1.self_attn.k_proj.weight", float("inf"), "layer 1"),
    ("model.embed_tokens.weight", float("nan"), "the embedding"),
])
def test_non_finite_weights_stop_generation_naming_the_layer(tiny_copy, capsys, name, value, where):
    poison(tiny_copy, name, value)
    err = fails(gen(tiny_copy, "--prompt-ids", "0,1,2,3,4,5,6"), capsys, "NaN or inf", f"first in the output of {where}:")
    assert "re-create" in err


def test_sweep_draws_no_verdict_over_failed_runs(tiny_copy, capsys):
    poison(tiny_copy, "model.layers.2.self_attn.o_proj.weight", float("nan"))
    rc = main(["sweep", "--model", str(tiny_copy), "--keep", "1,off", "--prompt-ids", "0,1,2,3,4,5,6",
               "--max-new-tokens", "2", "--json"])
    out = capsys.readouterr()
    assert rc == 2 and out.out == "" and "identical" not in out.err
    assert out.err.startswith("kestrel: error: sweep warm-up on cpu_ref: ") and "layer 2" in out.err


def test_the_layer_search_runs_on_the_error_path_only(tiny_ckpt, monkeypatch, run_model):
    probes = []
    real = Runner.forward

    def counting(self, *args, **kwargs):
        probes.append(kwargs.get("probe") or (args[5] if len(args) > 5 else None))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Runner, "forward", counting)
    result, _ = run_model(tiny_ckpt, residency__keep=2)
    assert probes == []  # a good run never probes: its prompt and tokens go through the batch's passes
    assert sum(result.steps.values()) == len(result.token_ids) - 1


# --- generation numbers ----------------------------------------------------------------

def test_a_kv_cache_too_large_to_allocate(tiny_copy, capsys):
    cfg = json.loads((tiny_copy / "config.json").read_text())
    cfg["max_position_embeddings"] = 2**40
    (tiny_copy / "config.json").write_text(json.dumps(cfg))
    fails(gen(tiny_copy, "--max-new-tokens", str(2**38)), capsys, "KV cache", "MiB", "--max-new-tokens")


def test_a_kv_cache_the_allocator_refuses(tiny_ckpt, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 99 bytes")

    monkeypatch.setattr(kvcache.KVCache, "allocate", refuse)
    fails(gen(tiny_ckpt), capsys, "KV cache", "--max-new-tokens")


@pytest.mark.parametrize("flags, needle", [
    (["--temperature", "nan"], "temperature"), (["--temperature", "inf"], "temperature"),
    (["--seed", str(2**64)], "seed"), (["--seed", "-1"], "seed"),
])
def test_bad_sampling_flags(tiny_ckpt, capsys, flags, needle):
    fails(gen(tiny_ckpt, *flags), capsys, needle)


@pytest.mark.parametrize("line", ["temperature = nan", "temperature = inf", f"seed = {2**63 - 1}0"])
def test_bad_sampling_in_the_config_file(tiny_ckpt, tmp_path, capsys, line):
    path = tmp_path / "kestrel.toml"
    path.write_text(f"[generation]\n{line}\n")
    fails(gen(tiny_ckpt, "--config", str(path)), capsys, line.split()[0])


def test_a_config_file_that_is_a_directory(tiny_ckpt, tmp_path, capsys):
    fails(gen(tiny_ckpt, "--config", str(tmp_path)), capsys, str(tmp_path))


@pytest.mark.parametrize("name, needle", [("no-such-dir/curve.png", "cannot write the plot"),
                                          ("curve.unknownformat", "cannot write the plot")])
def test_a_plot_that_cannot_be_written(tiny_ckpt, tmp_path, capsys, name, needle):
    fails(["sweep", "--model", str(tiny_ckpt), "--keep", "2", "--max-new-tokens", "2", "--plot", str(tmp_path / name)],
          capsys, needle)


# --- what plugins answer ---------------------------------------------------------------

class Answers:
    """A policy plugin whose answers the test sets."""

    def __init__(self, advice=None, preload=None):
        self.advice, self.answer = advice, preload

    @hookimpl
    def on_layer_advance(self, window, layer, phase):
        return self.advice(layer) if callable(self.advice) else self.advice

    @hookimpl
    def preload(self, window):
        return self.answer


@pytest.mark.parametrize("kwargs, needle", [
    (dict(advice=Advice(evict=[[0]])), "asked to evict [0], which is not a layer number"),
    (dict(advice=Advice(prefetch=["2"])), "asked to prefetch '2', which is not a layer number"),
    (dict(advice=Advice(evict=[1.0])), "asked to evict 1.0, which is not a layer number"),
    (dict(advice=Advice(evict=[np.int64(9)])), "asked to evict layer 9; layers are 0..5"),
    (dict(preload=3), "preload must return layer numbers"),
    (dict(preload="01"), "preload must return layer numbers"),
    (dict(preload=[[0]]), "asked to preload [0], which is not a layer number"),
])
def test_bad_plugin_answers_are_one_line_errors(tiny_ckpt, capsys, register_plugin, kwargs, needle):
    register_plugin(Answers(**kwargs), "answers")
    err = fails(gen(tiny_ckpt, "--keep", "2"), capsys, needle)
    assert "np.int64" not in err


def test_numpy_layer_numbers_are_accepted(tiny_ckpt, register_plugin, run_model):
    plain, _ = run_model(tiny_ckpt, residency__keep=2)
    advice = lambda layer: Advice(evict=[np.int64((layer - 1) % 6)], prefetch=[np.int32((layer + 1) % 6)])  # noqa: E731
    register_plugin(Answers(advice=advice, preload=np.arange(2)), "np")
    result, _ = run_model(tiny_ckpt, residency__keep=2)
    assert result.token_ids == plain.token_ids


def test_window_layer_check_names_the_policy(tiny_ckpt, register_plugin):
    from kestrel_core.engine.run import Model
    from conftest import run_config

    register_plugin(Answers(advice=Advice(evict=[7])), "answers")
    with Model(tiny_ckpt) as model, model.open(run_config(residency__keep=2)) as run:
        with pytest.raises(PluginError, match="policy 'asymmetric' asked to evict layer 7"):
            run.window.plan(0, "prefill")


class Noting(Answers):
    """Says a note at every boundary (a backend's fallback note, say), then answers as told."""

    @hookimpl
    def on_layer_advance(self, window, layer, phase):
        warnings.warn("the example note", KestrelNote)
        return super().on_layer_advance(window, layer, phase)


def test_notes_come_after_the_output_and_never_before_an_error(tiny_ckpt, capsys, register_plugin):
    plugin = register_plugin(Noting(), "noting")
    assert main(gen(tiny_ckpt, "--keep", "2")) == 0
    out = capsys.readouterr()
    assert "token ids: " in out.out and out.err.startswith("kestrel: note: the example note\n")
    plugin.advice = Advice(evict=[[0]])
    fails(gen(tiny_ckpt, "--keep", "2"), capsys, "not a layer number")  # one line: the note is dropped
