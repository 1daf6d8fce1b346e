"""A bench record: one JSON file a scenario's run leaves, stamped, written atomically, never overwritten.

    rec = Record("stream", out_dir)          # stamped as the run starts
    rec.save_partial(result)                 # <name>.json.partial, rewritten as the run goes
    path = rec.finish(result)                # <scenario>_<UTCstamp>.json; the partial goes

A record holds ``format`` (2: written by ``python -m bench``; the older scripts' records have none), the
``scenario``, its ``stamp`` (bench.stamp), the ``options`` it ran with, ``complete`` (false where the run stopped
early, with the ``error``), and the scenario's ``result``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from bench import stamp as stamping
from kestrel_core.errors import ConfigError
from kestrel_core.io import newfile, signals

FORMAT = 2


def jsonable(value):
    """``value`` with paths, tuples, sets and non-finite floats made JSON (a NaN or inf is written as null)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def write_new(path: Path, content: dict) -> Path:
    """Write ``content`` to ``path`` through kestrel's writer (a temp file, fsynced, then linked into place; never
    over an existing file), with SIGINT and SIGTERM held while it writes: a signal that comes then (a timeout's
    SIGTERM) acts once the record is whole, so neither the record nor a temp file of it is left half-way."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(jsonable(content), indent=1) + "\n"
    try:
        with signals.deferred():
            newfile.write_text_new(path, text, "the record")
    except ConfigError as exc:
        if path.exists():
            raise FileExistsError(f"{path} exists: a record is never overwritten") from None
        raise OSError(str(exc)) from None
    _fsync_dir(path.parent)
    return path


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Record:
    """One scenario's record, stamped when made; ``finish`` writes it."""

    def __init__(self, scenario: str, out_dir: Path, options: dict | None = None, argv: list[str] | None = None):
        self.scenario, self.out_dir = scenario, Path(out_dir)
        self.stamp = stamping.stamp(argv)
        when = stamping.utc_now()
        self.name = f"{scenario}_{when:%Y%m%dT%H%M%SZ}.json"
        self.options = jsonable(options or {})
        self.path = self.out_dir / self.name
        self.partial = self.out_dir / (self.name + ".partial")
        self.last_partial: dict | None = None

    def content(self, result: dict, complete: bool, error: str | None = None) -> dict:
        return {"format": FORMAT, "scenario": self.scenario, "complete": complete, "error": error,
                "stamp": self.stamp, "options": self.options, "result": result}

    def save_partial(self, result: dict) -> None:
        """What the run has measured so far, so a run cut short still leaves it (rewritten at each call)."""
        self.last_partial = result
        self.out_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.partial.with_name(f".{self.partial.name}.{os.getpid()}.tmp")
        text = json.dumps(jsonable(self.content(result, False, "the run has not finished")), indent=1)
        with signals.deferred():  # a signal acts once the partial is whole and no temp file is left
            try:
                tmp.write_text(text)
                os.replace(tmp, self.partial)
            finally:
                tmp.unlink(missing_ok=True)

    def finish(self, result: dict, complete: bool = True, error: str | None = None) -> Path:
        path = write_new(self.path, self.content(result, complete, error))
        self.partial.unlink(missing_ok=True)
        return path
