"""GPU timing for the microbenchmarks: CUDA events after a warm-up, every repetition's time kept.

    times = event_times(fn, warmup=3, reps=10)          # ms of each call, as the host waits for it
    times = graph_times(fn, calls=16)                   # device ms of one call, from CUDA-graph replays
    rates = copy_rates()                                # pinned / pageable host->device, device->device

A figure is quoted as the median of its times (``bench.stats.summary``); the times stay in the record.
"""

from __future__ import annotations

from collections.abc import Callable

from bench.stats import summary


def event_times(fn: Callable[[], object], warmup: int = 3, reps: int = 10) -> list[float]:
    """Milliseconds of each of ``reps`` calls of ``fn``, between two CUDA events, after ``warmup`` calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def graph_times(fn: Callable[[], object], calls: int = 16, warmup: int = 3, reps: int = 30) -> list[float]:
    """Device milliseconds of one ``fn`` call, each repetition's: a CUDA graph of ``calls`` back-to-back calls,
    replayed and timed by CUDA events, divided by ``calls``. The host's launch cost stays out, so this is the
    kernels' own time (``event_times`` on the eager call gives what a caller waits for)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graph asks
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = [t / calls for t in event_times(graph.replay, warmup=warmup, reps=reps)]
    del graph
    return times


def rate(nbytes: int, times_ms: list[float], factor: int = 1) -> dict:
    """A copy rate: the times, their summary, and GB/s at the median (``factor`` 2 counts read and write)."""
    s = summary(times_ms)
    return {"bytes": nbytes, "ms": times_ms, "summary": s, "GBps": factor * nbytes / s["p50"] / 1e6}


def copy_rates(nbytes: int = 2**30, reps: int = 10) -> dict:
    """Pinned and pageable host->device, and device->device (bytes read + written), each with every repetition."""
    import torch

    buf = {"dev": torch.empty(nbytes, dtype=torch.uint8, device="cuda"),
           "pinned": torch.randint(0, 255, (nbytes,), dtype=torch.uint8).pin_memory(),
           "pageable": torch.randint(0, 255, (nbytes,), dtype=torch.uint8)}
    buf["dev2"] = torch.empty_like(buf["dev"])
    out = {
        "pinned_h2d": rate(nbytes, event_times(lambda: buf["dev"].copy_(buf["pinned"], non_blocking=True), reps=reps)),
        "pageable_h2d": rate(nbytes, event_times(lambda: buf["dev"].copy_(buf["pageable"]), warmup=1,
                                                 reps=max(3, reps // 2))),
        "d2d_read_plus_write": rate(nbytes, event_times(lambda: buf["dev2"].copy_(buf["dev"]), reps=reps), factor=2),
    }
    buf.clear()  # the 4 GiB go before the run's rows
    torch.cuda.empty_cache()
    return out
