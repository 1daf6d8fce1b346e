"""What torch does with a host-to-device copy from each kind of host memory the ring could use, on a GPU.

    python -m bench ring-copy [--mib 512] [--reps 10]

Side by side in one run, for one buffer of ``--mib`` MiB of each kind: torch-pinned (a block of torch's pinned
allocator), registered (an aligned pageable block page-locked with ``cudaHostRegister``: ``HostMemory``, which pins
exactly its bytes) and pageable. For each: ``tensor.is_pinned()``; the host milliseconds ``copy_(non_blocking=True)``
takes to return; the copy's device time by CUDA events and its GB/s; and whether a CUDA graph can capture the copy.
Every repetition's time is kept. This is the gate for how the ring's slots are made.
"""

from __future__ import annotations

import time

from bench.errors import cuda_missing
from bench.log import log
from bench.stats import summary
from bench.timing import event_times


def add_arguments(p) -> None:
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--reps", type=int, default=10)


def needs_gpu(args) -> str | None:
    return cuda_missing()


def host_return_ms(dev, src, reps: int) -> list[float]:
    import torch

    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.copy_(src, non_blocking=True)
        times.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    return times


def captures(dev, src) -> str:
    import torch

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


def run(args, record) -> dict:
    import torch
    from backends.cuda.host.tier import HostMemory

    n = args.mib * 2**20
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    registered = HostMemory(n, pin=True)
    kinds = {"torch-pinned": torch.empty(n, dtype=torch.uint8, pin_memory=True), "registered": registered.raw,
             "pageable": torch.empty(n, dtype=torch.uint8)}
    rows = {}
    try:
        for name, src in kinds.items():
            src.fill_(7)
            device_ms = event_times(lambda: dev.copy_(src, non_blocking=True), warmup=2, reps=args.reps)
            host_ms = host_return_ms(dev, src, args.reps)
            d = summary(device_ms)
            rows[name] = {"is_pinned": bool(src.is_pinned()), "host_return_ms": host_ms,
                          "host_return": summary(host_ms), "device_ms": device_ms, "device": d,
                          "GBps": n / d["p50"] / 1e6, "graph_capture": captures(dev, src)}
            log(f"{name:13} {rows[name]['GBps']:6.1f} GB/s, host back in {rows[name]['host_return']['p50']:.3f} ms, "
                f"capture {rows[name]['graph_capture']}")
    finally:
        kinds.clear()
        registered.close()
    return {"copy_bytes": n, "reps": args.reps, "rows": rows}
