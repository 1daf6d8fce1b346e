"""``--devices``: a command's layers split over several devices of this host, one rank each, the ranks started by
kestrel itself with the environment torchrun would give them (``torchrun --standalone --nproc-per-node N -m
kestrel_core.cli ...``). Every rank runs the same command line; each computes on its own device."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

from kestrel_core.engine.pipeline import ACROSS_RANKS, split
from kestrel_core.errors import ConfigError

SHUTDOWN_S = 60  # how long the ranks have to end after the launcher passes them a signal
LAUNCHER = "KESTREL_LAUNCHER_PID"  # set for the ranks it starts: each ends when its launcher does, however it ends
PR_SET_PDEATHSIG = 1  # Linux's prctl option: a signal the kernel sends this process when its parent ends


def check_layers(args, ranks: int) -> None:
    """The model opened here (its config and tensor table, no weights), and more ranks than it has layers refused,
    before any rank starts: else each would load it only to say so. The model's own errors are said here once."""
    from kestrel_core.commands.common import config_from_args
    from kestrel_core.config import model_dir
    from kestrel_core.engine.run import load

    alone = argparse.Namespace(**{**vars(args), "devices": None})  # the config as one rank reads it, less its device
    with load(model_dir(config_from_args(alone))) as model:
        layers = model.config.num_hidden_layers
    split([1] * layers, ranks)


def launch(args, argv: list[str]) -> int:
    """Start one rank a device on this host, each running ``argv`` (RANK, LOCAL_RANK, WORLD_SIZE and a free loopback
    MASTER_PORT set, as torchrun sets them); the first failing rank's exit code, else 0. A rank that fails ends the
    others; a signal that reaches this process (Ctrl-C, SIGTERM from a supervisor) is passed to every rank."""
    from kestrel_core.commands.common import parse_devices  # its checks import torch: once the flags are read

    names = parse_devices(args.devices)
    if args.command not in ACROSS_RANKS:
        raise ConfigError(f"kestrel {args.command} does not run over several ranks yet; drop --devices")
    if getattr(args, "device", None) is not None:
        raise ConfigError("pass --device or --devices, not both")
    check_layers(args, len(names))
    with socket.socket() as sock:  # a free port for the ranks' rendezvous (rank 0 listens on it)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": str(len(names)), "LOCAL_WORLD_SIZE": str(len(names)),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), LAUNCHER: str(os.getpid())}
    procs = [subprocess.Popen([sys.executable, "-m", "kestrel_core.cli", *argv],  # rank 0 reads stdin (chat's lines)
                              stdin=None if r == 0 else subprocess.DEVNULL,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(len(names))]
    try:
        return _wait(procs)
    except KeyboardInterrupt as exc:  # to rank 0, which leads: it ends its work and the others follow it out
        _end(procs[:1], getattr(exc, "signum", signal.SIGINT), then=procs[1:])
        raise


def tie_to_launcher() -> None:
    """A rank ``launch`` started ends with its launcher, even one killed outright (SIGKILL), which passes nothing on:
    on Linux the kernel sends it SIGKILL when the launcher ends (prctl PR_SET_PDEATHSIG), elsewhere a thread watches
    its parent. A launcher that ended before this ran ends the rank now. Outside such a rank, nothing."""
    launcher = os.environ.pop(LAUNCHER, None)  # read once: a process this rank starts is no rank of that launcher
    if launcher is None:
        return
    if not _parent_death_signal():
        import threading

        threading.Thread(target=_watch_parent, args=(int(launcher),), daemon=True, name="launcher-watch").start()
    if os.getppid() != int(launcher):  # the launcher ended before the signal was set: nothing would send it
        os.kill(os.getpid(), signal.SIGKILL)


def _parent_death_signal() -> bool:
    """SIGKILL to this process when its parent ends (Linux); False where it cannot be set."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(launcher: int) -> None:
    while os.getppid() == launcher:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)


def _wait(procs: list[subprocess.Popen]) -> int:
    """Every rank's end: the first failure's code (the others ended then), else 0. A rank killed by a signal is named
    in one line (its neighbours' errors follow from it), and the code is the shell's for that signal."""
    while True:
        codes = [p.poll() for p in procs]
        killed = next((r for r, c in enumerate(codes) if c is not None and c < 0), None)
        failed = next((c for c in codes if c not in (None, 0)), None)
        if killed is not None:
            signum = -codes[killed]
            print(f"kestrel: error: rank {killed} was killed by {_signal_name(signum)}; the run stopped "
                  "(the other ranks were ended)", file=sys.stderr, flush=True)
            _end(procs, signal.SIGTERM)
            return 128 + signum
        if failed is not None:
            _end(procs, signal.SIGTERM)
            return failed
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.1)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _end(procs: list[subprocess.Popen], signum: int, then: list[subprocess.Popen] = ()) -> None:
    """``signum`` to each of ``procs`` still running; every one of them and of ``then`` waited for, and killed where
    it is left after SHUTDOWN_S."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signum)
    deadline = time.monotonic() + SHUTDOWN_S
    for p in [*procs, *then]:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
