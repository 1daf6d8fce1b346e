"""The ``kestrel`` command. Each built-in subcommand lives in ``kestrel_core/commands/<name>.py``;
plugins add theirs through the ``register_commands`` hook."""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import importlib.metadata
import os
import signal
import sys
import warnings

from kestrel_core import plugins

from kestrel_core.io import progress

from kestrel_core.io import signals
from kestrel_core.engine.pipeline import check_command, launched_rank
from kestrel_core.commands.ranks import launch as ranks_launch, tie_to_launcher
from kestrel_core.errors import Interrupted, KestrelError, KestrelNote, PluginError

SUBCOMMANDS = ("make_model", "generate", "chat", "serve", "sweep", "replay", "plugins", "demo", "quantize")


def _add(sub, name: str, command) -> None:
    p = sub.add_parser(name, help=command.HELP, description=command.HELP)
    command.add_arguments(p)
    p.set_defaults(run=command.run)


class Parser(argparse.ArgumentParser):
    """argparse with kestrel's one-line errors: the usage block would bury the line that names the problem."""

    def error(self, message: str, prog: str | None = None):
        print(f"kestrel: error: {message}; see {prog or self.prog} --help", file=sys.stderr)
        raise SystemExit(2)

    def parse_args(self, args=None, namespace=None):
        ns, extra = self.parse_known_args(args, namespace)
        if extra:  # point at the subcommand's help, whose flags these were meant to be
            command = getattr(ns, "command", None)
            self.error(f"unrecognized arguments: {' '.join(extra)}", f"{self.prog} {command}" if command else None)
        return ns


def version() -> str:
    try:
        return importlib.metadata.version("kestrel")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kestrel", description="Run models whose weights do not fit in device memory.")
    parser.add_argument("--version", action="version", version=f"kestrel {version()}", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    builtin = {name.replace("_", "-"): importlib.import_module(f".commands.{name}", __package__) for name in SUBCOMMANDS}
    for name, module in builtin.items():
        _add(sub, name, module)
    for name, reg in plugins.registry("commands").items():
        if name in builtin:
            raise PluginError(f"command {name!r} from {reg.plugin} collides with the built-in `kestrel {name}`; rename it")
        missing = [a for a in ("HELP", "add_arguments", "run") if not hasattr(reg.factory, a)]
        if missing:
            raise PluginError(f"command {name!r} from {reg.plugin} lacks {', '.join(missing)}; "
                              "a command has HELP, add_arguments(parser) and run(args)")
        _add(sub, name, reg.factory)
    return parser


def _drop_output() -> None:
    """Send what stdout still buffers to /dev/null, so that the flush at exit cannot fail again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


class OutputWriteError(OSError):
    """A write to standard output failed (a full disk under `> file`): named as the output's, not as a path's."""


class _Output:
    """sys.stdout while a command runs: its write errors become OutputWriteError (a reader gone away stays a
    BrokenPipeError); everything else is the stream's own."""

    def __init__(self, stream):
        self._stream = stream

    def _guard(self, call, *args):
        try:
            return call(*args)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputWriteError(exc.errno, exc.strerror) from None

    def write(self, text):
        return self._guard(self._stream.write, text)

    def writelines(self, lines):
        return self._guard(self._stream.writelines, lines)

    def flush(self):
        return self._guard(self._stream.flush)

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def _guarded_output(rank: int = 0):
    """stdout guarded (``_Output``); a pipeline's other ranks (``rank`` > 0) write theirs nowhere."""
    quiet = open(os.devnull, "w") if rank else None  # noqa: SIM115 - closed below
    real, sys.stdout = sys.stdout, _Output(quiet or sys.stdout)
    try:
        yield
    finally:
        sys.stdout = real
        if quiet is not None:
            quiet.close()


def main(argv: list[str] | None = None) -> int:
    """The program (``argv`` None: sys.argv), or one command in this process (tests, the docs check)."""
    if argv is not None:
        return _main(argv)
    try:
        return _main(None)
    finally:
        # The command has ended and said so: a Ctrl-C, SIGTERM or SIGHUP while Python exits has nothing left to stop, and
        # would only print a traceback from an atexit hook (torch's). The exit code stays the command's.
        for s in signals.SIGNALS:
            signal.signal(s, signal.SIG_IGN)


def _main(argv: list[str] | None) -> int:
    tie_to_launcher()  # a rank that --devices started ends with its launcher, however that ends
    if sys.stdout is None:  # started with stdout closed (`kestrel ... >&-`): Python gives None, not a stream
        print("kestrel: error: standard output is closed; send it somewhere: a file, a pipe, or >/dev/null",
              file=sys.stderr)
        return 2
    try:
        parser = build_parser()  # plugins load here: they may add commands (and the commands import torch: seconds)
    except KestrelError as exc:
        print(f"kestrel: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while the imports ran: nothing had started
        print("kestrel: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # a bad flag (one line, above), or --help and --version: a code to return, not raise
        return exc.code if isinstance(exc.code, int) else 2
    who = "kestrel"  # a pipeline's later rank names itself: each rank says its own error
    try:
        rank, ranks = launched_rank()
        who = f"kestrel (rank {rank})" if rank else who
        if getattr(args, "devices", None) is not None and ranks == 1:  # kestrel starts the ranks, each with this line
            with signals.terminate_as_interrupt():
                return ranks_launch(args, sys.argv[1:] if argv is None else list(argv))
        check_command(args.command)
        # every rank of a pipeline runs the command; the first one speaks
        with warnings.catch_warnings(record=True) as notes, signals.terminate_as_interrupt(), _guarded_output(rank):
            warnings.simplefilter("default")
            with progress.shown(not getattr(args, "json", False)):  # bars on stderr, for a person at a terminal
                rc = args.run(args) or 0
                sys.stdout.flush()  # here, so that a reader gone away is met by the handlers below, not at exit
        for note in notes:  # after the output, and only when the command did not fail
            if issubclass(note.category, KestrelNote):
                print(f"kestrel: note: {note.message}", file=sys.stderr)
            else:
                warnings.showwarning(note.message, note.category, note.filename, note.lineno)
        return rc
    except KestrelError as exc:
        print(f"{who}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader of our output left (`kestrel generate ... | head`): not an error of ours
        _drop_output()
        return 141  # 128 + SIGPIPE, as a shell reports it
    except OutputWriteError as exc:
        _drop_output()
        how = "free space, or send it elsewhere" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "send it elsewhere"
        print(f"kestrel: error: cannot write the output: {exc.strerror} (standard output); {how}", file=sys.stderr)
        return 2
    except OSError as exc:  # a disk or permission problem the command did not name itself
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"kestrel: error: {exc.strerror or exc}{where}; check the path, its permissions and the free space",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM or SIGHUP (Interrupted): what was left, where a writer knows
        try:
            print(f"kestrel: {exc if isinstance(exc, Interrupted) else 'interrupted'}", file=sys.stderr)
        except OSError:  # a hung-up terminal: the exit code still says it
            pass
        return 128 + getattr(exc, "signum", signal.SIGINT)


if __name__ == "__main__":
    sys.exit(main())
