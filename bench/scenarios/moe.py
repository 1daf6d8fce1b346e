"""Mixture-of-Experts: kestrel's expert cache against everything resident, whole-layer streaming and the peers, on
the Qwen3-30B-A3B shape.

    python -m bench moe --models /tmp/m --layers 8 [--tokens 41] [--warmup 12] [--skew 1.2] [--q8-group 64]
    python -m bench moe --backend cpu_ref --preset tiny-moe --layers 4 --tokens 8 --warmup 2 --peers ""   # on the CPU
    python -m bench moe --models /tmp/m --layers 48 --gguf q4_k --skew 0 --q8-group 0 --peers ""   # full depth, 4-bit

``--layers`` cuts the depth (a device's disk holds about one full model); every layer keeps the full model's shapes,
so per-layer and per-token-per-layer figures are the full model's. The expert budgets are the full-depth 2, 4 and
8 GiB scaled by layers/full depth, so the cache holds the same share of each layer's experts as at full depth.

One run measures, side by side: the pinned copy rate and the HBM floor (cuda: one token's active weights, attention,
router, the routed experts and lm_head, read once by F.linear in a CUDA graph); `off` (every unit resident); the expert
cache at each budget with expert_lru and expert_lfu on each decode path of ``--decode`` (``table``: the step reads its
experts through the expert table and never waits for the host, lands each miss in a free slot as it reads it, and
copies those past the ring into staging slots; ``table-unstaged``: the same with expert_staging off, the misses past
the ring read in place; ``table-twice``: the same with expert_landing off, the policy uploading a step's misses again
a step later, the path before landing; ``host``: the host routes each sparse layer and fetches
before use, also with speculative prefetch), on the uniform router (random weights: the worst case for any cache) and on
a Zipf-skewed one (``--skew``); whole-layer streaming (asymmetric keep=1, every expert with its layer); q8 experts
(``--q8-group``); and the peers (transformers resident, accelerate with the experts on the CPU, AirLLM) on the same
weights, last (a peer may leave threads behind). Each cache row has its stream bound: the bytes that cross a token, a
miss counted once (a table row's admissions re-read the misses its steps read from host copies: counted apart), over
the pinned copy rate.

A row's figure is over the decode steps after the first ``--warmup`` (the cache fills); every step's time stays in
the row. Also per row: bytes uploaded a token, hit rate, prefetch recall, the streamed bytes resident at each decode
boundary (an observer), allocations after warm-up, and whether its ids equal `off`'s.
"""

from __future__ import annotations

import gc

from bench import llama_cpp, models, peers
from bench.errors import cuda_backend_missing
from bench.log import log
from bench.observe import observing
from bench.prompt import prompt_for
from bench.rows import compare_ids, row
from bench.timing import copy_rates
from kestrel_core.engine.plan import bytes_streamed
from kestrel_core.hookspecs import hookimpl

FULL_BUDGETS_GIB = (2, 4, 8)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
BIG = 120_000  # MiB of weight-cache budget: every row fits; the expert budget is what bounds the experts


def add_arguments(p) -> None:
    models.add_arguments(p)
    p.add_argument("--preset", default="qwen3-30b-a3b", help="a MoE preset (tiny-moe with --backend cpu_ref)")
    p.add_argument("--backend", default="cuda", choices=("cuda", "cpu_ref"))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=41, help="new tokens of each kestrel row")
    p.add_argument("--warmup", type=int, default=12, help="decode steps left out of the steady-state figures (0: none)")
    p.add_argument("--slow-tokens", type=int, default=18, help="new tokens of the slow rows (whole layers, peers)")
    p.add_argument("--skew", type=float, default=1.2, help="Zipf exponent of the skewed router (0: no skewed rows)")
    p.add_argument("--q8-group", type=int, default=64, help="q8 group size (0: no q8 rows)")
    p.add_argument("--decode", default="table,table-twice,host",
                   help="decode paths of the cache rows: table (misses landed, the rest staged), table-unstaged (the "
                        "rest read in place), table-twice (admitted a step later), host")
    models.add_gguf_argument(p)  # the uniform rows only: no skewed, q8 or peer rows
    p.add_argument("--rows", choices=("all", "off"), default="all",
                   help="off: each section's off row alone (no cache or whole-layer rows, no targets)")
    llama_cpp.add_argument(p)
    p.add_argument("--peers", default=None,
                   help="comma-separated (default on cuda: transformers,accelerate-experts,airllm; on cpu_ref none)")


def needs_gpu(args) -> str | None:
    return cuda_backend_missing(args, "--backend cpu_ref --preset tiny-moe --layers 4")


class DecodeResidency:
    """Streamed bytes resident at each decode boundary (after the layer before's experts and guesses came in)."""

    def __init__(self):
        self.seen: list[int] = []

    @hookimpl
    def on_layer_advance(self, window, layer, phase):
        if phase == "decode":
            self.seen.append(window.resident_bytes)


def unit_bytes(run, res) -> dict:
    """A layer's own units' bytes and the largest expert's, from the run's unit table."""
    units = run.backend.units
    return {"own_unit_bytes": sum(u.nbytes for u in units.own()),
            "expert_bytes": max((u.nbytes for u in units.experts()), default=0)}


def kestrel_row(model, args, label: str, tokens: int, warmup: int, **settings) -> dict:
    settings = {"backend": args.backend, "budget_mb": BIG, **settings}
    if args.backend != "cuda":
        settings.pop("budget_mb")
        settings["prefetch"] = 0
    watch = DecodeResidency()
    with observing(watch):
        r = row(model, settings, prompt_for(model.config.vocab_size), tokens, label=label, warmup=warmup,
                inspect=unit_bytes)
    steady = [r["per_token"][i] for i in r["steady_steps"]]
    hits, misses = sum(p["expert_hits"] for p in steady), sum(p["expert_misses"] for p in steady)
    guessed = sum(p["expert_guessed"] for p in steady)
    n_layers = model.config.num_hidden_layers
    r.update(
        expert_policy=settings.get("expert_policy") or None, expert_prefetch=bool(settings.get("expert_prefetch")),
        expert_fetch=settings.get("expert_fetch", "routed"),
        expert_budget_bytes=int(settings.get("expert_budget_mb", 0) * 2**20),
        hit_rate=hits / (hits + misses) if hits + misses else None,
        prefetch_recall=sum(p["expert_guess_hits"] for p in steady) / guessed if guessed else None,
        expert_misses_per_token=sum(p["expert_misses"] for p in steady) / max(1, len(steady)),
        expert_prefetches_per_token=sum(p["expert_prefetches"] for p in steady) / max(1, len(steady)),
        # through the table a miss is read from its host copy in the step, then again by its admission (a re-read)
        bytes_read_host_per_token=sum(p["bytes_read_host"] for p in steady) / max(1, len(steady)),
        bytes_reread_per_token=sum(p["bytes_reread"] for p in steady) / max(1, len(steady)),
        expert_landed_per_token=sum(p["expert_landed"] for p in steady) / max(1, len(steady)),
        bytes_streamed_per_token=sum(bytes_streamed(p) for p in steady) / max(1, len(steady)),
        peak_streamed_bytes_decode=max(watch.seen[warmup * n_layers:], default=0),
        allocations_after_warmup=sum(p["allocations"] for p in steady),
        mapping_rss_bytes=r["memory"].get("mapping_rss_bytes"))
    hr = f"{100 * r['hit_rate']:5.1f}%" if r["hit_rate"] is not None else "  -   "
    p50 = f"{r['summary']['p50']:8.2f}" if r["summary"]["n"] else "       -"  # no step timed: no figure
    log(f"{label:44} p50 {p50} ms (n={r['summary']['n']}) "
        f"{r['bytes_streamed_per_token'] / 1e6:9.1f} MB/tok crossed ({r['bytes_reread_per_token'] / 1e6:.1f} re-read) "
        f"hit {hr} allocs*={r['allocations_after_warmup']}")
    gc.collect()
    return r


def decode_paths(args) -> list[str]:
    paths = [d.strip() for d in args.decode.split(",") if d.strip()]
    bad = [d for d in paths if d not in DECODE_PATHS]
    if bad or not paths:
        from bench.errors import BenchError

        raise BenchError(f"--decode takes some of {', '.join(DECODE_PATHS)}, got {args.decode!r}")
    return paths


# a cache row's decode path: through the table, its misses landed where they are read (one crossing) and those past
# the ring staged (``table``) or read in place (``table-unstaged``, expert_staging off), or admitted a step later
# (``table-twice``, expert_landing off: read again), or routed on the host
DECODE_PATHS = ("table", "table-unstaged", "table-twice", "host")


def cache_rows(model, args, router: str, scale: float) -> list[dict]:
    rows = []
    for gib in FULL_BUDGETS_GIB:
        for policy in ("expert_lru", "expert_lfu"):
            for decode in decode_paths(args):
                for prefetch in (False, True) if decode == "host" else (False,):  # a guess needs the host
                    r = kestrel_row(model, args, f"{router} {decode} {policy} {gib} GiB-eq pf={int(prefetch)}",
                                    args.tokens, args.warmup, keep="off", expert_policy=policy,
                                    expert_budget_mb=gib * 1024 * scale, expert_prefetch=prefetch,
                                    expert_decode="host" if decode == "host" else "table",
                                    expert_landing=decode != "table-twice", expert_staging=decode != "table-unstaged")
                    r.update(router=router, budget_full_depth_gib=gib, expert_decode=decode)
                    rows.append(r)
    return rows


def hbm_floor(cfg, reps: int = 20) -> dict:
    """One token's active weights (attention, router, the routed experts of each layer, lm_head), each read once by
    F.linear at batch 1, replayed as one CUDA graph: the device's floor for a decode step of this shape."""
    import torch
    import torch.nn.functional as F

    from bench.stats import summary
    from bench.timing import graph_times

    h, k = cfg.hidden_size, cfg.num_experts_per_tok
    mats = []
    for layer in range(cfg.num_hidden_layers):
        mats += [(cfg.q_dim + 2 * cfg.kv_dim, h), (h, cfg.q_dim)]
        if cfg.moe_layer(layer):
            mats += [(cfg.num_experts, h)] + [(2 * cfg.moe_intermediate_size, h), (h, cfg.moe_intermediate_size)] * k
        else:
            mats += [(2 * cfg.intermediate_size, h), (h, cfg.intermediate_size)]
    mats.append((cfg.vocab_size, h))
    weights = [torch.randn(shape, dtype=torch.bfloat16, device="cuda") for shape in mats]
    xs = {n: torch.randn(1, n, dtype=torch.bfloat16, device="cuda") for n in {shape[1] for shape in mats}}
    times = graph_times(lambda: [F.linear(xs[w.shape[1]], w) for w in weights], calls=2, reps=reps)
    nbytes = sum(w.numel() * 2 for w in weights)
    weights.clear()  # the floor's gigabytes go before the run's rows
    torch.cuda.empty_cache()
    p50 = summary(times)["p50"]
    return {"bytes": nbytes, "ms": times, "summary": summary(times), "TBps": nbytes / p50 / 1e9}


def section(path, args, router: str, scale: float) -> dict:
    from kestrel_core import load

    with load(path) as model:
        kestrel_row(model, args, f"{router} warm-up (not recorded)", 4, 1, keep="off")
        off = kestrel_row(model, args, f"{router} off", args.tokens, args.warmup, keep="off")
        off["router"] = router
        # the budgets hold the share of the experts they hold in the file's dtype: a backend computing wider (cpu_ref's
        # float32 from a bfloat16 file) holds each expert in more bytes, so its budgets grow by as much
        cfg = model.config
        file_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * DTYPE_BYTES[cfg.torch_dtype]
        off["budget_widening"] = widen = off["expert_bytes"] / file_expert if off["expert_bytes"] else 1.0
        rows = [off] + (cache_rows(model, args, router, scale * widen) if args.rows == "all" else [])
        if router == "uniform" and args.rows == "all":
            pf = int(args.backend == "cuda")
            whole = kestrel_row(model, args, f"uniform whole-layer asymmetric keep=1 pf={pf}", args.slow_tokens, 1,
                                keep=1, expert_fetch="layer", pool_slots=4096, prefetch=pf)
            whole["router"] = router
            rows.append(whole)
    for r in rows:  # a slow row generates fewer tokens: its ids against off's first ones
        r.update(compare_ids(r, off))
    return {"path": str(path), "rows": rows}


def q8_section(path, args, scale: float) -> dict:
    from kestrel_core import load

    qpath = models.ensure_q8(path, args.q8_group)
    with load(qpath) as model:
        kestrel_row(model, args, "q8 warm-up (not recorded)", 4, 1, keep="off")
        off = kestrel_row(model, args, "q8 off", args.tokens, args.warmup, keep="off")
        rows = [off]
        for prefetch in (False, True):
            rows.append(kestrel_row(model, args, f"q8 uniform expert_lru 4 GiB-eq pf={int(prefetch)}", args.tokens,
                                    args.warmup, keep="off", expert_policy="expert_lru",
                                    expert_budget_mb=4 * 1024 * scale, expert_prefetch=prefetch))
    for r in rows:
        r.update(compare_ids(r, off))
    return {"group": args.q8_group, "path": str(qpath), "weight_bytes": models.weight_bytes(qpath), "rows": rows}


def targets(result: dict, cfg) -> dict:
    """The issue's targets, each from this run's rows."""
    pinned = (result.get("ceilings") or {}).get("pinned_h2d", {}).get("GBps")
    uni = {r["label"]: r for r in result["uniform"]["rows"]}
    sparse = sum(1 for layer in range(cfg.num_hidden_layers) if cfg.moe_layer(layer))
    moved, overlap, peaks = {}, {}, {}
    for sec in ("uniform", "skewed"):
        sec_rows = result.get(sec, {}).get("rows", [])
        for r in sec_rows:
            if not r["expert_policy"]:
                continue
            active = sparse * cfg.num_experts_per_tok * r["expert_bytes"]
            if not r["expert_prefetch"] and r["hit_rate"] is not None and r["hit_rate"] < 1:
                # Bytes uploaded a token (the counter) against (1 - hit rate) x the active expert bytes; a prefetching
                # row also moves its guesses, by design.
                moved[r["label"]] = r["bytes_uploaded_per_token"] / ((1 - r["hit_rate"]) * active)
            bound = r["own_unit_bytes"] + r["expert_budget_bytes"] + (
                cfg.num_experts_per_tok * r["expert_bytes"] if r["expert_prefetch"] else 0)
            peaks[r["label"]] = r["peak_streamed_bytes_decode"] / bound
            if r["budget_full_depth_gib"] == 4 and pinned:
                sec_off = next(x for x in sec_rows if x["label"] == f"{sec} off")
                allowed = 1.2 * r["bytes_uploaded_per_token"] / (pinned * 1e9) * 1e3 + sec_off["summary"]["p50"]
                overlap[r["label"]] = r["summary"]["p50"] / allowed
    out: dict = {"routed_only_ratio_max": max(moved.values(), default=None), "overlap_ratio_at_4GiB": overlap,
                 "peak_over_bound_max": max(peaks.values(), default=None)}
    best4 = min((r for r in result["uniform"]["rows"] if r.get("budget_full_depth_gib") == 4),
                key=lambda r: r["summary"]["p50"])
    out["best_uniform_4GiB"] = {"label": best4["label"], "p50_ms": best4["summary"]["p50"]}
    whole = next((r for label, r in uni.items() if label.startswith("uniform whole-layer")), None)
    if whole:
        out["whole_layer_over_best_4GiB"] = whole["summary"]["p50"] / best4["summary"]["p50"]
    for name, peer in (result.get("peers") or {}).items():
        if isinstance(peer, dict) and (peer.get("summary") or {}).get("p50"):
            out[f"{name}_over_best_4GiB"] = peer["summary"]["p50"] / best4["summary"]["p50"]
    floor = (result.get("hbm_floor") or {}).get("summary", {}).get("p50")
    if floor:
        out["off_over_hbm_floor"] = uni.get("uniform off", {}).get("summary", {}).get("p50", 0) / floor
    table_vs_host, bounds = {}, {}
    for sec in ("uniform", "skewed"):
        sec_rows = result.get(sec, {}).get("rows", [])
        by = {r["label"]: r for r in sec_rows}
        sec_off = by.get(f"{sec} off")
        for r in sec_rows:
            if r.get("expert_decode") != "table":
                continue
            host = by.get(r["label"].replace(" table ", " host "))
            if host:  # the eager host-planned path at the same budget and policy, over the table path
                table_vs_host[r["label"]] = host["summary"]["p50"] / r["summary"]["p50"]
            if sec_off and r.get("stream_bound_ms") is not None:  # the target: <= 1.2 x (off + miss bytes / pinned)
                bounds[r["label"]] = r["summary"]["p50"] / (sec_off["summary"]["p50"] + r["stream_bound_ms"])
    out["host_over_table"] = table_vs_host
    # item 1: what landing saves, at the same budget and policy: the bytes crossing a token, and the step's time
    out["landing"] = {r["label"]: {"crossed_over_twice": r["bytes_streamed_per_token"] / twice["bytes_streamed_per_token"]
                                   if twice["bytes_streamed_per_token"] else None,
                                   "p50_over_twice": r["summary"]["p50"] / twice["summary"]["p50"]}
                      for r, twice in table_twins(result, "table-twice")}
    # staging: the misses past the ring copied into staging slots, over the same row reading them in place
    out["staging"] = {r["label"]: r["summary"]["p50"] / unstaged["summary"]["p50"]
                      for r, unstaged in table_twins(result, "table-unstaged")}
    # item 1's bound: the share of a table row's crossing bytes that were an admission re-reading a step's miss
    out["table_reread_share"] = {r["label"]: r["bytes_reread_per_token"] / r["bytes_streamed_per_token"]
                                 for s in ("uniform", "skewed") for r in result.get(s, {}).get("rows", [])
                                 if r.get("expert_decode", "").startswith("table") and r.get("bytes_streamed_per_token")}
    out["table_over_off_plus_stream_bound"] = bounds
    every = [r for s in ("uniform", "skewed") for r in result.get(s, {}).get("rows", [])]
    out["every_row_ids_match_off"] = all(r.get("ids_match_baseline") for r in every)
    out["allocations_after_warmup_max"] = max((r["allocations_after_warmup"] for r in every if r["expert_policy"]),
                                              default=None)
    return out


def table_twins(result: dict, path: str):
    """Each ``table`` row with its twin on decode path ``path`` at the same budget and policy, where that ran."""
    for s in ("uniform", "skewed"):
        by = {x["label"]: x for x in result.get(s, {}).get("rows", [])}
        for r in by.values():
            twin = by.get(r["label"].replace(" table ", f" {path} ")) if r.get("expert_decode") == "table" else None
            if twin:
                yield r, twin


def run(args, record) -> dict:
    from bench.errors import BenchError
    from kestrel_core.tools.presets import PRESETS, preset_config

    if args.slow_tokens < 2:  # a slow row's first decode step is left out: one token leaves none to time
        raise BenchError(f"--slow-tokens must be at least 2 (a slow row times the decode steps after its first), "
                         f"got {args.slow_tokens}")

    full = PRESETS[args.preset]["num_hidden_layers"]
    layers = min(args.layers, full)
    scale = layers / full
    cfg = preset_config(args.preset, layers=layers)
    if not cfg.is_moe:
        from bench.errors import BenchError

        raise BenchError(f"preset {args.preset} is not a Mixture-of-Experts model")
    names = peers.parse_names(args.peers if args.peers is not None else
                              ("transformers,accelerate-experts,airllm" if args.backend == "cuda" and not args.gguf else ""))
    if args.gguf:
        from bench.errors import BenchError

        extra = [flag for flag, on in (("--skew", args.skew), ("--q8-group", args.q8_group), ("--peers", names)) if on]
        if extra:
            raise BenchError(f"--gguf writes random blocks: the uniform rows only; set {', '.join(extra)} to 0 or empty "
                             "(--skew 0 --q8-group 0 --peers '')")
    result: dict = {"preset": args.preset, "backend": args.backend, "layers": layers, "full_depth_layers": full,
                    "budget_scale": scale, "prompt_ids": prompt_for(cfg.vocab_size), "tokens": args.tokens,
                    "warmup_steps": args.warmup, "slow_tokens": args.slow_tokens, "skew": args.skew,
                    "note": (f"--layers {layers} of {full}: each layer has the full model's shapes; expert budgets are "
                             f"the full-depth 2/4/8 GiB x {layers}/{full}. Random routers route almost uniformly, so "
                             "the uniform rows are a worst case for any cache.")}
    if args.backend == "cuda":
        result["ceilings"] = copy_rates()
        log(f"pinned h2d {result['ceilings']['pinned_h2d']['GBps']:.1f} GB/s")
        result["hbm_floor"] = hbm_floor(cfg)
        log(f"HBM floor {result['hbm_floor']['summary']['p50']:.3f} ms ({result['hbm_floor']['TBps']:.2f} TB/s)")
    bins = llama_cpp.check(args)
    path, result["weight_bytes"] = models.ensure_model(args.models, args.preset, layers, args.gguf)
    result["gguf"] = args.gguf or None
    result["uniform"] = section(path, args, "uniform", scale)
    record.save_partial(result)
    if bins is not None:
        from kestrel_core import load

        settings = {"backend": args.backend, "keep": "off", **({"budget_mb": BIG} if args.backend == "cuda" else {})}
        with load(path) as model:
            result["llama_cpp"] = llama_cpp.compare(
                bins, model, path, settings, shape=f"{args.preset} ({layers} of {full} layers)", file_type=args.gguf,
                args=args, log=log)
        result["vs_llama_cpp"] = result["llama_cpp"]["rows"]
        record.save_partial(result)
    if args.skew:
        skewed = models.ensure_preset(args.models, args.preset, layers=layers, router_skew=args.skew)
        result["skewed"] = section(skewed, args, "skewed", scale)
        record.save_partial(result)
    if args.q8_group:
        result["q8"] = q8_section(path, args, scale)
        record.save_partial(result)
    if names:  # last: a peer may leave threads behind that would slow kestrel's rows
        result["peers"] = peers.beside(names, path, result["prompt_ids"], args.tokens, args.slow_tokens,
                                       result["uniform"]["rows"][0], device="cuda" if args.backend == "cuda" else "cpu",
                                       scratch_root=args.models, fuse_experts=True,
                                       done=lambda rows: record.save_partial({**result, "peers": rows}))
    pinned = (result.get("ceilings") or {}).get("pinned_h2d", {}).get("GBps")
    for sec in ("uniform", "skewed", "q8"):
        for r in result.get(sec, {}).get("rows", []):
            if pinned and "bytes_streamed_per_token" in r:  # moving its bytes at the pinned rate, a miss crossing once
                r["stream_bound_ms"] = (r["bytes_streamed_per_token"] - r["bytes_reread_per_token"]) / (pinned * 1e9) * 1e3
    if args.rows == "all":
        result["targets"] = targets(result, cfg)
        log(f"targets: {result['targets']}")
    return result
