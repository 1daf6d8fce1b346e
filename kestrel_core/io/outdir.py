"""Writing a model directory so that no data is lost: a temporary sibling, fsync, then one rename.

An interrupt, a full disk or an exception leaves the old directory as it was, or the new one
whole: never a mix of two models, never a partial file, and nothing hidden left behind (what a
``kill -9`` leaves, a later writer removes: ``leftovers``). A non-empty ``--out`` is refused unless
``force``, and even then only when it holds model files alone, which are replaced as a whole; the
rule holds when another process writes the same directory meanwhile. A link is written through.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import os
from pathlib import Path
from typing import Iterator

from kestrel_core.io import leftovers

from kestrel_core.io import renameat

from kestrel_core.io import signals
from kestrel_core.errors import Interrupted, KestrelError

# What a Hugging Face model directory holds; --force replaces these, and nothing else.
MODEL_FILES = (
    "*.safetensors", "model.safetensors.index.json", "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
)


class OutputError(KestrelError):
    """The output directory cannot be written, or writing it would destroy a user's files."""


def is_model_file(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in MODEL_FILES)


def _some(entries: list[str]) -> str:
    return f"{entries[0]}{f' and {len(entries) - 1} more' if len(entries) > 1 else ''}"


def target_of(out: str | Path, flag: str = "--out") -> Path:
    """The real directory ``out`` names: a link's target (written through, the link kept), as an absolute path."""
    out = Path(out)
    if out.is_symlink() and not out.exists():
        raise OutputError(f"{flag} {out} is a link to {os.readlink(out)}, which does not exist; "
                          "create that directory, or name a new one")
    target = Path(os.path.realpath(out))
    if target.parent == target:
        raise OutputError(f"{flag} {out} is the filesystem's root; name a new directory")
    cwd = Path(os.path.realpath(os.getcwd()))
    if cwd == target or target in cwd.parents:
        raise OutputError(f"{flag} {out} is the working directory (or holds it), and kestrel replaces an output "
                          f"directory as a whole; name a new directory, e.g. {flag} {Path(out) / 'model'}")
    return target


def check_output(out: str | Path, force: bool, flag: str = "--out", force_flag: str | None = "--force") -> Path:
    """Refuse, before any work, an ``out`` that is a file, or non-empty without ``force``; the directory to write.

    ``force_flag`` is the flag that allows replacing a model (None where the command has none)."""
    target = target_of(out, flag)
    if target.exists() and not target.is_dir():
        raise OutputError(f"{flag} {out} is a file, not a directory; name a new directory")
    try:
        entries = sorted(os.listdir(target)) if target.is_dir() else []
    except OSError as exc:
        raise OutputError(f"{flag} {out} cannot be listed ({exc.strerror}); pick another directory") from None
    if not entries:
        return target
    if not force:
        how = f"pass {force_flag} to replace the model in it, or name a new directory" if force_flag else \
            f"empty it, or pass another {flag}"
        raise OutputError(f"{flag} {out} is not empty (it holds {_some(entries)}); {how}")
    foreign = _foreign(target)
    if foreign:
        raise OutputError(f"{force_flag} replaces a model directory, but {out} also holds {foreign[0]}, which is not a "
                          "model file; move it away or name a new directory")
    return target


def _foreign(directory: Path) -> list[str]:
    return [e for e in sorted(os.listdir(directory)) if not (is_model_file(e) and (directory / e).is_file())]


def _advice(exc: OSError) -> str:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free space, or pick a directory on another disk"
    if exc.errno == errno.EFBIG:
        return "a file is larger than this process may write (ulimit -f) or the filesystem holds; raise the limit or pick another disk"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "pick a directory you can write to"
    if exc.errno in (errno.EBUSY, errno.EXDEV):
        return "it is a mount point or in use; name a new directory inside it"
    return "pick another directory"


@contextlib.contextmanager
def model_output(out: str | Path, force: bool = False, flag: str = "--out",
                 force_flag: str | None = "--force") -> Iterator[Path]:
    """Yield an empty temporary directory beside ``out``; when the block succeeds it becomes ``out``.

    An interrupt (SIGINT, or SIGTERM and SIGHUP under ``signals.terminate_as_interrupt``) is re-raised as
    ``Interrupted`` saying which model ``out`` holds: the install and the removal of the old copy run with the
    signals held, so that one never stops half-way. Parent directories made for ``out`` go again if it is not
    installed."""
    target = check_output(out, force, flag, force_flag)
    had_old = target.is_dir() and any(target.iterdir())
    made = [p for p in (target.parent, *target.parent.parents) if not p.exists()]  # innermost first
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        leftovers.sweep(target.parent)
        tmp = leftovers.temp_dir(target.parent, target.name)
    except OSError as exc:
        _unmake(made)
        raise OutputError(f"cannot write {out}: {exc.strerror} ({exc.filename or target.parent}); "
                          f"nothing was changed: {_advice(exc)}") from None
    installed = False
    try:
        yield tmp
        _seal(tmp)
        with signals.deferred():
            _install(tmp, target, force, f"{flag} {out}", force_flag)
            installed = True
            leftovers.remove(tmp)  # the replaced old model, or nothing
    except KeyboardInterrupt as exc:
        if installed:
            raise Interrupted.of(exc, f"{{}} after the new model was installed in {out}") from None
        _discard(tmp, made)
        kept = f"the old model in {out} is intact" if had_old else f"nothing was written to {out}"
        raise Interrupted.of(exc, f"{{}}: {kept}") from None
    except OSError as exc:
        _discard(tmp, [] if installed else made)
        if installed:  # only the old copy's removal failed
            raise OutputError(f"wrote {out}, but could not remove the old model at {tmp}: {exc.strerror}; "
                              "remove that directory") from None
        where = _inside(exc.filename, tmp, out) if exc.filename else out
        raise OutputError(f"cannot write {out}: {exc.strerror} ({where}); nothing in {out} "
                          f"was changed: {_advice(exc)}") from None
    except BaseException:
        _discard(tmp, made)
        raise


def _inside(filename, tmp: Path, out) -> str:
    """A path the OSError names, with the hidden temporary directory shown as the ``out`` it stands for."""
    name = os.fsdecode(filename)
    return str(Path(out) / os.path.relpath(name, tmp)) if name.startswith(str(tmp) + os.sep) else name


def _discard(tmp: Path, made: list[Path]) -> None:
    """The unfinished new model, and the parents made for it, gone, even if a second Ctrl-C comes meanwhile (the
    first is already on its way)."""
    with signals.deferred(reraise=False):
        try:
            leftovers.remove(tmp)
        except OSError:
            pass  # it carries its owner's tag: the next writer here removes it
        _unmake(made)


def _unmake(made: list[Path]) -> None:
    for p in made:  # innermost first; one that holds anything now is someone's: kept
        try:
            p.rmdir()
        except OSError:
            break


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _seal(tmp: Path) -> None:
    """Normal permissions (some writers create 0600 files, mkdtemp a 0700 folder), and everything on disk."""
    mask = _umask()
    for f in tmp.iterdir():  # the writers write flat directories
        os.chmod(f, 0o666 & ~mask)
        _fsync(f)
    os.chmod(tmp, 0o777 & ~mask)
    _fsync(tmp)


def _install(tmp: Path, target: Path, force: bool, named: str, force_flag: str | None) -> None:
    """Put ``tmp`` at ``target``; a replaced old model ends up at ``tmp``, for the caller to remove.

    Without ``force`` the rename succeeds only onto nothing or an empty directory, so a writer that filled
    ``target`` meanwhile (another kestrel, or anyone) wins and this one fails. With ``force`` the old copy is
    checked again after the swap, and swapped back if a file that is not a model's appeared in it."""
    try:
        os.rename(tmp, target)  # onto nothing, or an empty directory: one step
        _fsync(target.parent)
        return
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        if not force:
            what = f"it now holds {_some(sorted(os.listdir(target)))}" if target.is_dir() else "it is now a file"
            how = f"pass {force_flag} to replace it, or name a new directory" if force_flag else "name a new directory"
            raise OutputError(f"{named} was written by another process meanwhile ({what}); this model was not "
                              f"installed and nothing there was changed: {how}") from None
    if renameat.exchange(tmp, target):
        foreign = _foreign(tmp)
        if foreign:
            renameat.exchange(tmp, target)
            raise OutputError(f"{named} gained {foreign[0]}, which is not a model file, while this model was written; "
                              "nothing there was changed: move it away and run again")
    else:  # no renameat2: a moment with no target, the old model kept beside it
        # under a name no sweep removes: if this process is killed in that moment, the user finds the old model there
        old = target.with_name(f".{target.name[:80]}.{leftovers.tag()}.kestrel-old")
        os.rename(target, old)
        foreign = _foreign(old)
        if foreign:
            os.rename(old, target)
            raise OutputError(f"{named} gained {foreign[0]}, which is not a model file, while this model was written; "
                              "nothing there was changed: move it away and run again")
        os.rename(tmp, target)
        os.rename(old, tmp)  # a tagged name again, for the caller to remove
    _fsync(target.parent)
