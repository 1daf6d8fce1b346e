"""Model names from the local Hugging Face cache: `--model Org/Name` runs the cached snapshot, offline, and a name
that is not there is one line naming the cache searched."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import fails

from kestrel_core import load

from kestrel_core.formats import hub
from kestrel_core.cli import main
from kestrel_core.tools.presets import preset_config, write_checkpoint

REPO = "Org/Name"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
RUN = ["--prompt-ids", "5,17,42", "--max-new-tokens", "4", "--ignore-eos", "--json"]


def cache_model(cache: Path, repo_id: str, model: Path, commit: str = COMMIT, ref: str | None = "main") -> Path:
    """Lay ``model``'s files into ``cache`` as huggingface_hub does: blobs named by hash, a snapshot of symlinks to
    them, and refs/<ref> holding the commit. Returns the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for f in sorted(model.iterdir()):
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    if ref:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return write_checkpoint(preset_config("tiny"), tmp_path_factory.mktemp("hub") / "tiny")


@pytest.fixture
def hf_cache(tmp_path, monkeypatch, tiny_model) -> Path:
    """A Hugging Face cache holding the tiny model as Org/Name, named by HF_HUB_CACHE (set after huggingface_hub
    was imported), with every network connection refused."""
    import huggingface_hub  # noqa: F401  imported first: its constants no longer see the environment

    cache = tmp_path / "hf-cache"
    cache_model(cache, REPO, tiny_model)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def no_network(*args, **kwargs):
        raise AssertionError(f"a network call: {args}")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    return cache


def generate_json(capsys, model: str, *extra: str) -> dict:
    rc = main(["generate", "--model", model, *RUN, *extra])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out)


def test_the_fake_cache_is_laid_out_as_huggingface_hub_reads_it(hf_cache):
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(hf_cache)
    assert not info.warnings, info.warnings
    (repo,) = info.repos
    assert repo.repo_id == REPO and repo.repo_type == "model"
    (rev,) = repo.revisions
    assert rev.commit_hash == COMMIT and rev.refs == frozenset({"main"})
    assert {f.file_name for f in rev.files} >= {"config.json", "model.safetensors", "tokenizer.json"}


def test_generate_by_name_runs_the_cached_snapshot(hf_cache, tiny_model, capsys):
    by_name = generate_json(capsys, REPO)
    by_dir = generate_json(capsys, str(tiny_model))
    assert by_name["token_ids"] == by_dir["token_ids"] and len(by_name["token_ids"]) == 4
    assert by_name["model"] == REPO


def test_a_name_in_kestrel_toml_resolves_too(hf_cache, tiny_model, tmp_path, capsys):
    toml = tmp_path / "kestrel.toml"
    toml.write_text(f'model = "{REPO}"\n')
    rc = main(["generate", "--config", str(toml), *RUN])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert json.loads(out.out)["token_ids"] == generate_json(capsys, str(tiny_model))["token_ids"]


def test_the_python_api_loads_a_name(hf_cache):
    with load(REPO) as model:
        assert model.dir == (hf_cache / "models--Org--Name" / "snapshots" / COMMIT).resolve()
        with model.open(backend="cpu_ref", keep=2) as run:
            assert len(run.generate(prompt_ids=[1, 2, 3], max_new_tokens=2, stop_at_eos=False).token_ids) == 2


def test_a_lookup_writes_nothing_to_the_cache(hf_cache, capsys):
    def tree():
        return sorted((str(p.relative_to(hf_cache)), p.lstat().st_mtime_ns) for p in hf_cache.rglob("*"))

    before = tree()
    generate_json(capsys, REPO)
    fails(["generate", "--model", "Org/Missing", *RUN], capsys, "not in the Hugging Face cache")
    assert tree() == before


def test_hf_home_names_the_cache_when_hf_hub_cache_is_unset(hf_cache, tmp_path, monkeypatch, tiny_model, capsys):
    home = tmp_path / "hf-home"
    cache_model(home / "hub", "other/model", tiny_model)
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    assert hub.cache_dir() == home / "hub"
    assert len(generate_json(capsys, "other/model")["token_ids"]) == 4
    fails(["generate", "--model", REPO, *RUN], capsys, str(home / "hub"))  # HF_HUB_CACHE's cache is not searched now


def test_a_name_not_in_the_cache_is_one_line_naming_the_cache_and_the_fix(hf_cache, capsys):
    fails(["generate", "--model", "Org/Missing", *RUN], capsys,
          "'Org/Missing' is not a directory and not in the Hugging Face cache", f"searched {hf_cache}",
          "pass a model directory", "hf download Org/Missing", "kestrel never downloads")
    fails(["sweep", "--model", "gpt2", "--keep", "2"], capsys, f"searched {hf_cache}", "hf download gpt2")


def test_an_incomplete_snapshot_says_so(hf_cache, tmp_path, tiny_model, capsys):
    cache_model(hf_cache, "Org/NoRef", tiny_model, ref=None)  # interrupted before refs/main was written
    fails(["generate", "--model", "Org/NoRef", *RUN], capsys, "holds models--Org--NoRef but no complete snapshot",
          "hf download Org/NoRef")
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copyfile(tiny_model / "config.json", partial / "config.json")  # only config.json was fetched
    snapshot = cache_model(hf_cache, "Org/Partial", partial)
    fails(["generate", "--model", "Org/Partial", *RUN], capsys, f"({snapshot})", "has no *.safetensors",
          "hf download Org/Partial")


def test_a_download_listing_asks_only_for_the_files_kestrel_reads(hf_cache, tmp_path, tiny_model, capsys):
    """huggingface_hub keeps the repo's file listing beside a download (trees/<commit>.json) and calls a snapshot
    that lacks a listed file incomplete: a download of only *.json and *.safetensors still resolves, a missing
    shard does not."""
    cache_mod = pytest.importorskip("huggingface_hub._tree_cache", reason="huggingface_hub without download listings")

    def listing(repo_id: str, names: list[str]) -> None:
        entries = {n: cache_mod.TreeCacheEntry(size=1, blob_id="0" * 40) for n in names}
        cache_mod.write_tree_cache(str(hf_cache / ("models--" + repo_id.replace("/", "--"))), COMMIT, entries)

    files = sorted(p.name for p in tiny_model.iterdir())
    listing(REPO, files + ["pytorch_model.bin", "original/consolidated.00.pth"])  # not downloaded, not read
    assert len(generate_json(capsys, REPO)["token_ids"]) == 4
    sharded = write_checkpoint(preset_config("tiny", "float32"), tmp_path / "sharded", shard_mb=1)  # 2 shards
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    (sharded / shards[-1]).unlink()
    (sharded / "model.safetensors.index.json").unlink()
    cache_model(hf_cache, "Org/Sharded", sharded)
    listing("Org/Sharded", sorted(p.name for p in sharded.iterdir()) + [shards[-1], "model.safetensors.index.json"])
    fails(["generate", "--model", "Org/Sharded", *RUN], capsys, "holds models--Org--Sharded but no complete snapshot",
          "hf download Org/Sharded")


def test_a_path_that_is_no_repo_id_keeps_the_directory_error(hf_cache, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for path in ("no/such/dir", "./nowhere", str(tmp_path / "absent")):
        assert not hub.is_repo_id(path)
        fails(["generate", "--model", path, *RUN], capsys, "does not exist", "make-model")
    (tmp_path / "weights.bin").write_text("x")
    fails(["generate", "--model", "weights.bin", *RUN], capsys, "is a file, not a directory")  # exists: a path


def test_a_directory_wins_over_a_cached_name(hf_cache, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write_checkpoint(preset_config("tiny-llama"), tmp_path / "Org" / "Name")
    with load(REPO) as model:
        assert model.dir == Path("Org/Name") and model.config.model_type == "llama"


def test_quantize_reads_a_cached_name(hf_cache, tmp_path, capsys):
    rc = main(["quantize", "--model", REPO, "--out", str(tmp_path / "q8"), "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert json.loads(out.out)["quantized"] > 0
    with load(tmp_path / "q8") as model:
        assert model.quant is not None
    from kestrel_core.tools.quantize import quantize_checkpoint  # the Python API takes the name too

    assert quantize_checkpoint(REPO, tmp_path / "q8-api", 32)["quantized"] > 0


@pytest.mark.parametrize("env", [
    {},
    {"HF_HOME": "/x/hf-home"},
    {"XDG_CACHE_HOME": "/x/xdg"},
    {"HF_HOME": "~/hf", "XDG_CACHE_HOME": "/x/xdg"},
    {"HUGGINGFACE_HUB_CACHE": "/x/legacy", "HF_HOME": "/x/hf-home"},
    {"HF_HUB_CACHE": "$KESTREL_T/hub", "KESTREL_T": "/x/t", "HUGGINGFACE_HUB_CACHE": "/x/legacy"},
])
def test_cache_dir_is_huggingface_hubs_own(env, monkeypatch):
    """huggingface_hub's constant, read in a process started with ``env``, is kestrel's lookup under ``env`` now."""
    for name in ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code = "from huggingface_hub import constants; print(constants.HF_HUB_CACHE)"
    theirs = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert str(hub.cache_dir()) == theirs


def test_kestrel_generate_by_name_in_a_fresh_process(hf_cache, tiny_model):
    """The `kestrel` command itself, with HF_HUB_CACHE set before anything is imported and offline mode off."""
    env = {**os.environ, "HF_HUB_CACHE": str(hf_cache), "HF_HUB_OFFLINE": "0"}
    proc = subprocess.run([sys.executable, "-m", "kestrel_core.cli", "generate", "--model", REPO, *RUN],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert len(json.loads(proc.stdout)["token_ids"]) == 4
