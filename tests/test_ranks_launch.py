"""``--devices``' launcher (``commands.ranks``) and rank 0's told calls (``Pipeline.tell``/``hear``) at their edges:
the first failing rank's code, stdin for rank 0 alone, a signal to rank 0 alone, a GPU named twice, a told
message at every size around the one broadcast's room, a rank killed (named with its signal, the shell's code; its
neighbour's lost message one line), and ranks that end with a launcher killed outright."""

from __future__ import annotations

import argparse
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kestrel_core.commands import common, ranks
from kestrel_core.cli import main
from kestrel_core.engine.pipeline import TOLD_BYTES
from kestrel_core.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def two_ranks(script: Path, text: str, *args: str) -> list[subprocess.Popen]:
    """``text`` written to ``script`` and run as ranks 0 and 1 of two, meeting on a free loopback port."""
    script.write_text(text)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    return [subprocess.Popen([sys.executable, str(script), *args], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env={**env, "RANK": str(r)}) for r in (0, 1)]


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
    monkeypatch.setattr(ranks, "check_layers", lambda args, n: None)  # no model here: the ranks' start alone
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
        common.parse_devices("cuda:0,cuda:1,cuda:0")
    with pytest.raises(ConfigError, match="names 'cuda' without an index"):
        common.parse_devices("cuda,cuda:1")
    assert common.parse_devices("cuda:1, cuda:0") == ["cuda:1", "cuda:0"]


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
    procs = two_ranks(tmp_path / "tell.py", TELL, *map(str, sizes))
    out = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], out[0][1][-2000:] + out[1][1][-2000:]
    assert out[1][0].strip() == "OK 1"


def test_a_rank_killed_by_a_signal_is_named_and_the_code_is_the_shells(capsys):
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]),
             subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])]
    try:
        assert ranks._wait(procs) == 128 + signal.SIGKILL  # not Popen's -9, which exits as 247
        assert procs[0].returncode is not None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert capsys.readouterr().err == ("kestrel: error: rank 1 was killed by SIGKILL; the run stopped (the other "
                                       "ranks were ended)\n")


LOST = """
import datetime, os
import torch
import torch.distributed as dist
from kestrel_core.engine.pipeline import Pipeline
from kestrel_core.errors import KestrelError
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))  # gloo may not see a close before a receive
pipe = Pipeline(dist.get_rank(), 2, 0, 1, [(0, 1), (1, 1)])
dist.barrier()  # the ranks' link made, as a run's start makes it
if pipe.rank == 1:
    os._exit(3)  # gone without a word, as a rank killed is
try:
    pipe.hidden_in(1, 4, torch.float32, torch.device("cpu"))
except KestrelError as exc:
    print("ERR", exc, flush=True)
    os._exit(2)
"""


def test_a_rank_whose_neighbour_is_gone_mid_step_ends_in_one_line(tmp_path):
    """Rank 0 waits for a step's hidden state from a rank that died: one line naming the loss, not gloo's traceback."""
    procs = two_ranks(tmp_path / "lost.py", LOST)
    try:
        out = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [2, 3], out[0][1][-2000:]
    assert out[0][0].startswith("ERR rank 0 of 2 lost a rank it exchanges steps with (")
    assert out[0][0].rstrip().endswith("; see that rank's error") and "Traceback" not in out[0][1]


def _gone(pid: int) -> bool:
    """The process has ended (a zombie no one reaps yet has ended too)."""
    try:
        return "zombie" in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True


def _serve_over_two_ranks(tiny_ckpt):
    from bench.serve_process import ServeProcess

    server = ServeProcess(tiny_ckpt, "--backend", "cpu_ref", "--max-seq", "64", "--devices", "cpu,cpu",
                          env={"OMP_NUM_THREADS": "1"}, timeout=120)
    pids = Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text().split()
    assert len(pids) == 2
    return server, [int(p) for p in pids]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_ranks_end_when_their_launcher_is_killed_outright(tiny_ckpt):
    """SIGKILL to kestrel serve --devices, which can pass nothing on: its ranks end anyway, and the port closes."""
    import httpx

    server, pids = _serve_over_two_ranks(tiny_ckpt)
    try:
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        server.proc.kill()
        server.proc.wait()
        deadline = time.monotonic() + 60
        while not all(map(_gone, pids)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(map(_gone, pids)), [Path(f"/proc/{p}/cmdline").read_text() for p in pids if not _gone(p)]
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{server.url}/health", timeout=30)
    finally:
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_rank_killed_mid_run_is_named_and_the_launcher_exits_as_the_shell_would(tiny_ckpt):
    server, pids = _serve_over_two_ranks(tiny_ckpt)
    try:
        os.kill(pids[1], signal.SIGKILL)
        assert server.proc.wait(90) == 128 + signal.SIGKILL
        server._reader.join(30)
        assert "kestrel: error: rank 1 was killed by SIGKILL; the run stopped (the other ranks were ended)" in \
            server.lines, server.lines[-20:]
        assert not any("Traceback" in line for line in server.lines), server.lines[-40:]
        deadline = time.monotonic() + 60
        while not _gone(pids[0]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _gone(pids[0])
    finally:
        server.stop()
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("flags, says", [
    (["--devices", "cpu,cpu:7"], "--devices cpu:7 names no device: the host's CPU is one device, cpu (or cpu:0); use "
                                 "cpu for each rank (cpu,cpu)"),
    (["--device", "cpu:1"], "--device cpu:1 names no device: the host's CPU is one device, cpu (or cpu:0); use cpu"),
    (["--devices", ",".join(["cpu"] * 7)], "7 ranks for a model of 6 layers: each rank holds at least one layer; run "
                                           "at most 6 ranks"),
    (["--devices", "cpu,cpu", "--model", "/nonexistent/model"], "model directory '/nonexistent/model' does not exist"),
])
def test_devices_that_name_nothing_or_more_ranks_than_layers_are_refused_before_any_rank_starts(
        tiny_ckpt, flags, says, monkeypatch, capsys):
    def no_rank(*args, **kw):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(ranks.subprocess, "Popen", no_rank)
    rc = main(["generate", "--model", str(tiny_ckpt), "--backend", "cpu_ref", "--prompt-ids", "1,2", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("kestrel: error: ") and says in err and err.count("\n") == 1, err
