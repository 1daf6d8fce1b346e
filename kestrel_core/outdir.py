"""Writing a model directory so that no data is lost: a temporary sibling, fsync, then one rename.

An interrupt, a full disk or an exception leaves the old directory as it was, or the new one
whole: never a mix of two models, never a partial file. A non-empty ``--out`` is refused unless
``force``, and even then only when it holds model files alone, which are replaced as a whole.
"""

from __future__ import annotations

import contextlib
import ctypes
import fnmatch
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from .errors import KestrelError

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


def check_output(out: Path, force: bool, flag: str = "--out") -> None:
    """Refuse, before any work, an ``out`` that is a file, or non-empty without ``force``."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputError(f"{flag} {out} is a file, not a directory; name a new directory")
    try:
        entries = sorted(os.listdir(out)) if out.is_dir() else []
    except OSError as exc:
        raise OutputError(f"{flag} {out} cannot be listed ({exc.strerror}); pick another directory") from None
    if not entries:
        return
    if not force:
        raise OutputError(f"{flag} {out} is not empty (it holds {entries[0]}"
                          f"{f' and {len(entries) - 1} more' if len(entries) > 1 else ''}); "
                          "pass --force to replace the model in it, or name a new directory")
    foreign = [e for e in entries if not (is_model_file(e) and (out / e).is_file())]
    if foreign:
        raise OutputError(f"--force replaces a model directory, but {out} also holds {foreign[0]}, which is not a "
                          "model file; move it away or name a new directory")


@contextlib.contextmanager
def model_output(out: str | Path, force: bool = False, flag: str = "--out") -> Iterator[Path]:
    """Yield an empty temporary directory beside ``out``; when the block succeeds it becomes ``out``."""
    out = Path(out)
    check_output(out, force, flag)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".kestrel-partial", dir=out.parent))
    except OSError as exc:
        raise OutputError(f"cannot write {out}: {exc.strerror} ({exc.filename or out.parent}); "
                          "pick a directory you can write to") from None
    try:
        yield tmp
        _seal(tmp)
        _replace(tmp, out)
    except OSError as exc:
        raise OutputError(f"cannot write {out}: {exc.strerror} ({exc.filename or out}); nothing in {out} "
                          "was changed: free space or pick another directory") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the unfinished new model, or the replaced old one


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


_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one step (Linux renameat2); False where the system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_cwd = -100
    if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: this filesystem cannot exchange
        return False
    raise OSError(err, os.strerror(err), str(b))


def _replace(tmp: Path, out: Path) -> None:
    """Put ``tmp`` at ``out``; an old ``out`` ends up at ``tmp``, for the caller to remove."""
    if not out.exists() or not any(out.iterdir()):
        os.replace(tmp, out)  # a rename may replace an empty directory
    elif not _exchange(tmp, out):
        old = tmp.with_suffix(".kestrel-old")
        os.rename(out, old)  # without renameat2: a moment with no `out`, the old model kept beside it
        os.rename(tmp, out)
        os.rename(old, tmp)
    _fsync(out.parent)
