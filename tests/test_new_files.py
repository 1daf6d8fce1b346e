"""Output files (a trace, a gate report, a plot) are new files: refused before the work when they exist, written
whole, never over a file that appeared meanwhile, with the user's umask, and nothing hidden left behind."""

from __future__ import annotations

import json
import os
import stat

import pytest

from kestrel_core.io import newfile

from kestrel_core.io import renameat
from kestrel_core.cli import main
from kestrel_core.errors import ConfigError
from cli_helpers import fails

GATE = ["gate", "kv-paging", "--total-mb", "32607", "--peak-mb", "19625"]


@pytest.fixture
def config_only(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512}))
    return d


def hidden(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_a_gate_report_never_replaces_a_file(config_only, tmp_path, capsys):
    """`kestrel gate --report FILE` used to replace FILE silently."""
    report = tmp_path / "notes.md"
    report.write_text("my notes")
    fails([*GATE, "--model", str(config_only), "--report", str(report)], capsys,
          f"--report {report} already exists; name a new file")
    assert report.read_text() == "my notes"


def test_a_gate_report_in_a_missing_directory_is_refused_before_the_gate_runs(config_only, tmp_path, capsys):
    report = tmp_path / "no" / "r.md"
    rc = main([*GATE, "--model", str(config_only), "--report", str(report)])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""  # no verdict printed: the gate never ran
    assert captured.err == (f"kestrel: error: --report {report}: {report.parent} does not exist; create the directory "
                            "or name a file in another\n")


def test_a_gate_report_is_written_whole_with_the_users_umask(config_only, tmp_path, capsys):
    report = tmp_path / "r.md"
    old = os.umask(0o022)
    try:
        assert main([*GATE, "--model", str(config_only), "--report", str(report)]) == 0
    finally:
        os.umask(old)
    assert report.read_text().startswith("# gate kv-paging")
    assert stat.S_IMODE(report.stat().st_mode) == 0o644  # mkstemp's 0600 would hide it from the user's group
    assert hidden(tmp_path) == []


def test_a_file_that_appears_meanwhile_is_never_replaced(tmp_path):
    path = tmp_path / "t.json"

    def write(f):
        path.write_text("someone else's")  # after the check, before the rename
        f.write(b"mine")

    with pytest.raises(ConfigError, match="already exists; name a new file"):
        newfile.write_new(path, write, "--trace")
    assert path.read_text() == "someone else's"
    assert hidden(tmp_path) == []


@pytest.mark.parametrize("noreplace", [True, False], ids=["renameat2", "link"])
def test_either_way_into_place_refuses_an_existing_file(tmp_path, monkeypatch, noreplace):
    if not noreplace:
        monkeypatch.setattr(renameat, "noreplace", lambda a, b: False)  # a kernel or filesystem without the flag
    path = tmp_path / "r.md"
    assert newfile.write_text_new(path, "one", "--report") == path
    assert path.read_text() == "one"
    (tmp_path / "s.md").write_text("theirs")
    monkeypatch.setattr(newfile, "check_new", lambda p, flag, suffix=None: p)  # as if it appeared after the check
    with pytest.raises(ConfigError, match="already exists"):
        newfile.write_text_new(tmp_path / "s.md", "two", "--report")
    assert (tmp_path / "s.md").read_text() == "theirs"
    assert hidden(tmp_path) == []


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), OSError(28, "No space left on device")], ids=["interrupt", "full"])
def test_an_interrupted_or_failed_write_leaves_nothing(tmp_path, exc):
    def write(f):
        f.write(b"half")
        raise exc

    with pytest.raises(type(exc) if isinstance(exc, KeyboardInterrupt) else ConfigError):
        newfile.write_new(tmp_path / "t.json", write, "--trace")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("make, needle", [
    (lambda d: d / "f.png", None),
    (lambda d: d / "exists.png", "already exists"),
    (lambda d: d / "exists.png" / "x.png", "is not a directory"),
    (lambda d: d / "curve.svg", "must end in .png"),
    (lambda d: d / "curve", "must end in .png"),
])
def test_check_new(tmp_path, make, needle):
    (tmp_path / "exists.png").write_text("x")
    if needle is None:
        assert newfile.check_new(make(tmp_path), "--plot", ".png") == make(tmp_path)
    else:
        with pytest.raises(ConfigError, match=needle):
            newfile.check_new(make(tmp_path), "--plot", ".png")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_directory_that_cannot_be_written_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(ConfigError, match="is not writable"):
            newfile.check_new(ro / "r.md", "--report")
    finally:
        ro.chmod(0o755)
