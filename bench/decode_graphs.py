"""The captured decode step against eager, the GEMV floor and the transformers peer (``stream_bench.py --graphs``).

Every row decodes ``tokens`` steps; its statistics are over the steps after the first two (the
first runs eagerly, the second is captured), so at least 32 steps each.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch
import torch.nn.functional as F

from common import hf_decode, time_cuda_graph

from kestrel_core.config import GenerationConfig, KestrelConfig
from kestrel_core.engine import Model, open_run
from kestrel_core.generate import generate

PROMPT = [785, 3974, 13876, 38835, 34208, 916, 279, 15678]
SKIP = 2  # decode steps left out of the statistics: the eager first step and the capture


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def spread(ms: list[float]) -> dict:
    q = statistics.quantiles(ms, n=10, method="inclusive")
    return {"median": statistics.median(ms), "p10": q[0], "p90": q[-1], "p90_over_p10": q[-1] / q[0], "n": len(ms)}


def gemv_floor(model: Model) -> dict:
    """Every linear weight of the shape (the layers' fused QKV, o, gate-up and down, and lm_head) read once
    with F.linear at batch 1, replayed as one CUDA graph: the device time a decode step cannot beat."""
    cfg = model.config
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes = [(cfg.q_dim + 2 * cfg.kv_dim, h), (h, cfg.q_dim), (2 * i, h), (h, i)] * cfg.num_hidden_layers
    shapes.append((cfg.vocab_size, h))
    weights = [torch.randn(s, dtype=torch.bfloat16, device="cuda") for s in shapes]
    x = {k: torch.randn((1, k), dtype=torch.bfloat16, device="cuda") for k in {s[1] for s in shapes}}

    def all_linears():
        for w in weights:
            F.linear(x[w.shape[1]], w)

    ms = time_cuda_graph(all_linears, calls=1, warmup=3, reps=30)
    nbytes = sum(w.numel() * 2 for w in weights)
    del weights
    gc.collect()
    torch.cuda.empty_cache()
    log(f"GEMV floor: {ms:.3f} ms for {nbytes / 1e9:.2f} GB ({nbytes / ms / 1e9:.2f} TB/s)")
    return {"ms": ms, "bytes": nbytes, "TBps": nbytes / ms / 1e9}


def decode_row(model: Model, label: str, tokens: int, graphs: str, **flags) -> dict:
    cfg = KestrelConfig().override(backend__name="cuda", backend__graphs=graphs, **flags)
    gen = GenerationConfig(max_new_tokens=tokens, stop_at_eos=False)
    with open_run(model, cfg) as run:
        r = generate(run, PROMPT, gen)
    steady = r.decode_ms[SKIP:]
    per = r.per_token[SKIP:]
    bytes_tok = statistics.fmean(p["bytes_uploaded"] for p in per)
    res = cfg.residency
    row = {"label": label, "graphs": graphs, "policy": res.policy if res.windowed else "off", "keep": res.keep,
           "prefetch": cfg.backend.prefetch, "allocator": res.allocator, **spread(steady), "steps": r.steps,
           "bytes_uploaded_per_token": bytes_tok, "effective_GBps": bytes_tok / statistics.median(steady) / 1e6,
           "allocations_after_first_token": sum(p["allocations"] for p in r.per_token[1:]),
           "peak_device_bytes": r.memory.get("device_peak_bytes"), "decode_ms": r.decode_ms, "token_ids": r.token_ids}
    log(f"{label:38} {graphs:5} median {row['median']:8.2f} ms  p10 {row['p10']:8.2f}  p90 {row['p90']:8.2f}  "
        f"{bytes_tok / 1e9:6.2f} GB/tok {row['effective_GBps']:6.1f} GB/s  steps {r.steps}")
    gc.collect()
    torch.cuda.empty_cache()
    return row


def settings(L: int):
    yield "off", dict(residency__keep="off")
    for policy in ("asymmetric", "pinned_set"):
        for keep in (L, L - 1, L // 2, 4, 1):
            for pf in (0, 1):
                yield f"{policy} keep={keep} pf={pf}", dict(residency__policy=policy, residency__keep=keep,
                                                           backend__prefetch=pf)


COMPILED = ("off", "asymmetric keep=1 pf=1")  # the settings also measured with --compile


def graph_rows(model: Model, tokens: int, only_off: bool = False, compiled: bool = False) -> list[dict]:
    """Graph and eager side by side, setting by setting (and with torch.compile'd layers, where asked)."""
    decode_row(model, "warm-up (not recorded)", 8, "auto", residency__keep="off")
    rows = []
    for label, flags in settings(model.n_layers):
        if only_off and label != "off":
            continue
        for graphs in ("auto", "off"):
            rows.append(decode_row(model, label, tokens, graphs, **flags))
    if compiled:
        try:
            decode_row(model, "compile warm-up (not recorded)", 8, "auto", residency__keep="off", backend__compile=True)
            for label, flags in settings(model.n_layers):
                if label in COMPILED and not (only_off and label != "off"):
                    for graphs in ("auto", "off"):
                        rows.append(decode_row(model, label + " +compile", tokens, graphs, backend__compile=True, **flags))
        except Exception as exc:  # recorded with the rows: the compiled path may not run on this stack
            log(f"--compile failed: {type(exc).__name__}: {exc}")
            rows.append({"label": "compile failed", "graphs": "auto", "error": f"{type(exc).__name__}: {str(exc)[:500]}",
                         "token_ids": None, "allocations_after_first_token": 0})
    ref = rows[0]["token_ids"]
    for row in rows:
        row["ids_match_off"] = row["token_ids"] == ref
    return rows


def off_vs_keep_all(model: Model, tokens: int, rounds: int = 3) -> dict:
    """off against asymmetric keep=L, both replayed, run after run in turn so drift hits both alike."""
    steps: dict[str, list[float]] = {"off": [], "keep_all": []}
    for _ in range(rounds):
        for key, keep in (("off", "off"), ("keep_all", model.n_layers)):
            cfg = KestrelConfig().override(backend__name="cuda", residency__keep=keep)
            with open_run(model, cfg) as run:
                steps[key] += generate(run, PROMPT, GenerationConfig(max_new_tokens=tokens, stop_at_eos=False)).decode_ms[SKIP:]
    out = {k: {**spread(v), "decode_ms": v} for k, v in steps.items()}
    out["ratio"] = out["keep_all"]["median"] / out["off"]["median"]
    log(f"interleaved: off {out['off']['median']:.3f} ms, keep={model.n_layers} {out['keep_all']['median']:.3f} (x{out['ratio']:.3f})")
    return out


def _events():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def hf_dynamic(hf, tokens: int) -> dict:
    """transformers' eager greedy decode with its DynamicCache; CUDA-event ms per step."""
    out, times, _ = hf_decode(hf, PROMPT, tokens)
    return {**spread(times[SKIP:]), "decode_ms": times, "token_ids": out}


def hf_static_compiled(hf, tokens: int) -> dict:
    """transformers with a StaticCache of the run's length and torch.compile(mode="reduce-overhead")."""
    from transformers import StaticCache

    max_len = len(PROMPT) + tokens
    try:
        cache = StaticCache(config=hf.config, max_batch_size=1, max_cache_len=max_len, device="cuda", dtype=torch.bfloat16)
    except TypeError:  # newer transformers take fewer arguments
        cache = StaticCache(config=hf.config, max_cache_len=max_len)
    step = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
    times, out = [], []
    t0 = time.perf_counter()
    with torch.inference_mode():
        ids = torch.tensor([PROMPT], device="cuda")
        res = hf(input_ids=ids, past_key_values=cache, cache_position=torch.arange(len(PROMPT), device="cuda"), use_cache=True)
        tok = res.logits[0, -1].argmax().view(1, 1)
        out.append(int(tok))
        for p in range(len(PROMPT), max_len - 1):
            a, b = _events()
            a.record()
            res = step(input_ids=tok, past_key_values=cache, cache_position=torch.tensor([p], device="cuda"), use_cache=True)
            tok = res.logits[0, -1].argmax().view(1, 1).clone()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
            out.append(int(tok))
    wall = time.perf_counter() - t0
    skip = max(SKIP, 3)  # compile and the cudagraph trees' warm-up runs
    return {**spread(times[skip:]), "decode_ms": times, "token_ids": out, "wall_s_with_compile": wall}


def peers(path, tokens: int, static: bool = True) -> dict:
    import transformers
    from transformers import AutoModelForCausalLM

    log("transformers: loading")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).to("cuda").eval()
    out = {"transformers_version": transformers.__version__, "dynamic_cache_eager": hf_dynamic(hf, tokens)}
    log(f"transformers DynamicCache eager: {out['dynamic_cache_eager']['median']:.2f} ms/tok")
    if static:
        try:
            out["static_cache_compiled"] = hf_static_compiled(hf, tokens)
            log(f"transformers StaticCache + compile: {out['static_cache_compiled']['median']:.2f} ms/tok")
        except Exception as exc:  # recorded, not hidden: the peer's best path may not run on this stack
            out["static_cache_compiled"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
            log(f"transformers StaticCache + compile failed: {out['static_cache_compiled']['error']}")
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return out


def targets(shape: dict) -> dict:
    by = {(r["label"], r["graphs"]): r for r in shape["rows"]}
    off = by["off", "auto"]
    t = {"off_graph_over_floor": off["median"] / shape["floor"]["ms"], "off_graph_p90_over_p10": off["p90_over_p10"],
         "off_eager_over_graph": by["off", "off"]["median"] / off["median"],
         "keepL_over_off_interleaved": shape["interleaved"]["ratio"],
         "all_ids_match_off": all(r["ids_match_off"] for r in shape["rows"] if "error" not in r),
         "pool_allocations_after_first_token_graph": sum(r["allocations_after_first_token"] for r in shape["rows"]
                                                         if r["graphs"] == "auto")}
    if ("off +compile", "auto") in by:
        t["off_graph_compile_over_floor"] = by["off +compile", "auto"]["median"] / shape["floor"]["ms"]
        t["off_graph_compile_p90_over_p10"] = by["off +compile", "auto"]["p90_over_p10"]
    if ("asymmetric keep=1 pf=1", "auto") in by:
        g, e = by["asymmetric keep=1 pf=1", "auto"], by["asymmetric keep=1 pf=1", "off"]
        t["stream_keep1_pf1_graph_fraction_of_pinned"] = g["effective_GBps"] / shape["pinned_h2d_GBps"]
        t["stream_keep1_pf1_eager_fraction_of_pinned"] = e["effective_GBps"] / shape["pinned_h2d_GBps"]
    return t
