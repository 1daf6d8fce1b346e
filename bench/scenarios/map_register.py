"""The gate for a hot path with no host copy: upload a unit straight from the file's mapping, registered with CUDA,
on a GPU.

    python -m bench map-register [--dir /tmp] [--gib 4] [--unit-mib 384] [--threads 14] [--shares 0.3,0.45,0.6]

The ring's hot path copies each unit from the page cache into a pinned slot (``pread`` on the ring's threads), then
uploads the slot; its rate is bounded by that host copy. The other way is to page-lock the unit's pages of the file
mapping in place (``cudaHostRegister`` with ``cudaHostRegisterReadOnly``), upload them, and unlock them: no host
copy, but a register and an unregister per unit. This measures, side by side in one run, on a file of ``--gib`` GiB
whose pages are all in the page cache, in units of ``--unit-mib`` MiB (one 8B-shape layer is about 375 MB), every
unit's time kept:

- pinned H2D: the copy rate from torch's pinned memory (the ceiling either way);
- fill: ``pread`` of each unit into a registered slot on ``--threads`` threads (the ring's copy);
- ring: that fill pipelined with the upload over two slots;
- register / unregister: the host milliseconds of each call on one unit of the mapping (its pages dropped from the
  mapping after each unit, as the ring does), and the copy rate from a registered mapping;
- mapped: register, upload and unregister pipelined; and registering one unit split over 4 threads;
- hybrid: for each of ``--shares``, that share of each unit registered in place while the pool preads the rest.

Also whether cuFile (GPUDirect Storage) and its kernel driver are present here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import statistics
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.errors import cuda_missing
from bench.log import log
from bench.stats import summary
from bench.timing import event_times


def add_arguments(p) -> None:
    p.add_argument("--dir", default="/tmp", help="where the scratch file is written (and removed)")
    p.add_argument("--gib", type=int, default=4)
    p.add_argument("--unit-mib", type=int, default=384)
    p.add_argument("--threads", type=int, default=14)
    p.add_argument("--shares", type=lambda v: [float(x) for x in v.split(",")], default=[0.3, 0.45, 0.6],
                   help="the shares of a unit the hybrid registers in place, comma-separated")


def needs_gpu(args) -> str | None:
    return cuda_missing()


READ_ONLY = 0x08  # cudaHostRegisterReadOnly: a read-only (file) mapping may be registered with it
MADV_DONTNEED = 4


def check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what}: cuda error {code}")


def gds_present() -> dict:
    lib = ctypes.util.find_library("cufile")
    mod = Path("/sys/module/nvidia_fs").exists()
    return {"libcufile": lib, "nvidia_fs_module": mod}


def pread_into(fd: int, buf, offset: int, pool: ThreadPoolExecutor, threads: int) -> None:
    step = -(-buf.nbytes // threads)
    step = -(-step // 4096) * 4096

    def one(lo: int) -> None:
        view = memoryview(buf[lo:lo + step])
        at = 0
        while at < len(view):
            got = os.preadv(fd, [view[at:]], offset + lo + at)
            if got <= 0:
                raise RuntimeError("short read")
            at += got

    list(pool.map(one, range(0, buf.nbytes, step)))


def two_slots(n_units: int, stream, stage, upload, retire=lambda i: None, finish=lambda: None) -> float:
    """Seconds to move ``n_units`` units through two slots: ``stage(i, s)`` fills slot ``s`` once its last upload is
    done, ``upload(i, s)`` queues its copies on ``stream``, ``retire(i)`` runs once unit i's upload is done and the
    next unit's is queued; ``finish()`` runs after the last retire, inside the timing."""
    events: list = [None, None]
    last = None
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n_units):
        s = i % 2
        if events[s] is not None:
            events[s].synchronize()
        stage(i, s)
        with torch.cuda.stream(stream):
            upload(i, s)
            events[s] = torch.cuda.Event()
            events[s].record(stream)
        if last is not None:
            last[1].synchronize()
            retire(last[0])
        last = (i, events[s])
    if last is not None:
        last[1].synchronize()
        retire(last[0])
    finish()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def run(args, record) -> dict:
    import numpy as np
    import torch
    from backends.cuda.host.tier import HostMemory

    warnings.filterwarnings("ignore", message=".*not writable.*")
    unit = args.unit_mib * 2**20
    n_units = args.gib * 2**30 // unit
    path = Path(args.dir) / f"kestrel-map-register-{os.getpid()}.bin"
    rec: dict = {"unit_bytes": unit, "units": n_units, "threads": args.threads, "gds": gds_present()}
    chunk = torch.randint(0, 255, (256 * 2**20,), dtype=torch.uint8).numpy()
    try:
        with open(path, "xb") as fh:  # a new file of our own; its pages stay in the cache
            for _ in range(-(-n_units * unit // chunk.nbytes)):
                fh.write(chunk.data)
        fd = os.open(path, os.O_RDONLY)
        size = os.fstat(fd).st_size
        while os.read(fd, 64 * 2**20):  # every page in the cache
            pass
        mm = mmap.mmap(fd, size, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
        arr = np.frombuffer(mm, dtype=np.uint8)
        base = arr.ctypes.data
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        cudart = torch.cuda.cudart()
        dev = [torch.empty(unit, dtype=torch.uint8, device="cuda") for _ in range(2)]
        stream = torch.cuda.Stream()

        pinned = torch.empty(unit, dtype=torch.uint8, pin_memory=True)
        times = event_times(lambda: dev[0].copy_(pinned, non_blocking=True))
        rec["pinned_h2d"] = {"ms": times, "summary": summary(times)}
        rec["pinned_h2d_GBps"] = unit / rec["pinned_h2d"]["summary"]["p50"] / 1e6

        # fill: pread into a registered slot, alone and pipelined with the upload over two slots
        slots_mem = HostMemory(2 * unit, pin=True)
        slots = [slots_mem.raw[i * unit:(i + 1) * unit] for i in range(2)]
        slot_np = [s.numpy() for s in slots]
        with ThreadPoolExecutor(args.threads) as pool:
            times = []
            for i in range(n_units):
                t0 = time.perf_counter()
                pread_into(fd, slot_np[i % 2], i * unit, pool, args.threads)
                times.append(time.perf_counter() - t0)
            rec["fill_s"] = times
            rec["fill_GBps"] = unit / statistics.median(times) / 1e9
            secs = two_slots(n_units, stream, lambda i, s: pread_into(fd, slot_np[s], i * unit, pool, args.threads),
                             lambda i, s: dev[s].copy_(slots[s], non_blocking=True))
            rec["ring_GBps"] = n_units * unit / secs / 1e9
        slots_mem.close()

        def drop(i: int) -> None:
            libc.madvise(ctypes.c_void_p(base + i * unit), ctypes.c_size_t(unit), MADV_DONTNEED)

        def register(i: int, parts: int = 1) -> None:
            step = unit // parts
            for p in range(parts):
                check(cudart.cudaHostRegister(base + i * unit + p * step, step, READ_ONLY), "cudaHostRegister")

        def unregister(i: int, parts: int = 1) -> None:
            step = unit // parts
            for p in range(parts):
                check(cudart.cudaHostUnregister(base + i * unit + p * step), "cudaHostUnregister")

        host = [torch.from_numpy(arr[i * unit:(i + 1) * unit]) for i in range(n_units)]
        reg_ms, unreg_ms, copy_ms = [], [], []
        for i in range(n_units):
            drop(i)
            t0 = time.perf_counter()
            register(i)
            reg_ms.append((time.perf_counter() - t0) * 1e3)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dev[0].copy_(host[i], non_blocking=True)
            b.record()
            b.synchronize()
            copy_ms.append(a.elapsed_time(b))
            t0 = time.perf_counter()
            unregister(i)
            unreg_ms.append((time.perf_counter() - t0) * 1e3)
            drop(i)
        rec["register_ms_each"], rec["unregister_ms_each"], rec["mapped_copy_ms_each"] = reg_ms, unreg_ms, copy_ms
        rec["register_ms"] = statistics.median(reg_ms)
        rec["unregister_ms"] = statistics.median(unreg_ms)
        rec["register_GBps"] = unit / rec["register_ms"] / 1e6
        rec["mapped_copy_GBps"] = unit / statistics.median(copy_ms) / 1e6

        # registering one unit in 4 pieces on 4 threads at once
        with ThreadPoolExecutor(4) as pool:
            times = []
            for i in range(n_units):
                drop(i)
                t0 = time.perf_counter()
                step = unit // 4
                list(pool.map(lambda p: check(cudart.cudaHostRegister(base + i * unit + p * step, step, READ_ONLY), "reg"),
                              range(4)))
                times.append(time.perf_counter() - t0)
                unregister(i, 4)
                drop(i)
            rec["register_4_threads_s"] = times
            rec["register_4_threads_GBps"] = unit / statistics.median(times) / 1e9

        # mapped, pipelined: a worker registers unit i+1 while unit i uploads, and unregisters each once its copy is done
        with ThreadPoolExecutor(1) as worker:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ahead = worker.submit(register, 0)
            pending: list = []
            for i in range(n_units):
                ahead.result()
                if i + 1 < n_units:
                    ahead = worker.submit(register, i + 1)
                with torch.cuda.stream(stream):
                    dev[i % 2].copy_(host[i], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                pending.append((i, ev))
                while len(pending) > 1:
                    j, e = pending.pop(0)
                    e.synchronize()
                    worker.submit(lambda j=j: (unregister(j), drop(j)))
            for j, e in pending:
                e.synchronize()
                worker.submit(lambda j=j: (unregister(j), drop(j))).result()
            torch.cuda.synchronize()
            rec["mapped_GBps"] = n_units * unit / (time.perf_counter() - t0) / 1e9
        # hybrid: the first share of each unit registered in place (on the worker) while the pool preads the rest into a slot
        slots_mem = HostMemory(2 * unit, pin=True)
        slots = [slots_mem.raw[i * unit:(i + 1) * unit] for i in range(2)]
        rec["hybrid_GBps"] = {}
        with ThreadPoolExecutor(1) as worker, ThreadPoolExecutor(args.threads) as pool:
            for share in args.shares:
                fu = int(unit * share) // 4096 * 4096

                def reg_part(i: int) -> None:
                    check(cudart.cudaHostRegister(base + i * unit, fu, READ_ONLY), "cudaHostRegister")

                def unreg_part(i: int) -> None:
                    check(cudart.cudaHostUnregister(base + i * unit), "cudaHostUnregister")
                    libc.madvise(ctypes.c_void_p(base + i * unit), ctypes.c_size_t(fu), MADV_DONTNEED)

                def stage(i: int, s: int) -> None:
                    reg = worker.submit(reg_part, i)
                    pread_into(fd, slots[s][fu:].numpy(), i * unit + fu, pool, args.threads)
                    reg.result()

                def upload(i: int, s: int) -> None:
                    dev[s][:fu].copy_(host[i][:fu], non_blocking=True)
                    dev[s][fu:].copy_(slots[s][fu:], non_blocking=True)

                secs = two_slots(n_units, stream, stage, upload, retire=lambda j: worker.submit(unreg_part, j),
                                 finish=lambda: worker.submit(lambda: None).result())  # the last unregister is done
                rec["hybrid_GBps"][str(share)] = n_units * unit / secs / 1e9
        slots_mem.close()
        host.clear()  # the views of the mapping go before it closes
        del arr
        mm.close()
        os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    rec["verdict_inputs"] = {k: rec[k] for k in ("pinned_h2d_GBps", "fill_GBps", "ring_GBps", "register_GBps",
                                                   "register_4_threads_GBps", "mapped_copy_GBps", "mapped_GBps",
                                                   "hybrid_GBps")}
    log(f"{rec['verdict_inputs']} {rec['gds']}")
    return rec
