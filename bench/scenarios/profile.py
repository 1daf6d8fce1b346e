"""Where a decode step's time goes: torch.profiler over one generate of one setting, after a warm one.

    python -m bench profile --model /tmp/m/qwen3-1.7b [--keep off] [--backend cuda] [--rows 25]
    python -m bench profile --preset tiny --backend cpu_ref --tokens 6         # on the CPU

The record holds the generate's decode times (every step, and its summary), the device's own events (kernels,
copies: each once) summed per forward pass, and the profiler's tables as text: by device time (on a GPU) and by the
host's own time.
"""

from __future__ import annotations

from bench import models
from bench.errors import cuda_backend_missing
from bench.options import keep
from bench.prompt import prompt_for
from bench.rows import from_result
from bench.scenarios.moe_host_cost import device_events_us


def add_arguments(p) -> None:
    models.add_arguments(p)
    p.add_argument("--model", help="a model directory (default: the --preset's checkpoint)")
    p.add_argument("--preset", default="qwen3-1.7b")
    p.add_argument("--backend", default="cuda", choices=("cuda", "cpu_ref"))
    p.add_argument("--keep", default="off", type=keep)
    p.add_argument("--prefetch", type=int, default=0)
    p.add_argument("--graphs", default="auto", choices=("auto", "off"))
    p.add_argument("--tokens", type=int, default=6)
    p.add_argument("--rows", type=int, default=25, help="rows of each profiler table")


def needs_gpu(args) -> str | None:
    return cuda_backend_missing(args)


def run(args, record) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kestrel_core import load

    path = args.model or models.ensure_preset(args.models, args.preset)
    keep = args.keep if args.keep == "off" else int(args.keep)
    settings = {"backend": args.backend, "keep": keep, "prefetch": args.prefetch, "graphs": args.graphs}
    cuda = torch.cuda.is_available() and args.backend == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with load(path) as model, model.open(**settings) as run_:
        prompt = prompt_for(model.config.vocab_size)
        run_.generate(prompt_ids=prompt, max_new_tokens=args.tokens, stop_at_eos=False)  # warm-up
        with profile(activities=acts) as prof:
            res = run_.generate(prompt_ids=prompt, max_new_tokens=args.tokens, stop_at_eos=False)
    r = from_result(res, f"{args.backend} keep={keep}", settings)
    events = prof.key_averages()
    device_us, top_device = device_events_us(prof)
    passes = 1 + len(res.decode_ms)
    return {"model": str(path), "settings": settings, "row": r, "passes": passes,
            "device_busy_ms_per_pass": device_us / 1e3 / passes if cuda else None, "top_device_events": top_device,
            "table_by_device_time": events.table(sort_by="self_cuda_time_total", row_limit=args.rows) if cuda else None,
            "table_by_host_time": events.table(sort_by="self_cpu_time_total", row_limit=args.rows)}
