"""Record `kestrel demo --json` (every available backend) under bench/results/.

    python bench/demo_record.py [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, write_record  # noqa: E402

from kestrel_core.cli import main as kestrel  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-dir")
    args = p.parse_args()
    out = io.StringIO()
    argv = ["demo", "--json"] + (["--cache-dir", args.cache_dir] if args.cache_dir else [])
    with contextlib.redirect_stdout(out):
        rc = kestrel(argv)
    demo = json.loads(out.getvalue())
    paths = write_record("demo", {"exit_code": rc, **demo}, [RESULTS])
    for c in demo["pinned_vs_asymmetric"]:
        print(f"{c['backend']} keep={c['keep']} {c['allocator']}: pinned_set moves {c['saved_fraction']:.0%} fewer bytes a token")
    for r in demo["rows"]:  # every policy against the offline optimum (belady) at its own peak
        if r["allocator"] == "pool" and r["keep"] != "off":
            print(f"{r['backend']} {r['policy']:16} keep={r['keep']}: peak {r['peak_resident_bytes'] / 2**20:6.2f} MiB, "
                  f"{r['bytes_uploaded_per_token'] / 2**20:6.2f} MiB/token, optimum {r['min_bytes_per_token'] / 2**20:6.2f} "
                  f"(x{r['bytes_vs_min']:.2f})")
    print("identical ids:", demo["invariance"]["identical"], "record:", paths[0])
    return rc


if __name__ == "__main__":
    sys.exit(main())
