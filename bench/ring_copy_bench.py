"""What torch does with a host->device copy from each kind of host memory the ring could use.

    python bench/ring_copy_bench.py [--mib 512] [--reps 10] [--out DIR]

Side by side in one run, for one buffer of ``--mib`` MiB of each kind:

- **torch-pinned**: ``torch.empty(..., pin_memory=True)``, a block of torch's pinned allocator;
- **registered**: an aligned pageable block page-locked with ``cudaHostRegister`` (``HostMemory``),
  which pins exactly its bytes;
- **pageable**: plain host memory.

For each: ``tensor.is_pinned()``; the host seconds ``copy_(non_blocking=True)`` takes to return (an
asynchronous copy returns before the DMA ends); the copy's device time by CUDA events and its GB/s;
and whether a CUDA graph can capture the copy. This is the gate for how the ring's slots are made.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, time_cuda, write_record  # noqa: E402

from kestrel_cuda.host.tier import HostMemory  # noqa: E402


def host_return_s(dev: torch.Tensor, src: torch.Tensor, reps: int) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.copy_(src, non_blocking=True)
        times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    return statistics.median(times)


def captures(dev: torch.Tensor, src: torch.Tensor) -> str:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(side):
            with torch.cuda.graph(graph):
                dev.copy_(src, non_blocking=True)
        graph.replay()
        torch.cuda.synchronize()
        return "yes"
    except RuntimeError as exc:
        torch.cuda.synchronize()
        return f"no: {str(exc).splitlines()[0]}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", action="append", default=[])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("ring_copy_bench needs a GPU", file=sys.stderr)
        return 2
    n = args.mib * 2**20
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    registered = HostMemory(n, pin=True)
    kinds = {
        "torch-pinned": torch.empty(n, dtype=torch.uint8, pin_memory=True),
        "registered": registered.raw,
        "pageable": torch.empty(n, dtype=torch.uint8),
    }
    rows = {}
    for name, src in kinds.items():
        src.fill_(7)
        ms = time_cuda(lambda: dev.copy_(src, non_blocking=True), warmup=2, reps=args.reps)
        rows[name] = {
            "is_pinned": bool(src.is_pinned()),
            "host_return_ms": host_return_s(dev, src, args.reps) * 1e3,
            "device_ms": ms,
            "GBps": n / ms / 1e6,
            "graph_capture": captures(dev, src),
        }
        print(name, rows[name], flush=True)
    paths = write_record("ring_copy", {"copy_bytes": n, "reps": args.reps, "rows": rows},
                         [RESULTS] + [Path(d) for d in args.out])
    print("wrote", *paths)
    registered.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
