"""The host ring's hot path on its own: staging rate from the page cache, copied through the mapping or read with pread.

    python bench/host_fill_bench.py --models /tmp/models [--preset small-300m] [--rounds 3] [--threads 2,4]
    python bench/host_fill_bench.py --model /tmp/models/qwen3-8b --threads 4,8,14 [--mapped] [--dma]

(``--model`` takes a checkpoint already written, such as the one ``host_tier_bench.py`` writes.)

Every streamed unit of a checkpoint whose pages are in the page cache is staged into the slots of a
ring (unpinned here: the staging is host work, so this runs on a machine without a GPU), the two
ways side by side, interleaved round by round:

- **mapping**: each part copied from the safetensors mapping (faulting its pages in), then the
  unit's pages dropped from the mapping so the process's RSS does not grow with the model;
- **pread**: each part read with buffered ``pread`` straight into the slot (the page cache's copy;
  nothing mapped, nothing to drop). This is what the ring does for a part stored in the slot's dtype;
- **mapped** (``--mapped``): each part copied from the mapping with its pages left mapped, after an untimed
  pass that faulted them all in: a plain memory copy, the upper bound of a hot path that kept the model
  mapped (and so in the process's RSS).

``--dma`` runs, on a thread beside each timed pass, pinned host-to-device copies of 1 GiB back to back (as the
ring's uploads do beside its fill), and records the rate they kept: memory copies and DMA share the host's memory.

For each ``--threads`` count (the ring's fill threads), the record gives GB/s for each, per round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, write_record  # noqa: E402

from kestrel_core.checkpoint import Checkpoint  # noqa: E402
from kestrel_cuda.host.tier import PinnedRing, slot_bytes  # noqa: E402
from kestrel_core.tensor_table import unit_specs  # noqa: E402
from kestrel_core.modelconfig import read_model_config  # noqa: E402
from kestrel_core.presets import preset_config, write_checkpoint  # noqa: E402
from kestrel_cuda.host.staging import Filler  # noqa: E402
from kestrel_cuda.layout import slot_entries  # noqa: E402

DTYPE = torch.bfloat16


def stage_all(ckpt: Checkpoint, entries: dict, ring: PinnedRing, filler: Filler, path: str) -> tuple[float, int]:
    """Every unit staged once by ``path`` (pread, mapping, mapped); seconds and bytes."""
    t0 = time.perf_counter()
    total = 0
    for key, es in entries.items():
        slot = ring.acquire()
        ring.fill(slot, es, filler.sources(es, DTYPE if path == "pread" else None).__getitem__)
        if path == "mapping":
            filler.done(es)
        total += sum(e.nbytes(DTYPE) for e in es)
    return time.perf_counter() - t0, total


class Dma:
    """Pinned host -> device copies of 1 GiB back to back on a thread while in the ``with`` block; ``GBps`` after."""

    def __init__(self, on: bool):
        self.on, self.GBps = on, None
        if on:
            self.src = torch.empty(2**30, dtype=torch.uint8).pin_memory()
            self.dst = torch.empty(2**30, dtype=torch.uint8, device="cuda")
            self.stream = torch.cuda.Stream()

    def _run(self):
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", help="where to write (and find) the --preset checkpoint")
    ap.add_argument("--model", help="a bf16 checkpoint already written (instead of --models/--preset)")
    ap.add_argument("--preset", default="small-300m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="2", help="fill thread counts, comma-separated")
    ap.add_argument("--mapped", action="store_true", help="also copy from the mapping with its pages kept mapped")
    ap.add_argument("--dma", action="store_true", help="pinned host-to-device copies beside each pass (needs CUDA)")
    args = ap.parse_args()
    if args.dma and not torch.cuda.is_available():
        ap.error("--dma needs a CUDA device")
    paths = ("mapping", "pread") + (("mapped",) if args.mapped else ())
    threads = [int(t) for t in args.threads.split(",")]
    if args.model:
        path = Path(args.model)
    elif args.models:
        path = Path(args.models) / f"{args.preset}-bf16"
        if not (path / "config.json").is_file():
            write_checkpoint(preset_config(args.preset), path, seed=0)
    else:
        ap.error("give --models (with --preset) or --model")
    entries = {spec.key: slot_entries(spec.tensors) for spec in unit_specs(read_model_config(path))}
    ckpt = Checkpoint(path)
    rows = []
    filler = Filler(ckpt, direct=False)  # the hot path only: every page is cached
    try:
        for f in ckpt.files.values():  # warm the page cache: read every byte once
            with open(f.path, "rb") as fh:
                while fh.read(64 * 2**20):
                    pass
        for n in threads:
            ring = PinnedRing(3, slot_bytes(entries.values(), DTYPE), DTYPE, threads=n, pin=False)
            try:
                stage_all(ckpt, entries, ring, filler, "pread")  # warm-up, not recorded
                if args.mapped:
                    stage_all(ckpt, entries, ring, filler, "mapped")  # faults every page in, not recorded
                for rnd in range(args.rounds):
                    for path_ in (paths if rnd % 2 == 0 else paths[::-1]):
                        with Dma(args.dma) as dma:
                            seconds, nbytes = stage_all(ckpt, entries, ring, filler, path_)
                        rows.append({"threads": n, "round": rnd, "path": path_, "seconds": seconds, "bytes": nbytes,
                                     "GBps": nbytes / seconds / 1e9, "dma_beside_GBps": dma.GBps})
                        print(f"threads {n} round {rnd} {path_:8} {rows[-1]['GBps']:6.2f} GB/s"
                              + ("" if dma.GBps is None else f" dma beside {dma.GBps:6.2f} GB/s"), file=sys.stderr)
            finally:
                ring.close()
    finally:
        filler.close()
        ckpt.close()
    summary = {f"{p} {n} threads": statistics.median(r["GBps"] for r in rows if r["path"] == p and r["threads"] == n)
               for n in threads for p in paths}
    rec = {"model": path.name, "threads": threads, "rounds": args.rounds, "dma_beside": args.dma, "slot_bytes": slot_bytes(entries.values(), DTYPE),
           "model_bytes": sum(p.stat().st_size for p in path.glob("*.safetensors")), "rows": rows,
           "median_GBps": summary}
    print(write_record("host_fill", rec, [RESULTS])[0])
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
