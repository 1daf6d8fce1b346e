"""The cuda host tier: kestrel streaming at keep=1 through pinned host budgets, pages hot and dropped, against its
ceilings, on a GPU.

    python -m bench host-tier --models /tmp/models [--rows kestrel|peers|moe] [--piece-variants] [--tokens 6]

``--rows kestrel`` measures, side by side in one run: the pinned H2D copy rate; the disk's sequential O_DIRECT read
rate on the checkpoint's own filesystem; a pageable-to-pinned memcpy rate on 8 threads and on as many as the ring
fills a slot with; and kestrel at keep=1, prefetch 1, at host budgets of everything, 4 GiB and 1 GiB, each with the
checkpoint's pages in the page cache (hot: read through the cache first; each row records the share cached as it
starts) and with them dropped (cold: each ring row between two O_DIRECT reads of the largest shard, since a disk's
rate drifts over a run). ``--piece-variants`` adds the 1 GiB hot row with the parts read in pieces of 2, 4 and
16 MiB. ``--rows moe``: routed experts through the tier (the Qwen3-30B-A3B shape cut to ``--moe-layers``, keep=off,
expert_lru at the full depth's 2 GiB scaled), at budgets of everything, 1 GiB and 256 MiB, hot and cold;
``--moe-variants`` adds the 1 GiB hot row with the ring's small-unit measures taken back. ``--rows peers``: a kestrel
cold row at 1 GiB beside AirLLM (its split dropped before every step) and accelerate's disk_offload.

Each row keeps every decode step's time and mode; its figure is over its replayed steps, or its eager steps after
the first (``bench.rows``): with few tokens say so, since the all-pinned rows capture their second step. Bytes from
disk and from the page cache are the ring's counters (``memory_stats``) over the generate, per forward pass. Peak
RSS is sampled every 2 ms on a thread over the generate call, against the process's RSS before the run opened.
Each row loads the model afresh, so no staging of an earlier row is held while "before" is read.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import models, peers
from bench.errors import cuda_missing
from bench.log import log
from bench.prompt import prompt_for
from bench.rows import from_result
from bench.timing import copy_rates

PRESET = "qwen3-8b"
BUDGETS = (("all", 0), ("4 GiB", 4096), ("1 GiB", 1024))
MOE_PRESET, MOE_EXPERT_GIB = "qwen3-30b-a3b", 2
MOE_BUDGETS = (("all", 0), ("1 GiB", 1024), ("256 MiB", 256))
SLACK = 768 * 2**20  # the cold path's aligned scratch (8 MiB a fill thread, a landing buffer) and the threads' memory
MEASURES = ("expect", "batch")
PIECE_VARIANT = 2**20  # the smaller piece the MoE variants try: a 3 MiB expert part cut in three
DENSE_PIECES = (2 * 2**20, 4 * 2**20, 16 * 2**20)  # --piece-variants: around the ring's 8 MiB for a dense layer


def add_arguments(p) -> None:
    models.add_arguments(p)
    p.add_argument("--rows", choices=("kestrel", "peers", "moe"), default="kestrel")
    p.add_argument("--moe-layers", type=int, default=8)
    p.add_argument("--moe-variants", action="store_true")
    p.add_argument("--piece-variants", action="store_true")
    p.add_argument("--tokens", type=int, default=6, help="new tokens a row (the first decode step is left out)")


def needs_gpu(args) -> str | None:
    return cuda_missing()


def rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssPeak:
    """The process's peak RSS over a ``with`` block, sampled on a thread."""

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


def mem_available() -> int | None:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def cached_share(files) -> float | None:
    """The share of the files' pages in the page cache now (``cachestat``); None where it cannot be told."""
    from backends.cuda.host.pagecache import cached_pages

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
    """The O_DIRECT read rate of ``shard``'s first ``nbytes`` now, on 8 threads, GB/s (read at the start of a run
    and on each side of a cold ring row: this disk's rate drifts over a run)."""
    from backends.cuda.host.diskread import sequential_read_rate
    from backends.cuda.host.pagecache import drop_cache

    drop_cache(shard)
    return sequential_read_rate(shard, nbytes=nbytes, threads=8) / 1e9


def run_checkpoint(run):
    """The mapped checkpoint the cuda backend streams from (its own attribute: the cold rows drop its pages)."""
    ckpt = getattr(run.backend, "ckpt", None)
    if ckpt is None:
        from bench.errors import BenchError

        raise BenchError("the cuda backend no longer exposes its checkpoint as run.backend.ckpt: update host_tier.py")
    return ckpt


def kestrel_row(path: Path, label: str, budget_mb: int, cold: bool, tokens: int, **settings) -> dict:
    """One row at host budget ``budget_mb`` (0: the default); ``settings`` override keep=1, prefetch 1. A cold ring
    row measures the O_DIRECT ceiling just before and just after it."""
    import torch
    from kestrel_core import load
    from backends.cuda.host.pagecache import drop_checkpoint

    settings = {"backend": "cuda", "keep": 1, "prefetch": 1, "host_budget_mb": budget_mb, **settings}
    gc.collect()
    before = rss()
    with load(path) as model, model.open(**settings) as run:
        ckpt = run_checkpoint(run)
        files = [f.path for f in ckpt.files.values()]
        shard = max(files, key=os.path.getsize)
        ring = "host_ring_hot_bytes" in run.backend.memory_stats()
        ceiling_before = odirect_ceiling(shard) if cold and ring else None
        dropped_s = None
        if cold:
            t0 = time.perf_counter()
            drop_checkpoint(ckpt)
            dropped_s = time.perf_counter() - t0
        share = cached_share(files)
        stats_before = run.backend.memory_stats()
        with RssPeak() as peak:
            res = run.generate(prompt_ids=prompt_for(model.config.vocab_size), max_new_tokens=tokens,
                               stop_at_eos=False)
        ceiling_after = odirect_ceiling(shard) if ceiling_before is not None else None
    r = from_result(res, label, settings)
    passes = 1 + len(res.decode_ms)
    moved = {k: (res.memory.get(k, 0) - stats_before.get(k, 0)) / passes
             for k in ("host_ring_hot_bytes", "host_ring_cold_bytes", "host_ring_disk_read_bytes")}
    p50 = r["summary"]["p50"]
    r.update(host_budget_mb=budget_mb, mode="ring" if ring else "all", host_budget_bytes=res.memory.get("host_budget_bytes"),
             host_pinned_bytes=res.memory.get("host_pinned_bytes"), cold=cold, drop_s=dropped_s,
             upload_GBps=r["bytes_uploaded_per_token"] / p50 / 1e6 if p50 else None,
             bytes_from_page_cache_per_pass=moved["host_ring_hot_bytes"],
             bytes_from_disk_per_pass=moved["host_ring_cold_bytes"],
             disk_bytes_read_per_pass=moved["host_ring_disk_read_bytes"],
             disk_GBps=moved["host_ring_disk_read_bytes"] / p50 / 1e6 if p50 else None,
             rss_before_open_bytes=before, peak_rss_bytes=peak.peak, peak_rss_over_before_bytes=peak.peak - before,
             slack_bytes=SLACK, page_cache_share_before=share,
             odirect_adjacent_GBps=None if ceiling_before is None else [ceiling_before, ceiling_after])
    if ceiling_before is not None:
        r["disk_vs_adjacent_ceiling"] = r["disk_GBps"] / statistics.fmean([ceiling_before, ceiling_after])
    log(f"{label:30} p50 {p50:9.2f} ms (n={r['summary']['n']} {r['steady_mode']}) "
        f"{r['bytes_uploaded_per_token'] / 1e9:6.2f} GB/tok {r['upload_GBps']:6.1f} GB/s "
        f"pinned {(r['host_pinned_bytes'] or 0) / 2**30:6.2f} GiB rss+ {r['peak_rss_over_before_bytes'] / 2**30:6.2f} GiB")
    torch.cuda.empty_cache()
    return r


@contextlib.contextmanager
def staging_variant(off: tuple[str, ...] = (), piece: int | None = None):
    """The ring's staging with some of its small-unit measures taken back: ``expect`` stages a plan's units only on
    demand, ``batch`` stages one unit at a time; ``piece`` reads the parts in pieces of that many bytes."""
    from backends.cuda.host.staging import PartRead, Stager

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
    """Read the checkpoint's files through the page cache (a hot row after a cold one finds its pages there)."""
    t0 = time.perf_counter()
    for f in sorted(Path(path).glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            while fh.read(64 * 2**20):
                pass
    return time.perf_counter() - t0


def with_ids(rows: list[dict]) -> list[dict]:
    ref = rows[0]["token_ids"]
    for r in rows:
        r["ids_match_first_row"] = r["token_ids"] == ref
    return rows


def moe_rows(root: Path, layers: int, tokens: int, variants: bool) -> dict:
    from kestrel_core.tools.presets import preset_config
    from backends.cuda.host.staging import PartRead

    path = models.ensure_preset(root, MOE_PRESET, layers=layers)
    full = preset_config(MOE_PRESET).num_hidden_layers
    flags = dict(keep="off", expert_policy="expert_lru", prefetch=0,
                 expert_budget_mb=MOE_EXPERT_GIB * 1024 * layers / full)
    out: dict = {"path": str(path), "layers": layers, "full_depth_layers": full,
                 "expert_budget_full_depth_gib": MOE_EXPERT_GIB, "weight_bytes": models.weight_bytes(path), "rows": []}
    log(f"page cache warmed in {warm_cache(path):.1f} s")
    kestrel_row(path, "moe warm-up (not recorded)", 1024, False, 3, **flags)
    for name, mb in MOE_BUDGETS:
        out["rows"].append(kestrel_row(path, f"moe {name} hot", mb, False, tokens, **flags))
    if variants:  # the 1 GiB hot row again, before any cold row: each measure taken back, all of them, small pieces
        for off, piece in [((m,), None) for m in MEASURES] + [(MEASURES, None), ((), PIECE_VARIANT)]:
            label = f"without {' '.join(off)}" if off else f"{piece // 2**20} MiB pieces"
            with staging_variant(off, piece):
                r = kestrel_row(path, f"moe 1 GiB hot, {label}", 1024, False, tokens, **flags)
            r.update(measures_off=list(off), piece_bytes=piece or PartRead.PIECE)
            out["rows"].append(r)
    for name, mb in MOE_BUDGETS:
        out["rows"].append(kestrel_row(path, f"moe {name} cold", mb, True, tokens, **flags))
    with_ids(out["rows"])
    return out


def memcpy_rate(nbytes: int = 2**30, threads: int = 8) -> dict:
    """Pageable -> pinned, ``threads`` copies side by side (torch's copy releases the GIL); every pass's seconds."""
    import torch

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
    return {"threads": threads, "seconds": times, "GBps": step * threads / statistics.median(times) / 1e9}


def ceilings(path: Path) -> dict:
    from backends.cuda.host.tier import fill_threads

    out = copy_rates()
    shard = max(Path(path).glob("*.safetensors"), key=lambda p: p.stat().st_size)
    out["odirect_read_GBps"] = odirect_ceiling(shard, nbytes=4 * 2**30)
    out["odirect_file"] = shard.name
    out["memcpy_pageable_to_pinned"] = [memcpy_rate(threads=n) for n in sorted({8, fill_threads()})]
    log(f"ceilings: pinned {out['pinned_h2d']['GBps']:.1f} GB/s, O_DIRECT {out['odirect_read_GBps']:.2f} GB/s")
    return out


def peer_rows(path: Path, tokens: int, root: Path) -> dict:
    import torch

    out: dict = {"kestrel_cold_1GiB": kestrel_row(path, "kestrel 1 GiB cold (beside the peers)", 1024, True, tokens)}
    prompt = out["kestrel_cold_1GiB"]["prompt_ids"]
    out["airllm_cold"] = peers.peer("airllm", path, prompt, 4, scratch_root=root, drop_cache_each_step=True)
    torch.cuda.empty_cache()
    out["accelerate_disk_offload"] = peers.peer("accelerate-disk", path, prompt, tokens, scratch_root=root)
    for key in ("airllm_cold", "accelerate_disk_offload"):
        r = out[key]
        if "token_ids" in r:
            n = min(len(r["token_ids"]), len(out["kestrel_cold_1GiB"]["token_ids"]))
            r["ids_match_kestrel"] = r["token_ids"][:n] == out["kestrel_cold_1GiB"]["token_ids"][:n]
    return out


def run(args, record) -> dict:
    os.environ.pop("KESTREL_HOST_MB", None)  # it would beat the rows' own budgets
    root = Path(args.models)
    root.mkdir(parents=True, exist_ok=True)
    if args.rows == "moe":
        result = {"preset": MOE_PRESET, "tokens": args.tokens, "rows_kind": "moe", "ceilings": copy_rates()}
        result["moe"] = moe_rows(root, args.moe_layers, args.tokens, args.moe_variants)
        return result
    path = models.ensure_preset(root, PRESET)
    result: dict = {"preset": PRESET, "keep": 1, "prefetch": 1, "tokens": args.tokens, "rows_kind": args.rows,
                    "weight_bytes": models.weight_bytes(path),
                    "mem_total_bytes": os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")}
    result["ceilings"] = ceilings(path)
    result["mem_available_bytes_before_rows"] = mem_available()
    result["page_cache_warmed_s"] = warm_cache(path)  # the ceilings dropped a shard; the hot rows need every page
    kestrel_row(path, "warm-up (not recorded)", 1024, False, 3)
    if args.rows == "peers":
        result["peers"] = peer_rows(path, args.tokens, root)
        return result
    rows: list[dict] = []
    result["rows"] = rows
    for name, mb in BUDGETS:
        rows.append(kestrel_row(path, f"{name} hot", mb, False, args.tokens))
    for piece in DENSE_PIECES if args.piece_variants else ():  # before any cold row, on the same warm cache
        with staging_variant(piece=piece):
            r = kestrel_row(path, f"1 GiB hot, {piece // 2**20} MiB pieces", 1024, False, args.tokens)
        r["piece_bytes"] = piece
        rows.append(r)
    record.save_partial(result)
    for name, mb in BUDGETS:  # a cold row's drop leaves the cache empty, and O_DIRECT keeps it so
        rows.append(kestrel_row(path, f"{name} cold", mb, True, args.tokens))
        record.save_partial(result)
    with_ids(rows)
    return result
