"""Mixture-of-Experts benchmark on a GPU: kestrel's expert cache against everything resident, whole-layer
streaming and peers, on the Qwen3-30B-A3B shape.

    python bench/moe_bench.py --models /tmp/models --layers 8 [--tokens 41] [--skew 1.2] [--q8-group 64]
                              [--skip-peers] [--out DIR]

``--layers`` cuts the depth (the device's disk holds about one full model); every layer keeps the
full model's shapes, so per-layer and per-token-per-layer figures are the full model's. The expert
budgets are the full-depth 2, 4 and 8 GiB scaled by layers/48, so the cache holds the same share
of each layer's experts as it would at full depth; the record gives both.

One run measures, side by side: the pinned copy rate; `off` (every unit resident); the expert cache
at each budget with expert_lru and expert_lfu, speculative prefetch off and on, on the uniform
router (random weights: the worst case for any cache) and on a Zipf-skewed one; whole-layer
streaming (asymmetric keep=1, every expert with its layer, prefetch 1); q8 experts; and peers
(transformers resident, accelerate with the experts on the CPU, AirLLM) on the same weights.
Steady-state figures are taken over the decode steps after ``--warmup`` steps.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, copy_ceilings, utc_stamp, write_record  # noqa: E402

from kestrel_core.config import GenerationConfig, KestrelConfig  # noqa: E402
from kestrel_core.engine import Model, open_run  # noqa: E402
from kestrel_core.generate import generate  # noqa: E402
from kestrel_core.hookspecs import hookimpl  # noqa: E402
from kestrel_core import plugins  # noqa: E402
from kestrel_core.presets import PRESETS, preset_config, write_checkpoint  # noqa: E402

PRESET = "qwen3-30b-a3b"
BACKEND = "cuda"  # --backend cpu_ref, with --preset tiny-moe, is a smoke run of this script on a CPU
PROMPT = [785, 3974, 13876, 38835, 34208, 916, 279, 15678]
FULL_BUDGETS_GIB = (2, 4, 8)
BIG = 120_000  # MiB of weight-cache budget: every row fits; the expert budget is what bounds the experts


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ensure_model(root: Path, layers: int, skew: float) -> Path:
    path = root / (f"{PRESET}-L{layers}" + (f"-zipf{skew:g}" if skew else ""))
    if not (path / "config.json").is_file():
        log(f"writing {path.name}")
        write_checkpoint(preset_config(PRESET, layers=layers), path, seed=0, router_skew=skew,
                         device="cuda" if torch.cuda.is_available() else "cpu")
    return path


class DecodeResidency:
    """Streamed bytes resident at each decode boundary (after the layer before's experts and guesses came in)."""

    def __init__(self):
        self.seen: list[int] = []

    @hookimpl
    def on_layer_advance(self, window, layer, phase):
        if phase == "decode":
            self.seen.append(window.resident_bytes)


def kestrel_row(model: Model, label: str, tokens: int, warmup: int, **flags) -> dict:
    cfg = KestrelConfig().override(backend__name=BACKEND, residency__budget_mb=BIG, **flags)
    watch = DecodeResidency()
    plugins.load_plugins()
    plugins.pm.register(watch, name="moe-bench-residency")
    try:
        with open_run(model, cfg) as run:
            r = generate(run, PROMPT, GenerationConfig(max_new_tokens=tokens, stop_at_eos=False))
            units = run.backend.units.units
            own = sum(u.nbytes for key, u in units.items() if len(key) == 1)
            expert = max(u.nbytes for key, u in units.items() if len(key) == 2)
    finally:
        plugins.pm.unregister(name="moe-bench-residency")
    steady = r.per_token[warmup:]
    ms = r.decode_ms[warmup:]
    mean = lambda key: statistics.fmean(p[key] for p in steady)  # noqa: E731
    hits, misses = sum(p["expert_hits"] for p in steady), sum(p["expert_misses"] for p in steady)
    guessed = sum(p["expert_guessed"] for p in steady)
    res = cfg.residency
    row = {
        "label": label, "policy": res.policy if res.windowed else "off", "keep": res.keep,
        "expert_policy": res.expert_policy or None, "expert_budget_bytes": int(res.expert_budget_mb * 2**20),
        "expert_prefetch": res.expert_prefetch, "expert_fetch": res.expert_fetch, "prefetch": cfg.backend.prefetch,
        "ms_per_token": statistics.median(ms), "ms_per_token_all_steps": r.ms_per_token,
        "decode_steps_measured": len(ms), "prefill_ms": r.prefill_ms,
        "bytes_uploaded_per_token": mean("bytes_uploaded"),
        "expert_misses_per_token": mean("expert_misses"), "expert_prefetches_per_token": mean("expert_prefetches"),
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        "prefetch_recall": sum(p["expert_guess_hits"] for p in steady) / guessed if guessed else None,
        "expert_bytes": expert, "own_unit_bytes": own, "fixed_resident_bytes": r.fixed_resident_bytes,
        "peak_streamed_bytes_decode": max(watch.seen[warmup * model.n_layers:], default=0),
        "peak_resident_bytes": r.counters["peak_resident_bytes"],
        "peak_device_bytes": r.memory.get("device_peak_bytes"),
        "mapping_rss_bytes": r.memory.get("mapping_rss_bytes"),
        "allocations_after_warmup": sum(p["allocations"] for p in steady),
        "frees_after_warmup": sum(p["frees"] for p in steady),
        "steps": r.steps, "token_ids": r.token_ids,
    }
    hr = f"{100 * row['hit_rate']:5.1f}%" if row["hit_rate"] is not None else "  -   "
    rc = f"{100 * row['prefetch_recall']:5.1f}%" if row["prefetch_recall"] is not None else "  -  "
    log(f"{label:44} {row['ms_per_token']:8.2f} ms/tok {row['bytes_uploaded_per_token'] / 1e6:9.1f} MB/tok "
        f"hit {hr} recall {rc} allocs*={row['allocations_after_warmup']}")
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def cache_rows(model: Model, router: str, scale: float, tokens: int, warmup: int) -> list[dict]:
    rows = []
    for gib in FULL_BUDGETS_GIB:
        mb = gib * 1024 * scale
        for policy in ("expert_lru", "expert_lfu"):
            for prefetch in (False, True):
                row = kestrel_row(model, f"{router} {policy} {gib} GiB{'-eq' if scale != 1 else ''} pf={int(prefetch)}",
                                  tokens, warmup, residency__keep="off", residency__expert_policy=policy,
                                  residency__expert_budget_mb=mb, residency__expert_prefetch=prefetch)
                row.update(router=router, budget_full_depth_gib=gib)
                rows.append(row)
    return rows


def section(path: Path, router: str, scale: float, args) -> dict:
    with Model(path) as model:
        kestrel_row(model, f"{router} warm-up (not recorded)", 4, 1, residency__keep="off")
        off = kestrel_row(model, f"{router} off", args.tokens, args.warmup, residency__keep="off")
        rows = [off] + cache_rows(model, router, scale, args.tokens, args.warmup)
        if router == "uniform":
            rows.append(kestrel_row(model, "uniform whole-layer asymmetric keep=1 pf=1", args.slow_tokens, 1,
                                    residency__keep=1, residency__expert_fetch="layer", residency__pool_slots=4096,
                                    backend__prefetch=int(BACKEND == "cuda")))
    for row in rows:  # a slow row generates fewer tokens: its ids against off's first ones
        row["ids_match_off"] = row["token_ids"] == off["token_ids"][: len(row["token_ids"])]
    return {"path": path.name, "rows": rows}


def q8_section(path: Path, scale: float, args) -> dict:
    from kestrel_core.quantize import quantize_checkpoint

    qpath = path.parent / f"{path.name}-q8g{args.q8_group}"
    if not (qpath / "config.json").is_file():
        log(f"quantizing to {qpath.name}")
        quantize_checkpoint(path, qpath, args.q8_group, device="cuda" if torch.cuda.is_available() else "cpu")
    with Model(qpath) as model:
        kestrel_row(model, "q8 warm-up (not recorded)", 4, 1, residency__keep="off")
        off = kestrel_row(model, "q8 off", args.tokens, args.warmup, residency__keep="off")
        rows = [off]
        for prefetch in (False, True):
            rows.append(kestrel_row(model, f"q8 uniform expert_lru 4 GiB-eq pf={int(prefetch)}", args.tokens, args.warmup,
                                    residency__keep="off", residency__expert_policy="expert_lru",
                                    residency__expert_budget_mb=4 * 1024 * scale, residency__expert_prefetch=prefetch))
    for row in rows:
        row["ids_match_q8_off"] = row["token_ids"] == off["token_ids"]
    return {"group": args.q8_group, "checkpoint_bytes": sum(p.stat().st_size for p in qpath.glob("*.safetensors")),
            "rows": rows}


def peer_section(path: Path, args) -> dict:
    out: dict = {}
    try:
        import moe_peers

        out["transformers_resident"] = moe_peers.transformers_resident(str(path), PROMPT, args.tokens)
        log(f"transformers resident: {out['transformers_resident'].get('ms_per_token')}")
        out["accelerate_experts_on_cpu"] = moe_peers.accelerate_offload(str(path), PROMPT, args.slow_tokens, what="experts")
        log(f"accelerate experts on cpu: {out['accelerate_experts_on_cpu'].get('ms_per_token')}")
    except Exception as exc:  # a peer that cannot run is recorded, not fatal
        out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        log(f"peer failed: {out['error']}")
    gc.collect()
    torch.cuda.empty_cache()
    try:
        import airllm_peer

        # A new directory of this run's own: removing it afterwards cannot take anything of the user's.
        scratch = Path(tempfile.mkdtemp(prefix="airllm-scratch-", dir=args.models))
        # AirLLM 4.0.0's own split keeps per-expert names, which transformers 5 cannot load into its fused experts
        # module: fuse_experts rewrites the scratch split (never the checkpoint) into the fused layout first.
        out["airllm"] = airllm_peer.airllm_row(str(path), PROMPT, args.slow_tokens, str(scratch), fuse_experts=True)
        shutil.rmtree(scratch, ignore_errors=True)
        log(f"airllm: {out['airllm'].get('ms_per_token')} {out['airllm'].get('error', '')}")
    except Exception as exc:
        out["airllm"] = {"label": "airllm", "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    gc.collect()
    torch.cuda.empty_cache()
    return out


def targets(rec: dict, cfg) -> dict:
    """The issue's targets, each from this run's rows."""
    rate = rec["ceilings"]["pinned_h2d_GBps"] * 1e9  # bytes/s
    uni = {r["label"]: r for r in rec["uniform"]["rows"]}
    off = uni["uniform off"]
    sparse = sum(cfg.moe_layer(layer) for layer in range(cfg.num_hidden_layers))
    out: dict = {}
    moved, overlap, peaks = {}, {}, {}
    for sec in ("uniform", "skewed"):
        for r in rec.get(sec, {}).get("rows", []):
            if not r["expert_policy"]:
                continue
            active = sparse * cfg.num_experts_per_tok * r["expert_bytes"]
            if not r["expert_prefetch"] and r["hit_rate"] is not None and r["hit_rate"] < 1:
                # Every byte uploaded a token (the counter, not the misses) against (1 - hit rate) x the active
                # expert bytes. A prefetching row also moves its guesses, by design: those are recorded apart.
                moved[r["label"]] = r["bytes_uploaded_per_token"] / ((1 - r["hit_rate"]) * active)
            bound = r["own_unit_bytes"] + r["expert_budget_bytes"] + (
                cfg.num_experts_per_tok * r["expert_bytes"] if r["expert_prefetch"] else 0)
            peaks[r["label"]] = r["peak_streamed_bytes_decode"] / bound
            if r["budget_full_depth_gib"] == 4:
                sec_off = {x["label"]: x for x in rec[sec]["rows"]}[f"{sec} off"]
                allowed = 1.2 * r["bytes_uploaded_per_token"] / rate * 1e3 + sec_off["ms_per_token"]
                overlap[r["label"]] = r["ms_per_token"] / allowed
    out["routed_only_ratio_max"] = max(moved.values(), default=None)  # <= 1: only routed experts move
    out["overlap_ratio_at_4GiB"] = overlap  # <= 1 meets ms/tok <= 1.2 x bytes/rate + off
    out["peak_over_bound_max"] = max(peaks.values(), default=None)  # <= 1
    best4 = min((r for r in rec["uniform"]["rows"] if r.get("budget_full_depth_gib") == 4), key=lambda r: r["ms_per_token"])
    out["best_uniform_4GiB"] = {"label": best4["label"], "ms_per_token": best4["ms_per_token"]}
    whole = uni.get("uniform whole-layer asymmetric keep=1 pf=1")
    if whole:
        out["whole_layer_over_best_4GiB"] = whole["ms_per_token"] / best4["ms_per_token"]  # >= 10
    for name, peer in (rec.get("peers") or {}).items():
        if isinstance(peer, dict) and peer.get("ms_per_token"):
            out[f"{name}_over_best_4GiB"] = peer["ms_per_token"] / best4["ms_per_token"]  # >= 20 for accelerate, airllm
    out["every_row_ids_match_off"] = all(r["ids_match_off"] for s in ("uniform", "skewed")
                                         for r in rec.get(s, {}).get("rows", []))
    out["allocations_after_warmup_max"] = max(r["allocations_after_warmup"] for s in ("uniform", "skewed")
                                              for r in rec.get(s, {}).get("rows", []) if r["expert_policy"])
    off_ids = off["token_ids"]
    for name, peer in (rec.get("peers") or {}).items():
        if isinstance(peer, dict) and peer.get("token_ids"):
            n = min(len(off_ids), len(peer["token_ids"]))
            out[f"{name}_leading_ids_equal_kestrel_off"] = next((i for i in range(n) if peer["token_ids"][i] != off_ids[i]), n)
    return out


def main() -> int:
    global PRESET, BACKEND
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", required=True, help="where checkpoints are written (and found on a rerun)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=41, help="new tokens of each kestrel row")
    ap.add_argument("--warmup", type=int, default=12, help="decode steps left out of the steady-state figures")
    ap.add_argument("--slow-tokens", type=int, default=18, help="new tokens of the slow rows (whole layers, peers)")
    ap.add_argument("--skew", type=float, default=1.2, help="Zipf exponent of the skewed router (0: no skewed rows)")
    ap.add_argument("--q8-group", type=int, default=64, help="q8 group size (0: no q8 rows)")
    ap.add_argument("--skip-peers", action="store_true")
    ap.add_argument("--out", action="append", default=[], help="also write the record here")
    ap.add_argument("--preset", default=PRESET, help="a MoE preset (tiny-moe with --backend cpu_ref: a smoke run)")
    ap.add_argument("--backend", default=BACKEND)
    args = ap.parse_args()
    PRESET, BACKEND = args.preset, args.backend
    if PRESETS[PRESET]["vocab_size"] <= max(PROMPT):
        PROMPT[:] = [i % PRESETS[PRESET]["vocab_size"] for i in PROMPT]
    full = PRESETS[PRESET]["num_hidden_layers"]
    scale = args.layers / full
    root = Path(args.models)
    stamp, name = utc_stamp(), f"moe_{PRESET}_L{args.layers}"
    cfg = preset_config(PRESET, layers=args.layers)
    record: dict = {"preset": PRESET, "layers": args.layers, "full_depth_layers": full, "budget_scale": scale,
                    "prompt_ids": PROMPT, "tokens": args.tokens, "warmup_steps": args.warmup,
                    "slow_tokens": args.slow_tokens, "skew": args.skew,
                    "note": (f"--layers {args.layers} of {full}: each layer has the full model's shapes; expert budgets are "
                             f"the full-depth 2/4/8 GiB x {args.layers}/{full}. Random routers route almost uniformly, "
                             "so the uniform rows are a worst case for any cache.")}

    def save(stage: str) -> list[Path]:
        record["stage"] = stage
        dirs = [RESULTS] if BACKEND == "cuda" else []  # a smoke run on the CPU records nothing in the repo
        return write_record(name, record, [*dirs, *map(Path, args.out)], stamp)

    record["ceilings"] = copy_ceilings() if torch.cuda.is_available() else {"pinned_h2d_GBps": float("nan")}
    log(f"pinned h2d {record['ceilings']['pinned_h2d_GBps']:.1f} GB/s")
    path = ensure_model(root, args.layers, 0.0)
    record["model_bytes"] = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    record["uniform"] = section(path, "uniform", scale, args)
    save("uniform")
    if args.skew:
        skewed = ensure_model(root, args.layers, args.skew)
        record["skewed"] = section(skewed, "skewed", scale, args)
        save("skewed")
    if args.q8_group:
        record["q8"] = q8_section(path, scale, args)
        save("q8")
    if not args.skip_peers:  # last: a peer may leave threads behind that would slow kestrel's rows
        record["peers"] = peer_section(path, args)
        save("peers")
    record["targets"] = targets(record, cfg)
    log(f"targets: {record['targets']}")
    paths = save("done")
    print("record:", *paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
