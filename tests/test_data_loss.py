"""A model writer loses nothing under a signal, a race, a link or a full disk, and leaves nothing hidden behind.

In-process tests place the signal or the rival writer at an exact moment; process tests send real
signals to ``python -m kestrel_core.cli`` and check what any moment must leave: the old model or the
new one, whole, a report that says which, and no temporary directory.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kestrel_core.io import leftovers

from kestrel_core.io import outdir

from kestrel_core.tools import presets

from kestrel_core.io import renameat
from kestrel_core.cli import main
from kestrel_core.errors import KestrelNote
from kestrel_core.tools.presets import preset_config, write_checkpoint
from cli_helpers import fails

MAKE = ["make-model", "--preset", "tiny-llama"]


def snapshot(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(path).iterdir())}


def hidden(parent: Path) -> list[str]:
    """What a writer may have left: every hidden name in ``parent``."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def reference(tmp_path: Path, preset: str, seed: int, **kw) -> dict[str, bytes]:
    """The bytes of a model written whole, elsewhere: what 'the new model' or 'the old model' must be."""
    ref = write_checkpoint(preset_config(preset), tmp_path / "refs" / f"{preset}-{seed}", seed=seed, **kw)
    return snapshot(ref)


def old_and_new(tmp_path: Path, out: Path) -> tuple[dict, dict]:
    """``out`` holds tiny-llama seed 1; the bytes of seed 1 and of seed 2."""
    write_checkpoint(preset_config("tiny-llama"), out, seed=1)
    return snapshot(out), reference(tmp_path, "tiny-llama", 2)


def _signal_on_first(monkeypatch, module, name: str, signum: int, armed=lambda: True):
    """Send ``signum`` to this process the first time ``module.name`` is called while ``armed()``."""
    real, sent = getattr(module, name), []

    def call(*args, **kwargs):
        if armed() and not sent:
            sent.append(signum)
            os.kill(os.getpid(), signum)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, call)
    return sent


# --- a signal at an exact moment (in-process) ------------------------------------------

def test_an_interrupt_while_the_old_model_is_removed_is_held_until_it_is_gone(tmp_path, capsys, monkeypatch):
    """Ctrl-C at the end of `make-model --force` used to stop the removal of the replaced model half-way: exit 130
    "interrupted", the new model installed all the same, and a hidden directory holding half the old one."""
    out = tmp_path / "m"
    _, new = old_and_new(tmp_path, out)
    sealed = []
    real_seal = outdir._seal
    monkeypatch.setattr(outdir, "_seal", lambda tmp: (real_seal(tmp), sealed.append(1)))
    sent = _signal_on_first(monkeypatch, os, "unlink", signal.SIGINT, armed=lambda: bool(sealed))
    assert main([*MAKE, "--out", str(out), "--seed", "2", "--force"]) == 130
    err = capsys.readouterr().err
    assert sent, "the signal was never sent: the old model was not removed with os.unlink"
    assert err == f"kestrel: interrupted after the new model was installed in {out}\n"
    assert snapshot(out) == new
    assert hidden(tmp_path) == []


SIGNALS = [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated"), (signal.SIGHUP, 129, "hung up")]


@pytest.mark.parametrize("signum, rc, word", SIGNALS)
def test_a_signal_during_the_swap_is_held_until_it_ends(tmp_path, capsys, monkeypatch, signum, rc, word):
    out = tmp_path / "m"
    _, new = old_and_new(tmp_path, out)
    real = renameat.exchange

    def exchange(a, b):  # the signal comes between the two halves of the swap's work
        os.kill(os.getpid(), signum)
        return real(a, b)

    monkeypatch.setattr(renameat, "exchange", exchange)
    assert main([*MAKE, "--out", str(out), "--seed", "2", "--force"]) == rc
    assert capsys.readouterr().err == f"kestrel: {word} after the new model was installed in {out}\n"
    assert snapshot(out) == new and hidden(tmp_path) == []


@pytest.mark.parametrize("signum, rc, word", SIGNALS)
@pytest.mark.parametrize("had_old", [True, False], ids=["replacing", "new"])
def test_a_signal_while_writing_says_what_out_holds(tmp_path, capsys, monkeypatch, signum, rc, word, had_old):
    out = tmp_path / "m"
    old = old_and_new(tmp_path, out)[0] if had_old else None
    _signal_on_first(monkeypatch, presets, "save_file", signum)
    assert main([*MAKE, "--out", str(out), "--seed", "2", "--force"]) == rc
    err = capsys.readouterr().err
    if had_old:
        assert err == f"kestrel: {word}: the old model in {out} is intact\n"
        assert snapshot(out) == old
    else:
        assert err == f"kestrel: {word}: nothing was written to {out}\n"
        assert not out.exists()
    assert hidden(tmp_path) == []


# --- real signals to a real process ----------------------------------------------------

def spawn(*argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kestrel_core.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for_partial(parent: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until the writer's temporary directory appears beside its target (the writing has begun)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.name.endswith(leftovers.SUFFIX) for p in parent.iterdir()):
            return
        assert proc.poll() is None, f"the writer ended before writing: {proc.communicate()}"
        time.sleep(0.002)
    raise AssertionError("the writer never started writing")


SLOW = ["--preset", "small-300m", "--layers", "2", "--shard-mb", "16"]  # about a second of writing, in shards


@pytest.fixture(scope="module")
def slow_models(tmp_path_factory) -> dict:
    """A small-300m cut to 2 layers, seed 1 (the old model) and seed 2 (the new one), and their bytes."""
    root = tmp_path_factory.mktemp("slow")
    cfg = preset_config("small-300m", layers=2)
    found = {}
    for seed in (1, 2):
        path = write_checkpoint(cfg, root / f"seed{seed}", seed=seed, shard_mb=16)
        found[seed] = (path, snapshot(path))
    return found


@pytest.mark.parametrize("delay", [0.0, 0.1, 0.3, 0.6])
def test_ctrl_c_at_any_moment_leaves_one_whole_model_and_says_which(tmp_path, slow_models, delay):
    old_path, old = slow_models[1]
    new = slow_models[2][1]
    out = tmp_path / "m"
    shutil.copytree(old_path, out)
    proc = spawn("make-model", *SLOW, "--out", str(out), "--seed", "2", "--force")
    wait_for_partial(tmp_path, proc)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    said, err = proc.communicate(timeout=120)
    assert "Traceback" not in err, err
    now = snapshot(out)
    assert now in (old, new), "a mix of the two models"
    # 0 also where the signal came as Python exited (main ignores it then); -SIGINT in the microseconds before that
    if proc.returncode in (0, -signal.SIGINT):
        assert now == new and said.startswith("wrote small-300m") and err == "", (proc.returncode, said, err)
    else:
        assert proc.returncode == 130, (proc.returncode, err)
        if now == old:
            assert err == f"kestrel: interrupted: the old model in {out} is intact\n"
        else:
            assert err == f"kestrel: interrupted after the new model was installed in {out}\n"
    assert hidden(tmp_path) == []


def test_sigterm_during_make_model_leaves_the_old_model_and_nothing_hidden(tmp_path, slow_models):
    """SIGTERM used to kill the writer with its 83 MB temporary directory in place, which nothing removed."""
    old_path, old = slow_models[1]
    out = tmp_path / "m"
    shutil.copytree(old_path, out)
    proc = spawn("make-model", *SLOW, "--out", str(out), "--seed", "2", "--force")
    wait_for_partial(tmp_path, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, (proc.returncode, err)
    assert err == f"kestrel: terminated: the old model in {out} is intact\n"
    assert snapshot(out) == old
    assert hidden(tmp_path) == []


def test_what_a_killed_writer_left_is_removed_by_the_next_one(tmp_path, capsys):
    """kill -9 cannot be handled; the next writer in that directory removes the temporary the dead one left."""
    proc = spawn("make-model", *SLOW, "--out", str(tmp_path / "m"))
    wait_for_partial(tmp_path, proc)
    proc.kill()
    proc.communicate(timeout=60)
    left = hidden(tmp_path)
    assert len(left) == 1 and left[0].endswith(leftovers.SUFFIX)
    assert main([*MAKE, "--out", str(tmp_path / "other")]) == 0
    assert f"kestrel: note: removed {tmp_path / left[0]}, left by a kestrel writer that was killed" in capsys.readouterr().err
    assert hidden(tmp_path) == [] and not (tmp_path / "m").exists()


def test_a_live_writers_temporary_and_anything_not_provably_kestrels_are_kept(tmp_path):
    mine = leftovers.temp_dir(tmp_path, "m")  # this process: alive
    other_host = tmp_path / f".m.k{'0' * 8}{leftovers.tag()[9:]}.abc.kestrel-partial"
    untagged = tmp_path / ".m.x1y2z3.kestrel-partial"  # an older kestrel's, or anyone's: no owner to check
    for p in (other_host, untagged):
        p.mkdir()
    dead = tmp_path / f".m.{leftovers.tag().rsplit('-', 2)[0]}-{2**22 + 7}-1.abc.kestrel-partial"  # no such pid
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"x")
    with pytest.warns(KestrelNote, match="left by a kestrel writer that was killed"):
        assert leftovers.sweep(tmp_path) == [dead.name]
    assert sorted(hidden(tmp_path)) == sorted([mine.name, other_host.name, untagged.name])


# --- races -------------------------------------------------------------------------------

def test_a_writer_that_loses_a_race_for_a_new_directory_fails_and_leaves_the_winner(tmp_path, capsys, monkeypatch):
    """Two `make-model --out m2` at once (no --force) both said "wrote" and exited 0, and one model was lost."""
    out = tmp_path / "m2"
    winner = reference(tmp_path, "tiny-llama", 5)
    real, raced = presets.save_file, []

    def save(tensors, path, metadata=None):
        if not raced:  # the rival starts and finishes while this writer is in the middle
            raced.append(1)
            assert main([*MAKE, "--out", str(out), "--seed", "5"]) == 0
            capsys.readouterr()
        real(tensors, path, metadata=metadata)

    monkeypatch.setattr(presets, "save_file", save)
    fails([*MAKE, "--out", str(out), "--seed", "2"], capsys, f"--out {out} was written by another process meanwhile",
          "this model was not installed", "--force")
    assert snapshot(out) == winner
    assert hidden(tmp_path) == []


def test_two_concurrent_writers_of_one_new_directory_one_wins(tmp_path):
    out = tmp_path / "m2"
    procs = [spawn(*MAKE, "--out", str(out), "--seed", str(seed)) for seed in (1, 2)]
    results = [(p.wait(timeout=120), p.communicate()) for p in procs]
    assert sorted(rc for rc, _ in results) == [0, 2], results
    (_, (_, err)), = [r for r in results if r[0] == 2]
    assert err.startswith("kestrel: error: --out") and err.count("\n") == 1 and "--force" in err, err
    seed = [s for (rc, _), s in zip(results, (1, 2)) if rc == 0][0]
    assert snapshot(out) == reference(tmp_path, "tiny-llama", seed)
    assert hidden(tmp_path) == []


def test_force_puts_back_a_directory_that_gained_a_users_file_meanwhile(tmp_path, capsys, monkeypatch):
    out = tmp_path / "m"
    old, _ = old_and_new(tmp_path, out)
    real = presets.save_file

    def save(tensors, path, metadata=None):
        (out / "notes.txt").write_text("mine")  # the user saves a file into the model directory meanwhile
        real(tensors, path, metadata=metadata)

    monkeypatch.setattr(presets, "save_file", save)
    fails([*MAKE, "--out", str(out), "--seed", "2", "--force"], capsys, "gained notes.txt", "nothing there was changed")
    assert snapshot(out) == {**old, "notes.txt": b"mine"}
    assert hidden(tmp_path) == []


def test_without_renameat2_force_still_replaces_the_model_whole(tmp_path, capsys, monkeypatch):
    out = tmp_path / "m"
    _, new = old_and_new(tmp_path, out)
    monkeypatch.setattr(renameat, "exchange", lambda a, b: False)  # an old kernel, or a filesystem without it
    assert main([*MAKE, "--out", str(out), "--seed", "2", "--force"]) == 0
    assert snapshot(out) == new and hidden(tmp_path) == []


# --- links and the working directory ---------------------------------------------------

def test_force_writes_through_a_link_to_a_model_directory(tmp_path, capsys):
    """A linked --out used to be replaced by a real directory, the old model left in the link's target and a hidden
    link beside it."""
    store = tmp_path / "store"
    store.mkdir()
    real_dir = store / "m"
    write_checkpoint(preset_config("tiny-llama"), real_dir, seed=1)
    link = tmp_path / "link"
    link.symlink_to(real_dir)
    assert main([*MAKE, "--out", str(link), "--seed", "2", "--force"]) == 0
    assert link.is_symlink() and os.readlink(link) == str(real_dir)
    assert snapshot(real_dir) == reference(tmp_path, "tiny-llama", 2)
    assert hidden(tmp_path) == [] and hidden(store) == []


def test_a_link_to_nothing_is_refused(tmp_path, capsys):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    fails([*MAKE, "--out", str(link)], capsys, f"--out {link} is a link to {tmp_path / 'gone'}, which does not exist")
    assert link.is_symlink() and not (tmp_path / "gone").exists()


@pytest.mark.parametrize("out", [".", "..", "./"])
@pytest.mark.parametrize("force", [False, True])
def test_the_working_directory_is_refused_as_out(tmp_path, capsys, monkeypatch, out, force):
    """`--out .` used to fail with "free space or pick another directory"; it would replace the directory a shell
    stands in."""
    here = tmp_path / "a" / "here"
    here.mkdir(parents=True)
    monkeypatch.chdir(here)
    fails([*MAKE, "--out", out, *(["--force"] if force else [])], capsys, "is the working directory",
          f"--out {Path(out) / 'model'}")
    assert list(here.iterdir()) == [] and hidden(tmp_path / "a") == []


# --- a full disk --------------------------------------------------------------------------

def _small_file_limit():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))


def test_a_write_that_fails_for_space_is_one_line_and_leaves_nothing(tmp_path):
    """safetensors raised its own SafetensorError (a traceback) where quantize's writer gave a one-line error."""
    out = tmp_path / "m"
    proc = subprocess.run([sys.executable, "-m", "kestrel_core.cli", "make-model", "--preset", "demo", "--out", str(out)],
                          preexec_fn=_small_file_limit, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (f"kestrel: error: cannot write {out}: File too large ({out / 'model.safetensors'}); nothing in "
                           f"{out} was changed: a file is larger than this process may write (ulimit -f) or the "
                           "filesystem holds; raise the limit or pick another disk\n")
    assert not out.exists() and hidden(tmp_path) == []


def test_save_file_errors_become_os_errors(tmp_path, capsys, monkeypatch):
    from safetensors import SafetensorError

    def full(tensors, path, metadata=None):
        raise SafetensorError(f'Error while serializing: I/O error: No space left on device (os error 28) at path "{path}"')

    monkeypatch.setattr(presets, "save_file", full)
    out = tmp_path / "m"
    fails([*MAKE, "--out", str(out)], capsys, "No space left on device", "free space, or pick a directory on another disk")
    assert not out.exists() and hidden(tmp_path) == []


# --- the demo's cache ------------------------------------------------------------------

def test_the_demo_never_suggests_a_force_it_does_not_have(tmp_path, capsys):
    (tmp_path / "demo-qwen3").mkdir()
    (tmp_path / "demo-qwen3" / "notes.txt").write_text("mine")
    err = fails(["demo", "--cache-dir", str(tmp_path), "--max-new-tokens", "1"], capsys, "is not empty",
                "--cache-dir")
    assert "--force" not in err
    assert (tmp_path / "demo-qwen3" / "notes.txt").read_text() == "mine"


def test_parents_made_for_an_output_that_was_not_installed_go_again(tmp_path, capsys, monkeypatch):
    _signal_on_first(monkeypatch, presets, "save_file", signal.SIGINT)
    out = tmp_path / "a" / "b" / "m"
    assert main([*MAKE, "--out", str(out)]) == 130
    assert capsys.readouterr().err == f"kestrel: interrupted: nothing was written to {out}\n"
    assert list(tmp_path.iterdir()) == []  # no empty a/b left behind
