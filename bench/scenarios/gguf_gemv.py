"""The GGUF block kernels (Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0) at real layers' shapes, against the device copy and
against dequantizing then multiplying, on a GPU.

    python -m bench gguf-gemv [--types Q4_K,Q8_0] [--shapes qwen3-8b,qwen3-30b-a3b|NxK,NxK] [--rows 1,8,64]
                              [--plans auto,64:1:8] [--no-baseline]

The gate for running GGUF weights as their own blocks: how close does the one-row kernel come to the memory's
speed, and what do 8 and 64 rows cost. For each type and weight shape n x k (W [n, k] in ggml's block layout; the
Qwen3-8B layers: q_proj and o_proj 4096x4096, k_proj and v_proj 1024x4096, gate_proj and up_proj 12288x4096,
down_proj 4096x12288; a Qwen3-30B-A3B expert: gate and up 768x2048, down 2048x768) one run measures, side by side:

- the device-to-device copy rate (bytes read + written), the ceiling, once a run;
- ``kernel`` at each M of ``--rows`` and each plan of ``--plans``: ``auto`` is ``gguf_kernels.matmul`` as the
  engine calls it (Q4_K and Q6_K on the CUDA C++ kernel where it builds, the rest on Triton), ``triton`` and ``cuda``
  ask for one (a row's ``impl`` says which ran), BLOCK_N:SPLIT:WARPS forces a Triton plan (M = 1 is the decode GEMV);
  its GB/s counts the weight's stored bytes (what it reads of the weight), its fraction the part of the copy rate
  that is;
- ``dequant+linear`` at each M, the baseline: kestrel's torch dequantizer on the device into float32, cast to bf16,
  then ``F.linear`` in bf16 (what running GGUF weights costs without the fused kernels);
- ``bf16 linear`` at each M: ``F.linear`` on the weight already dequantized to bf16 (2 bytes a weight resident), for
  scale.

Each is timed by CUDA events around CUDA graphs of back-to-back calls after a warm-up, every repetition kept and the
median quoted; the one-row kernel also eagerly (one call between two events, the host's launch cost in). Weights
rotate over enough copies that their total is at least 3x the L2, so no call reads its weight from L2. Each shape's
kernel result (each plan's) is checked against a float64 product of the dequantized weight, and each row of the
M = 8 and 64 results bitwise against the one-row kernel on that row alone (``batch_invariant``). The verdict gives,
per type and for the launcher's plan, the one-row fraction of the copy rate at the 8B shapes and the speed-up on
dequant+linear at each M.
"""

from __future__ import annotations

import math
import statistics

from bench.options import names, numbers
from bench.errors import BenchError, cuda_missing
from bench.log import log
from bench.stats import summary
from bench.timing import copy_rates, event_times, graph_times

TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0")
# name -> ((n, k), the layers of that shape)
QWEN3_8B = {"q_proj,o_proj": (4096, 4096), "k_proj,v_proj": (1024, 4096), "gate_proj,up_proj": (12288, 4096),
            "down_proj": (4096, 12288)}
QWEN3_30B_A3B = {"expert gate,up": (768, 2048), "expert down": (2048, 768)}
SHAPE_SETS = {"qwen3-8b": QWEN3_8B, "qwen3-30b-a3b": QWEN3_30B_A3B}
# where each type keeps its float16 scales (byte offsets in a block): set to finite values, the rest random bits
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
DEVICE = "cuda"
MAX_M = 2048  # rows a timed call: up to a long prompt's


def add_arguments(p) -> None:
    p.add_argument("--types", type=names(TYPES), default=set(TYPES), help=f"comma-separated, of {','.join(TYPES)}")
    p.add_argument("--shapes", default="qwen3-8b,qwen3-30b-a3b",
                   help="comma-separated: 'qwen3-8b', 'qwen3-30b-a3b' (its experts) or NxK")
    p.add_argument("--rows", type=numbers(int, 1), default=[1, 8, 64],
                   help=f"the M of each timed call (1 to {MAX_M}: a prompt's rows)")
    p.add_argument("--plans", default="auto",
                   help="float kernel plans to time, comma-separated: 'auto' (what gguf_kernels.matmul runs), 'triton' (the "
                        "Triton kernel's own plan), 'cuda' or 'cuda:WARPS' (the CUDA C++ kernel, Q4_K and Q6_K) or "
                        "BLOCK_N:SPLIT:WARPS (a Triton plan)")
    p.add_argument("--int8-plans", default="auto",
                   help="the int8 kernels' plans, comma-separated: 'auto', 'auto:DIGITS', BLOCK_N:SB:SPLIT:WARPS[:DIGITS] "
                        "(SB blocks a step, SPLIT 0 the launcher's, DIGITS int8 digits a value of x) or "
                        "mmq:BM:BN:WARPS:STAGES (the tensor-core kernel's tile, from 16 rows); empty: none")
    p.add_argument("--no-baseline", action="store_true", help="leave out dequant+linear and bf16 linear")
    p.add_argument("--graph-reps", type=int, default=30)
    p.add_argument("--eager-reps", type=int, default=100)


def needs_gpu(args) -> str | None:
    return cuda_missing()


def parse_shapes(text: str) -> dict[str, tuple[int, int]]:
    shapes: dict[str, tuple[int, int]] = {}
    for part in text.split(","):
        if part in SHAPE_SETS:
            shapes.update(SHAPE_SETS[part])
        else:
            try:
                n, k = (int(v) for v in part.split("x"))
            except ValueError:
                raise BenchError(f"--shapes: {part!r} is neither {' nor '.join(SHAPE_SETS)} nor NxK") from None
            shapes[part] = (n, k)
    return shapes


def parse_plans(text: str) -> list[dict]:
    """Each plan as ``matmul``'s overrides: {} for 'auto', else block_n, split and num_warps."""
    plans = []
    for part in filter(None, text.split(",")):  # empty: no float plan (the int8 kernels' alone)
        if part == "auto":
            plans.append({})
            continue
        if part == "triton":
            plans.append({"impl": "triton"})
            continue
        if part == "cuda" or part.startswith("cuda:"):
            warps = part[5:]
            if warps and warps not in ("1", "2", "4"):
                raise BenchError(f"--plans: {part!r}: the CUDA kernel's warps a block are 1, 2 or 4")
            plans.append({"impl": "cuda", **({"warps": int(warps)} if warps else {})})
            continue
        try:
            bn, split, warps = (int(v) for v in part.split(":"))
        except ValueError:
            raise BenchError(f"--plans: {part!r} is neither 'auto' nor BLOCK_N:SPLIT:WARPS") from None
        if bn < 1 or bn & (bn - 1) or warps < 1 or warps & (warps - 1) or split < 1:
            raise BenchError(f"--plans: {part!r}: BLOCK_N and WARPS are powers of two, SPLIT at least 1")
        plans.append({"block_n": bn, "split": split, "num_warps": warps})
    return plans


def parse_int8_plans(text: str) -> list[dict]:
    """Each int8 plan as ``gguf_int8.matmul``'s overrides: {} for 'auto', else block_n, sb, split, num_warps."""
    plans = []
    for part in filter(None, text.split(",")):
        if part == "auto":
            plans.append({})
            continue
        if part in ("auto:1", "auto:2"):
            plans.append({"digits": int(part[-1])})
            continue
        if part.startswith("mmq:"):
            try:
                bm, bn, warps, stages = (int(v) for v in part[4:].split(":"))
            except ValueError:
                bm = bn = warps = stages = 0
            if min(bm, bn, warps, stages) < 1 or bm < 16 or bn < 16 or any(v & (v - 1) for v in (bm, bn, warps)):
                raise BenchError(f"--int8-plans: {part!r}: give mmq:BM:BN:WARPS:STAGES, the tensor-core kernel's tile "
                                 "(BM, BN powers of two from 16), warps (a power of two) and stages (1 or more)")
            plans.append({"mmq_plan": (bm, bn, warps, stages)})
            continue
        try:
            bn, sb, split, warps, *digits = (int(v) for v in part.split(":"))
        except ValueError:
            bn = sb = split = warps = 0
            digits = []
        if (min(bn, sb, warps) < 1 or split < 0 or any(v & (v - 1) for v in (bn, sb, warps)) or len(digits) > 1
                or (digits and digits[0] not in (1, 2))):
            raise BenchError(f"--int8-plans: {part!r}: give 'auto', 'auto:DIGITS' or BLOCK_N:SB:SPLIT:WARPS[:DIGITS], "
                             "BLOCK_N, SB and WARPS powers of two, SPLIT 0 or more, DIGITS 1 or 2")
        plans.append({"block_n": bn, "sb": sb, "num_warps": warps, **({"split": split} if split else {}),
                      **({"digits": digits[0]} if digits else {})})
    return plans


def random_weight(qtype, n: int, k: int, seed: int):
    """Valid ``qtype`` blocks for W [n, k] on the GPU: random quant bits, float16 scales finite and small."""
    import torch

    from kestrel_core.formats.gguf_quants import block_geometry

    values, nbytes = block_geometry(qtype)
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    raw = torch.randint(0, 256, (n * (k // values), nbytes), dtype=torch.uint8, device=DEVICE, generator=g)
    for at in F16_FIELDS[qtype.name]:
        d = torch.empty(len(raw), dtype=torch.float32, device=DEVICE).uniform_(-1e-2, 1e-2, generator=g)
        raw[:, at:at + 2] = d.half().view(torch.uint8).view(-1, 2)
    return raw.view(n, -1)


def timed(fn, graph_reps: int, eager_reps: int = 0) -> dict:
    """Device times from graph replays (eager event times where the calls cannot be captured), and eager ones."""
    try:
        device, how = graph_times(fn, calls=16, reps=graph_reps), "graph"
    except RuntimeError:  # a call that cannot be captured: timed eagerly, the launches in
        device, how = event_times(fn, warmup=3, reps=graph_reps), "eager"
    out = {"device_ms": device, "device": summary(device), "device_timing": how}
    if eager_reps:
        eager = event_times(fn, warmup=8, reps=eager_reps)
        out.update(eager_ms=eager, eager=summary(eager))
    return out


def shape_rows(qtype, label: str, n: int, k: int, rows: list[int], plans: list[dict], d2d: float, baseline: bool,
               graph_reps: int, eager_reps: int, int8_plans: list[dict] = ()) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from kestrel_core.formats.gguf_quants import dequantize
    from backends.cuda import gguf_cuda, gguf_int8, gguf_kernels

    stored = gguf_kernels.stored_bytes(qtype, n, k)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size if DEVICE == "cuda" else 64 * 2**20

    def copies(t: torch.Tensor) -> list:  # enough copies of ``t`` that together they are >= 3x the L2
        return [t] + [t.clone() for _ in range(max(4, math.ceil(3 * l2 / (t.numel() * t.element_size()))) - 1)]

    first = random_weight(qtype, n, k, seed=0)
    sets = copies(first)
    with torch.device(DEVICE):  # the dequantizer makes its tensors on the default device
        deq = dequantize(first, qtype, (n, k))
    x = torch.randn(max(rows), k, generator=torch.Generator(device=DEVICE).manual_seed(1), device=DEVICE,
                    dtype=torch.bfloat16)
    want = x.double() @ deq.double().T

    def rotate(make, over=sets):
        fns, state = [make(w) for w in over], {"i": 0}

        def step():
            fns[state["i"] % len(fns)]()
            state["i"] += 1
        return step

    out = []
    base = {"type": qtype.name, "layers": label, "n": n, "k": k, "stored_bytes": stored, "weight_sets": len(sets)}
    kinds = [("kernel", gguf_kernels, kw) for kw in plans]
    if qtype in gguf_int8.TYPES:
        kinds += [("int8", gguf_int8, kw) for kw in int8_plans]

    def cuda_runs(kw, xq, qtype, k) -> bool:  # the float plan runs on the CUDA kernel (asked, or auto's choice)
        if kw.get("impl") == "cuda":
            why = gguf_cuda.usable()
            if why or qtype not in gguf_cuda.TYPES:
                raise BenchError(why or f"--plans cuda: the CUDA kernel computes Q4_K and Q6_K, not {qtype.name}")
            return True
        return not kw and gguf_cuda.takes(xq, qtype, k)

    for variant, mod, asked in kinds:
        kw = asked
        if mod is gguf_kernels and cuda_runs(asked, xq=x, qtype=qtype, k=k):
            mod, kw = gguf_cuda, {"warps": asked["warps"]} if "warps" in asked else {}
        impl = "cuda" if mod is gguf_cuda else "triton"
        # correctness once a plan: the float64 product, and every row of each batch against that row alone
        ys = {m: mod.matmul(x[:m], first, qtype, n, k, **kw) for m in rows}
        alone = torch.cat([mod.matmul(x[i:i + 1], first, qtype, n, k, **kw) for i in range(max(rows))])
        rel = {m: float((y.double() - want[:m]).norm() / want[:m].norm()) for m, y in ys.items()}
        invariant = all(torch.equal(y, alone[:m]) for m, y in ys.items())
        del ys, alone
        if mod is gguf_int8 and "mmq_plan" in kw:
            chosen, warps = kw["mmq_plan"], kw["mmq_plan"][2]
        elif mod is gguf_int8:
            chosen = gguf_int8.plan(qtype, n, k, kw.get("block_n"), kw.get("sb"), kw.get("split"))
            warps = kw.get("num_warps", gguf_int8.DEFAULT_PLAN[qtype][3])
        elif mod is gguf_cuda:
            chosen, warps = None, kw.get("warps", gguf_cuda.plan(k)[0])
        else:
            chosen = gguf_kernels.plan(qtype, n, k, kw.get("block_n"), kw.get("split"))
            warps = kw.get("num_warps", gguf_kernels.NUM_WARPS)
        for m in rows:
            xm = x[:m]
            plan_m, warps_m = chosen, warps
            if mod is gguf_cuda:
                plan_m = [warps, gguf_cuda.plan(k, m, qtype)[1]]  # warps a block, weight rows a block
            if mod is gguf_int8 and m >= gguf_int8.MMQ_ROWS and qtype in gguf_int8.MMQ_TYPES and "mmq_plan" not in kw:
                plan_m, warps_m = gguf_int8.mmq_tiles(m), gguf_int8.mmq_tiles(m)[2]  # the tensor-core kernel's tile
            t = timed(rotate(lambda w: lambda: mod.matmul(xm, w, qtype, n, k, **kw)), graph_reps,
                      eager_reps if m == 1 else 0)
            gbps = stored / t["device"]["p50"] / 1e6
            out.append({**base, "variant": variant, "m": m, "plan_asked": asked or "auto", "plan": list(plan_m),
                        **({"impl": impl} if mod is not gguf_int8 else {}),
                        "num_warps": warps_m, **t, "GBps": gbps, "fraction_of_d2d": gbps / d2d,
                        "rel_error_vs_float64": rel[m], "batch_invariant": invariant,
                        **({"digits": kw.get("digits", gguf_int8.DIGITS)} if mod is gguf_int8 else {})})
            eager = f" | eager {t['eager']['p50'] * 1e3:6.1f} us" if m == 1 else ""
            d = f"d{kw.get('digits', gguf_int8.DIGITS)}" if mod is gguf_int8 else f" {impl}"
            log(f"{qtype.name} {n:>6}x{k:<6} M={m:<2} {variant:6}{d} {plan_m}x{warps_m} {t['device']['p50'] * 1e3:8.1f} us "
                f"{gbps:6.0f} GB/s {100 * gbps / d2d:4.0f}% of d2d{eager}" + ("" if invariant else " NOT INVARIANT"))
    if baseline:
        bf16_sets = copies(deq.to(torch.bfloat16))

        def dequant_linear(w, xm):
            with torch.device(DEVICE):
                return F.linear(xm, dequantize(w, qtype, (n, k)).to(torch.bfloat16))

        for m in rows:
            xm = x[:m]
            t = timed(rotate(lambda w: lambda: dequant_linear(w, xm)), graph_reps)
            out.append({**base, "variant": "dequant+linear", "m": m, **t,
                        "GBps": stored / t["device"]["p50"] / 1e6})
            t2 = timed(rotate(lambda w: lambda: F.linear(xm, w), bf16_sets), graph_reps)
            out.append({**base, "variant": "bf16 linear", "m": m, **t2, "weight_sets": len(bf16_sets),
                        "bf16_bytes": 2 * n * k, "GBps_bf16_bytes": 2 * n * k / t2["device"]["p50"] / 1e6})
            log(f"{qtype.name} {n:>6}x{k:<6} M={m:<2} dequant+linear {t['device']['p50'] * 1e3:8.1f} us | bf16 linear "
                f"{t2['device']['p50'] * 1e3:8.1f} us")
        del bf16_sets
    del sets, first, deq, want
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out


def verdict(rows: list[dict]) -> dict:
    """Per type, for the launcher's own plan: the one-row kernel's fraction of the copy rate at the 8B shapes and
    its speed-up on the baseline at each M; and, over every plan, whether each was batch invariant."""
    out = {}
    for t in sorted({r["type"] for r in rows}):
        kernel = [r for r in rows if r["type"] == t and r["variant"] in ("kernel", "int8")]
        auto = [r for r in kernel if r["plan_asked"] == "auto" and r["variant"] == "kernel"]
        int8 = [r for r in kernel if r["plan_asked"] == "auto" and r["variant"] == "int8"]
        one = [r["fraction_of_d2d"] for r in auto if r["m"] == 1 and (r["n"], r["k"]) in QWEN3_8B.values()]
        speedup: dict[str, list[float]] = {}
        for r in auto:
            b = next((b for b in rows if b["type"] == t and b["variant"] == "dequant+linear" and b["m"] == r["m"]
                      and (b["n"], b["k"]) == (r["n"], r["k"])), None)
            if b:
                speedup.setdefault(str(r["m"]), []).append(b["device"]["p50"] / r["device"]["p50"])
        one8 = [r["fraction_of_d2d"] for r in int8 if r["m"] == 1 and (r["n"], r["k"]) in QWEN3_8B.values()]
        out[t] = {"min_fraction_of_d2d_8b_m1": min(one) if one else None,
                  "int8_min_fraction_of_d2d_8b_m1": min(one8) if one8 else None,
                  "int8_median_fraction_of_d2d_8b_m1": statistics.median(one8) if one8 else None,
                  "median_fraction_of_d2d_8b_m1": statistics.median(one) if one else None,
                  "min_speedup_vs_dequant_linear": {m: min(v) for m, v in speedup.items()},
                  "batch_invariant": all(r["batch_invariant"] for r in kernel),
                  "max_rel_error_vs_float64": max(r["rel_error_vs_float64"] for r in kernel)}
    return out


def run(args, record) -> dict:
    from gguf import GGMLQuantizationType

    from backends.cuda import gguf_kernels

    why = gguf_kernels.available()
    if why:
        raise BenchError(why)
    types = [GGMLQuantizationType[t] for t in TYPES if t in args.types]  # argparse checked them
    rows_m = args.rows
    if not all(1 <= m <= MAX_M for m in rows_m):
        raise BenchError(f"--rows: each M is 1 to {MAX_M}")
    shapes = parse_shapes(args.shapes)
    plans = parse_plans(args.plans)
    int8_plans = parse_int8_plans(args.int8_plans)
    ceilings = copy_rates()
    d2d = ceilings["d2d_read_plus_write"]["GBps"]
    log(f"device-to-device copy {d2d:.0f} GB/s (read + write)")
    result = {"ceilings": ceilings, "rows": [], "shapes": {k: list(v) for k, v in shapes.items()}}
    for qtype in types:
        for label, (n, k) in shapes.items():
            result["rows"] += shape_rows(qtype, label, n, k, rows_m, plans, d2d, not args.no_baseline,
                                         args.graph_reps, args.eager_reps, int8_plans)
            record.save_partial(result)
    result["verdict"] = verdict(result["rows"])
    return result
