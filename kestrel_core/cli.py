"""The ``kestrel`` command. Each subcommand lives in ``kestrel_core/commands/<name>.py``."""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings

from .errors import KestrelError, KestrelNote

SUBCOMMANDS = ("make_model", "generate", "sweep", "plugins", "demo", "quantize", "gate")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kestrel", description="Run models whose weights do not fit in device memory.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        module = importlib.import_module(f".commands.{name}", __package__)
        p = sub.add_parser(name.replace("_", "-"), help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings(record=True) as notes:
            warnings.simplefilter("default")
            rc = args.run(args) or 0
        for note in notes:  # after the output, and only when the command did not fail
            if issubclass(note.category, KestrelNote):
                print(f"kestrel: note: {note.message}", file=sys.stderr)
            else:
                warnings.showwarning(note.message, note.category, note.filename, note.lineno)
        return rc
    except KestrelError as exc:
        print(f"kestrel: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a disk or permission problem the command did not name itself
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"kestrel: error: {exc.strerror or exc}{where}; check the path, its permissions and the free space",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kestrel: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
