"""The host ring's hot path on its own: staging from the page cache, copied through the mapping or read with pread.
Runs without a GPU (``--dma`` needs one).

    python -m bench host-fill --models /tmp/models [--preset small-300m] [--rounds 3] [--threads 2,4]
    python -m bench host-fill --model /tmp/models/qwen3-8b --threads 8,14 [--mapped] [--dma]

Every streamed unit of a checkpoint whose pages are in the page cache is staged into the slots of a ring (unpinned
here: the staging is host work), the ways below side by side, interleaved round by round, every pass kept:

- mapping: each part copied from the safetensors mapping (faulting its pages in), then the unit's pages dropped
  from the mapping so the process's RSS does not grow with the model;
- pread: each part read with buffered ``pread`` straight into the slot (what the ring does for a part stored in
  the slot's dtype);
- mapped (``--mapped``): each part copied from the mapping with its pages left mapped, after an untimed pass that
  faulted them in: a plain memory copy, the upper bound of a hot path that kept the model mapped.

``--dma`` runs pinned host-to-device copies of 1 GiB back to back on a thread beside each timed pass (as the ring's
uploads do beside its fill), and records the rate they kept: memory copies and DMA share the host's memory.
This measures the cuda backend's own staging parts (``backends.cuda.host``), not a run.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from bench.options import numbers
from bench import models
from bench.errors import BenchError, cuda_missing
from bench.log import log
from bench.stats import summary

DTYPE_NAME = "bfloat16"


def add_arguments(p) -> None:
    models.add_arguments(p)
    p.add_argument("--model", type=Path, help="a bf16 checkpoint already written (instead of --models/--preset)")
    p.add_argument("--preset", default="small-300m")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=numbers(int, 1), default=[2], help="fill thread counts, comma-separated")
    p.add_argument("--mapped", action="store_true", help="also copy from the mapping with its pages kept mapped")
    p.add_argument("--dma", action="store_true", help="pinned host-to-device copies beside each pass (needs CUDA)")


def needs_gpu(args) -> str | None:
    return cuda_missing() if args.dma else None


def stage_all(entries: dict, ring, filler, how: str, dtype) -> tuple[float, int]:
    """Every unit staged once by ``how`` (pread, mapping, mapped); seconds and bytes."""
    t0 = time.perf_counter()
    total = 0
    for es in entries.values():
        slot = ring.acquire()
        ring.fill(slot, es, filler.sources(es, dtype if how == "pread" else None).__getitem__)
        if how == "mapping":
            filler.done(es)
        total += sum(e.nbytes(dtype) for e in es)
    return time.perf_counter() - t0, total


class Dma:
    """Pinned host -> device copies of 1 GiB back to back on a thread while in the ``with`` block; ``GBps`` after."""

    def __init__(self, on: bool):
        self.on, self.GBps = on, None
        if on:
            import torch

            self.src = torch.empty(2**30, dtype=torch.uint8).pin_memory()
            self.dst = torch.empty(2**30, dtype=torch.uint8, device="cuda")
            self.stream = torch.cuda.Stream()

    def _run(self):
        import torch

        with torch.cuda.stream(self.stream):
            while not self._stop.is_set():
                self.dst.copy_(self.src, non_blocking=True)
                self.stream.synchronize()
                self.copies += 1

    def __enter__(self):
        if self.on:
            self._stop, self.copies = threading.Event(), 0
            self._t = threading.Thread(target=self._run)
            self.t0 = time.perf_counter()
            self._t.start()
        return self

    def __exit__(self, *exc):
        if self.on:
            self._stop.set()
            self._t.join()
            self.GBps = self.copies * 2**30 / (time.perf_counter() - self.t0) / 1e9


def run(args, record) -> dict:
    import torch
    from kestrel_core.formats.checkpoint import Checkpoint
    from kestrel_core.formats.modelconfig import read_model_config
    from kestrel_core.formats.tensor_table import unit_specs
    from backends.cuda.host.staging import Filler
    from backends.cuda.host.tier import PinnedRing, slot_bytes
    from backends.cuda.layout import slot_entries

    dtype = getattr(torch, DTYPE_NAME)
    hows = ("mapping", "pread") + (("mapped",) if args.mapped else ())
    threads = args.threads
    path = args.model or models.ensure_preset(args.models, args.preset, layers=args.layers)
    cfg = read_model_config(path)
    if cfg.torch_dtype != DTYPE_NAME:
        raise BenchError(f"{path} is {cfg.torch_dtype}; host-fill stages a {DTYPE_NAME} checkpoint")
    entries = {spec.key: slot_entries(spec.tensors) for spec in unit_specs(cfg)}
    ckpt = Checkpoint(path)
    rows: list[dict] = []
    result = {"model": str(path), "threads": threads, "rounds": args.rounds, "dma_beside": args.dma,
              "slot_bytes": slot_bytes(entries.values(), dtype), "weight_bytes": models.weight_bytes(path), "rows": rows}
    filler = Filler(ckpt, direct=False)  # the hot path only: every page is cached
    try:
        for f in ckpt.files.values():  # warm the page cache: read every byte once
            with open(f.path, "rb") as fh:
                while fh.read(64 * 2**20):
                    pass
        for n in threads:
            ring = PinnedRing(3, slot_bytes(entries.values(), dtype), dtype, threads=n, pin=False)
            try:
                stage_all(entries, ring, filler, "pread", dtype)  # warm-up, not recorded
                if args.mapped:
                    stage_all(entries, ring, filler, "mapped", dtype)  # faults every page in, not recorded
                for rnd in range(args.rounds):
                    for how in (hows if rnd % 2 == 0 else hows[::-1]):
                        with Dma(args.dma) as dma:
                            seconds, nbytes = stage_all(entries, ring, filler, how, dtype)
                        rows.append({"threads": n, "round": rnd, "path": how, "seconds": seconds, "bytes": nbytes,
                                     "GBps": nbytes / seconds / 1e9, "dma_beside_GBps": dma.GBps})
                        log(f"threads {n} round {rnd} {how:8} {rows[-1]['GBps']:6.2f} GB/s"
                            + ("" if dma.GBps is None else f" dma beside {dma.GBps:6.2f} GB/s"))
                record.save_partial(result)
            finally:
                ring.close()
    finally:
        filler.close()
        ckpt.close()
    result["summary_GBps"] = {f"{h} {n} threads": summary([r["GBps"] for r in rows if r["path"] == h and r["threads"] == n])
                              for n in threads for h in hows}
    return result
