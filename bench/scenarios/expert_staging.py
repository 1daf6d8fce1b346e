"""Where an expert's staging into the host ring goes: Qwen3-30B-A3B experts (three parts of 3 MiB), pages hot.
Runs without a GPU (the slots are pinned where there is one, else pageable).

    python -m bench expert-staging --models DIR [--layers 1] [--experts 64] [--threads N]

The ring's MoE rows (``host-tier --rows moe``) stage every routed expert that misses into a slot before its upload.
This measures, side by side in one run and with the checkpoint's pages in the page cache, the time to stage one
expert unit, every expert's (or group's) time kept and summarised:

- preadv: its parts read with ``os.preadv``, all on one thread, and one part a thread;
- cachestat / mincore: asking whether an expert's three parts are all in the page cache, on the file (``cachestat``,
  where the kernel has it) and on the mapping (``mincore``);
- sources: ``Filler.sources`` alone (the views and reads built before a read);
- fill: ``PinnedRing.fill`` of the unit from those sources, parts read whole and in 1 MiB pieces;
- stager: ``Stager.take``/``give_back`` through the worker thread, 8 experts at a time (a layer's top-8): on
  demand, with ``expect`` announcing the 8 first and staged one at a time, and with ``expect`` and side by side.

Nothing is uploaded: this is the host's side of an expert's staging, the cuda backend's own parts.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import models
from bench.log import log
from bench.stats import summary

PRESET = "qwen3-30b-a3b"
TOP_K = 8
SMALL_PIECE = 2**20


def add_arguments(p) -> None:
    models.add_arguments(p)
    p.add_argument("--preset", default=PRESET, help="a MoE preset (tiny-moe for a quick run)")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--experts", type=int, default=64, help="expert units staged a figure (a multiple of 8)")
    p.add_argument("--threads", type=int, default=0, help="the ring's fill threads (default: fill_threads())")


def warm(path: Path) -> None:
    for f in Path(path).glob("*.safetensors"):
        with open(f, "rb") as fh:
            while fh.read(64 * 2**20):
                pass


def us(times_s: list[float], factor: float = 1.0) -> dict:
    """Microseconds: each time and their summary."""
    xs = [t * 1e6 * factor for t in times_s]
    return {"us": xs, "summary": summary(xs)}


def run(args, record) -> dict:
    import torch
    from kestrel_core.formats.checkpoint import Checkpoint
    from kestrel_core.formats.modelconfig import read_model_config
    from kestrel_core.formats.tensor_table import unit_specs
    from kestrel_core.formats.units import is_expert
    from backends.cuda.host.pagecache import cached_pages, resident_fraction
    from backends.cuda.host.staging import Filler, PartRead, Stager
    from backends.cuda.host.tier import PinnedRing, fill_threads, slot_bytes
    from backends.cuda.layout import slot_entries

    dtype = torch.bfloat16
    path = models.ensure_preset(args.models, args.preset, layers=args.layers)
    warm(path)
    cfg = read_model_config(path)
    entries = {spec.key: slot_entries(spec.tensors) for spec in unit_specs(cfg)}
    experts = sorted(k for k in entries if is_expert(k))[: args.experts]
    threads = args.threads or fill_threads()
    ckpt = Checkpoint(path)
    pin = torch.cuda.is_available()
    ring = PinnedRing(2 * TOP_K, slot_bytes([entries[k] for k in experts], dtype), dtype, threads=threads, pin=pin)
    unit_bytes = sum(ckpt.info(n).nbytes for e in entries[experts[0]] for n in e.parts)
    out: dict = {}
    result = {"preset": args.preset, "layers": args.layers, "experts": len(experts), "threads": threads,
              "pinned_slots": pin, "expert_bytes": unit_bytes, "piece_bytes": PartRead.PIECE,
              "small_piece_bytes": SMALL_PIECE, "per_expert": out}

    # the bytes alone: preadv of each part into the slot, on one thread and a part a thread
    fd = os.open(ckpt.file_of(entries[experts[0]][0].parts[0]).path, os.O_RDONLY)
    slot = ring.acquire()
    flat = slot.raw.numpy()

    def spans(key):
        at, found = 0, []
        for e in entries[key]:
            for n in e.parts:
                info = ckpt.info(n)
                found.append((memoryview(flat[at:at + info.nbytes]), info.start))
                at += info.nbytes
        return found

    def read(span):
        buf, off = span
        got = 0
        while got < len(buf):
            got += os.preadv(fd, [buf[got:]], off + got)

    times = []
    for k in experts:
        s = spans(k)
        t0 = time.perf_counter()
        for sp in s:
            read(sp)
        times.append(time.perf_counter() - t0)
    out["preadv 1 thread"] = us(times)
    with ThreadPoolExecutor(threads) as pool:
        times = []
        for k in experts:
            s = spans(k)
            t0 = time.perf_counter()
            list(pool.map(read, s))
            times.append(time.perf_counter() - t0)
    out["preadv a part a thread"] = us(times)
    os.close(fd)

    # asking whether a part's pages are all cached: cachestat on the file, mincore on the mapping (x3 an expert)
    parts = [n for k in experts for e in entries[k] for n in e.parts]
    fd = os.open(ckpt.file_of(parts[0]).path, os.O_RDONLY)
    result["cachestat"] = cached_pages(fd, ckpt.info(parts[0]).start, ckpt.info(parts[0]).nbytes) is not None
    for label, ask in (("cachestat", lambda n: cached_pages(fd, ckpt.info(n).start, ckpt.info(n).nbytes)),
                       ("mincore", lambda n: resident_fraction(ckpt.view(n).data_ptr(), ckpt.info(n).nbytes))):
        if label == "cachestat" and not result["cachestat"]:
            continue
        times = []
        for n in parts:
            t0 = time.perf_counter()
            ask(n)
            times.append(time.perf_counter() - t0)
        out[f"{label}, a part (x3 an expert)"] = us(times, factor=3)
    os.close(fd)

    filler = Filler(ckpt)
    times = []
    for k in experts:
        t0 = time.perf_counter()
        filler.sources(entries[k], dtype)
        times.append(time.perf_counter() - t0)
        filler.done(entries[k])
    out["sources"] = us(times)

    def fill_times(piece: int) -> list[float]:
        saved = PartRead.PIECE
        PartRead.PIECE = piece
        try:
            found = []
            for k in experts:
                t0 = time.perf_counter()
                ring.fill(slot, entries[k], filler.sources(entries[k], dtype).__getitem__)
                filler.done(entries[k])
                found.append(time.perf_counter() - t0)
            return found
        finally:
            PartRead.PIECE = saved

    out[f"fill, parts whole ({PartRead.PIECE // 2**20} MiB pieces)"] = us(fill_times(PartRead.PIECE))
    out[f"fill, {SMALL_PIECE // 2**20} MiB pieces"] = us(fill_times(SMALL_PIECE))
    filler.close()
    ring.release(slot, None)

    for expect, batch in ((False, True), (True, False), (True, True)):
        stager = Stager(ring, Filler(ckpt), entries.__getitem__, lookahead=len(ring) - 1)
        if not batch:
            stager.BATCH_BYTES = 1
        times = []
        try:
            for g in range(0, len(experts) - TOP_K + 1, TOP_K):
                group = experts[g:g + TOP_K]
                t0 = time.perf_counter()
                if expect:
                    stager.expect(group)
                for k in group:
                    s, _ = stager.take(k)
                    stager.give_back(s, None)
                times.append((time.perf_counter() - t0) / len(group))
        finally:
            stager.close()
        out[f"stager, {'expect' if expect else 'on demand'}{'' if batch else ', one at a time'}"] = us(times)
    ring.close()
    ckpt.close()
    for k, v in out.items():
        p50 = v["summary"]["p50"]
        log(f"{k:36} {p50:9.1f} us/expert  {unit_bytes / p50 / 1e3:6.2f} GB/s")
    return result
