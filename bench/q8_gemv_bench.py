"""q8 GEMV benchmark on a GPU: the csrc kernel against the pure-torch path and the device copy.

    python bench/q8_gemv_bench.py [--group 64] [--shapes 4096x12288,12288x4096] [--out DIR]

For each weight shape ``n x k`` (W is [n, k]; batch-1 decode, bf16 in and out) one run
measures, side by side: device-to-device copy bandwidth (bytes read + written); the kernel
with the launcher's own split-K choice and with each forced split count (1, 2, 4, 8); and
the torch path (dequantize into a reused buffer, then a matmul). Each is timed two ways:

- device: a CUDA graph of back-to-back calls, replayed and timed with CUDA events (median
  per call). This is the kernel's own time, and the effective bandwidth is quoted from it.
- eager: one Python call between two CUDA events (median), which adds the host's launch
  cost: what the decode loop waits for when the GPU has nothing queued.

Weights rotate over enough sets that their total is at least 3x the L2 cache, so no call
reads its weights from L2. Every variant's output is checked against a float64 product.
The JSON record goes to bench/results/ (and --out).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, copy_ceilings, time_cuda, time_cuda_graph, write_record  # noqa: E402

TARGET_SHAPES = ((4096, 12288), (12288, 4096))  # the two: down_proj-like and up-like, 8B
QWEN3_8B_SHAPES = ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096))  # qkv, o, gate_up, down, lm_head
VARIANTS = ("auto", 1, 2, 4, 8, "torch")


def _sets_for(nbytes: int) -> int:
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 * 2**20)
    return max(4, math.ceil(3 * l2 / nbytes))


def weight_sets(n: int, k: int, group: int, dtype=torch.bfloat16) -> list:
    """Random q8 weights and input rows, enough sets that together they are >= 3x the L2."""
    from kestrel_cuda import q8

    first = q8.gemv_case(n, k, group, dtype, seed=0)
    return [first] + [q8.gemv_case(n, k, group, dtype, seed=i) for i in range(1, _sets_for(first.bytes_moved))]


def measure(cases: list, ref: torch.Tensor, variant, d2d_GBps: float) -> dict:
    """One row: device and eager time of one variant over the rotating sets, with its error
    against ``ref``, the float64 product of the first set."""
    from kestrel_cuda import q8

    first = cases[0]
    w = first.weight
    path = "torch" if variant == "torch" else "kernel"
    splits = 0 if variant in ("auto", "torch") else int(variant)
    fns = [q8.gemv_runner(c.x, c.weight, path, splits) for c in cases]
    plan = list(q8.gemv_plan(w, splits)) if path == "kernel" else None
    rel = ((fns[0]().double() - ref).norm() / ref.norm()).item()
    state = {"i": 0}

    def step():
        fns[state["i"] % len(fns)]()
        state["i"] += 1

    device_ms = time_cuda_graph(step, calls=len(fns) * max(1, 16 // len(fns)))
    eager_ms = time_cuda(step, warmup=8, reps=200)
    return {
        "n": w.n, "k": w.k, "group": w.group, "variant": str(variant),
        "path": path, "plan": plan,
        "weight_sets": len(cases), "bytes_moved": first.bytes_moved,
        "device_ms": device_ms, "eager_ms": eager_ms,
        "GBps": first.bytes_moved / device_ms / 1e6,
        "fraction_of_d2d": first.bytes_moved / device_ms / 1e6 / d2d_GBps,
        "eager_GBps": first.bytes_moved / eager_ms / 1e6,
        "rel_error_vs_float64": rel,
    }


def gemv_rows(shapes, group: int, d2d_GBps: float, variants=VARIANTS, log=print) -> list[dict]:
    rows = []
    for n, k in shapes:
        cases = weight_sets(n, k, group)
        first = cases[0]
        ref = first.x.double() @ first.weight.dequantize(torch.float64).to(first.x.device).T  # once per shape
        for v in variants:
            rows.append(measure(cases, ref, v, d2d_GBps))
            log(format_row(rows[-1]))
        del cases, first, ref
        torch.cuda.empty_cache()
    return rows


def format_row(r: dict) -> str:
    plan = "x".join(map(str, r["plan"][:2])) if r["plan"] else "-"
    return (f"{r['n']:>6}x{r['k']:<6} {r['variant']:>5} grid {plan:>6}  device {r['device_ms'] * 1e3:7.1f} us "
            f"{r['GBps']:6.0f} GB/s {100 * r['fraction_of_d2d']:4.0f}% of d2d | eager {r['eager_ms'] * 1e3:7.1f} us | "
            f"rel err {r['rel_error_vs_float64']:.1e}")


def parse_shapes(text: str):
    if text == "target":
        return TARGET_SHAPES
    if text == "qwen3-8b":
        return TARGET_SHAPES + tuple(s for s in QWEN3_8B_SHAPES if s not in TARGET_SHAPES)
    return tuple(tuple(int(v) for v in s.split("x")) for s in text.split(","))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--group", type=int, default=64)
    p.add_argument("--shapes", default="qwen3-8b", help="'target', 'qwen3-8b' (target + the 8B's layers) or NxK,NxK")
    p.add_argument("--variants", default=",".join(map(str, VARIANTS)))
    p.add_argument("--out", action="append", default=[], help="also write the record here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("q8_gemv_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    variants = tuple(v if v in ("auto", "torch") else int(v) for v in args.variants.split(","))
    ceil = copy_ceilings()
    d2d = ceil["d2d_GBps_read_plus_write"]
    print(f"d2d copy {d2d:.0f} GB/s (read + write)", flush=True)
    rows = gemv_rows(parse_shapes(args.shapes), args.group, d2d, variants)
    auto = [r for r in rows if r["variant"] == "auto" and (r["n"], r["k"]) in TARGET_SHAPES]
    targets = {}
    if auto:
        targets["min_fraction_of_d2d_target_shapes"] = min(r["fraction_of_d2d"] for r in auto)
        targets["met_70pct_of_d2d"] = targets["min_fraction_of_d2d_target_shapes"] >= 0.7
    from kestrel_cuda import q8

    sms, peak, per_sm = q8.gemv_device_facts()
    split_rule = {"sms": sms, "peak_dram_GBps": peak, "blocks_per_sm_aimed_at": per_sm}
    record = {"group": args.group, "ceilings": ceil, "auto_split_rule": split_rule, "rows": rows, "targets": targets}
    paths = write_record("q8_gemv", record, [RESULTS, *map(Path, args.out)])
    print("targets:", targets)
    print("record:", *paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
