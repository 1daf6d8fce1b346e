"""Streaming benchmark on a GPU: kestrel's window against the pinned-copy ceiling and Hugging Face peers.

    python bench/stream_bench.py --preset qwen3-8b --models /tmp/models [--out DIR] [--skip-peers]

``--graphs`` measures the captured decode step instead (bench/decode_graphs.py): the GEMV floor, graph
against eager for off, asymmetric and pinned_set, off against keep=L interleaved, and transformers.

One run measures, side by side: pinned/pageable/device copy bandwidth; kestrel `off`;
asymmetric at keep in {L, L-1, L/2, 4, 1} with prefetch off and on; future_evicting at
the same keeps; pool against free at keep 1 and 4; pinned_set at asymmetric's peak;
and transformers on the same weights, fully resident and with accelerate offloading
every decoder layer to the CPU. The JSON record goes to bench/results/ (and --out).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, copy_ceilings, hf_decode, write_record  # noqa: E402

from kestrel_core.config import GenerationConfig, KestrelConfig  # noqa: E402
from kestrel_core.engine import Model, open_run  # noqa: E402
from kestrel_core.generate import generate  # noqa: E402
from kestrel_core.presets import preset_config, write_checkpoint  # noqa: E402

PROMPT = [785, 3974, 13876, 38835, 34208, 916, 279, 15678]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ensure_model(preset: str, root: Path) -> Path:
    path = root / preset
    if not (path / "config.json").is_file():
        log(f"writing {preset} to {path}")
        write_checkpoint(preset_config(preset), path, seed=0, device="cuda" if torch.cuda.is_available() else "cpu")
    return path


def kestrel_row(model: Model, label: str, gen: GenerationConfig, **flags) -> dict:
    cfg = KestrelConfig().override(backend__name="cuda", **flags)
    with open_run(model, cfg) as run:
        r = generate(run, PROMPT, gen)
    steady = r.per_token[1:]
    bytes_tok = statistics.fmean(p["bytes_uploaded"] for p in steady) if steady else 0.0
    res = cfg.residency
    row = {
        "label": label, "policy": res.policy if res.windowed else "off", "keep": res.keep,
        "allocator": res.allocator, "prefetch": cfg.backend.prefetch,
        "ms_per_token": r.ms_per_token, "ms_per_token_mean": statistics.fmean(r.decode_ms),
        "prefill_ms": r.prefill_ms, "decode_steps": len(r.decode_ms),
        "layer_uploads_per_token": statistics.fmean(p["layer_uploads"] for p in steady) if steady else 0.0,
        "bytes_uploaded_per_token": bytes_tok,
        "effective_GBps": bytes_tok / r.ms_per_token / 1e6 if r.ms_per_token else 0.0,
        "peak_resident_bytes": r.counters["peak_resident_bytes"],
        "peak_device_bytes": r.memory.get("device_peak_bytes"),
        "allocations_after_warmup": sum(p["allocations"] for p in steady),
        "frees_after_warmup": sum(p["frees"] for p in steady),
        "pool_hits": r.counters["pool_hits"],
        "token_ids": r.token_ids,
    }
    log(f"{label:34} {row['ms_per_token']:8.2f} ms/tok  {bytes_tok / 1e9:6.2f} GB/tok  "
        f"{row['effective_GBps']:6.1f} GB/s  allocs*={row['allocations_after_warmup']}")
    gc.collect()
    torch.cuda.empty_cache()
    return row


def baseline_rows(model: Model, gen: GenerationConfig) -> list[dict]:
    """Only the bf16 rows the q8 rows are compared with (--rows q8)."""
    kestrel_row(model, "warm-up (not recorded)", gen, residency__keep="off")
    rows = [kestrel_row(model, "off", gen, residency__keep="off")]
    for keep in (4, 1):
        for pf in (0, 1):
            rows.append(kestrel_row(model, f"asymmetric keep={keep} pf={pf}", gen, residency__keep=keep, backend__prefetch=pf))
    for row in rows:
        row["ids_match_off"] = row["token_ids"] == rows[0]["token_ids"]
    return rows


def kestrel_rows(model: Model, gen: GenerationConfig) -> list[dict]:
    L = model.n_layers
    keeps = [L, L - 1, L // 2, 4, 1]
    kestrel_row(model, "warm-up (not recorded)", gen, residency__keep="off")
    rows = [kestrel_row(model, "off", gen, residency__keep="off")]
    for keep in keeps:
        for pf in (0, 1):
            rows.append(kestrel_row(model, f"asymmetric keep={keep} pf={pf}", gen, residency__keep=keep, backend__prefetch=pf))
    for keep in keeps:
        rows.append(kestrel_row(model, f"future_evicting keep={keep}", gen, residency__keep=keep,
                                residency__policy="future_evicting"))
    for keep in (4, 1):
        rows.append(kestrel_row(model, f"asymmetric keep={keep} free", gen, residency__keep=keep,
                                residency__allocator="free"))
    for keep in (4, 1):
        rows.append(kestrel_row(model, f"pinned_set keep={keep} pf=1", gen, residency__keep=keep,
                                residency__policy="pinned_set", backend__prefetch=1))
    ref = rows[0]["token_ids"]
    for row in rows:
        row["ids_match_off"] = row["token_ids"] == ref
    return rows


def off_vs_keep_all(model: Model, rounds: int = 3, tokens: int = 17) -> dict:
    """off against asymmetric keep=L, interleaved A/B so host-side drift hits both alike."""
    L = model.n_layers
    gen = GenerationConfig(max_new_tokens=tokens, stop_at_eos=False)
    steps: dict[str, list[float]] = {"off": [], "keep_all": []}
    for _ in range(rounds):
        for key, keep in (("off", "off"), ("keep_all", L)):
            cfg = KestrelConfig().override(backend__name="cuda", residency__keep=keep)
            with open_run(model, cfg) as run:
                steps[key] += generate(run, PROMPT, gen).decode_ms
    out = {k: {"ms_per_token": statistics.median(v), "decode_ms": v} for k, v in steps.items()}
    out["ratio"] = out["keep_all"]["ms_per_token"] / out["off"]["ms_per_token"]
    log(f"interleaved: off {out['off']['ms_per_token']:.2f} ms/tok, keep={L} {out['keep_all']['ms_per_token']:.2f} (x{out['ratio']:.3f})")
    return out


def peer_rows(path: Path, n_layers: int, n_new: int, n_offload: int) -> dict:
    import accelerate
    from accelerate.hooks import remove_hook_from_submodules
    from transformers import AutoModelForCausalLM

    log("transformers: loading on the CPU")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
    hf.eval()
    device_map = {"model.embed_tokens": 0, "model.norm": 0, "model.rotary_emb": 0, "lm_head": 0}
    device_map.update({f"model.layers.{i}": "cpu" for i in range(n_layers)})
    hf = accelerate.dispatch_model(hf, device_map=device_map, main_device=0)
    ids_off, t_off, pre_off = hf_decode(hf, PROMPT, n_offload)
    log(f"accelerate offload: {statistics.median(t_off):.1f} ms/tok")
    remove_hook_from_submodules(hf)
    hf = hf.to("cuda")
    torch.cuda.reset_peak_memory_stats()
    ids_res, t_res, pre_res = hf_decode(hf, PROMPT, n_new)
    peak = torch.cuda.max_memory_allocated()
    log(f"transformers resident: {statistics.median(t_res):.1f} ms/tok")
    out = {
        "transformers_version": __import__("transformers").__version__,
        "accelerate_version": accelerate.__version__,
        "hf_resident": {"ms_per_token": statistics.median(t_res), "prefill_ms": pre_res, "decode_ms": t_res,
                        "token_ids": ids_res, "peak_device_bytes": peak},
        "accelerate_offload": {"ms_per_token": statistics.median(t_off), "prefill_ms": pre_off, "decode_ms": t_off,
                               "token_ids": ids_off},
    }
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return out


def q8_gemv_rows(group: int, d2d_GBps: float) -> list[dict]:
    """The int8 GEMV kernel (the launcher's own split choice) against the torch path on the
    issue's two shapes, timed as q8_gemv_bench does (device time from graph replays, and eager)."""
    from q8_gemv_bench import TARGET_SHAPES, gemv_rows

    return gemv_rows(TARGET_SHAPES, group, d2d_GBps, variants=("auto", "torch"), log=log)


def q8_section(path: Path, group: int, gen: GenerationConfig, bf16_rows: list[dict], ceil: dict) -> dict:
    from kestrel_core.quantize import quantize_checkpoint

    qpath = path.parent / f"{path.name}-q8g{group}"
    if not (qpath / "config.json").is_file():
        log(f"quantizing to {qpath} (group {group}, on the GPU)")
        quantize_checkpoint(path, qpath, group, device="cuda")
    gemv = q8_gemv_rows(group, ceil["d2d_GBps_read_plus_write"])
    bf16 = {r["label"]: r for r in bf16_rows}
    rows = []
    with Model(qpath) as qmodel:
        kestrel_row(qmodel, "q8 warm-up (not recorded)", gen, residency__keep="off")
        rows.append(kestrel_row(qmodel, "q8 off", gen, residency__keep="off"))
        for keep in (4, 1):
            for pf in (0, 1):
                rows.append(kestrel_row(qmodel, f"q8 asymmetric keep={keep} pf={pf}", gen, residency__keep=keep,
                                        backend__prefetch=pf))
        long = GenerationConfig(max_new_tokens=32, stop_at_eos=False)
        q_ids = kestrel_row(qmodel, "q8 off, 32 tokens", long, residency__keep="off")["token_ids"]
    for r in rows:
        r["ids_match_q8_off"] = r["token_ids"] == rows[0]["token_ids"]
        twin = bf16.get(r["label"][3:])
        r["ratio_to_bf16"] = r["ms_per_token"] / twin["ms_per_token"] if twin else None
    with Model(path) as model:
        b_ids = kestrel_row(model, "bf16 off, 32 tokens", long, residency__keep="off")["token_ids"]
    return {"group": group, "checkpoint_bytes": sum(p.stat().st_size for p in qpath.glob("*.safetensors")),
            "gemv": gemv, "rows": rows, "q8_vs_bf16_leading_ids_of_32": leading_match(q_ids, b_ids),
            "q8_ids_32": q_ids, "bf16_ids_32": b_ids}


def q8_targets(q8: dict) -> dict:
    kernel = [g for g in q8["gemv"] if g["path"] == "kernel"]
    by = {r["label"]: r for r in q8["rows"]}
    t = {"q8_gemv_min_fraction_of_d2d": min(g["fraction_of_d2d"] for g in kernel)}
    t["met_q8_gemv_70pct_of_d2d"] = t["q8_gemv_min_fraction_of_d2d"] >= 0.7
    for keep in (1, 4):
        t[f"q8_over_bf16_keep{keep}_pf1"] = by[f"q8 asymmetric keep={keep} pf=1"]["ratio_to_bf16"]
    t["met_q8_streaming_0.6x_bf16"] = all(t[f"q8_over_bf16_keep{k}_pf1"] <= 0.6 for k in (1, 4))
    t["q8_vs_bf16_leading_ids_of_32"] = q8["q8_vs_bf16_leading_ids_of_32"]
    return t


def leading_match(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def targets(rows: list[dict], ceil: dict, peers: dict | None, ab: dict) -> dict:
    by = {r["label"]: r for r in rows}
    L = max(r["keep"] for r in rows if r["keep"] != "off")
    stream = by["asymmetric keep=1 pf=1"]
    off = by["off"]
    keepL = by[f"asymmetric keep={L} pf=0"]
    t = {
        "stream_keep1_prefetch_fraction_of_pinned": stream["effective_GBps"] / ceil["pinned_h2d_GBps"],
        "stream_keep1_prefetch_ms_per_token": stream["ms_per_token"],
        "keepL_over_off_single_runs": keepL["ms_per_token"] / off["ms_per_token"],
        "keepL_over_off": ab["ratio"],
        "pool_allocations_after_warmup": sum(r["allocations_after_warmup"] for r in rows if r["allocator"] == "pool"),
        "pool_allocations_after_warmup_asymmetric": sum(
            r["allocations_after_warmup"] for r in rows if r["allocator"] == "pool" and r["policy"] == "asymmetric"),
        "free_allocations_after_warmup_keep1": by["asymmetric keep=1 free"]["allocations_after_warmup"],
        "all_ids_match_off": all(r["ids_match_off"] for r in rows),
    }
    t["met_stream_80pct_of_pinned"] = t["stream_keep1_prefetch_fraction_of_pinned"] >= 0.8
    t["met_keepL_within_3pct"] = t["keepL_over_off"] <= 1.03
    t["met_pool_zero_allocations"] = t["pool_allocations_after_warmup"] == 0
    t["met_pool_zero_allocations_asymmetric"] = t["pool_allocations_after_warmup_asymmetric"] == 0
    if peers:
        acc = peers["accelerate_offload"]["ms_per_token"]
        res = peers["hf_resident"]["ms_per_token"]
        t["speedup_vs_accelerate_offload"] = acc / stream["ms_per_token"]
        t["met_5x_accelerate"] = t["speedup_vs_accelerate_offload"] >= 5
        t["off_over_hf_resident"] = off["ms_per_token"] / res
        t["met_off_no_slower_than_hf"] = off["ms_per_token"] <= res
        t["leading_ids_matching_hf_resident"] = leading_match(off["token_ids"], peers["hf_resident"]["token_ids"])
    return t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--models", default="/tmp/kestrel-models")
    p.add_argument("--max-new-tokens", type=int, default=10)
    p.add_argument("--offload-tokens", type=int, default=4)
    p.add_argument("--skip-peers", action="store_true")
    p.add_argument("--rows", choices=("all", "q8"), default="all",
                   help="q8: only the bf16 rows the q8 rows are compared with (with --q8-group)")
    p.add_argument("--q8-group", type=int, default=0, help="also quantize (this group size) and add the q8 rows")
    p.add_argument("--out", action="append", default=[], help="also write the record here")
    p.add_argument("--graphs", action="store_true",
                   help="the captured-decode section instead: the GEMV floor, graph against eager, the peer; "
                        "--preset may list several shapes (qwen3-1.7b,qwen3-8b)")
    p.add_argument("--tokens", type=int, default=35, help="--graphs: tokens a row decodes (the statistics skip two)")
    p.add_argument("--compile", action="store_true", help="--graphs: also the rows with torch.compile'd layers")
    p.add_argument("--no-static-peer", action="store_true", help="--graphs: skip transformers' StaticCache + compile")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("stream_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.graphs:
        return graphs_main(args)
    path = ensure_model(args.preset, Path(args.models))
    ceil = copy_ceilings()
    log(f"ceilings: pinned {ceil['pinned_h2d_GBps']:.1f} GB/s, pageable {ceil['pageable_h2d_GBps']:.1f}, d2d {ceil['d2d_GBps_read_plus_write']:.0f}")
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, stop_at_eos=False)
    with Model(path) as model:
        cfg = model.config
        n_layers = model.n_layers
        weight_bytes = sum(i.nbytes for f in model.checkpoint.files.values() for i in f.tensors.values())
        rows = kestrel_rows(model, gen) if args.rows == "all" else baseline_rows(model, gen)
        ab = off_vs_keep_all(model)
    q8 = q8_section(path, args.q8_group, gen, rows, ceil) if args.q8_group else None
    peers = None if args.skip_peers else peer_rows(path, n_layers, args.max_new_tokens, args.offload_tokens)
    record = {
        "model": {"preset": args.preset, "dtype": cfg.torch_dtype, "layers": n_layers, "weight_bytes": weight_bytes},
        "prompt_ids": PROMPT, "max_new_tokens": args.max_new_tokens,
        "ceilings": ceil, "rows": rows, "off_vs_keep_all_interleaved": ab, "peers": peers, "q8": q8,
        "targets": targets(rows, ceil, peers, ab) if args.rows == "all" else {"keepL_over_off": ab["ratio"]},
    }
    if q8:
        record["targets"].update(q8_targets(q8))
    paths = write_record(f"stream_{args.preset}", record, [RESULTS, *map(Path, args.out)])
    print(format_summary(record))
    print("record:", *paths)
    return 0


def graphs_main(args) -> int:
    """Each stage rewrites the one record, so a run cut short still leaves what it measured."""
    import decode_graphs as dg
    from common import utc_stamp

    stamp, name = utc_stamp(), f"decode_graphs_{args.preset.replace(',', '+')}"
    ceil = copy_ceilings()
    log(f"ceilings: pinned {ceil['pinned_h2d_GBps']:.1f} GB/s")
    shapes: dict = {}
    record = {"ceilings": ceil, "prompt_ids": PROMPT, "tokens": args.tokens, "shapes": shapes}

    def save(stage: str) -> list[Path]:
        record["complete"] = stage == "done"
        return write_record(name, record, [RESULTS, *map(Path, args.out)], stamp)

    for preset in args.preset.split(","):
        path = ensure_model(preset, Path(args.models))
        shape: dict = {"pinned_h2d_GBps": ceil["pinned_h2d_GBps"]}
        shapes[preset] = shape
        with Model(path) as model:
            shape["floor"] = dg.gemv_floor(model)
            shape["rows"] = dg.graph_rows(model, args.tokens, compiled=args.compile)
            shape["interleaved"] = dg.off_vs_keep_all(model, args.tokens)
        shape["targets"] = dg.targets(shape)
        save(preset)
        if args.q8_group:
            from kestrel_core.quantize import quantize_checkpoint

            qpath = path.parent / f"{path.name}-q8g{args.q8_group}"
            if not (qpath / "config.json").is_file():
                log(f"quantizing to {qpath}")
                quantize_checkpoint(path, qpath, args.q8_group, device="cuda")
            with Model(qpath) as qmodel:
                shape["q8_rows"] = dg.graph_rows(qmodel, args.tokens, only_off=True, compiled=args.compile)
            q8_off = next(r for r in shape["q8_rows"] if r["label"] == "off" and r["graphs"] == "auto")
            bf16_off = next(r for r in shape["rows"] if r["label"] == "off" and r["graphs"] == "auto")
            shape["targets"]["q8_off_over_bf16_off_graph"] = q8_off["median"] / bf16_off["median"]
            save(preset + " q8")
        if not args.skip_peers:
            shape["peer"] = dg.peers(path, args.tokens, static=not args.no_static_peer)
        log(f"{preset} targets: {shape['targets']}")
    paths = save("done")
    print("record:", *paths)
    return 0


def format_summary(rec: dict) -> str:
    c = rec["ceilings"]
    lines = [f"{rec['model']['preset']} ({rec['model']['weight_bytes'] / 1e9:.1f} GB, {rec['hardware'].get('gpu', '?') if 'hardware' in rec else ''})",
             f"pinned h2d {c['pinned_h2d_GBps']:.1f} GB/s | pageable {c['pageable_h2d_GBps']:.1f} | d2d {c['d2d_GBps_read_plus_write']:.0f}",
             f"{'setting':34} {'ms/tok':>8} {'GB/tok':>7} {'GB/s':>6} {'%pin':>5} {'peak GB':>8} {'allocs*':>7} ids"]
    for r in rec["rows"]:
        pk = (r["peak_device_bytes"] or 0) / 1e9
        lines.append(f"{r['label']:34} {r['ms_per_token']:8.2f} {r['bytes_uploaded_per_token'] / 1e9:7.2f} "
                     f"{r['effective_GBps']:6.1f} {100 * r['effective_GBps'] / c['pinned_h2d_GBps']:5.0f} {pk:8.2f} "
                     f"{r['allocations_after_warmup']:7} {'same' if r['ids_match_off'] else 'DIFF'}")
    if rec["peers"]:
        lines.append(f"transformers resident: {rec['peers']['hf_resident']['ms_per_token']:.1f} ms/tok; "
                     f"accelerate offload: {rec['peers']['accelerate_offload']['ms_per_token']:.1f} ms/tok")
    if rec.get("q8"):
        q = rec["q8"]
        for g in q["gemv"]:
            lines.append(f"q8 gemv {g['n']}x{g['k']} {g['path']:6} device {g['device_ms'] * 1e3:7.1f} us {g['GBps']:6.0f} GB/s "
                         f"{100 * g['fraction_of_d2d']:4.0f}% of d2d | eager {g['eager_ms'] * 1e3:7.1f} us")
        for r in q["rows"]:
            ratio = f"x{r['ratio_to_bf16']:.3f} of bf16" if r["ratio_to_bf16"] else ""
            lines.append(f"{r['label']:34} {r['ms_per_token']:8.2f} {r['bytes_uploaded_per_token'] / 1e9:7.2f} "
                         f"{r['effective_GBps']:6.1f} {ratio} {'same' if r['ids_match_q8_off'] else 'DIFF'}")
        lines.append(f"q8 vs bf16 greedy ids: {q['q8_vs_bf16_leading_ids_of_32']}/32 leading tokens match")
    lines.append("targets: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in rec["targets"].items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
