"""What a record says about where it was measured: the commit and whether the tree was dirty, the machine (GPU,
driver, torch and CUDA, CPU model, RAM), Python, the command and the UTC date. Nothing is typed in by hand.

The commit comes from ``bench/results/.stamp.json`` where the tree is the one it hashed, else from git (which
honours ``GIT_DIR``). The stamp file is written beforehand by ``python -m bench stamp``: the commit, the dirty flag
and a sha256 over every tracked and untracked-not-ignored file (path and content). A GPU machine that receives a
copy of the working tree reads it: the copy may come without ``.git``, or with one of another commit (seen: the
copy's ``.git`` said 911a6e7, dirty, for a tree stamped at 103a225). The hash is recomputed there, and a tree that
differs from the stamped one is dirty.

``bench/results/`` is left out of the dirty check and the hash: records are what a run writes, not what it runs,
and a second run after a first would otherwise always be dirty.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
STAMP_FILE = RESULTS / ".stamp.json"
OUTPUTS = "bench/results/"  # left out of the dirty check and the tree hash


def git(*args: str) -> str | None:
    """``git args`` in the repository root; its stdout, or None where git or a repository is not there."""
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.decode() if done.returncode == 0 else None


def tree_files() -> list[str] | None:
    """Every tracked and untracked-not-ignored file, repository-relative, outputs left out (None without git)."""
    out = git("ls-files", "-z", "--cached", "--others", "--exclude-standard")
    if out is None:
        return None
    return sorted({p for p in out.split("\0") if p and not p.startswith(OUTPUTS)})


def tree_sha256(files: list[str], root: Path | None = None) -> str:
    """sha256 over each file's path and content under ``root`` (the repository), in the order given (a missing file
    counts as missing)."""
    root = REPO if root is None else root
    h = hashlib.sha256()
    for rel in files:
        p = root / rel
        h.update(rel.encode() + b"\0")
        if p.is_symlink():
            h.update(b"link:" + os.readlink(p).encode())
        elif p.is_file():
            h.update(hashlib.sha256(p.read_bytes()).digest())
        else:
            h.update(b"<missing>")
        h.update(b"\0")
    return h.hexdigest()


def from_git() -> dict | None:
    commit = git("rev-parse", "HEAD")
    if commit is None:
        return None
    status = git("status", "--porcelain", "--untracked-files=all", "--", ".", f":(exclude){OUTPUTS}")
    files = tree_files() or []
    return {"commit": commit.strip(), "dirty": bool(status and status.strip()), "stamp_source": "git",
            "git_dir": os.environ.get("GIT_DIR"), "tree_sha256": tree_sha256(files)}


def write_stamp_file(path: Path = STAMP_FILE) -> dict:
    """Write the stamp a tree without ``.git`` reads (``python -m bench stamp``); needs git here."""
    stamp = from_git()
    if stamp is None:
        raise RuntimeError("python -m bench stamp needs git and this repository (or GIT_DIR)")
    files = tree_files() or []
    content = {"commit": stamp["commit"], "dirty": stamp["dirty"], "tree_sha256": stamp["tree_sha256"],
               "files": files, "written_utc": utc_now().isoformat(), "command": command_line()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(content, indent=1))
    os.replace(tmp, path)  # the stamp file, unlike a record, is rewritten at will
    return content


def from_stamp_file(path: Path = STAMP_FILE) -> dict | None:
    """The stamp file's commit, dirty where the tree here differs from the one it hashed."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    now = tree_sha256(saved.get("files", []))
    same = now == saved.get("tree_sha256")
    return {"commit": saved.get("commit"), "dirty": bool(saved.get("dirty")) or not same, "stamp_source": "stamp-file",
            "tree_sha256": now, "stamp_tree_sha256": saved.get("tree_sha256"), "tree_matches_stamp": same,
            "stamp_written_utc": saved.get("written_utc")}


def source() -> dict:
    """The commit and dirty flag: from the stamp file where this tree is the one it hashed (a tree copied to another
    machine may come with a ``.git`` of another commit, or none), else from git, else from the stamp file (then dirty),
    else unknown (said so)."""
    stamped = from_stamp_file(STAMP_FILE)
    if stamped is not None and stamped["tree_matches_stamp"]:
        return stamped
    return from_git() or stamped or {"commit": None, "dirty": None, "stamp_source": "none"}


def _first(path: str, key: str) -> str | None:
    try:
        with open(path) as fh:
            for line in fh:
                name, _, value = line.partition(":")
                if name.strip() == key:
                    return value.strip()
    except OSError:
        pass
    return None


def machine() -> dict:
    """The host and its GPUs, read from /proc, torch and nvidia-smi."""
    import torch

    mem_kb = _first("/proc/meminfo", "MemTotal")
    out = {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "cpu_model": _first("/proc/cpuinfo", "model name"), "cpus": os.cpu_count(),
           "mem_total_bytes": int(mem_kb.split()[0]) * 1024 if mem_kb else None, "gpus": []}
    if hasattr(os, "sched_getaffinity"):
        out["cpus_usable"] = len(os.sched_getaffinity(0))
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out["gpus"].append({"name": p.name, "memory_bytes": p.total_memory, "sms": p.multi_processor_count,
                                "capability": f"{p.major}.{p.minor}"})
        out["gpu"] = out["gpus"][0]["name"]
        out["driver"] = _driver()
    return out


def _driver() -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        return Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
    except OSError:
        return None


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed to run this module (``python -m bench ...``)."""
    argv = sys.argv if argv is None else argv
    return "python -m bench " + shlex.join(argv[1:])


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def stamp(argv: list[str] | None = None) -> dict:
    """Everything a record says about where and when it was measured."""
    when = utc_now()
    return {**source(), "date_utc": when.isoformat(timespec="seconds"), "command": command_line(argv),
            "argv": list(sys.argv if argv is None else argv), "machine": machine()}
