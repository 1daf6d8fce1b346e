"""``--devices``' launcher (``commands.ranks``) and rank 0's told calls (``Pipeline.tell``/``hear``) at their edges:
the first failing rank's code, stdin for rank 0 alone, a signal to rank 0 alone, a GPU named twice, and a told
message at every size around the one broadcast's room."""

from __future__ import annotations

import argparse
import os
import pickle
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kestrel_core.commands import ranks
from kestrel_core.engine.pipeline import TOLD_BYTES
from kestrel_core.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def test_the_first_failing_rank_gives_its_code_and_ends_the_others():
    procs = [subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"]),
             subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])]
    try:
        assert ranks._wait(procs) == 3
        assert procs[1].returncode is not None  # ended, not left running
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


class FakeProc:
    running = False  # what poll() says: ended (0), or still running (None)

    def __init__(self, cmd, stdin=None, env=None):
        self.cmd, self.stdin, self.env, self.signals = cmd, stdin, env, []

    def poll(self):
        return None if self.running else 0

    def send_signal(self, signum):
        self.signals.append(signum)

    def wait(self, timeout=None):
        return 0


def _launch(monkeypatch, wait=None) -> list[FakeProc]:
    made: list[FakeProc] = []

    def popen(cmd, stdin=None, env=None):
        made.append(FakeProc(cmd, stdin, env))
        return made[-1]

    monkeypatch.setattr(ranks.subprocess, "Popen", popen)
    if wait is not None:
        monkeypatch.setattr(ranks, "_wait", wait)
    args = argparse.Namespace(devices="cpu,cpu", command="generate", device=None)
    try:
        ranks.launch(args, ["generate", "--devices", "cpu,cpu"])
    except KeyboardInterrupt:
        pass
    return made


def test_rank_0_alone_reads_stdin_and_each_rank_gets_its_place(monkeypatch):
    made = _launch(monkeypatch)
    assert [p.stdin for p in made] == [None, subprocess.DEVNULL]
    assert [(p.env["RANK"], p.env["LOCAL_RANK"], p.env["WORLD_SIZE"]) for p in made] == [("0", "0", "2"),
                                                                                          ("1", "1", "2")]
    assert made[0].env["MASTER_PORT"] == made[1].env["MASTER_PORT"]


def test_a_signal_to_the_launcher_goes_to_rank_0_alone(monkeypatch):
    def interrupted(procs):
        raise KeyboardInterrupt

    monkeypatch.setattr(FakeProc, "running", True)
    made = _launch(monkeypatch, interrupted)
    assert made[0].signals == [signal.SIGINT] and made[1].signals == []  # rank 1 ends with rank 0


def test_a_gpu_named_twice_is_refused(monkeypatch):
    import torch

    from kestrel_core.engine import devices

    monkeypatch.setattr(devices, "compute_device", lambda name, flag: torch.device(name))
    with pytest.raises(ConfigError, match="--devices names cuda:0 twice; give each rank a GPU of its own"):
        ranks.parse_devices("cuda:0,cuda:1,cuda:0")
    with pytest.raises(ConfigError, match="names 'cuda' without an index"):
        ranks.parse_devices("cuda,cuda:1")
    assert ranks.parse_devices("cuda:1, cuda:0") == ["cuda:1", "cuda:0"]


TELL = """
import datetime, pickle, sys
import torch.distributed as dist
from kestrel_core.engine.pipeline import Pipeline
dist.init_process_group("gloo")
pipe = Pipeline(dist.get_rank(), 2, 0, 1, [(0, 1), (1, 1)],
                dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60)))
for size in map(int, sys.argv[1:]):
    ops = [(b"x" * size,)]
    if pipe.rank == 0:
        pipe.tell(ops[0], now=True)
    else:
        assert pipe.hear() == ops, size
print("OK", pipe.rank, flush=True)
dist.destroy_process_group()
"""


def test_a_told_message_of_any_size_arrives_whole(tmp_path):
    """Around the one broadcast's room (TOLD_BYTES less the length's 8 bytes): inline, and in a second broadcast."""
    def payload_for(length: int) -> int:  # the bytes whose told message pickles to ``length``
        return next(n for n in range(length) if len(pickle.dumps([(b"x" * n,)])) == length)

    sizes = [payload_for(TOLD_BYTES + d) for d in (-9, -8, -7, 0, 1)]
    script = tmp_path / "tell.py"
    script.write_text(TELL)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), *map(str, sizes)], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**env, "RANK": str(r)})
             for r in (0, 1)]
    out = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], out[0][1][-2000:] + out[1][1][-2000:]
    assert out[1][0].strip() == "OK 1"
