"""The host GGUF GEMV (backends/cpu_ref/host_gguf.py) on this machine's CPU cores, against the host's copy rate.

    python -m bench host-gemv [--types Q8_0,Q4_0,Q4_K,Q6_K] [--shapes qwen3-30b-a3b,4096x4096] [--rows 1,8]
                              [--isa auto] [--threads N] [--reps 30] [--rotate-mib 1024]

The first step of running a MoE's experts on the host's cores: how close does the CPU kernel come to the memory's
speed. One run measures, side by side:

- the host copy rate: a ``--rotate-mib`` MiB tensor copied into another by torch (its threads), bytes read +
  written, every repetition kept, the ceiling;
- for each type and weight shape n x k (the Qwen3-30B-A3B experts: gate and up 768x2048, down 2048x768; a Qwen3-8B
  layer 4096x4096) at each M of ``--rows`` and each path of ``--isa``: ``host_gguf.matmul`` timed by
  time.perf_counter around one call, after a warm-up, every repetition kept; each call reads the next of enough
  copies of the weight that together they are ``--rotate-mib`` MiB (beyond the caches, so the weight comes from
  memory); GB/s counts the weight's stored bytes, its fraction the part of the copy rate that is.

Each shape's result is checked once against ``host_gguf.reference`` (bitwise) and against the float32 product of the
dequantized weight (relative error, beside the stated bound's verdict).

**The gate for computing a missed expert on the host** (``result["expert_gate"]``, where the rows hold the 30B-A3B
expert shapes at M = 1): a missed expert either crosses the link (its stored bytes over the pinned host-to-device
rate) or is computed here (gate, up and down at one row, their p50s summed, plus its activation row down and its
output row back over the link). A step's misses split between the two so both finish together, so the miss phase
can shrink at most to t_link * t_host / (t_link + t_host): the bound on its speed-up is 1 + t_link / t_host. The link
rate is measured in this run where a GPU is here, else taken from ``--link-gbps`` (a record's figure: say which).
"""

from __future__ import annotations

import math
import os
import time

from bench.errors import BenchError
from bench.log import log
from bench.options import names, numbers
from bench.stats import summary

TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")  # the kernel's
DEFAULT_TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q6_K")  # a run without --types: the four the records so far hold
SHAPE_SETS = {"qwen3-30b-a3b": {"expert gate,up": (768, 2048), "expert down": (2048, 768)},
              "qwen3-8b-q_proj": {"q_proj,o_proj": (4096, 4096)}}
MIB = 2**20


def add_arguments(p) -> None:
    p.add_argument("--types", type=names(TYPES), default=set(DEFAULT_TYPES),
                   help=f"comma-separated, of {','.join(TYPES)} (default {','.join(DEFAULT_TYPES)})")
    p.add_argument("--shapes", default="qwen3-30b-a3b,4096x4096",
                   help="comma-separated: 'qwen3-30b-a3b' (its experts), 'qwen3-8b-q_proj' or NxK")
    p.add_argument("--rows", type=numbers(int, 1), default=[1, 8], help="the M of each timed call")
    p.add_argument("--isa", default="auto", help="paths to time, comma-separated: auto, scalar, avx2, avx512")
    p.add_argument("--threads", type=int, default=0, help="the kernel's threads (0: torch's default)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--rotate-mib", type=int, default=1024,
                   help="MiB of weight copies each shape's calls rotate over (and the copy's size)")
    p.add_argument("--link-gbps", type=float, default=0.0,
                   help="the pinned host-to-device GB/s for the expert gate where no GPU is here (a record's figure); "
                        "with a GPU it is measured")


def needs_gpu(args) -> str | None:
    return None


def parse_shapes(text: str) -> dict[str, tuple[int, int]]:
    shapes: dict[str, tuple[int, int]] = {}
    for part in text.split(","):
        if part in SHAPE_SETS:
            shapes.update(SHAPE_SETS[part])
            continue
        try:
            n, k = (int(v) for v in part.split("x"))
        except ValueError:
            raise BenchError(f"--shapes: {part!r} is neither {' nor '.join(SHAPE_SETS)} nor NxK") from None
        shapes[part] = (n, k)
    return shapes


def wall_times(fn, warmup: int, reps: int) -> list[float]:
    """Milliseconds of each of ``reps`` calls of ``fn`` (time.perf_counter), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def copy_rate(nbytes: int, reps: int) -> dict:
    import torch

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = wall_times(lambda: dst.copy_(src), warmup=2, reps=max(5, reps // 3))
    s = summary(times)
    del src, dst
    return {"bytes": nbytes, "ms": times, "summary": s, "GBps_read_plus_write": 2 * nbytes / s["p50"] / 1e6,
            "threads": torch.get_num_threads()}


def random_weight(qtype, n: int, k: int, seed: int):
    """Valid blocks for W [n, k]: real quantization where gguf quantizes the type, else random bits with finite
    float16 scales."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    from kestrel_core.formats.gguf_quants import block_geometry

    rng = np.random.default_rng(seed)
    if qtype in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
        raw = quants.quantize(rng.standard_normal((n, k)).astype(np.float32) / k**0.5, qtype)
    else:
        values, nbytes = block_geometry(qtype)
        raw = rng.integers(0, 256, (n * k // values, nbytes), dtype=np.uint8)
        for at in {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}[qtype]:
            d = rng.uniform(1e-3, 1e-2, len(raw)) * rng.choice([-1.0, 1.0], len(raw))
            raw[:, at:at + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(np.ascontiguousarray(raw).reshape(n, -1))


def shape_rows(qtype, label: str, n: int, k: int, rows: list[int], isas: list[str], threads: int | None,
               ceiling: float, reps: int, rotate_bytes: int) -> list[dict]:
    import torch

    from backends.cpu_ref import host_gguf
    from kestrel_core.formats.gguf_quants import dequantize, row_nbytes

    stored = n * row_nbytes(qtype, k)
    first = random_weight(qtype, n, k, seed=n * 7 + k)
    sets = [first] + [first.clone() for _ in range(max(2, math.ceil(rotate_bytes / stored)) - 1)]
    x = torch.randn(max(rows), k, generator=torch.Generator().manual_seed(1))
    want = x.double() @ dequantize(first.reshape(-1), qtype, (n, k)).double().T
    base = {"type": qtype.name, "layers": label, "n": n, "k": k, "stored_bytes": stored, "weight_sets": len(sets)}
    out = []
    for isa in isas:
        path = host_gguf.which_isa(isa)
        for m in rows:
            xm = x[:m]
            y = host_gguf.matmul(xm, first, qtype, n, k, threads=threads, isa=isa)
            exact = bool(torch.equal(y, host_gguf.reference(xm, first, qtype, n, k)))
            within = bool(((y.double() - want[:m]).abs() <= host_gguf.bound(xm, first, qtype, n, k).double()).all())
            rel = float((y.double() - want[:m]).norm() / want[:m].norm())
            state = {"i": 0}

            def call():
                host_gguf.matmul(xm, sets[state["i"] % len(sets)], qtype, n, k, threads=threads, isa=isa)
                state["i"] += 1

            times = wall_times(call, warmup=max(3, len(sets) // 4), reps=reps)
            s = summary(times)
            gbps = stored / s["p50"] / 1e6
            out.append({**base, "isa": path, "m": m, "ms": times, "summary": s, "GBps": gbps,
                        "fraction_of_copy": gbps / ceiling, "equals_reference": exact, "within_bound": within,
                        "rel_error_vs_float64": rel})
            log(f"{qtype.name} {n:>5}x{k:<5} M={m} {path:6} {s['p50'] * 1e3:9.1f} us {gbps:6.2f} GB/s "
                f"{100 * gbps / ceiling:5.1f}% of copy" + ("" if exact and within else " CHECK FAILED"))
    del sets, first
    return out


def run(args, record) -> dict:
    import torch
    from gguf import GGMLQuantizationType

    from backends.cpu_ref import host_gguf

    why = host_gguf.usable()
    if why:
        raise BenchError(why)
    types = [GGMLQuantizationType[t] for t in TYPES if t in args.types]  # argparse checked them
    isas = args.isa.split(",")
    for isa in isas:
        try:
            host_gguf.which_isa(isa)
        except ValueError as exc:
            raise BenchError(f"--isa: {exc}") from None
    if args.threads < 0:
        raise BenchError("--threads: 0 (torch's default) or more")
    if not (math.isfinite(args.link_gbps) and args.link_gbps >= 0):
        raise BenchError(f"--link-gbps: a GB/s of 0 (none) or more, got {args.link_gbps}")
    threads = args.threads or None
    shapes = parse_shapes(args.shapes)
    rotate = args.rotate_mib * MIB
    copy = copy_rate(rotate, args.reps)
    ceiling = copy["GBps_read_plus_write"]
    log(f"host copy {ceiling:.2f} GB/s (read + write, {copy['threads']} threads)")
    result = {"host_copy": copy, "cpu": cpu_facts(), "threads": threads or torch.get_num_threads(),
              "best_isa": host_gguf.which_isa("auto"), "tolerance": host_gguf.TOLERANCE,
              "shapes": {k: list(v) for k, v in shapes.items()}, "rows": []}
    for qtype in types:
        for label, (n, k) in shapes.items():
            result["rows"] += shape_rows(qtype, label, n, k, args.rows, isas, threads, ceiling, args.reps, rotate)
            record.save_partial(result)
    link = args.link_gbps
    if torch.cuda.is_available():
        from bench.timing import copy_rates

        link = copy_rates()["pinned_h2d"]["GBps"]
        log(f"pinned h2d {link:.1f} GB/s (measured)")
    if link > 0:
        result["expert_gate"] = expert_gate(result["rows"], link, measured=torch.cuda.is_available())
    result["verdict"] = {t.name: {f"{r['layers']} M={r['m']} {r['isa']}": round(r["fraction_of_copy"], 4)
                                  for r in result["rows"] if r["type"] == t.name} for t in types}
    result["all_checks_pass"] = all(r["equals_reference"] and r["within_bound"] for r in result["rows"])
    return result


def expert_gate(rows: list[dict], link_gbps: float, measured: bool) -> dict:
    """Per type and path, a 30B-A3B expert's time on the host (gate + up + down at one row) against its bytes over the
    link, and the bound 1 + t_link / t_host on how much a step's miss phase can shrink by splitting the misses."""
    gate_up, down = SHAPE_SETS["qwen3-30b-a3b"]["expert gate,up"], SHAPE_SETS["qwen3-30b-a3b"]["expert down"]
    out = {"link_GBps": link_gbps, "link_measured_here": measured, "rows": []}
    for (qtype, isa) in dict.fromkeys((r["type"], r["isa"]) for r in rows):
        def one(shape):
            return next((r for r in rows if (r["type"], r["isa"], r["m"], r["n"], r["k"]) == (qtype, isa, 1, *shape)),
                        None)
        gu, dn = one(gate_up), one(down)
        if gu is None or dn is None:
            continue
        nbytes = 2 * gu["stored_bytes"] + dn["stored_bytes"]
        crossing = (gate_up[1] * 2 + gate_up[1] * 4)  # its x row down (bf16) and its output row back (float32)
        t_host = (2 * gu["summary"]["p50"] + dn["summary"]["p50"]) * 1e3 + crossing / link_gbps / 1e3  # us
        t_link = nbytes / link_gbps / 1e3  # us
        bound = 1 + t_link / t_host
        out["rows"].append({"type": qtype, "isa": isa, "expert_bytes": nbytes, "host_us": round(t_host, 2),
                            "link_us": round(t_link, 2), "miss_phase_speedup_bound": round(bound, 4)})
        log(f"expert gate {qtype} {isa}: host {t_host:.1f} us, link {t_link:.1f} us ({link_gbps:.1f} GB/s"
            f"{'' if measured else ', given'}): the miss phase can shrink at most {bound:.2f}x")
    return out


def cpu_facts() -> dict:
    """The CPU's model name, cores this process may use, and the ISA flags the kernel cares about."""
    facts = {"cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return facts
    for line in text.splitlines():
        if line.startswith("model name"):
            facts["model"] = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            facts["flags"] = sorted(flags & {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni"})
            break
    return facts
