"""The example out-of-tree package, pip-installed into a temporary directory, plugs in like a third party would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "kestrel-plugin-example"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "--target", str(target), str(EXAMPLE)],
        check=True, capture_output=True, text=True, timeout=180,
    )
    return target


PACKAGE = "kestrel-plugin-example"


def with_package(site: Path, load: str | None = PACKAGE) -> dict:
    """The environment of a process that sees the installed example; ``load`` is KESTREL_LOAD_PLUGINS (None: unset)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))
    env.pop("KESTREL_LOAD_PLUGINS", None)
    if load is not None:
        env["KESTREL_LOAD_PLUGINS"] = load
    return env


def kestrel(args: list[str], site: Path | None, load: str | None = PACKAGE):
    env = dict(os.environ) if site is None else with_package(site, load)
    return subprocess.run([sys.executable, "-m", "kestrel_core.cli", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def belady_uploads(n_layers: int, capacity: int, passes: int) -> int:
    """Misses of Belady's MIN (evict the entry next used furthest ahead) on the cyclic layer loop."""
    seq = [layer for _ in range(passes) for layer in range(n_layers)]
    cache: set[int] = set()
    misses = 0
    for t, x in enumerate(seq):
        if x in cache:
            continue
        misses += 1
        if len(cache) >= capacity:
            ahead = {y: next((u for u in range(t + 1, len(seq)) if seq[u] == y), len(seq)) for y in cache}
            cache.remove(max(cache, key=ahead.get))
        cache.add(x)
    return misses


@pytest.mark.slow  # pip-installs the example package (the installed fixture)
def test_plugins_lists_the_installed_package_with_its_version(installed):
    meta = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    out = kestrel(["plugins", "--json"], installed)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    mine = [r for r in rows if r["name"] == "mru"]
    assert mine == [{"kind": "policy", "name": "mru", "package": meta["name"], "version": meta["version"],
                     "plugin": mine[0]["plugin"]}]
    assert {r["package"] for r in rows if r["name"] != "mru"} == {"kestrel"}


@pytest.mark.slow  # pip-installs the example package (the installed fixture)
@pytest.mark.parametrize("load, listed", [(None, True), (PACKAGE, True), (PACKAGE.replace("-", "_").upper(), True),
                                          ("", False), ("some-other-package,kestrel", None)])
def test_kestrel_load_plugins_selects_the_packages(installed, load, listed):
    out = kestrel(["plugins", "--json"], installed, load)
    if listed is None:  # a name that no installed package provides is an error, not a silent no-op
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert "KESTREL_LOAD_PLUGINS names some-other-package" in out.stderr
        return
    assert out.returncode == 0, out.stderr
    names = {r["name"] for r in json.loads(out.stdout)}
    assert ("mru" in names) is listed
    assert {"asymmetric", "pool", "cpu_ref"} <= names  # the built-ins always load


def test_without_the_install_the_policy_is_unknown(tiny_ckpt):
    from kestrel_core.errors import PluginError
    from kestrel_core.plugins import lookup

    with pytest.raises(PluginError, match="unknown policy 'mru'; available: asymmetric, belady, future_evicting"):
        lookup("policies", "mru")


@pytest.mark.slow  # pip-installs the example package (the installed fixture)
def test_generate_through_the_cli_with_the_plugin_policy(installed, tiny_ckpt, run_model):
    out = kestrel(["generate", "--model", str(tiny_ckpt), "--prompt-ids", "5,6,7", "--policy", "mru", "--keep", "2",
                   "--max-new-tokens", "10", "--ignore-eos", "--json"], installed)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    L = json.loads((tiny_ckpt / "config.json").read_text())["num_hidden_layers"]
    assert got["policy"] == "mru" and len(got["token_ids"]) == 10
    same, _ = run_model(tiny_ckpt, prompt=[5, 6, 7], residency__keep=2, generation__max_new_tokens=10)
    assert got["token_ids"] == same.token_ids  # the policy's ids are everyone's ids
    assert got["counters"]["layer_uploads"] == belady_uploads(L, 2, 10)


# One fresh process runs several generations through the installed entry point (a process costs seconds).
DRIVER = """
import contextlib, io, json, sys
from kestrel_core.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    out.append({"rc": rc, "result": json.loads(buf.getvalue()) if rc == 0 else None})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def many(installed, tiny_ckpt):
    def argv(policy, keep):
        return ["generate", "--model", str(tiny_ckpt), "--prompt-ids", "5,6,7", "--policy", policy, "--keep", str(keep),
                "--max-new-tokens", "10", "--ignore-eos", "--json"]

    settings = [("mru", 1), ("mru", 4), ("future_evicting", 1), ("future_evicting", 4), ("pinned_set", 2)]
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps([argv(*s) for s in settings])], env=with_package(installed),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(r["rc"] == 0 for r in runs), proc.stderr
    return {s: r["result"] for s, r in zip(settings, runs)}


@pytest.mark.slow  # pip-installs the example package (the installed fixture)
@pytest.mark.parametrize("keep", [1, 4])
def test_mru_uploads_what_belady_predicts_at_a_peak_of_keep_layers(many, tiny_ckpt, keep):
    L = json.loads((tiny_ckpt / "config.json").read_text())["num_hidden_layers"]
    mru = many[("mru", keep)]
    assert mru["counters"]["layer_uploads"] == belady_uploads(L, keep, 10)
    # Its peak is exactly `keep` layers: the same as future_evicting's, which never holds more.
    assert mru["peak_resident_bytes"] == many[("future_evicting", keep)]["peak_resident_bytes"]
    assert mru["token_ids"] == many[("future_evicting", keep)]["token_ids"]


@pytest.mark.slow  # pip-installs the example package (the installed fixture)
def test_mru_beats_pinned_set_at_the_same_peak(many):
    mru, pinned = many[("mru", 4)], many[("pinned_set", 2)]
    assert mru["peak_resident_bytes"] == pinned["peak_resident_bytes"]
    assert sum(mru["bytes_uploaded_per_token"]) < sum(pinned["bytes_uploaded_per_token"])
