"""python -m bench SCENARIO [options]: run one benchmark scenario and write its stamped record.

``python -m bench --help`` lists the scenarios; ``python -m bench SCENARIO --help`` gives one's options. A
scenario's record goes to bench/results/<scenario>_<UTCstamp>.json (``--out DIR`` to change).
"""

from __future__ import annotations

import argparse
import signal
import sys
import traceback
from pathlib import Path

from bench.errors import BenchError, Said
from bench.legacy import RETIRED
from bench.scenarios import SCENARIOS, TOOLS, module
from bench.stamp import RESULTS
from kestrel_core.errors import KestrelError


def overview() -> str:
    width = max(map(len, [*SCENARIOS, *TOOLS]))
    lines = [__doc__.strip(), "", "scenarios:"]
    lines += [f"  {name:{width}}  {text}" for name, (_, text) in SCENARIOS.items()]
    lines += ["", "tools:"] + [f"  {name:{width}}  {text}" for name, (_, text) in TOOLS.items()]
    return "\n".join(lines)


def parser_for(name: str, mod) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m bench {name}", description=mod.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    if hasattr(mod, "run"):
        p.add_argument("--out", type=Path, default=RESULTS, help=f"where the record goes (default {RESULTS})")
    mod.add_arguments(p)
    return p


MAX_COUNT = 2**40  # kestrel's own bound on a count of tokens: a count past it is refused before any work


def below_one(parser: argparse.ArgumentParser, args) -> str | None:
    """Why a count was refused, or None: an int option whose default is a positive count (tokens, repeats, layers, ...)
    and whose help gives 0 no meaning must be at least 1 (0 would run rows of nothing, or be read as "not given"), and
    none may pass MAX_COUNT (kestrel would refuse it only once a checkpoint and the record were written)."""
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if action.type is not int or not isinstance(action.default, int) or action.default < 1 or value is None:
            continue
        if "0:" not in (action.help or "") and value < 1:
            return f"{'/'.join(action.option_strings)} must be at least 1, got {value}"
        if value > MAX_COUNT:
            return f"{'/'.join(action.option_strings)} must be at most 2**40, got {value}"
    return None


def _stop(signum, frame):  # a SIGTERM (a timeout) ends the run as Ctrl-C does, so its record is still written
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(overview())
        return 0 if argv else 2
    name = argv[0]
    if name in RETIRED:
        print(f"python -m bench: {name} is retired ({RETIRED[name]}); its records stay in bench/results/",
              file=sys.stderr)
        return 2
    if name not in SCENARIOS and name not in TOOLS:
        print(f"python -m bench: unknown scenario {name!r}; `python -m bench --help` lists them", file=sys.stderr)
        return 2
    mod = module(name)
    parser = parser_for(name, mod)
    args = parser.parse_args(argv[1:])
    bad = below_one(parser, args)
    if bad:
        parser.error(bad)
    why = mod.needs_gpu(args) if hasattr(mod, "needs_gpu") else None
    if why:
        print(f"python -m bench {name}: {why}", file=sys.stderr)
        return 2
    try:
        if not hasattr(mod, "run"):
            return mod.main(args)
        return measure(name, mod, args, ["python -m bench", *argv])
    except Said:  # kestrel has said why, in its line: the record holds it, and nothing is said twice
        return 2
    except (BenchError, KestrelError) as exc:  # a setting or checkpoint kestrel refuses: one line, no traceback
        print(f"python -m bench {name}: {exc}", file=sys.stderr)
        return 2


def measure(name: str, mod, args, argv: list[str]) -> int:
    """Run a scenario and write its record: complete, or, where it stopped early, with what it had and why."""
    from bench.record import Record

    options = {k: v for k, v in vars(args).items() if k != "out"}
    rec = Record(name, args.out, options, argv)
    result: dict = {}
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        result = mod.run(args, rec) or {}
    except (BenchError, KestrelError) as exc:
        rec.finish(getattr(rec, "last_partial", None) or result, complete=False, error=f"{type(exc).__name__}: {exc}")
        raise
    except BaseException as exc:  # the record says where and why it stopped, then the error goes on
        partial = getattr(rec, "last_partial", None) or result
        path = rec.finish(partial, complete=False, error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        print(f"record (incomplete): {path}", file=sys.stderr)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    path = rec.finish(result)
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
