"""kestrel plugins: every registered backend, policy, allocator and gate, with its package and version."""

from __future__ import annotations

from .. import plugins
from .common import emit_json

HELP = "list registered backends, policies, allocators and gates with their package and version"
KINDS = ("backends", "policies", "allocators", "gates")


def add_arguments(p):
    p.add_argument("--json", action="store_true")


def run(args) -> int:
    rows = [reg for kind in KINDS for reg in plugins.registry(kind).values()]
    if args.json:
        emit_json([{"kind": r.kind[:-1] if r.kind != "policies" else "policy", "name": r.name,
                    "package": r.package, "version": r.version, "plugin": r.plugin} for r in rows])
        return 0
    print(f"{'kind':10} {'name':18} {'package':28} version")
    for r in rows:
        kind = "policy" if r.kind == "policies" else r.kind[:-1]
        print(f"{kind:10} {r.name:18} {r.package:28} {r.version}")
    return 0
