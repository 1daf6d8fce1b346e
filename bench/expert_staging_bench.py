"""Where an expert's staging into the host ring goes: Qwen3-30B-A3B experts (three parts of 3 MiB), pages hot.

    python bench/expert_staging_bench.py --models DIR [--layers 1] [--experts 64] [--threads N] [--out DIR]

The ring's MoE rows (``host_tier_bench.py --rows moe``) stage every routed expert that misses into
a slot before its upload. This measures, side by side in one run and with the checkpoint's pages
in the page cache, the median microseconds to stage one expert unit:

- **preadv**: its parts read with ``os.preadv``, all on one thread, and one part a thread (the bytes'
  own cost, and no Python around them but the call);
- **cachestat / mincore**: asking whether an expert's three parts are all in the page cache, on the
  file (``cachestat``, the ring's way where the kernel has it) and on the mapping (``mincore``);
- **sources**: ``Filler.sources`` alone (the views and ``PartRead`` objects built before a read);
- **fill**: ``PinnedRing.fill`` of the unit from those sources, with the parts read whole (the ring's
  8 MiB pieces: a part a piece) and in 1 MiB pieces (three a part, on more threads);
- **stager**: ``Stager.take``/``give_back`` through the worker thread, 8 experts at a time (a
  layer's top-8), on demand, with ``expect`` announcing the 8 first and the worker staging them one at
  a time, and with ``expect`` and the 8 staged side by side.

The slots are pinned (registered) where there is a GPU, else pageable. Nothing is uploaded: this
is the host's side of an expert's staging.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, write_record  # noqa: E402

from kestrel_core.checkpoint import Checkpoint  # noqa: E402
from kestrel_cuda.host.tier import PinnedRing, fill_threads, slot_bytes  # noqa: E402
from kestrel_core.tensor_table import unit_specs  # noqa: E402
from kestrel_core.modelconfig import read_model_config  # noqa: E402
from kestrel_cuda.host.pagecache import cached_pages, resident_fraction  # noqa: E402
from kestrel_core.presets import preset_config, write_checkpoint  # noqa: E402
from kestrel_cuda.host.staging import Filler, PartRead, Stager  # noqa: E402
from kestrel_cuda.layout import slot_entries  # noqa: E402

PRESET = "qwen3-30b-a3b"
DTYPE = torch.bfloat16
TOP_K = 8
SMALL_PIECE = 2**20


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def median_us(times: list[float]) -> float:
    return statistics.median(times) * 1e6


def warm(path: Path) -> None:
    for f in path.glob("*.safetensors"):
        with open(f, "rb") as fh:
            while fh.read(64 * 2**20):
                pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", required=True)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--experts", type=int, default=64, help="expert units staged a figure (a multiple of 8)")
    ap.add_argument("--threads", type=int, default=0, help="the ring's fill threads (default: fill_threads())")
    ap.add_argument("--out", action="append", default=[])
    args = ap.parse_args()
    path = Path(args.models) / f"{PRESET}-L{args.layers}"
    if not (path / "config.json").is_file():
        log(f"writing {path}")
        write_checkpoint(preset_config(PRESET, layers=args.layers), path, seed=0,
                         device="cuda" if torch.cuda.is_available() else "cpu")
    warm(path)
    cfg = read_model_config(path)
    entries = {spec.key: slot_entries(spec.tensors) for spec in unit_specs(cfg)}
    experts = sorted(k for k in entries if len(k) == 2)[: args.experts]
    threads = args.threads or fill_threads()
    ckpt = Checkpoint(path)
    pin = torch.cuda.is_available()
    ring = PinnedRing(2 * TOP_K, slot_bytes([entries[k] for k in experts], DTYPE), DTYPE, threads=threads, pin=pin)
    unit_bytes = sum(ckpt.info(n).nbytes for e in entries[experts[0]] for n in e.parts)
    rec: dict = {"preset": PRESET, "layers": args.layers, "experts": len(experts), "threads": threads,
                 "pinned_slots": pin, "expert_bytes": unit_bytes, "piece_bytes": PartRead.PIECE,
                 "small_piece_bytes": SMALL_PIECE, "us_per_expert": {}}
    out = rec["us_per_expert"]

    # the bytes alone: preadv of each part into the slot, on one thread and a part a thread
    fd = os.open(ckpt.file_of(entries[experts[0]][0].parts[0]).path, os.O_RDONLY)
    slot = ring.acquire()
    flat = slot.raw.numpy()

    def spans(key):
        at, out_ = 0, []
        for e in entries[key]:
            for n in e.parts:
                info = ckpt.info(n)
                out_.append((memoryview(flat[at:at + info.nbytes]), info.start))
                at += info.nbytes
        return out_

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
    out["preadv 1 thread"] = median_us(times)
    with ThreadPoolExecutor(threads) as pool:
        times = []
        for k in experts:
            s = spans(k)
            t0 = time.perf_counter()
            list(pool.map(read, s))
            times.append(time.perf_counter() - t0)
    out["preadv a part a thread"] = median_us(times)
    os.close(fd)

    # asking whether a part's pages are all cached: cachestat on the file (the ring's way where the kernel has it),
    # mincore on its mapping (the fallback)
    parts = [n for k in experts for e in entries[k] for n in e.parts]
    fd = os.open(ckpt.file_of(parts[0]).path, os.O_RDONLY)
    rec["cachestat"] = cached_pages(fd, ckpt.info(parts[0]).start, ckpt.info(parts[0]).nbytes) is not None
    for label, ask in (("cachestat", lambda n: cached_pages(fd, ckpt.info(n).start, ckpt.info(n).nbytes)),
                       ("mincore", lambda n: resident_fraction(ckpt.view(n).data_ptr(), ckpt.info(n).nbytes))):
        if label == "cachestat" and not rec["cachestat"]:
            continue
        times = []
        for n in parts:
            t0 = time.perf_counter()
            ask(n)
            times.append(time.perf_counter() - t0)
        out[f"{label}, a part (x3 an expert)"] = median_us(times) * 3
    os.close(fd)

    filler = Filler(ckpt)
    times = []
    for k in experts:
        t0 = time.perf_counter()
        filler.sources(entries[k], DTYPE)
        times.append(time.perf_counter() - t0)
        filler.done(entries[k])
    out["sources"] = median_us(times)

    def fill_times(piece: int) -> list[float]:
        saved = PartRead.PIECE
        PartRead.PIECE = piece
        try:
            times = []
            for k in experts:
                t0 = time.perf_counter()
                ring.fill(slot, entries[k], filler.sources(entries[k], DTYPE).__getitem__)
                filler.done(entries[k])
                times.append(time.perf_counter() - t0)
            return times
        finally:
            PartRead.PIECE = saved

    out[f"fill, parts whole ({PartRead.PIECE // 2**20} MiB pieces)"] = median_us(fill_times(PartRead.PIECE))
    out[f"fill, {SMALL_PIECE // 2**20} MiB pieces"] = median_us(fill_times(SMALL_PIECE))
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
        out[f"stager, {'expect' if expect else 'on demand'}{'' if batch else ', one at a time'}"] = median_us(times)
    ring.close()
    ckpt.close()
    for k, v in out.items():
        log(f"{k:36} {v:9.1f} us/expert  {unit_bytes / v / 1e3:6.2f} GB/s")
    for p in write_record("expert_staging", rec, [RESULTS, *map(Path, args.out)]):
        log(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
