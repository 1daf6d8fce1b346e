"""Where a decode step's time goes: torch.profiler over a few decode steps of one setting.

    python bench/profile_decode.py --model DIR [--keep off] [--backend cuda]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from kestrel_core.config import GenerationConfig, KestrelConfig
from kestrel_core.engine import Model, open_run
from kestrel_core.generate import generate


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--backend", default="cuda")
    p.add_argument("--keep", default="off")
    p.add_argument("--prefetch", type=int, default=0)
    p.add_argument("--rows", type=int, default=25)
    args = p.parse_args()
    cfg = KestrelConfig().override(backend__name=args.backend, residency__keep=args.keep, backend__prefetch=args.prefetch)
    gen = GenerationConfig(max_new_tokens=6, stop_at_eos=False)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with Model(args.model) as model, open_run(model, cfg) as run:
        generate(run, [1, 2, 3, 4], gen)  # warm-up
        with profile(activities=acts) as prof:
            r = generate(run, [1, 2, 3, 4], gen)
    print(f"decode ms/token: {r.ms_per_token:.2f}")
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=args.rows))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
