"""kestrel sweep: the cost curve over keep, policy, allocator and backend, with the invariance verdict."""

from __future__ import annotations

import sys

from kestrel_core.io import newfile

from kestrel_core.io import progress
from kestrel_core.config import AUTO, model_dir, parse_keep
from kestrel_core.engine.run import Model
from kestrel_core.errors import ConfigError
from kestrel_core.tools.sweep import (available_backends, equal_peak_comparison, format_table, format_verdict, invariance, plot, plotting,
                     run_sweep)
from kestrel_core.io.jsonout import emit_json
from kestrel_core.commands.common import add_run_flags, config_from_args, prompt_ids_for

HELP = "sweep keep x policy x allocator (x backend); print the cost table and whether token ids stayed identical"
DEFAULT_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def add_arguments(p):
    add_run_flags(p, sweep=True)
    p.add_argument("--plot", help="write the cost curve to this new .png file (checked before the sweep; never replaces a file)")


def _list(value, default, flag=""):
    items = [v.strip() for v in value.split(",") if v.strip()] if value else default
    twice = sorted({v for v in items or () if items.count(v) > 1})
    if twice:  # the same setting run twice is not a second data point
        raise ConfigError(f"{flag} lists {twice[0]} twice; list each value once")
    return items


def sweep_lists(args, cfg):
    keeps = [parse_keep(k) for k in _list(args.keep, ["1", "2", "4", "off"], "--keep")]
    if AUTO in keeps:
        raise ConfigError("--keep auto picks one keep from the budget; a sweep compares the keeps it is given: list them "
                          "(e.g. --keep 1,2,4,off)")
    if len(set(keeps)) < len(keeps):  # '2' and '02'
        raise ConfigError(f"--keep lists a value twice ({args.keep}); list each value once")
    policies = _list(args.policy, [cfg.residency.policy], "--policy")
    allocators = _list(args.allocator, [cfg.residency.allocator], "--allocator")
    try:
        prefetches = [int(x) for x in _list(args.prefetch, [str(cfg.backend.prefetch)], "--prefetch")]
    except ValueError:
        raise ConfigError(f"--prefetch must be whole numbers, got {args.prefetch!r}") from None
    if any(p < 0 for p in prefetches):
        raise ConfigError(f"--prefetch must be layer counts >= 0, got {args.prefetch!r}")
    if len(set(prefetches)) < len(prefetches):  # '0' and '00'
        raise ConfigError(f"--prefetch lists a value twice ({args.prefetch}); list each value once")
    backends = available_backends(_list(args.backend, None, "--backend") or ([cfg.backend.name] if cfg.backend.name != "cpu_ref" else None))
    return keeps, policies, allocators, prefetches, backends


def check_plot(path: str | None) -> None:
    """Before the sweep: matplotlib is there, and the plot's path is a new .png file in a writable directory."""
    if not path:
        return
    plotting()
    try:
        newfile.check_new(path, "--plot", ".png")
    except ConfigError as exc:
        raise ConfigError(f"cannot write the plot: {exc}") from None


def report(rows, as_json: bool, plot_path: str | None, extra: dict | None = None) -> int:
    """The table and verdict (or JSON), then the plot: a plot that fails after all never costs the results."""
    verdict = invariance(rows)
    comparison = equal_peak_comparison(rows)
    if as_json:
        emit_json({**(extra or {}), "rows": [r.to_json() for r in rows], "invariance": verdict, "pinned_vs_asymmetric": comparison})
    else:
        print(format_table(rows))
        print(format_verdict(verdict, comparison))
    if plot_path:
        sys.stdout.flush()  # the results are out before a failed plot's error
        plot(rows, plot_path, (extra or {}).get("model", ""))
    return 0 if verdict["identical"] else 1


def run(args) -> int:
    cfg = config_from_args(args, sweep=True)
    check_plot(args.plot)
    keeps, policies, allocators, prefetches, backends = sweep_lists(args, cfg)
    with progress.shown(not args.json), Model(model_dir(cfg)) as model:
        prompt = prompt_ids_for(cfg, model, default=DEFAULT_PROMPT)
        rows = run_sweep(model, cfg, prompt, keeps, policies, allocators, backends, prefetches)
    return report(rows, args.json, args.plot, {"model": cfg.model, "prompt_ids": prompt})
