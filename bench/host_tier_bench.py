"""The host tier on a GPU: kestrel streaming at keep=1 through pinned host budgets, hot and cold, against its ceilings.

    python bench/host_tier_bench.py --models /tmp/models [--rows kestrel|peers|moe] [--piece-variants] [--tokens 6] [--out DIR]

``--rows kestrel`` measures, side by side in one run: the pinned H2D copy rate; the disk's
sequential O_DIRECT read rate on the checkpoint's own filesystem; a pageable-to-pinned memcpy rate
on 8 threads and on as many as the ring fills a slot with (``fill_threads``); and kestrel at keep=1, prefetch 1, at host budgets of everything, 4 GiB and
1 GiB, each with the checkpoint's pages in the page cache (hot: the files are read through the cache
first, and each row records the share of their pages cached as it starts) and with them dropped
(cold: each ring row between two O_DIRECT reads of the largest shard, 2 GiB on 8 threads, since this
disk's rate drifts over a run; the row gives its disk rate against their mean).
``--piece-variants`` adds, before the cold rows, the 1 GiB hot row with the parts read in pieces of
2, 4 and 16 MiB instead of the ring's 8 MiB.

Cold: the pages are dropped from the mapping and the cache (``POSIX_FADV_DONTNEED``) once the run is
open, before the prompt. The ring's cold path reads with O_DIRECT, which leaves nothing in the
cache, so every token after that reads from disk too; the row's counters show how its bytes came
(``host_cold_bytes`` against ``host_hot_bytes`` a token). An all-pinned run never reads the file
after load, so its cold row reads nothing and shows that.

``--rows moe`` measures Mixture-of-Experts through the host tier: the Qwen3-30B-A3B shape cut to
``--moe-layers`` layers (each with the full model's shapes), keep=off with expert_lru at the full
depth's 2 GiB scaled to the cut, so each layer's own unit stays on the device and every routed
expert that misses is staged and uploaded; at host budgets of everything, 1 GiB and 256 MiB, hot and cold.
``--moe-variants`` adds, before the cold rows, the 1 GiB hot row with the ring's small-unit measures
(``Stager.expect``, small units staged side by side) taken back one at a time and together, and with
the parts read in 1 MiB pieces instead of whole.

``--rows peers`` measures a kestrel cold row at 1 GiB again beside AirLLM (its per-layer shards
dropped from the cache before every step, so that it reads the same cold disk) and accelerate's
``disk_offload`` (an offload folder of memmapped weights; its pages are as the run leaves them:
accelerate keeps them mapped, so they cannot be dropped).

Peak RSS is sampled every 2 ms on a thread, from /proc/self/statm, over the generate call; the
record gives it against the process's RSS before the run opened, the host budget and the slack.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, copy_ceilings, utc_stamp, write_record  # noqa: E402

from kestrel_core.config import GenerationConfig, KestrelConfig  # noqa: E402
from kestrel_cuda.host.diskread import sequential_read_rate  # noqa: E402
from kestrel_core.engine import Model, open_run  # noqa: E402
from kestrel_core.generate import generate  # noqa: E402
from kestrel_core.host import meminfo  # noqa: E402
from kestrel_cuda.host.tier import HOST_ENV, fill_threads  # noqa: E402
from kestrel_cuda.host.pagecache import cached_pages, drop_cache, drop_checkpoint  # noqa: E402
from kestrel_core.presets import preset_config, write_checkpoint  # noqa: E402
from kestrel_cuda.host.staging import PartRead, Stager  # noqa: E402

PRESET = "qwen3-8b"
PROMPT = [785, 3974, 13876, 38835, 34208, 916, 279, 15678]
BUDGETS = (("all", 0), ("4 GiB", 4096), ("1 GiB", 1024))
MOE_PRESET, MOE_EXPERT_GIB = "qwen3-30b-a3b", 2
MOE_BUDGETS = (("all", 0), ("1 GiB", 1024), ("256 MiB", 256))
SLACK = 768 * 2**20  # the cold path's aligned scratch (8 MiB a fill thread, a landing buffer for parts read whole) and the threads' own memory


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ensure_model(root: Path) -> Path:
    path = root / PRESET
    if not (path / "config.json").is_file():
        log(f"writing {path}")
        write_checkpoint(preset_config(PRESET), path, seed=0, device="cuda")
    return path


def rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssPeak:
    def __init__(self, every: float = 0.002):
        self.every, self.peak, self._stop = every, 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(self.every)

    def __enter__(self):
        self.peak = rss()
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss())


def drop_checkpoint(ckpt) -> float:
    """Every page of the checkpoint out of the mapping and the cache; the seconds it took."""
    t0 = time.perf_counter()
    drop_checkpoint(ckpt)
    return time.perf_counter() - t0


def cached_share(files) -> float | None:
    """The share of the checkpoint's file pages in the page cache now (``cachestat``); None where it cannot be told."""
    cached = pages = 0
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            got = cached_pages(fd, 0, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        if got is None:
            return None
        cached, pages = cached + got[0], pages + got[1]
    return cached / max(pages, 1)


def odirect_ceiling(shard: Path, nbytes: int = 2 * 2**30) -> float:
    """The O_DIRECT read rate of ``shard``'s first ``nbytes`` now, on 8 threads, GB/s. Read at the start of a run and
    on each side of a cold ring row, since this disk's rate drifts over a run (1.66 GB/s at the start of
    ``host_tier_20261204T182017Z``, 0.80 to 1.52 GB/s beside its cold rows)."""
    drop_cache(shard)
    return sequential_read_rate(shard, nbytes=nbytes, threads=8) / 1e9


def kestrel_row(model: Model, label: str, budget_mb: int, cold: bool, tokens: int, **flags) -> dict:
    """One row at host budget ``budget_mb`` (0: the default); ``flags`` override keep=1, prefetch 1. A cold row
    that reads from disk measures the O_DIRECT ceiling just before and just after it."""
    settings = dict(backend__name="cuda", residency__keep=1, backend__prefetch=1, backend__host_budget_mb=budget_mb)
    cfg = KestrelConfig().override(**{**settings, **flags})
    if budget_mb:  # a ring's open hands back an all-pinned row's staging: hand it back first, so "before" excludes it
        model.host.clear()
    gc.collect()
    before = rss()
    with open_run(model, cfg) as run:
        files = [f.path for f in run.backend.ckpt.files.values()]
        shard = max(files, key=lambda f: os.path.getsize(f))
        tier = run.backend.host_budget
        ceiling_before = odirect_ceiling(shard) if cold and tier.mode == "ring" else None
        dropped_s = drop_checkpoint(run.backend.ckpt) if cold else None
        share = cached_share(files)
        with RssPeak() as peak:
            r = generate(run, PROMPT, GenerationConfig(max_new_tokens=tokens, stop_at_eos=False))
        ceiling_after = odirect_ceiling(shard) if ceiling_before is not None else None
    steady = r.per_token[1:]  # the first decode step warms the pool
    mean = lambda k: statistics.fmean(p[k] for p in steady)  # noqa: E731
    ms = statistics.median(r.decode_ms[1:])
    up = mean("bytes_uploaded")
    row = {"label": label, "host_budget_mb": budget_mb, "mode": tier.mode, "host_budget_bytes": tier.bytes,
           "cold": cold, "drop_s": dropped_s, "ms_per_token": ms, "decode_ms": r.decode_ms, "prefill_ms": r.prefill_ms,
           "bytes_uploaded_per_token": up, "upload_GBps": up / ms / 1e6,
           "bytes_from_disk_per_token": mean("host_cold_bytes"), "disk_bytes_read_per_token": mean("disk_bytes_read"),
           "bytes_from_page_cache_per_token": mean("host_hot_bytes"),
           "peak_host_pinned_bytes": r.counters["peak_host_pinned_bytes"],
           "rss_before_open_bytes": before, "peak_rss_bytes": peak.peak, "peak_rss_over_before_bytes": peak.peak - before,
           "slack_bytes": SLACK, "rss_bound_bytes": tier.bytes + SLACK, "steps": r.steps, "token_ids": r.token_ids,
           "expert_misses_per_token": mean("expert_misses"), "settings": {k: str(v) for k, v in flags.items()},
           "page_cache_share_before": share, "disk_GBps": mean("disk_bytes_read") / ms / 1e6,
           "odirect_adjacent_GBps": None if ceiling_before is None else [ceiling_before, ceiling_after]}
    if ceiling_before is not None:
        row["disk_vs_adjacent_ceiling"] = row["disk_GBps"] / statistics.fmean([ceiling_before, ceiling_after])
    log(f"{label:30} {ms:9.2f} ms/tok {up / 1e9:6.2f} GB/tok {row['upload_GBps']:6.1f} GB/s disk "
        f"{row['bytes_from_disk_per_token'] / 1e9:6.2f} GB/tok cache {row['bytes_from_page_cache_per_token'] / 1e9:6.2f} "
        f"pinned {row['peak_host_pinned_bytes'] / 2**30:6.2f} GiB rss+ {row['peak_rss_over_before_bytes'] / 2**30:6.2f} GiB"
        + ("" if share is None else f" cached {share:.2f}")
        + ("" if ceiling_before is None else f" ceiling {ceiling_before:.2f}/{ceiling_after:.2f} GB/s "
           f"ratio {row['disk_vs_adjacent_ceiling']:.2f}"))
    torch.cuda.empty_cache()
    return row


MEASURES = ("expect", "batch")
PIECE_VARIANT = 2**20  # the smaller piece the variants try: a 3 MiB expert part cut in three
DENSE_PIECES = (2 * 2**20, 4 * 2**20, 16 * 2**20)  # --piece-variants: pieces around the ring's 8 MiB for a dense layer


@contextlib.contextmanager
def staging_variant(off: tuple[str, ...] = (), piece: int | None = None):
    """The ring's staging with some of its small-unit measures taken back, for a row that measures without them:
    ``expect`` stages a plan's units only on demand, ``batch`` stages one unit at a time; ``piece`` reads the parts
    in pieces of that many bytes (the ring's is ``PartRead.PIECE``: an expert's parts whole)."""
    saved = PartRead.PIECE, Stager.expect, Stager.BATCH_BYTES
    if piece:
        PartRead.PIECE = piece
    if "expect" in off:
        Stager.expect = lambda self, keys: None
    if "batch" in off:
        Stager.BATCH_BYTES = 1
    try:
        yield
    finally:
        PartRead.PIECE, Stager.expect, Stager.BATCH_BYTES = saved


def warm_cache(path: Path) -> float:
    """Read the checkpoint's files through the page cache (a hot row after a cold one finds its pages there); seconds."""
    t0 = time.perf_counter()
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            while fh.read(64 * 2**20):
                pass
    return time.perf_counter() - t0


def moe_rows(root: Path, layers: int, tokens: int, variants: bool = False) -> dict:
    """The Qwen3-30B-A3B shape cut to ``layers`` layers, keep=off with expert_lru at the full depth's 2 GiB scaled to
    the cut: the layers' own units stay on the device and the routed experts that miss stream through the host tier,
    at each of ``MOE_BUDGETS``, hot and cold."""
    path = root / f"{MOE_PRESET}-L{layers}"
    if not (path / "config.json").is_file():
        log(f"writing {path}")
        write_checkpoint(preset_config(MOE_PRESET, layers=layers), path, seed=0, device="cuda")
    full = preset_config(MOE_PRESET).num_hidden_layers
    flags = dict(residency__keep="off", residency__expert_policy="expert_lru", backend__prefetch=0,
                 residency__expert_budget_mb=MOE_EXPERT_GIB * 1024 * layers / full)
    out: dict = {"path": path.name, "layers": layers, "full_depth_layers": full, "expert_budget_full_depth_gib": MOE_EXPERT_GIB,
                 "model_bytes": sum(p.stat().st_size for p in path.glob("*.safetensors")), "rows": []}
    with Model(path) as model:
        log(f"page cache warmed in {warm_cache(path):.1f} s")
        kestrel_row(model, "moe warm-up (not recorded)", 1024, False, 3, **flags)
        for name, mb in MOE_BUDGETS:
            out["rows"].append(kestrel_row(model, f"moe {name} hot", mb, False, tokens, **flags))
        if variants:  # the 1 GiB hot row again, before any cold row: each measure taken back, all of them, small pieces
            cases = [((m,), None) for m in MEASURES] + [(MEASURES, None), ((), PIECE_VARIANT)]
            for off, piece in cases:
                label = f"without {' '.join(off)}" if off else f"{piece // 2**20} MiB pieces"
                with staging_variant(off, piece):
                    row = kestrel_row(model, f"moe 1 GiB hot, {label}", 1024, False, tokens, **flags)
                row.update(measures_off=list(off), piece_bytes=piece or PartRead.PIECE)
                out["rows"].append(row)
        for name, mb in MOE_BUDGETS:
            out["rows"].append(kestrel_row(model, f"moe {name} cold", mb, True, tokens, **flags))
    ref = out["rows"][0]["token_ids"]
    for row in out["rows"]:
        row["ids_match_all_hot"] = row["token_ids"] == ref
    return out


def memcpy_rate(nbytes: int = 2**30, threads: int = 8) -> float:
    """Pageable -> pinned, ``threads`` copies side by side (torch's copy releases the GIL), bytes/s."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    step = nbytes // threads
    parts = [(dst[i * step:(i + 1) * step], src[i * step:(i + 1) * step]) for i in range(threads)]
    with ThreadPoolExecutor(threads) as pool:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            list(pool.map(lambda p: p[0].copy_(p[1]), parts))
            times.append(time.perf_counter() - t0)
    return step * threads / statistics.median(times)


def ceilings(path: Path) -> dict:
    out = copy_ceilings()
    shard = max(path.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    out["odirect_read_GBps"] = odirect_ceiling(shard, nbytes=4 * 2**30)
    out["odirect_file"] = shard.name
    for n in sorted({8, fill_threads()}):  # 8, and as many as the ring fills a slot with here
        out[f"memcpy_pageable_to_pinned_GBps_{n}_threads"] = memcpy_rate(threads=n) / 1e9
    log(f"ceilings: {out}")
    return out


def peer_rows(path: Path, model: Model, tokens: int, models_dir: Path) -> dict:
    out: dict = {"kestrel_cold_1GiB": kestrel_row(model, "kestrel 1 GiB cold (beside the peers)", 1024, True, tokens)}
    try:
        import airllm_peer

        scratch = Path(tempfile.mkdtemp(prefix="airllm-scratch-", dir=models_dir))
        out["airllm_cold"] = airllm_peer.airllm_row(str(path), PROMPT, 4, str(scratch), drop_cache_each_step=True)
        shutil.rmtree(scratch, ignore_errors=True)
        log(f"airllm cold: {out['airllm_cold'].get('ms_per_token')} {out['airllm_cold'].get('error', '')}")
    except Exception as exc:  # a peer that cannot run is recorded, not fatal
        out["airllm_cold"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    gc.collect()
    torch.cuda.empty_cache()
    try:
        out["accelerate_disk_offload"] = accelerate_disk_offload(path, tokens, models_dir)
        log(f"accelerate disk_offload: {out['accelerate_disk_offload'].get('ms_per_token')}")
    except Exception as exc:
        out["accelerate_disk_offload"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    return out


def accelerate_disk_offload(path: Path, tokens: int, models_dir: Path) -> dict:
    import accelerate
    import moe_peers

    folder = Path(tempfile.mkdtemp(prefix="offload-", dir=models_dir))
    try:
        model = moe_peers._load(path, torch.bfloat16)
        accelerate.disk_offload(model, str(folder), execution_device=0)
        ids, times, prefill = moe_peers._decode(model, PROMPT, tokens, "cuda", warmup=False)
        row = moe_peers._row("accelerate disk_offload", ids, times[1:], prefill, moe_peers._peak("cuda"),
                             offload_folder_bytes=sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()))
        del model
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        gc.collect()
        torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", required=True)
    ap.add_argument("--rows", choices=("kestrel", "peers", "moe"), default="kestrel")
    ap.add_argument("--moe-layers", type=int, default=8, help="--rows moe: the layers of the Qwen3-30B-A3B shape kept")
    ap.add_argument("--moe-variants", action="store_true",
                    help="--rows moe: the 1 GiB hot row again with each small-unit measure taken back, and all")
    ap.add_argument("--piece-variants", action="store_true",
                    help="--rows kestrel: the 1 GiB hot row again with the parts read in pieces of each of DENSE_PIECES")
    ap.add_argument("--tokens", type=int, default=6, help="new tokens a row (the first decode step is left out)")
    ap.add_argument("--out", action="append", default=[])
    args = ap.parse_args()
    os.environ.pop(HOST_ENV, None)
    root = Path(args.models)
    root.mkdir(parents=True, exist_ok=True)
    outs = [RESULTS] + [Path(d) for d in args.out]
    stamp = utc_stamp()
    if args.rows == "moe":
        rec = {"preset": MOE_PRESET, "tokens": args.tokens, "rows_kind": "moe", "ceilings": copy_ceilings(),
               "moe": moe_rows(root, args.moe_layers, args.tokens, args.moe_variants)}
        for p in write_record("host_tier", rec, outs, stamp):
            log(f"wrote {p}")
        return 0
    path = ensure_model(root)
    rec: dict = {"preset": PRESET, "keep": 1, "prefetch": 1, "tokens": args.tokens, "rows_kind": args.rows,
                 "model_bytes": sum(p.stat().st_size for p in path.glob("*.safetensors")),
                 "mem_total_bytes": os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")}
    rec["ceilings"] = ceilings(path)
    rec["mem_available_bytes_before_rows"] = meminfo().get("MemAvailable", 0)
    with Model(path) as model:
        rec["page_cache_warmed_s"] = warm_cache(path)  # the ceilings dropped a shard; the hot rows need every page
        kestrel_row(model, "warm-up (not recorded)", 1024, False, 3)
        if args.rows == "kestrel":
            rows = []
            for name, mb in BUDGETS:
                rows.append(kestrel_row(model, f"{name} hot", mb, False, args.tokens))
            for piece in DENSE_PIECES if args.piece_variants else ():  # before any cold row, on the same warm cache
                with staging_variant(piece=piece):
                    row = kestrel_row(model, f"1 GiB hot, {piece // 2**20} MiB pieces", 1024, False, args.tokens)
                row["piece_bytes"] = piece
                rows.append(row)
            rec["rows"] = rows
            write_record("host_tier", rec, outs, stamp)
            for name, mb in BUDGETS:  # a cold row's drop leaves the cache empty, and O_DIRECT keeps it so
                rows.append(kestrel_row(model, f"{name} cold", mb, True, args.tokens))
                write_record("host_tier", rec, outs, stamp)
            ref = rows[0]["token_ids"]
            for row in rows:
                row["ids_match_all_hot"] = row["token_ids"] == ref
        else:
            rec["peers"] = peer_rows(path, model, args.tokens, root)
    for p in write_record("host_tier", rec, outs, stamp):
        log(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
