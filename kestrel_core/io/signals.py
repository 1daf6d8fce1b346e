"""SIGINT, SIGTERM and SIGHUP: the last two raised as an interrupt (so that cleanup runs), and short critical
sections that hold all three until they end (a swap of two directories must not stop half-way)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from kestrel_core.errors import Interrupted

STOPS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))  # kill; a closed terminal
SIGNALS = (signal.SIGINT, *STOPS)


def _terminate(signum, frame):
    raise Interrupted(signum)


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Inside, SIGTERM and SIGHUP raise ``Interrupted(signum)`` as Ctrl-C raises KeyboardInterrupt (the default would
    kill the process with its temporary files in place); the CLI wraps a command in it."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    old = {s: signal.signal(s, _terminate) for s in STOPS}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


@contextlib.contextmanager
def deferred(reraise: bool = True) -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block ends, then act on the first that came (``reraise``) or drop them.

    Python handlers run only in the main thread, so a block in another thread is never interrupted anyway.
    Handlers are swapped rather than signals masked: torch's worker threads do not share a mask, and the
    kernel may deliver a process signal to any of them.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    old = {}
    try:
        for s in SIGNALS:
            old[s] = signal.signal(s, lambda signum, frame: caught.append(signum))
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)  # None: a handler set outside Python
    if caught and reraise:
        signal.raise_signal(caught[0])  # the handler that was in place acts now: KeyboardInterrupt, Interrupted, or exit
