"""A Mixture-of-Experts prompt's prefill through the expert cache against everything resident (`off`), per prompt
length, beside the bound the link sets (issue 40: within 1.2x of the bytes it streamed over the pinned rate plus off's
prefill), and the prompt chunk's size swept.

    python -m bench moe-prefill --models /tmp/m --layers 8 --prompts 512,2048,8192 --chunks 512,2048,8192
    python -m bench moe-prefill --models /tmp/m --layers 48 --gguf q4_k --prompts 512,2048,8192 --chunks 8192
    python -m bench moe-prefill --backend cpu_ref --preset tiny-moe --layers 2 --prompts 16,48 --chunks 16 \\
        --budget-mib 0.2 --reps 2                                                                   # on the CPU

``--layers`` cuts the depth as ``bench moe`` does (every layer has the full model's shapes); the expert budget is the
full-depth ``--budget-gib`` scaled by layers/full depth (``--budget-mib`` sets it outright). Each prompt length (random
ids, seeded by the length) runs ``--reps`` times, `off` and the cache row interleaved, each generating the one token its
prefill gives, on one loaded model. A row keeps every repetition's prefill ms, the bytes its prefill uploaded (counted
from its first layer, after the preload), its peak device bytes and its first id (equal to off's, or a fault). The
bound of a cache repetition: its bytes over the pinned copy rate measured in the same run, plus off's median prefill.

``--chunks``: the longest prompt through the batch path (``generate_batch``, one sequence, ``prefill_chunk`` each
size) on the cache row's settings, a run opened once, an untimed call first, then ``--reps`` timed calls each.
"""

from __future__ import annotations

import random
import statistics
import time

from bench import models
from bench.errors import BenchError, cuda_backend_missing
from bench.log import log
from bench.observe import observing
from bench.options import numbers
from bench.scenarios.stream import settle
from bench.timing import copy_rates
from kestrel_core.hookspecs import hookimpl

TARGET = 1.2  # issue 40: a prefill through the cache within 1.2x of (bytes streamed / pinned rate + off's prefill)


def add_arguments(p) -> None:
    models.add_arguments(p)
    p.add_argument("--preset", default="qwen3-30b-a3b", help="a MoE preset (tiny-moe with --backend cpu_ref)")
    p.add_argument("--backend", default="cuda", choices=("cuda", "cpu_ref"))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompts", type=numbers(int, 1), default=[512, 2048, 8192],
                   help="prompt lengths in tokens, comma-separated")
    p.add_argument("--chunks", type=numbers(int, 1, none_ok=True), default=[512, 2048, 8192],
                   help="prefill_chunk sizes for the longest prompt (empty: none)")
    models.add_gguf_argument(p)
    p.add_argument("--budget-gib", type=float, default=4.0, help="the expert budget at full depth, scaled by depth")
    p.add_argument("--budget-mib", type=float, default=0.0, help="the expert budget outright (0: --budget-gib scaled)")
    p.add_argument("--policy", default="expert_lru")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions of each row")


def needs_gpu(args) -> str | None:
    return cuda_backend_missing(args, "--backend cpu_ref --preset tiny-moe --layers 2 --prompts 16 --chunks 16 "
                                      "--budget-mib 0.2")


def over_bound(prefill_ms: float, streamed_bytes: int, pinned_GBps: float, off_ms: float) -> float:
    """A prefill through the cache over its bound: its bytes at the pinned copy rate plus off's prefill."""
    return prefill_ms / (streamed_bytes / (pinned_GBps * 1e9) * 1e3 + off_ms)


def prompt_of(n: int, vocab: int) -> list[int]:
    """``n`` ids drawn at random, seeded by ``n``: the same prompt on every run."""
    rng = random.Random(n)
    return [rng.randrange(vocab) for _ in range(n)]


class PrefillStart:
    """The bytes a run had uploaded when its prefill reached its first layer (the preload is before)."""

    def __init__(self) -> None:
        self.uploaded: int | None = None

    @hookimpl
    def on_layer_advance(self, window, layer, phase):
        if phase == "prefill" and self.uploaded is None:
            self.uploaded = window.counters.bytes_uploaded


def prefill(model, settings: dict, prompt: list[int]) -> dict:
    """One prefill (one token generated): its ms, the bytes it uploaded, the device peak and the id."""
    start = PrefillStart()
    with observing(start), model.open(**settings) as run:
        res = run.generate(prompt_ids=prompt, max_new_tokens=1, stop_at_eos=False)
    streamed = res.counters["bytes_uploaded"] - (start.uploaded or 0)
    return {"prefill_ms": res.prefill_ms, "streamed_bytes": streamed, "token_ids": list(res.token_ids),
            "peak_device_bytes": res.memory.get("device_peak_bytes"), "expert_misses": res.counters["expert_misses"]}


def chunked(model, settings: dict, prompt: list[int], chunk: int, reps: int) -> dict:
    """The prompt through ``generate_batch`` in chunks of ``chunk``: an untimed call, then ``reps`` timed ones."""
    times, ids = [], set()
    with model.open(**settings) as run:
        for i in range(reps + 1):
            t0 = time.perf_counter()
            (res,) = run.generate_batch([{"prompt_ids": prompt, "max_new_tokens": 1, "stop_at_eos": False}],
                                        max_batch=1, prefill_chunk=chunk)
            ms = (time.perf_counter() - t0) * 1e3
            if isinstance(res, Exception):
                raise res
            ids.add(tuple(res.token_ids))
            if i:
                times.append(ms)
    return {"chunk": chunk, "ms": times, "p50_ms": statistics.median(times), "token_ids": [list(t) for t in ids]}


def run(args, record) -> dict:
    from kestrel_core import load
    from kestrel_core.tools.presets import PRESETS, preset_config

    lengths, chunks = args.prompts, args.chunks
    full = PRESETS[args.preset]["num_hidden_layers"]
    layers = min(args.layers, full)
    cfg = preset_config(args.preset, layers=layers)
    if not cfg.is_moe:
        raise BenchError(f"preset {args.preset} is not a Mixture-of-Experts model")
    budget_mib = args.budget_mib or args.budget_gib * 1024 * layers / full
    result: dict = {"preset": args.preset, "backend": args.backend, "layers": layers, "full_depth_layers": full,
                    "expert_budget_mib": budget_mib, "policy": args.policy, "reps": args.reps, "target": TARGET}
    pinned = None
    if args.backend == "cuda":
        result["ceilings"] = copy_rates()
        pinned = result["ceilings"]["pinned_h2d"]["GBps"]
        log(f"pinned h2d {pinned:.1f} GB/s")
    path, result["weight_bytes"] = models.ensure_model(args.models, args.preset, layers, args.gguf)
    result["gguf"] = args.gguf or None
    base = {"backend": args.backend, "keep": "off"}
    cache = {**base, "expert_policy": args.policy, "expert_budget_mb": budget_mib}
    rows = []
    with load(path) as model:
        prefill(model, base, [1] * min(lengths))  # warm-up, not recorded
        for n in lengths:
            prompt = prompt_of(n, cfg.vocab_size)
            off, through = [], []
            for _ in range(args.reps):
                off.append(prefill(model, base, prompt))
                settle()
                through.append(prefill(model, cache, prompt))
                settle()
            off_ms = statistics.median(r["prefill_ms"] for r in off)
            entry = {"prompt_tokens": n, "distinct_ids": len(set(prompt)), "off": off, "cache": through, "off_p50_ms": off_ms,
                     "cache_p50_ms": statistics.median(r["prefill_ms"] for r in through),
                     "ids_equal": all(r["token_ids"] == off[0]["token_ids"] for r in off + through)}
            entry["cache_tokens_per_s"] = n / entry["cache_p50_ms"] * 1e3
            entry["off_tokens_per_s"] = n / off_ms * 1e3
            if pinned:
                over = [over_bound(r["prefill_ms"], r["streamed_bytes"], pinned, off_ms) for r in through]
                entry.update(over_bound=over, over_bound_p50=statistics.median(over))
            log(f"{n} tokens: off {off_ms:.1f} ms, cache {entry['cache_p50_ms']:.1f} ms "
                f"({entry['cache_tokens_per_s']:.0f} tokens/s, {through[0]['streamed_bytes'] / 1e9:.2f} GB streamed)"
                + (f", over the bound {entry['over_bound_p50']:.3f}x (target <= {TARGET})" if pinned else "")
                + f", ids equal: {entry['ids_equal']}")
            rows.append(entry)
            record.save_partial({**result, "prompts": rows})
        result["prompts"] = rows
        if chunks:
            longest = rows[-1]
            prompt = prompt_of(longest["prompt_tokens"], cfg.vocab_size)
            sweep = []
            for chunk in chunks:
                c = chunked(model, cache, prompt, chunk, args.reps)
                c["ids_equal_whole"] = c["token_ids"] == [longest["off"][0]["token_ids"]]  # a chunk's shapes may move bits
                log(f"chunk {chunk}: {c['p50_ms']:.1f} ms p50 for {longest['prompt_tokens']} tokens, "
                    f"ids equal the whole prompt's: {c['ids_equal_whole']}")
                sweep.append(c)
                settle()
            result["chunks"] = {"prompt_tokens": longest["prompt_tokens"], "rows": sweep}
    return result
