"""`kestrel demo --json` (the demo checkpoint swept on every available backend) as a record.

    python -m bench demo [--cache-dir DIR] [--max-new-tokens N]

The record holds the command's whole JSON (every row's settings, ms/token, bytes a token against the offline
optimum's, the invariance verdict) and its exit code.
"""

from __future__ import annotations

import contextlib
import io
import json

from bench.errors import Said
from bench.log import log


def add_arguments(p) -> None:
    p.add_argument("--cache-dir", help="where the demo checkpoint lives (kestrel demo's default otherwise)")
    p.add_argument("--max-new-tokens", type=int, default=None)


def run(args, record) -> dict:
    from kestrel_core.cli import main as kestrel

    argv = ["demo", "--json"] + (["--cache-dir", args.cache_dir] if args.cache_dir else []) + \
        (["--max-new-tokens", str(args.max_new_tokens)] if args.max_new_tokens else [])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = kestrel(argv)
    if rc != 0:  # kestrel said why on stderr, and wrote no JSON
        raise Said(f"kestrel {' '.join(argv)} exited with code {rc}")
    demo = json.loads(out.getvalue())
    for r in demo["rows"]:  # every policy against the offline optimum (belady) at its own peak
        if r["allocator"] == "pool" and r["keep"] != "off":
            log(f"{r['backend']} {r['policy']:16} keep={r['keep']}: {r['bytes_uploaded_per_token'] / 2**20:6.2f} MiB/token, "
                f"optimum {r['min_bytes_per_token'] / 2**20:6.2f} "
                f"({'x' + format(r['bytes_vs_min'], '.2f') if r['bytes_vs_min'] is not None else 'the optimum moves none'})")
    log(f"identical ids: {demo['invariance']['identical']}")
    return {"exit_code": rc, "command": "kestrel " + " ".join(argv), **demo}
