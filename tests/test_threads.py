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
