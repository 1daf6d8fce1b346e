"""Progress bars: tqdm draws them on stderr for a person at a terminal, and nothing is written under --json, off a
terminal, or from the Python API; a command's own output is the same either way."""

from __future__ import annotations

import json
import sys

import pytest

from kestrel_core.io import progress
from kestrel_core.cli import main
from kestrel_core.tools.presets import preset_config, write_checkpoint


@pytest.fixture
def tty(monkeypatch):
    """``tty()`` in a test: stderr (the capture that is sys.stderr while the test runs, not during its set-up)
    claims to be a terminal; ``tty(False)`` takes it back."""
    def set_tty(on: bool = True):
        monkeypatch.setattr(sys.stderr, "isatty", lambda: on, raising=False)
    return set_tty


def cli(capsys, *argv) -> tuple[str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out, out.err


def test_make_model_draws_a_bar_at_a_terminal_and_its_output_is_unchanged(tmp_path, capsys, tty):
    tty()
    out, err = cli(capsys, "make-model", "--preset", "tiny", "--out", str(tmp_path / "a"))
    assert "make-model:" in err and "570k/570k" in err and "writing model.safetensors" in err  # bytes, by 1024
    assert "\r" in err and err.endswith("\r")  # tqdm's bar, redrawn in place and cleared at the end
    assert out == f"wrote tiny (6 layers, 0.6 MiB) to {tmp_path / 'a'}\n"
    tty(False)
    quiet_out, quiet_err = cli(capsys, "make-model", "--preset", "tiny", "--out", str(tmp_path / "b"))
    assert quiet_err == "" and quiet_out == out.replace(str(tmp_path / "a"), str(tmp_path / "b"))
    for f in (tmp_path / "a").iterdir():
        assert (tmp_path / "b" / f.name).read_bytes() == f.read_bytes()


def test_make_model_json_is_quiet_at_a_terminal(tmp_path, capsys, tty):
    tty()
    out, err = cli(capsys, "make-model", "--preset", "tiny", "--out", str(tmp_path / "m"), "--json")
    assert err == ""
    assert json.loads(out)["preset"] == "tiny"


def test_quantize_counts_the_linear_weights(tiny_ckpt, tmp_path, capsys, tty):
    tty()
    out, err = cli(capsys, "quantize", "--model", str(tiny_ckpt), "--out", str(tmp_path / "q"))
    linear = 6 * 7  # q, k, v, o, gate, up, down a layer; the tied lm_head too, untied to q8
    assert "quantize:" in err and f"/{linear + 1} " in err and "weight" in err
    assert out.startswith("wrote q8 group 32") and "\r" not in out
    _, err = cli(capsys, "quantize", "--model", str(tiny_ckpt), "--out", str(tmp_path / "j"), "--json")
    assert err == ""
    tty(False)
    _, err = cli(capsys, "quantize", "--model", str(tiny_ckpt), "--out", str(tmp_path / "n"))
    assert err == ""


def test_sweep_json_is_quiet_at_a_terminal(tiny_ckpt, capsys, tty):
    tty()
    out, err = cli(capsys, "sweep", "--model", str(tiny_ckpt), "--keep", "2,off", "--max-new-tokens", "2", "--json")
    assert err == "" and len(json.loads(out)["rows"]) == 2


def test_the_python_api_draws_nothing_unless_asked(tmp_path, capsys, tty):
    tty()
    write_checkpoint(preset_config("tiny"), tmp_path / "api")
    assert capsys.readouterr().err == ""  # a library call at a terminal stays quiet
    with progress.shown():
        write_checkpoint(preset_config("tiny"), tmp_path / "shown")
    assert "make-model:" in capsys.readouterr().err


def test_shown_needs_a_terminal_and_restores_the_outer_setting(capsys, tty):
    tty()
    assert not progress.enabled()
    with progress.shown() as on:
        assert on and progress.enabled()
        with progress.shown(False) as inner:  # e.g. a --json command run from inside another
            assert not inner and not progress.enabled()
            with progress.bar(3, "hidden") as bar:
                bar.update(3)
            progress.say("hidden")
        assert progress.enabled()
    assert not progress.enabled()
    tty(False)
    with progress.shown() as on:
        assert not on
        with progress.bar(3, "hidden") as bar:
            bar.update(3)
    assert capsys.readouterr().err == ""


def test_a_bar_is_cleared_when_its_work_fails(capsys, tty):
    tty()
    with pytest.raises(RuntimeError), progress.shown(), progress.bar(10, "pinning", "B") as bar:
        bar.update(4)
        raise RuntimeError("boom")
    err = capsys.readouterr().err
    assert "pinning:" in err and err.endswith("\r")  # leave=False: the line is blanked, an error line comes next
    assert not progress.enabled()


def test_a_load_loop_reports_bytes_as_a_backend_would(capsys, tty):
    """The shape of a backend's pinning loop: one bar over the bytes staged, updated a unit at a time."""
    tty()
    units = [3 * 2**20, 5 * 2**20, 8 * 2**20]
    with progress.shown():
        with progress.bar(sum(units), "pinning", "B") as bar:
            for n in units:
                bar.set_postfix_str(f"unit of {n >> 20} MiB")
                bar.update(n)
        progress.say("pinned")
    err = capsys.readouterr().err
    assert "pinning:" in err and "16.0M" in err and "unit of 8 MiB" in err and "pinned\n" in err
