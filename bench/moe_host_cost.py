"""Where the expert cache's decode time goes, uniform against skewed routing, on a GPU.

    python bench/moe_host_cost.py --models /tmp/models [--layers 4] [--rounds 5] [--skew 1.2]

The MoE benchmark's skewed rows took more ms/tok over `off` than the uniform rows while uploading
fewer bytes. This run separates the candidate causes, each measured side by side in one process:

- **Noise:** the settings run interleaved, round by round, alternating which router goes first, so a
  drift of the machine shows as spread within a setting rather than as a difference between routers.
- **Device time against host time:** torch.profiler over decode steps gives the device-busy time of a
  step (the sum of its kernels and copies); the rest of the wall time is the host's.
- **Which host code:** cProfile over decode steps ranks kestrel's own functions by their time.

``--layers`` cuts the depth; each layer keeps the full model's shapes, so per-layer figures hold.
The expert budgets are the full-depth 4 and 8 GiB scaled by layers/48, as in ``moe_bench.py``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
import moe_bench  # noqa: E402
from common import RESULTS, copy_ceilings, utc_stamp, write_record  # noqa: E402
from moe_bench import BIG, PROMPT, ensure_model, log  # noqa: E402

from kestrel_core.config import GenerationConfig, KestrelConfig  # noqa: E402
from kestrel_core.engine import Model, open_run  # noqa: E402
from kestrel_core.generate import generate  # noqa: E402

FULL_DEPTH = 48
BACKEND = "cuda"  # --backend cpu_ref --preset tiny-moe: a smoke run on a CPU


def settings(scale: float) -> dict[str, dict]:
    out = {"off": {}}
    for gib in (4, 8):
        out[f"expert_lfu {gib} GiB-eq"] = dict(residency__expert_policy="expert_lfu",
                                               residency__expert_budget_mb=gib * 1024 * scale)
    return out


def prompt(model: Model) -> list[int]:
    return [i % model.config.vocab_size for i in PROMPT]  # the 30B shape's prompt as is; a smoke preset's folded in


def config(flags: dict) -> KestrelConfig:
    return KestrelConfig().override(backend__name=BACKEND, residency__budget_mb=BIG, residency__keep="off", **flags)


def timed(model: Model, flags: dict, tokens: int, warmup: int) -> dict:
    with open_run(model, config(flags)) as run:
        r = generate(run, prompt(model), GenerationConfig(max_new_tokens=tokens, stop_at_eos=False))
    steady = r.per_token[warmup:]
    return {"ms_per_token": statistics.median(r.decode_ms[warmup:]),
            "bytes_uploaded_per_token": statistics.fmean(p["bytes_uploaded"] for p in steady),
            "expert_misses_per_token": statistics.fmean(p["expert_misses"] for p in steady),
            "token_ids": r.token_ids}


def device_busy(model: Model, flags: dict, tokens: int) -> dict:
    """Per decode step: wall ms, and the device's kernel + copy time from the profiler."""
    gen = GenerationConfig(max_new_tokens=tokens, stop_at_eos=False)
    with open_run(model, config(flags)) as run:
        generate(run, prompt(model), gen)  # warm: the cache fills, the pool holds its buffers
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=acts) as prof:
            r = generate(run, prompt(model), gen)
    events = prof.key_averages()
    device_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in events)
    runs = tokens  # prefill + (tokens - 1) decode steps; device time is spread over the whole generate
    wall_ms = r.prefill_ms + sum(r.decode_ms)
    top = sorted(events, key=lambda e: -getattr(e, "self_cpu_time_total", 0))[:12]
    return {"wall_ms_per_step": wall_ms / runs, "device_busy_ms_per_step": device_us / 1e3 / runs,
            "host_top_ops": [{"name": e.key, "calls_per_step": e.count / runs,
                              "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / runs} for e in top]}


def python_profile(model: Model, flags: dict, tokens: int, rows: int = 20) -> dict:
    """cProfile over one generate after a warm one: kestrel's functions by own time, per step."""
    gen = GenerationConfig(max_new_tokens=tokens, stop_at_eos=False)
    with open_run(model, config(flags)) as run:
        generate(run, prompt(model), gen)
        prof = cProfile.Profile()
        prof.enable()
        generate(run, prompt(model), gen)
        prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    out = []
    for (file, line, name), (cc, nc, tt, ct, _) in stats.stats.items():
        out.append({"function": f"{Path(file).name}:{line}:{name}", "calls_per_step": nc / tokens,
                    "own_ms_per_step": tt * 1e3 / tokens, "cumulative_ms_per_step": ct * 1e3 / tokens})
    out.sort(key=lambda x: -x["own_ms_per_step"])
    total = sum(x["own_ms_per_step"] for x in out)
    ours = sum(x["own_ms_per_step"] for x in out if not x["function"].startswith(("{", "~")))
    return {"profiled_ms_per_step": total, "python_level_ms_per_step": ours, "top": out[:rows]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=28)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--skew", type=float, default=1.2)
    ap.add_argument("--out", action="append", default=[])
    ap.add_argument("--preset", default=moe_bench.PRESET)
    ap.add_argument("--backend", default="cuda")
    args = ap.parse_args()
    global BACKEND
    moe_bench.PRESET, BACKEND = args.preset, args.backend
    cuda = torch.cuda.is_available()
    root = Path(args.models)
    root.mkdir(parents=True, exist_ok=True)
    scale = args.layers / FULL_DEPTH
    paths = {"uniform": ensure_model(root, args.layers, 0.0), "skewed": ensure_model(root, args.layers, args.skew)}
    rec: dict = {"layers": args.layers, "full_depth_layers": FULL_DEPTH, "budget_scale": scale, "skew": args.skew,
                 "tokens": args.tokens, "warmup_steps": args.warmup, "rounds": args.rounds,
                 "ceilings": copy_ceilings() if cuda else None, "preset": args.preset, "interleaved": [], "device_busy": {}, "python_profile": {}}
    outs = [RESULTS] + [Path(d) for d in args.out]
    stamp = utc_stamp()  # one record, rewritten atomically as the run goes
    models = {name: Model(path) for name, path in paths.items()}
    try:
        for name, model in models.items():
            timed(model, {}, 4, 1)  # warm-up, not recorded
        order = list(models)
        for rnd in range(args.rounds):
            for router in (order if rnd % 2 == 0 else order[::-1]):
                for label, flags in settings(scale).items():
                    row = timed(models[router], flags, args.tokens, args.warmup)
                    row.update(round=rnd, router=router, setting=label)
                    rec["interleaved"].append(row)
                    log(f"round {rnd} {router:8} {label:22} {row['ms_per_token']:7.2f} ms/tok "
                        f"{row['bytes_uploaded_per_token'] / 1e6:7.1f} MB/tok")
        summary = {}
        for router in models:
            for label in settings(scale):
                ms = [r["ms_per_token"] for r in rec["interleaved"] if r["router"] == router and r["setting"] == label]
                summary[f"{router} {label}"] = {"median": statistics.median(ms), "min": min(ms), "max": max(ms)}
        rec["summary"] = summary
        write_record("moe_host_cost", rec, outs, stamp)
        for router, model in models.items():
            for label in ("off", "expert_lfu 8 GiB-eq"):
                flags = settings(scale)[label]
                rec["device_busy"][f"{router} {label}"] = device_busy(model, flags, 12)
                rec["python_profile"][f"{router} {label}"] = python_profile(model, flags, 12)
                d = rec["device_busy"][f"{router} {label}"]
                log(f"{router:8} {label:22} wall {d['wall_ms_per_step']:.2f} ms/step, device busy "
                    f"{d['device_busy_ms_per_step']:.2f} ms/step")
    finally:
        for model in models.values():
            model.close()
    for p in write_record("moe_host_cost", rec, outs, stamp):
        log(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
