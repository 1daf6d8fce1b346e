"""A sweep's side outputs: the plot's path is checked before the work and a failed plot never costs the table; the
plot names its model; the verdict names each figure with its policy; matplotlib comes with a plain install."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from kestrel_core.tools import sweep
from kestrel_core.cli import main
from cli_helpers import fails

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def sweep_argv(model, *extra):
    return ["sweep", "--model", str(model), "--keep", "2", "--policy", "asymmetric,pinned_set", "--max-new-tokens", "3",
            "--ignore-eos", *extra]


@pytest.fixture
def counted_runs(monkeypatch):
    """How many sweep runs started: a check 'before the sweep' must leave it at 0."""
    started = []
    real = sweep._run
    monkeypatch.setattr(sweep, "_run", lambda *a, **k: (started.append(1), real(*a, **k))[1])
    return started


@pytest.mark.parametrize("name, needle", [
    ("no-such-dir/curve.png", "no-such-dir does not exist"),
    ("curve.svg", "the file must end in .png"),
    ("curve", "the file must end in .png"),
    ("exists.png", "already exists; name a new file"),
    ("a-file/curve.png", "a-file is not a directory"),
])
@pytest.mark.parametrize("command", ["sweep", "demo"])
def test_a_bad_plot_path_is_refused_before_the_sweep(tiny_ckpt, tmp_path, capsys, counted_runs, command, name, needle):
    """A bad --plot was found only after the whole sweep (65 s lost), and then no table was printed at all."""
    (tmp_path / "exists.png").write_bytes(b"mine")
    (tmp_path / "a-file").write_text("x")
    argv = sweep_argv(tiny_ckpt) if command == "sweep" else ["demo", "--cache-dir", str(tmp_path / "cache"),
                                                              "--max-new-tokens", "1"]
    fails([*argv, "--plot", str(tmp_path / name)], capsys, "cannot write the plot: --plot", needle)
    assert counted_runs == []
    assert (tmp_path / "exists.png").read_bytes() == b"mine"


def test_a_plot_that_fails_after_the_sweep_keeps_the_table(tiny_ckpt, tmp_path, capsys, monkeypatch):
    png = tmp_path / "curve.png"

    def appears_meanwhile(rows, path, model=""):
        png.write_bytes(b"someone else's")  # the path was free when checked; a file took it during the sweep
        return real(rows, path, model)

    real = sweep.plot
    monkeypatch.setattr("kestrel_core.commands.sweep.plot", appears_meanwhile)
    rc = main(sweep_argv(tiny_ckpt, "--plot", str(png)))
    captured = capsys.readouterr()
    assert rc == 2
    assert "invariance on cpu_ref: token ids identical" in captured.out and "pinned_set vs asymmetric" in captured.out
    assert captured.err == f"kestrel: error: cannot write the plot: --plot {png} already exists; name a new file " \
                           "(kestrel never replaces one)\n"
    assert png.read_bytes() == b"someone else's"


def test_the_plot_is_titled_with_the_model(tiny_ckpt, tmp_path, capsys, monkeypatch):
    titles = []
    import matplotlib.axes

    real = matplotlib.axes.Axes.set_title
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title", lambda self, t, *a, **k: (titles.append(t),
                                                                                      real(self, t, *a, **k))[1])
    png = tmp_path / "curve.png"
    assert main(sweep_argv(tiny_ckpt, "--plot", str(png))) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert titles == [f"kestrel sweep: {tiny_ckpt}, 3 tokens a run"]
    assert [p.name for p in tmp_path.iterdir()] == ["curve.png"]  # and no temporary left beside it


def test_the_verdict_names_each_figure_with_its_policy(tiny_ckpt, capsys):
    """It printed 'pinned_set vs asymmetric ... 18.00 vs 15.00 MiB/token', asymmetric's figure first."""
    assert main(sweep_argv(tiny_ckpt)) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("pinned_set vs asymmetric")][0]
    m = re.search(r"uploaded pinned_set ([\d.,]+) MiB/token \((\d+)% fewer bytes\), asymmetric ([\d.,]+) MiB/token", line)
    assert m, line
    pinned, saved, asym = float(m[1].replace(",", "")), int(m[2]), float(m[3].replace(",", ""))
    assert pinned < asym and abs(saved - 100 * (asym - pinned) / asym) < 2  # the figures are printed rounded
    assert re.search(r"peak pinned_set [\d.]+ MiB, asymmetric [\d.]+ MiB", line)


def test_matplotlib_comes_with_a_plain_install():
    """The README's `kestrel sweep ... --plot curve.png` failed after the README's own `pip install -e .`."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(re.match(r"matplotlib\b", r) for r in project["dependencies"])
    readme = (ROOT / "README.md").read_text()
    assert "--plot curve.png" in readme and "pip install -e . && kestrel demo" in readme
