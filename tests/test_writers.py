"""Commands that write a model lose no data: they refuse a non-empty --out, and a write is whole or absent."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import pytest
import torch

from kestrel_core.tools import presets

from kestrel_core.tools import quantize
from kestrel_core.cli import main
from cli_helpers import fails

MAKE = ["make-model", "--preset", "tiny-llama"]


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file of a directory with its bytes: what 'left as it was' means."""
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def leftovers(parent: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name not in keep)


@pytest.fixture
def victim(tmp_path, capsys) -> Path:
    """A user's model directory (tiny-llama, seed 0)."""
    out = tmp_path / "victim"
    assert main([*MAKE, "--out", str(out)]) == 0
    capsys.readouterr()
    return out


# --- refusing -------------------------------------------------------------------------

def test_quantize_refuses_a_users_model_directory(victim, tiny_ckpt, capsys):
    before = snapshot(victim)
    fails(["quantize", "--model", str(tiny_ckpt), "--out", str(victim)], capsys, str(victim), "is not empty", "--force")
    assert snapshot(victim) == before


@pytest.mark.parametrize("content", ["config.json", "other model"])
def test_make_model_refuses_a_non_empty_out(victim, tmp_path, capsys, content):
    if content == "config.json":
        target = tmp_path / "mine"
        target.mkdir()
        (target / "config.json").write_text('{"mine": true}')
    else:
        target = victim
    before = snapshot(target)
    fails([*MAKE, "--out", str(target), "--seed", "7"], capsys, "is not empty", "--force")
    assert snapshot(target) == before


def test_force_refuses_files_that_are_not_a_models(victim, capsys):
    (victim / "notes.txt").write_text("mine")
    before = snapshot(victim)
    fails([*MAKE, "--out", str(victim), "--force"], capsys, "notes.txt", "not a model file")
    assert snapshot(victim) == before


def test_force_replaces_a_sharded_model_as_a_whole(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["make-model", "--preset", "demo", "--out", str(out), "--shard-mb", "1"]) == 0
    assert (out / "model.safetensors.index.json").is_file()
    capsys.readouterr()
    assert main(["make-model", "--preset", "demo", "--out", str(out), "--shard-mb", "0", "--force", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "tokenizer.json"]
    assert report["bytes"] == (out / "model.safetensors").stat().st_size  # not the stale shards' sizes too
    assert report["files"] == sorted(p.name for p in out.iterdir())
    assert main(["generate", "--model", str(out), "--prompt-ids", "1,2", "--max-new-tokens", "2"]) == 0
    assert leftovers(tmp_path, {"m"}) == []


# --- whole or absent -------------------------------------------------------------------

def _fail_on_second_save(monkeypatch, exc: BaseException):
    real, calls = presets.save_file, []

    def save(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise exc
        real(tensors, path, metadata=metadata)

    monkeypatch.setattr(presets, "save_file", save)
    return calls


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), OSError(errno.ENOSPC, "No space left on device")],
                         ids=["interrupt", "full-disk"])
def test_an_interrupted_make_model_leaves_the_old_model(tmp_path, capsys, monkeypatch, exc):
    out = tmp_path / "m"
    assert main(["make-model", "--preset", "demo", "--out", str(out), "--shard-mb", "1", "--seed", "1"]) == 0
    capsys.readouterr()
    before = snapshot(out)
    calls = _fail_on_second_save(monkeypatch, exc)
    argv = ["make-model", "--preset", "demo", "--out", str(out), "--shard-mb", "1", "--seed", "2", "--force"]
    if isinstance(exc, KeyboardInterrupt):
        assert main(argv) == 130
    else:
        fails(argv, capsys, "No space left on device", str(out))
    assert len(calls) == 2  # it did fail in the middle of the shards
    assert snapshot(out) == before  # the old seed's shards, all of them, and nothing of the new seed's
    assert leftovers(tmp_path, {"m"}) == []


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), OSError(errno.ENOSPC, "No space left on device")],
                         ids=["interrupt", "full-disk"])
def test_an_interrupted_quantize_leaves_nothing(tiny_ckpt, tmp_path, capsys, monkeypatch, exc):
    real = quantize.write_safetensors

    def write(path, items, tensors, metadata):
        def failing():
            for i, t in enumerate(tensors):
                if i == 3:
                    raise exc
                yield t
        real(path, items, failing(), metadata)

    monkeypatch.setattr(quantize, "write_safetensors", write)
    out = tmp_path / "q"
    argv = ["quantize", "--model", str(tiny_ckpt), "--out", str(out)]
    if isinstance(exc, KeyboardInterrupt):
        assert main(argv) == 130
    else:
        fails(argv, capsys, "No space left on device")
    assert not out.exists()
    assert leftovers(tmp_path, set()) == []  # no model.safetensors.partial, no temporary directory


def test_written_files_follow_the_umask(tmp_path, capsys, tiny_ckpt):
    old = os.umask(0o022)
    try:
        assert main([*MAKE, "--out", str(tmp_path / "m")]) == 0
        assert main(["quantize", "--model", str(tiny_ckpt), "--out", str(tmp_path / "q")]) == 0
    finally:
        os.umask(old)
    for d in (tmp_path / "m", tmp_path / "q"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o755
        for f in d.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o644, f  # others can read the model


# --- bad output paths and devices ------------------------------------------------------

@pytest.fixture
def a_file(tmp_path) -> Path:
    path = tmp_path / "a-file"
    path.write_text("not a directory")
    return path


@pytest.mark.parametrize("argv", [MAKE, ["quantize", "--model", "{tiny}"]], ids=["make-model", "quantize"])
def test_out_that_is_a_file(argv, a_file, tiny_ckpt, capsys):
    argv = [a.replace("{tiny}", str(tiny_ckpt)) for a in argv]
    fails([*argv, "--out", str(a_file)], capsys, str(a_file), "is a file")
    assert a_file.read_text() == "not a directory"


@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_out_that_cannot_be_written(where, a_file, capsys):
    out = a_file / "sub" if where == "under-a-file" else Path("/proc/kestrel-test-out")
    fails([*MAKE, "--out", str(out)], capsys, "cannot write", str(out))


def test_demo_cache_dir_that_is_a_file(a_file, capsys):
    fails(["demo", "--cache-dir", str(a_file), "--max-new-tokens", "1"], capsys, f"--cache-dir {a_file} is a file")


def test_demo_cache_that_holds_another_model(tmp_path, capsys):
    assert main([*MAKE, "--out", str(tmp_path / "demo-qwen3")]) == 0
    capsys.readouterr()
    fails(["demo", "--cache-dir", str(tmp_path), "--max-new-tokens", "1"], capsys, "not kestrel's demo checkpoint")


def test_demo_writes_its_cache_whole(tmp_path, capsys, monkeypatch):
    _fail_on_second_save(monkeypatch, KeyboardInterrupt())
    monkeypatch.setattr(presets, "shard_plan", lambda cfg, mb: [list(presets.all_specs(cfg))[:3],
                                                                list(presets.all_specs(cfg))[3:]])
    assert main(["demo", "--cache-dir", str(tmp_path), "--max-new-tokens", "1"]) == 130
    assert leftovers(tmp_path, set()) == []  # no half-written demo-qwen3 for the next run to trust


@pytest.mark.parametrize("device, needle", [("bogus", "'bogus' is not a device"), ("meta", "not meta")])
@pytest.mark.parametrize("argv", [MAKE, ["quantize", "--model", "{tiny}"]], ids=["make-model", "quantize"])
def test_bad_device(argv, device, needle, tiny_ckpt, tmp_path, capsys):
    argv = [a.replace("{tiny}", str(tiny_ckpt)) for a in argv]
    fails([*argv, "--out", str(tmp_path / "o"), "--device", device], capsys, needle)
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("argv", [MAKE, ["quantize", "--model", "{tiny}"]], ids=["make-model", "quantize"])
def test_cuda_device_without_a_gpu(argv, tiny_ckpt, tmp_path, capsys):
    argv = [a.replace("{tiny}", str(tiny_ckpt)) for a in argv]
    fails([*argv, "--out", str(tmp_path / "o"), "--device", "cuda"], capsys, "needs an NVIDIA GPU", "--device cpu")


@pytest.mark.parametrize("flags, needle", [(["--shard-mb", "-1"], "--shard-mb"), (["--seed", str(2**64)], "--seed"),
                                           (["--seed", "-1"], "--seed")])
def test_bad_make_model_numbers(flags, needle, tmp_path, capsys):
    fails([*MAKE, "--out", str(tmp_path / "o"), *flags], capsys, needle)
    assert not (tmp_path / "o").exists()
