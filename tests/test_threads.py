"""cpu_ref's threads: ``--threads`` / ``[backend] threads`` sets the torch threads a run computes on (default: the cores
this process may use), for the run alone; a bad count is one line; ids do not move with it."""

from __future__ import annotations

import os
import re

import pytest
import torch

from backends.cpu_ref.backend import default_threads, usable_cores
from kestrel_core import load
from kestrel_core.cli import main
from kestrel_core.errors import ConfigError


def test_a_run_computes_on_its_threads_and_gives_the_count_back(tiny_ckpt):
    before = torch.get_num_threads()
    ids = {}
    with load(tiny_ckpt) as model:
        for n in (1, 2, 0):
            with model.open(backend="cpu_ref", threads=n) as run:
                assert torch.get_num_threads() == (n or default_threads())
                ids[n] = run.generate(prompt_ids=[5, 17, 42], max_new_tokens=8, stop_at_eos=False).token_ids
            assert torch.get_num_threads() == before
    assert ids[1] == ids[2] == ids[0]


def test_the_default_is_the_cores_this_process_may_use_shared_among_this_hosts_ranks(monkeypatch):
    assert usable_cores() == len(os.sched_getaffinity(0))
    assert default_threads() == usable_cores()  # one process
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two hosts of two ranks: each rank takes half of its host's cores
    assert default_threads() == 4
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")  # more ranks than cores: one thread each, not none
    assert default_threads() == 1


@pytest.mark.parametrize("bad, says", [(-1, "must be a whole number of threads, 0..4096"), (5000, "0..4096"),
                                       (1.5, "must be int, got 1.5"), ("two", "must be int, got 'two'")])
def test_a_bad_thread_count_is_one_line(tiny_ckpt, bad, says):
    with load(tiny_ckpt) as model, pytest.raises(ConfigError, match=r"settings \[backend\]: threads .*" + re.escape(says)):
        model.open(backend="cpu_ref", threads=bad)


def test_the_flag(tiny_ckpt, capsys):
    assert main(["generate", "--model", str(tiny_ckpt), "--prompt-ids", "5,17", "--max-new-tokens", "2", "--threads", "1",
                 "--json"]) == 0
    assert main(["generate", "--model", str(tiny_ckpt), "--prompt-ids", "5,17", "--threads", "-2"]) == 2
    assert "threads (--threads) must be a whole number of threads" in capsys.readouterr().err


@pytest.mark.parametrize("given, want", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_openmp_threads_wait_passively_unless_the_user_says_otherwise(given, want):
    """Spinning OpenMP threads made every command 4-19x slower than one thread on 2 busy cores: kestrel asks for passive
    waiting before torch (and its OpenMP) is first imported, and keeps a policy the user set."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given:
        env["OMP_WAIT_POLICY"] = given
    code = ("import sys, os, kestrel_core.cli; assert 'torch' not in sys.modules; import torch; "
            "print(os.environ['OMP_WAIT_POLICY'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == want


def test_demo_takes_threads(tmp_path, capsys, monkeypatch):
    """``kestrel demo --threads N`` runs cpu_ref on N threads; a bad count is one line before the cache is written."""
    seen = []
    from backends.cpu_ref import backend as cpu_ref

    real = cpu_ref.CpuRefBackend.__init__

    def spy(self, ctx):
        seen.append(ctx.backend.threads)
        real(self, ctx)

    monkeypatch.setattr(cpu_ref.CpuRefBackend, "__init__", spy)
    assert main(["demo", "--threads", "-1", "--cache-dir", str(tmp_path / "c")]) != 0
    assert "threads (--threads) must be a whole number" in capsys.readouterr().err and not (tmp_path / "c").exists()
    assert main(["demo", "--threads", "1", "--max-new-tokens", "2", "--cache-dir", str(tmp_path / "c")]) == 0
    assert seen and set(seen) == {1}
