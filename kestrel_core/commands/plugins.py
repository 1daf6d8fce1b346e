"""kestrel plugins: every registration of every discovery hook (``register_<kind>``), with its package and version."""

from __future__ import annotations

import inspect

from kestrel_core import hookspecs, plugins
from kestrel_core.io.jsonout import emit_json

HELP = "list registered backends, policies, allocators, commands and the rest, with their package and version"
# One kind per discovery hook, in the order hookspecs.py declares them.
KINDS = tuple(name.removeprefix("register_") for name, spec in vars(hookspecs).items()
              if name.startswith("register_") and inspect.isfunction(spec) and hasattr(spec, "kestrel_spec"))


def add_arguments(p):
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args) -> int:
    rows = [reg for kind in KINDS for reg in plugins.registry(kind).values()]
    if args.json:
        emit_json([{"kind": plugins.SINGULAR.get(r.kind, r.kind), "name": r.name,
                    "package": r.package, "version": r.version, "plugin": r.plugin} for r in rows])
        return 0
    print(f"{'kind':10} {'name':18} {'package':28} version")
    for r in rows:
        print(f"{plugins.SINGULAR.get(r.kind, r.kind):10} {r.name:18} {r.package:28} {r.version}")
    return 0
