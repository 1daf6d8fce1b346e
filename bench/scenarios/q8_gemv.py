"""The q8 GEMV kernel against the pure-torch path and the device copy, on a GPU.

    python -m bench q8-gemv [--group 64] [--shapes qwen3-8b|target|NxK,NxK] [--variants auto,1,2,4,8,torch]

For each weight shape n x k (W is [n, k]; batch-1 decode, bf16 in and out) one run measures, side by side: the
device-to-device copy rate (bytes read + written); the kernel with the launcher's own split-K choice ("auto") and
with each forced split count; and the torch path (dequantize into a reused buffer, then a matmul). Each is timed two
ways, every repetition kept:

- device: a CUDA graph of back-to-back calls, replayed and timed by CUDA events (per call); the effective bandwidth
  is quoted from its median;
- eager: one Python call between two CUDA events, which adds the host's launch cost.

Weights rotate over enough sets that their total is at least 3x the L2, so no call reads its weights from L2. Every
variant's output is checked against a float64 product.
"""

from __future__ import annotations

import math

from bench.errors import cuda_missing
from bench.log import log
from bench.stats import summary
from bench.timing import copy_rates, event_times, graph_times

TARGET_SHAPES = ((4096, 12288), (12288, 4096))  # the two: down_proj-like and up-like, 8B
QWEN3_8B_SHAPES = ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096))  # qkv, o, gate_up, down, lm_head
VARIANTS = ("auto", 1, 2, 4, 8, "torch")


def add_arguments(p) -> None:
    p.add_argument("--group", type=int, default=64)
    p.add_argument("--shapes", default="qwen3-8b", help="'target', 'qwen3-8b' (target + the 8B's layers) or NxK,NxK")
    p.add_argument("--variants", default=",".join(map(str, VARIANTS)))
    p.add_argument("--eager-reps", type=int, default=200)
    p.add_argument("--graph-reps", type=int, default=30)


def needs_gpu(args) -> str | None:
    return cuda_missing()


def parse_shapes(text: str):
    if text == "target":
        return TARGET_SHAPES
    if text == "qwen3-8b":
        return TARGET_SHAPES + tuple(s for s in QWEN3_8B_SHAPES if s not in TARGET_SHAPES)
    return tuple(tuple(int(v) for v in s.split("x")) for s in text.split(","))


def weight_sets(n: int, k: int, group: int) -> list:
    """Random q8 weights and input rows, enough sets that together they are >= 3x the L2."""
    import torch
    from backends.cuda import q8

    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 * 2**20)
    first = q8.gemv_case(n, k, group, torch.bfloat16, seed=0)
    sets = max(4, math.ceil(3 * l2 / first.bytes_moved))
    return [first] + [q8.gemv_case(n, k, group, torch.bfloat16, seed=i) for i in range(1, sets)]


def measure(cases: list, ref, variant, d2d_GBps: float, graph_reps: int = 30, eager_reps: int = 200) -> dict:
    """One row: device and eager times of one variant over the rotating sets, and its error against ``ref``."""
    from backends.cuda import q8

    w = cases[0].weight
    path = "torch" if variant == "torch" else "kernel"
    splits = 0 if variant in ("auto", "torch") else int(variant)
    fns = [q8.gemv_runner(c.x, c.weight, path, splits) for c in cases]
    rel = ((fns[0]().double() - ref).norm() / ref.norm()).item()
    state = {"i": 0}

    def step():
        fns[state["i"] % len(fns)]()
        state["i"] += 1

    device = graph_times(step, calls=len(fns) * max(1, 16 // len(fns)), reps=graph_reps)
    eager = event_times(step, warmup=8, reps=eager_reps)
    moved = cases[0].bytes_moved
    ds, es = summary(device), summary(eager)
    return {"n": w.n, "k": w.k, "group": w.group, "variant": str(variant), "path": path,
            "plan": list(q8.gemv_plan(w, splits)) if path == "kernel" else None, "weight_sets": len(cases),
            "bytes_moved": moved, "device_ms": device, "device": ds, "eager_ms": eager, "eager": es,
            "GBps": moved / ds["p50"] / 1e6, "fraction_of_d2d": moved / ds["p50"] / 1e6 / d2d_GBps,
            "eager_GBps": moved / es["p50"] / 1e6, "rel_error_vs_float64": rel}


def gemv_rows(shapes, group: int, d2d_GBps: float, variants=VARIANTS, graph_reps: int = 30,
              eager_reps: int = 200) -> list[dict]:
    import torch

    rows = []
    for n, k in shapes:
        cases = weight_sets(n, k, group)
        first = cases[0]
        ref = first.x.double() @ first.weight.dequantize(torch.float64).to(first.x.device).T  # once per shape
        for v in variants:
            rows.append(measure(cases, ref, v, d2d_GBps, graph_reps, eager_reps))
            r = rows[-1]
            log(f"{n:>6}x{k:<6} {r['variant']:>5} device {r['device']['p50'] * 1e3:7.1f} us {r['GBps']:6.0f} GB/s "
                f"{100 * r['fraction_of_d2d']:4.0f}% of d2d | eager {r['eager']['p50'] * 1e3:7.1f} us")
        del cases, first, ref
        torch.cuda.empty_cache()
    return rows


def run(args, record) -> dict:
    from backends.cuda import q8

    variants = tuple(v if v in ("auto", "torch") else int(v) for v in args.variants.split(","))
    ceilings = copy_rates()
    d2d = ceilings["d2d_read_plus_write"]["GBps"]
    rows = gemv_rows(parse_shapes(args.shapes), args.group, d2d, variants, args.graph_reps, args.eager_reps)
    sms, peak, per_sm = q8.gemv_device_facts()
    auto = [r for r in rows if r["variant"] == "auto" and (r["n"], r["k"]) in TARGET_SHAPES]
    targets = {}
    if auto:
        targets["min_fraction_of_d2d_target_shapes"] = min(r["fraction_of_d2d"] for r in auto)
        targets["met_70pct_of_d2d"] = targets["min_fraction_of_d2d_target_shapes"] >= 0.7
    return {"group": args.group, "ceilings": ceilings, "rows": rows, "targets": targets,
            "auto_split_rule": {"sms": sms, "peak_dram_GBps": peak, "blocks_per_sm_aimed_at": per_sm}}
