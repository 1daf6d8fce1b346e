"""Where the expert cache's decode time goes, uniform against skewed routing.

    python -m bench moe-host-cost --models /tmp/models [--layers 4] [--rounds 5] [--skew 1.2]
    python -m bench moe-host-cost --backend cpu_ref --preset tiny-moe --layers 4 --tokens 8 --warmup 2 --rounds 2

The MoE benchmark's skewed rows took more ms/tok over `off` than the uniform rows while uploading fewer bytes. This
run separates the candidate causes, each measured side by side in one process:

- noise: the settings run interleaved, round by round, alternating which router goes first, so a drift of the
  machine shows as spread within a setting rather than as a difference between routers;
- device time against host time: torch.profiler over a generate gives the device-busy time of a step, the sum of
  the device's own events (kernels, copies, memsets) only; an op's device time, which counts the kernels it
  launched again, is left out, so each kernel counts once. The rest of the wall time is the host's;
- which host code: cProfile over a generate ranks kestrel's own functions by their time.

``--layers`` cuts the depth; each layer keeps the full model's shapes. The expert budgets are the full-depth 4 and
8 GiB scaled by layers/full depth, as in ``moe``.
"""

from __future__ import annotations

import cProfile
import io
import pstats
from pathlib import Path

from bench import models
from bench.errors import cuda_backend_missing
from bench.log import log
from bench.prompt import prompt_for
from bench.rows import row
from bench.scenarios.moe import BIG
from bench.stats import summary


def add_arguments(p) -> None:
    models.add_arguments(p)
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--backend", default="cuda", choices=("cuda", "cpu_ref"))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=28)
    p.add_argument("--warmup", type=int, default=8, help="decode steps left out of a row's figure (0: none)")
    p.add_argument("--profile-tokens", type=int, default=12, help="new tokens of each profiled generate")
    p.add_argument("--skew", type=float, default=1.2)


def needs_gpu(args) -> str | None:
    return cuda_backend_missing(args, "--backend cpu_ref --preset tiny-moe --layers 4")


def settings(args, scale: float) -> dict[str, dict]:
    base = {"backend": args.backend, "keep": "off"}
    if args.backend == "cuda":
        base["budget_mb"] = BIG
    out = {"off": dict(base)}
    for gib in (4, 8):
        out[f"expert_lfu {gib} GiB-eq"] = {**base, "expert_policy": "expert_lfu", "expert_budget_mb": gib * 1024 * scale}
    return out


def device_events_us(prof) -> tuple[float, list[dict]]:
    """The device's own events (DeviceType.CUDA: kernels, copies, memsets) and their summed microseconds. A CPU op's
    device time is the kernels it launched, counted again: summing every event would count each kernel twice."""
    from torch.autograd import DeviceType

    events = [e for e in prof.key_averages() if getattr(e, "device_type", None) == DeviceType.CUDA]
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:12]
    return (sum(e.self_device_time_total for e in events),
            [{"name": e.key, "calls": e.count, "self_device_us": e.self_device_time_total} for e in top])


def device_busy(model, flags: dict, tokens: int) -> dict:
    """Per forward pass (the prefill and each decode step): wall ms, and the device-busy ms from the profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    prompt = prompt_for(model.config.vocab_size)
    with model.open(**flags) as run:
        run.generate(prompt_ids=prompt, max_new_tokens=tokens, stop_at_eos=False)  # warm: the cache fills
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=acts) as prof:
            res = run.generate(prompt_ids=prompt, max_new_tokens=tokens, stop_at_eos=False)
    device_us, top_device = device_events_us(prof)
    passes = 1 + len(res.decode_ms)
    host = sorted(prof.key_averages(), key=lambda e: -getattr(e, "self_cpu_time_total", 0))[:12]
    return {"passes": passes, "wall_ms_per_pass": (res.prefill_ms + sum(res.decode_ms)) / passes,
            "device_busy_ms_per_pass": device_us / 1e3 / passes if torch.cuda.is_available() else None,
            "device_busy_counts": "device events only (each kernel once)",
            "top_device_events": top_device,
            "host_top_ops": [{"name": e.key, "calls_per_pass": e.count / passes,
                              "self_cpu_ms_per_pass": e.self_cpu_time_total / 1e3 / passes} for e in host]}


def python_profile(model, flags: dict, tokens: int, rows: int = 20) -> dict:
    """cProfile over one generate after a warm one: kestrel's functions by own time, per forward pass."""
    prompt = prompt_for(model.config.vocab_size)
    with model.open(**flags) as run:
        run.generate(prompt_ids=prompt, max_new_tokens=tokens, stop_at_eos=False)
        prof = cProfile.Profile()
        prof.enable()
        run.generate(prompt_ids=prompt, max_new_tokens=tokens, stop_at_eos=False)
        prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    out = []
    for (file, line, name), (cc, nc, tt, ct, _) in stats.stats.items():
        out.append({"function": f"{Path(file).name}:{line}:{name}", "calls_per_pass": nc / tokens,
                    "own_ms_per_pass": tt * 1e3 / tokens, "cumulative_ms_per_pass": ct * 1e3 / tokens})
    out.sort(key=lambda x: -x["own_ms_per_pass"])
    total = sum(x["own_ms_per_pass"] for x in out)
    ours = sum(x["own_ms_per_pass"] for x in out if not x["function"].startswith(("{", "~")))
    return {"profiled_ms_per_pass": total, "python_level_ms_per_pass": ours, "top": out[:rows]}


def run(args, record) -> dict:
    from kestrel_core import load
    from kestrel_core.tools.presets import PRESETS

    full = PRESETS[args.preset]["num_hidden_layers"]
    layers = min(args.layers, full)
    scale = layers / full
    paths = {"uniform": models.ensure_preset(args.models, args.preset, layers=layers),
             "skewed": models.ensure_preset(args.models, args.preset, layers=layers, router_skew=args.skew)}
    result: dict = {"preset": args.preset, "backend": args.backend, "layers": layers, "full_depth_layers": full,
                    "budget_scale": scale, "skew": args.skew, "tokens": args.tokens, "warmup_steps": args.warmup,
                    "rounds": args.rounds, "interleaved": [], "device_busy": {}, "python_profile": {}}
    opened = {name: load(path) for name, path in paths.items()}
    try:
        for model in opened.values():  # warm-up, not recorded
            row(model, settings(args, scale)["off"], prompt_for(model.config.vocab_size), 4)
        order = list(opened)
        for rnd in range(args.rounds):
            for router in (order if rnd % 2 == 0 else order[::-1]):
                for label, flags in settings(args, scale).items():
                    model = opened[router]
                    r = row(model, flags, prompt_for(model.config.vocab_size), args.tokens, label=label,
                            warmup=args.warmup)
                    r.update(round=rnd, router=router, setting=label)
                    result["interleaved"].append(r)
                    log(f"round {rnd} {router:8} {label:22} p50 {r['summary']['p50']:7.2f} ms "
                        f"{r['bytes_uploaded_per_token'] / 1e6:7.1f} MB/tok")
            record.save_partial(result)
        result["summary"] = {}
        for router in opened:
            for label in settings(args, scale):
                p50s = [r["summary"]["p50"] for r in result["interleaved"]
                        if r["router"] == router and r["setting"] == label]
                result["summary"][f"{router} {label}"] = {"round_p50s": p50s, "across_rounds": summary(p50s)}
        for router, model in opened.items():
            for label in ("off", "expert_lfu 8 GiB-eq"):
                flags = settings(args, scale)[label]
                result["device_busy"][f"{router} {label}"] = d = device_busy(model, flags, args.profile_tokens)
                result["python_profile"][f"{router} {label}"] = python_profile(model, flags, args.profile_tokens)
                log(f"{router:8} {label:22} wall {d['wall_ms_per_pass']:.2f} ms/pass, device busy "
                    f"{d['device_busy_ms_per_pass']} ms/pass")
                record.save_partial(result)
    finally:
        for model in opened.values():
            model.close()
    return result
