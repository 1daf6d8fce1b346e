"""Shared bits of the benchmarks: hardware facts, the commit, CUDA-event timing, the JSON record."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def commit() -> str:
    if os.environ.get("KESTREL_COMMIT"):
        return os.environ["KESTREL_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def hardware() -> dict:
    hw = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
          "machine": platform.machine()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        hw.update(gpu=p.name, gpu_memory_bytes=p.total_memory, sms=p.multi_processor_count,
                  cuda=torch.version.cuda, capability=f"{p.major}.{p.minor}")
        try:
            hw["driver"] = subprocess.check_output(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], text=True).strip()
        except (OSError, subprocess.CalledProcessError):
            pass
    return hw


def time_cuda(fn, warmup: int = 3, reps: int = 10) -> float:
    """Median milliseconds of ``fn`` by CUDA events, after warm-up."""
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
    return statistics.median(times)


def time_cuda_graph(fn, calls: int = 16, warmup: int = 3, reps: int = 30) -> float:
    """Median device milliseconds of one ``fn`` call: a CUDA graph of ``calls`` back-to-back
    calls, replayed and timed by CUDA events, divided by ``calls``. Host launch cost stays out,
    so this is the kernels' own time (``time_cuda`` on the eager call gives what a caller waits)."""
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
    ms = time_cuda(graph.replay, warmup=warmup, reps=reps) / calls
    del graph
    return ms


def hf_decode(model, prompt: list[int], n_new: int) -> tuple[list[int], list[float], float]:
    """Greedy decode of a transformers model with its DynamicCache: (ids, CUDA-event ms per decode step, prefill ms)."""
    ids = torch.tensor([prompt], device="cuda")
    times, out = [], []
    with torch.inference_mode():
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        res = model(input_ids=ids, use_cache=True)
        tok = int(res.logits[0, -1].argmax())
        b.record()
        b.synchronize()
        prefill = a.elapsed_time(b)
        past = res.past_key_values
        out.append(tok)
        for _ in range(n_new - 1):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            res = model(input_ids=torch.tensor([[tok]], device="cuda"), past_key_values=past, use_cache=True)
            tok = int(res.logits[0, -1].argmax())
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
            past = res.past_key_values
            out.append(tok)
    return out, times, prefill


def copy_ceilings(nbytes: int = 2**30) -> dict:
    """Pinned and pageable host->device, and device->device (bytes read + written), in GB/s."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.randint(0, 255, (nbytes,), dtype=torch.uint8).pin_memory()
    pageable = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dev2 = torch.empty_like(dev)
    ms_pinned = time_cuda(lambda: dev.copy_(pinned, non_blocking=True))
    ms_pageable = time_cuda(lambda: dev.copy_(pageable), warmup=1, reps=5)
    ms_d2d = time_cuda(lambda: dev2.copy_(dev))
    out = {
        "copy_bytes": nbytes,
        "pinned_h2d_GBps": nbytes / ms_pinned / 1e6,
        "pageable_h2d_GBps": nbytes / ms_pageable / 1e6,
        "d2d_GBps_read_plus_write": 2 * nbytes / ms_d2d / 1e6,
    }
    del dev, dev2, pinned, pageable
    torch.cuda.empty_cache()
    return out


def utc_stamp() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def write_record(name: str, record: dict, out_dirs: list[Path], stamp: str | None = None) -> list[Path]:
    """``name_stamp.json`` in each directory, written atomically (a bench that writes as it goes passes one stamp)."""
    stamp = stamp or utc_stamp()
    record = {"bench": name, "date_utc": stamp, "commit": commit(), "command": " ".join(sys.argv),
              "hardware": hardware(), **record}
    paths = []
    for d in out_dirs:
        d.mkdir(parents=True, exist_ok=True)
        p = d / f"{name}_{stamp}.json"
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, p)
        paths.append(p)
    return paths
