"""The window's own bookkeeping per layer boundary (Window.advance + acquire), keep=L against off.

    python bench/window_overhead.py [--model DIR] [--boundaries 20000]

Everything is resident in both settings, so no upload happens in the timed loop: what
remains is the policy hook, the advice merge and the lookup. Runs on the CPU backend.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, write_record  # noqa: E402

from kestrel_core.config import KestrelConfig  # noqa: E402
from kestrel_core.engine import Model, open_run  # noqa: E402
from kestrel_core.presets import preset_config, write_checkpoint  # noqa: E402


def per_boundary_us(model: Model, keep, boundaries: int) -> float:
    cfg = KestrelConfig().override(residency__keep=keep)
    L = model.n_layers
    with open_run(model, cfg) as run:
        w = run.window
        w.preload()
        for layer in range(L):  # make every layer resident
            w.advance(layer, "decode")
            w.acquire(layer)
        t0 = time.perf_counter()
        for i in range(boundaries):
            layer = i % L
            w.advance(layer, "decode")
            w.acquire(layer)
        return (time.perf_counter() - t0) / boundaries * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--boundaries", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model) if args.model else write_checkpoint(preset_config("demo"), Path(tmp) / "demo")
        with Model(path) as model:
            L = model.n_layers
            runs = {"off": [], f"asymmetric keep={L}": []}
            for _ in range(args.repeats):  # interleaved
                runs["off"].append(per_boundary_us(model, "off", args.boundaries))
                runs[f"asymmetric keep={L}"].append(per_boundary_us(model, L, args.boundaries))
    med = {k: statistics.median(v) for k, v in runs.items()}
    record = {"model": str(args.model or "demo preset"), "boundaries_per_run": args.boundaries,
              "us_per_boundary": runs, "median_us_per_boundary": med,
              "window_minus_off_us": med[f"asymmetric keep={L}"] - med["off"]}
    paths = write_record("window_overhead", record, [RESULTS])
    for k, v in med.items():
        print(f"{k:22} {v:.3f} us per boundary (median of {args.repeats})")
    print(f"window - off: {record['window_minus_off_us']:.3f} us per boundary; record: {paths[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
