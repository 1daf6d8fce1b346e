"""The ``kestrel`` command. Each built-in subcommand lives in ``kestrel_core/commands/<name>.py``;
plugins add theirs through the ``register_commands`` hook."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import warnings

from . import plugins, progress, signals
from .errors import Interrupted, KestrelError, KestrelNote, PluginError

SUBCOMMANDS = ("make_model", "generate", "chat", "sweep", "replay", "plugins", "demo", "quantize")


def _add(sub, name: str, command) -> None:
    p = sub.add_parser(name, help=command.HELP, description=command.HELP)
    command.add_arguments(p)
    p.set_defaults(run=command.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kestrel", description="Run models whose weights do not fit in device memory.")
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


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()  # plugins load here: they may add commands
    except KestrelError as exc:
        print(f"kestrel: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings(record=True) as notes, signals.terminate_as_interrupt():
            warnings.simplefilter("default")
            with progress.shown(not getattr(args, "json", False)):  # bars on stderr, for a person at a terminal
                rc = args.run(args) or 0
                sys.stdout.flush()  # here, so that a reader gone away is met by the handler below, not at exit
        for note in notes:  # after the output, and only when the command did not fail
            if issubclass(note.category, KestrelNote):
                print(f"kestrel: note: {note.message}", file=sys.stderr)
            else:
                warnings.showwarning(note.message, note.category, note.filename, note.lineno)
        return rc
    except KestrelError as exc:
        print(f"kestrel: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader of our output left (`kestrel generate ... | head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail again
        return 141  # 128 + SIGPIPE, as a shell reports it
    except OSError as exc:  # a disk or permission problem the command did not name itself
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"kestrel: error: {exc.strerror or exc}{where}; check the path, its permissions and the free space",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (Interrupted): what was left, where a writer knows
        print(f"kestrel: {exc if isinstance(exc, Interrupted) else 'interrupted'}", file=sys.stderr)
        return 128 + getattr(exc, "signum", signal.SIGINT)


if __name__ == "__main__":
    sys.exit(main())
