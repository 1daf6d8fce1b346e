"""Progress bars for long work (make-model, quantize, a sweep, staging weights at load), drawn by tqdm on stderr.

A command decides once whether a person is watching; the library only says how far it got:

    with progress.shown(not args.json):        # a command's run(); quiet too when stderr is not a terminal
        write_checkpoint(...)                  # somewhere inside: with progress.bar(total, "make-model", "B") as bar: bar.update(n)

Outside ``shown`` (the Python API, tests, a script) every bar is a no-op, so a library call never writes to
stderr on its own; the bar is cleared when its work ends, and the command's result stays the only output.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm import tqdm

_shown = False


@contextmanager
def shown(on: bool = True) -> Iterator[bool]:
    """Draw the bars of the work inside when ``on`` (a command passes ``not args.json``) and stderr is a terminal;
    yields whether they are drawn. Nested use restores the outer setting."""
    global _shown
    outer, _shown = _shown, on and _terminal()
    try:
        yield _shown
    finally:
        _shown = outer


def enabled() -> bool:
    """Whether bars are drawn now."""
    return _shown


def bar(total: float | None, desc: str, unit: str = "it") -> tqdm:
    """A tqdm bar over ``total`` units (``unit="B"``: bytes, shown as KiB/MiB/GiB), used as a context manager
    with ``.update(n)`` and ``.set_postfix_str(s)``; disabled (every call a no-op) unless ``enabled()``."""
    in_bytes = unit == "B"
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=in_bytes, unit_divisor=1024 if in_bytes else 1000,
                file=sys.stderr, leave=False, dynamic_ncols=True, disable=not _shown)


def say(message: str) -> None:
    """A line on stderr for the person watching (without breaking a bar that is drawn); nothing unless ``enabled()``."""
    if _shown:
        tqdm.write(message, file=sys.stderr)


def _terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False
