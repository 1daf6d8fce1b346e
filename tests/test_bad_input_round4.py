"""Bad input, round four: what round three left (each was accepted silently or worded wrongly)."""

from __future__ import annotations

import pytest
from cli_helpers import fails, gen

from kestrel_core import load
from kestrel_core.cli import main
from kestrel_core.errors import ConfigError


def test_expert_fetch_layer_on_a_dense_model_is_refused(tiny_ckpt, capsys):
    with load(tiny_ckpt) as model:
        with pytest.raises(ConfigError, match="expert_fetch = 'layer' is for Mixture-of-Experts models; .* has no "
                                              "experts: leave --expert-fetch out"):
            model.open(expert_fetch="layer")
    fails(gen(tiny_ckpt, "--expert-fetch", "layer"), capsys, "expert_fetch = 'layer' is for Mixture-of-Experts")


def test_an_unknown_gate_is_named_before_the_missing_model(capsys):
    assert main(["gate", "nope"]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "no model given" not in err and len(err.strip().splitlines()) == 1


def test_a_kestrel_toml_with_a_byte_order_mark_is_read(tiny_ckpt, tmp_path, capsys):
    """Windows editors write a UTF-8 BOM; tomllib then said "Invalid statement (at line 1, column 1)"."""
    (tmp_path / "kestrel.toml").write_bytes(b"\xef\xbb\xbf[generation]\nmax_new_tokens = 3\n")
    assert main(gen(tiny_ckpt, "--config", str(tmp_path / "kestrel.toml"), "--json")) == 0
    import json

    assert len(json.loads(capsys.readouterr().out)["token_ids"]) <= 3


def test_a_gguf_whose_metadata_is_wrong_is_not_told_to_fix_config_json(tmp_path):
    """A GGUF has no config.json: its metadata errors named one."""
    from gguf_files import write_model

    from kestrel_core.errors import CheckpointError

    path, _ = write_model(tmp_path / "m.gguf", meta={"llama.block_count": 10**9})
    with pytest.raises((ConfigError, CheckpointError)) as err:
        load(path)
    assert "config.json" not in str(err.value) and "the GGUF's metadata is wrong" in str(err.value)
    assert "re-convert the model" in str(err.value)


def _weights(model_dir):
    return sorted(model_dir.glob("*.safetensors"))[0]


@pytest.mark.parametrize("change", ["truncate", "rewrite"])
def test_a_weights_file_changed_under_a_run_stops_it_with_an_error_not_sigbus(tiny_copy, change):
    """cp over a model file truncates it first: the next touch of a mapped page past the new end killed the process
    with SIGBUS, with nothing logged; a same-size rewrite gave other weights without a word."""
    import os

    from kestrel_core.errors import CheckpointError

    with load(tiny_copy) as model, model.open(keep=1) as run:
        run.generate(prompt_ids=[1, 2, 3], max_new_tokens=2)
        path = _weights(tiny_copy)
        size = path.stat().st_size
        if change == "truncate":
            os.truncate(path, size // 2)
            needle = f"was cut from {size:,} to {size // 2:,} bytes while this run mapped it"
        else:
            with open(path, "r+b") as fh:  # the same bytes, written again: only the time moves
                data = fh.read()
                fh.seek(0)
                fh.write(data)
            os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
            needle = "was rewritten in place while this run mapped it"
        with pytest.raises(CheckpointError, match=needle):
            run.generate(prompt_ids=[1, 2, 3], max_new_tokens=2)


def test_a_gguf_changed_under_a_run_stops_it(tmp_path):
    import os

    from gguf_files import write_model

    from kestrel_core.errors import CheckpointError

    path, _ = write_model(tmp_path / "m.gguf")
    with load(path) as model, model.open(keep=1) as run:
        run.generate(prompt_ids=[1, 2, 3], max_new_tokens=2)
        os.truncate(path, path.stat().st_size - 4096)
        with pytest.raises(CheckpointError, match="m.gguf was cut from"):
            run.generate(prompt_ids=[1, 2, 3], max_new_tokens=2)


def test_a_model_renamed_over_a_running_one_is_no_change(tiny_copy, tmp_path):
    """Writing beside it and renaming over leaves the mapped file as it was: the run goes on."""
    import os
    import shutil

    with load(tiny_copy) as model, model.open(keep=1) as run:
        want = run.generate(prompt_ids=[1, 2, 3], max_new_tokens=3, stop_at_eos=False).token_ids
        path = _weights(tiny_copy)
        shutil.copy(path, tmp_path / "new.safetensors")
        os.replace(tmp_path / "new.safetensors", path)
        assert run.generate(prompt_ids=[1, 2, 3], max_new_tokens=3, stop_at_eos=False).token_ids == want


def test_ctrl_c_while_the_commands_import_is_one_line(monkeypatch, capsys):
    """The first second of any command is its imports (torch): a Ctrl-C there printed a traceback."""
    import sys

    from kestrel_core import cli

    def interrupted():
        raise KeyboardInterrupt

    import signal

    from kestrel_core.io import signals

    monkeypatch.setattr(cli, "build_parser", interrupted)
    monkeypatch.setattr(sys, "argv", ["kestrel", "generate"])
    held = {s: signal.getsignal(s) for s in signals.SIGNALS}  # main() leaves them ignored, as a process exits
    try:
        assert cli.main() == 130
    finally:
        for s, handler in held.items():
            signal.signal(s, handler)
    assert capsys.readouterr().err == "kestrel: interrupted\n"


def test_the_command_module_imports_no_torch():
    """So the command's handlers are in place before the heavy imports: ``kestrel_core`` loads ``load`` lazily."""
    import subprocess
    import sys

    code = "import sys, kestrel_core.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_open_naming_another_model_is_refused(tiny_ckpt, tmp_path):
    with load(tiny_ckpt) as model:
        with pytest.raises(ConfigError, match=r"open\(model='/elsewhere'\) names another model than the one loaded"):
            model.open(model="/elsewhere")
        with model.open(model=str(tiny_ckpt)) as run:  # its own path: taken
            assert run.generate(prompt_ids=[1, 2], max_new_tokens=1).token_ids


@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_cache_dir_that_is_a_file_is_named_as_one(tmp_path, capsys, monkeypatch, how):
    """It said "File exists"."""
    f = tmp_path / "a-file"
    f.write_text("x")
    if how == "flag":
        fails(["demo", "--cache-dir", str(f)], capsys, f"--cache-dir {f} is a file, not a directory")
    else:
        monkeypatch.setenv("KESTREL_CACHE", str(f))
        fails(["demo"], capsys, f"KESTREL_CACHE {f} is a file, not a directory")


def test_an_index_naming_a_missing_shard_names_that_shard(tmp_path, capsys):
    """A shard renamed in the index: the error named the real shard, still there, as a stray file."""
    import json

    from kestrel_core.tools.presets import preset_config, write_checkpoint

    d = write_checkpoint(preset_config("small-300m", layers=1), tmp_path / "m", shard_mb=30)
    index = d / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    first = sorted(set(raw["weight_map"].values()))[0]
    raw["weight_map"] = {t: ("model-09999-of-09999.safetensors" if f == first else f) for t, f in raw["weight_map"].items()}
    index.write_text(json.dumps(raw))
    fails(gen(d), capsys, "names model-09999-of-09999.safetensors but there is no such file")
