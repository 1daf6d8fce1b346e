"""cpu_ref's weights mapping RSS under an expert budget, on a Qwen3-30B-A3B-shaped MoE cut to a few layers.

    python bench/rss_experts.py [--layers 2] [--fractions 0.125,0.25,0.5] [--tokens 12] [--model DIR]

The model is the qwen3-30b-a3b preset with ``--layers`` layers (every shape of a layer unchanged:
128 experts of 3 x [768, 2048], top-8; bf16, about 3.5 GiB at 2 layers), written under a temp dir
(or an existing ``--model`` directory). Each run has keep=off (every layer's own unit resident) and
expert_lru with a budget of a fraction of one layer's experts, in cpu_ref's float32 buffers (the
bf16 mapping holds half those bytes), or no expert policy (every expert preloaded, and it stays).

The mapping's RSS (/proc/self/smaps) is read at every decision point (an on_experts_routed
observer, before that point's fetch) and every layer boundary, and after the run. Each sample is
set against the bytes the window's record holds then:

    bound = the page-rounded runs of the file that are resident: header, never-evicted tensors
            (embeddings, lm_head, norms) and every resident unit's tensors, merged where they touch.

``excess`` is RSS minus that bound: pages mapped beyond the resident runs (a read fault maps its
fault-around span or, on Linux 6.18 with large folios, the whole folio, which ``granule_bytes``
measures, and cpu_ref's retire drops only the evicted unit's own pages).

Routers are seeded random matrices, and a random model's routing says nothing of a trained one's. It is
not uniform either: each row's ``routing`` gives, per sparse layer, the distinct experts used in decode,
the busiest expert's share of steps and the share of a step's experts the step before also used
(uniform top-8 of 128: 0.0625). On the 2-layer cut, 72 and 58 of 128 experts over 31 steps, 0.25 and
0.32 reused: the hit rates are above what uniform routing would give, not a worst case.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, write_record  # noqa: E402

from kestrel_core import load, plugins  # noqa: E402
from bench.rss import ResidentRuns, fault_granule  # noqa: E402
from kestrel_core.hookspecs import hookimpl  # noqa: E402
from kestrel_core.presets import preset_config, write_checkpoint  # noqa: E402

MiB = 2**20
PROMPT = [1, 2, 3, 4]
OBSERVER = "rss-experts-bench"


class RssSampler:
    def __init__(self, ckpt, unit_names):
        self.ckpt = ckpt
        self.runs = ResidentRuns(ckpt, unit_names)
        self.samples: list[dict] = []

    def sample(self, window, where, phase):
        names = [e.source for key in window.resident_units for e in window.units[key].entries]
        runs, bound, units = self.runs.of(names)
        self.samples.append({"where": where, "phase": phase, "token": window.token, "rss": self.ckpt.mapping_rss(), "bound": bound,
                             "unit_mapping_bytes": units, "runs": len(runs),
                             "experts": sum(len(k) == 2 for k in window.resident_units)})

    @hookimpl
    def on_experts_routed(self, window, layer, experts, phase):
        self.sample(window, "routed", phase)

    @hookimpl
    def on_layer_advance(self, window, layer, phase):
        self.sample(window, "boundary", phase)


def run_one(model, unit_names, tokens, settings) -> dict:
    sampler = RssSampler(model.checkpoint, unit_names)
    plugins.load_plugins()
    plugins.pm.register(sampler, name=OBSERVER)
    try:
        t0 = time.perf_counter()
        with model.open(keep="off", **settings) as run:
            run.window.routing = []  # (phase, token, layer, experts) at each decision point
            res = run.generate(prompt_ids=PROMPT, max_new_tokens=tokens, stop_at_eos=False)
            sampler.sample(run.window, "end", "end")
            routing = run.window.routing
        wall = time.perf_counter() - t0
    finally:
        plugins.pm.unregister(name=OBSERVER)
    s = sampler.samples
    decode = [x for x in s if x["phase"] in ("decode", "end")]
    steady = [x for x in decode if x["phase"] == "end" or x["token"] >= 2]  # the prefill's overshoot trimmed
    c = res.counters
    routed = c["expert_hits"] + c["expert_misses"]
    per_tok = [p["bytes_uploaded"] for p in res.per_token]
    worst = max(s, key=lambda x: x["rss"] - x["bound"])
    return {
        "peak_mapping_rss_bytes": max(x["rss"] for x in s),
        "peak_bound_bytes": max(x["bound"] for x in s),
        "peak_decode_mapping_rss_bytes": max(x["rss"] for x in decode),
        "median_decode_mapping_rss_bytes": statistics.median(x["rss"] for x in decode),
        "median_decode_bound_bytes": statistics.median(x["bound"] for x in decode),
        "max_excess_bytes": worst["rss"] - worst["bound"],
        "max_excess_at": {k: worst[k] for k in ("where", "phase", "rss", "bound", "runs", "experts")},
        "median_decode_excess_bytes": statistics.median(x["rss"] - x["bound"] for x in decode),
        "samples_over_bound": sum(x["rss"] > x["bound"] for x in s),
        "samples": len(s),
        "peak_resident_experts_decode": max(x["experts"] for x in decode),
        "peak_resident_experts_from_decode_token_2": max(x["experts"] for x in steady),
        "median_resident_expert_mapping_bytes_decode": statistics.median(x["unit_mapping_bytes"] for x in decode),
        "expert_hits": c["expert_hits"], "expert_misses": c["expert_misses"],
        "hit_rate": c["expert_hits"] / routed if routed else None,
        "decode_hit_rate": (sum(p["expert_hits"] for p in res.per_token) /
                            max(1, sum(p["expert_hits"] + p["expert_misses"] for p in res.per_token))),
        "median_bytes_uploaded_per_token": statistics.median(per_tok) if per_tok else 0,
        "mean_bytes_uploaded_per_token": statistics.fmean(per_tok) if per_tok else 0,
        "ms_per_token": res.ms_per_token, "wall_s": wall, "token_ids": res.token_ids,
        "routing": routing_stats(routing),
    }


def routing_stats(routing) -> dict:
    """How uniform the decode routing was, per sparse layer: distinct experts, the busiest one's share, and the hit
    rate a cache of the previous step's experts would have (uniform top-k of n: k / n)."""
    out = {}
    for layer in sorted({r[2] for r in routing}):
        steps = [set(r[3]) for r in routing if r[0] == "decode" and r[2] == layer]
        if not steps:
            continue
        counts: dict[int, int] = {}
        for st in steps:
            for e in st:
                counts[e] = counts.get(e, 0) + 1
        again = [len(a & b) / len(b) for a, b in zip(steps, steps[1:])]
        out[str(layer)] = {"decode_steps": len(steps), "distinct_experts": len(counts),
                           "busiest_share_of_steps": max(counts.values()) / len(steps),
                           "reused_from_previous_step": statistics.fmean(again) if again else None}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--fractions", default="0.125,0.25,0.5", help="expert budgets, as fractions of one layer's experts")
    p.add_argument("--tokens", type=int, default=12)
    p.add_argument("--model", help="an existing qwen3_moe model directory (default: write the cut preset to a temp dir)")
    args = p.parse_args()
    fractions = [float(f) for f in args.fractions.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            path, write_s, preset = Path(args.model), None, None
        else:
            cfg = preset_config("qwen3-30b-a3b", "bfloat16", layers=args.layers)
            t0 = time.perf_counter()
            path = write_checkpoint(cfg, Path(tmp) / "moe")
            write_s = time.perf_counter() - t0
            preset = f"qwen3-30b-a3b --layers {args.layers}"
            print(f"wrote {preset} in {write_s:.0f} s")
        fault = fault_granule(Path(tmp))  # the temp dir's file system (the model's, unless --model)
        rows = []
        with load(path) as model:
            ckpt, mcfg = model.checkpoint, model.config
            unit_names = {n for spec in model.units for n, _ in spec.tensors.values()}
            expert_specs = [s for s in model.units if len(s.key) == 2]
            one_mapping = sum(ckpt.info(n).nbytes for n, _ in expert_specs[0].tensors.values())
            one_buffer = sum(sh[0] * sh[1] for _, sh in expert_specs[0].tensors.values()) * 4  # cpu_ref float32
            sparse = sorted({s.layer for s in expert_specs})
            layer_experts = mcfg.num_experts
            fixed = sum(ckpt.info(n).nbytes for n in ckpt.names() if n not in unit_names)
            experts_total = sum(ckpt.info(n).nbytes for s in expert_specs for n, _ in s.tensors.values())
            tensors = sum(ckpt.info(n).nbytes for n in ckpt.names())
            for frac in fractions + [None]:
                if frac is None:
                    settings, label = {}, "none"
                else:
                    n = max(1, round(frac * layer_experts))
                    settings = {"expert_policy": "expert_lru", "expert_budget_mb": n * one_buffer / MiB}
                    label = f"{frac:g} layer ({n} experts)"
                row = {"budget": label, "budget_fraction_of_layer": frac,
                       "budget_experts": None if frac is None else n,
                       "budget_bytes_float32": None if frac is None else n * one_buffer,
                       **run_one(model, unit_names, args.tokens, settings)}
                rows.append(row)
                hr = "-" if row["hit_rate"] is None else f"{row['hit_rate']:.3f}"
                print(f"{label:24} peak RSS {row['peak_mapping_rss_bytes'] / MiB:9.1f} MiB vs bound "
                      f"{row['peak_bound_bytes'] / MiB:9.1f}; decode median {row['median_decode_mapping_rss_bytes'] / MiB:9.1f} "
                      f"vs {row['median_decode_bound_bytes'] / MiB:9.1f}; excess max {row['max_excess_bytes'] / MiB:6.2f} MiB; "
                      f"hit {hr}; {row['median_bytes_uploaded_per_token'] / MiB:8.1f} MiB up/token; {row['wall_s']:.0f} s")
    record = {
        "model": preset or str(path), "layers": mcfg.num_hidden_layers, "sparse_layers": sparse,
        "num_experts": mcfg.num_experts, "top_k": mcfg.num_experts_per_tok, "dtype": mcfg.torch_dtype,
        "backend": "cpu_ref", "compute_dtype": "float32", "keep": "off", "expert_policy": "expert_lru",
        "expert_mapping_bytes": one_mapping, "expert_buffer_bytes_float32": one_buffer,
        "never_evicted_mapping_bytes": fixed, "all_experts_mapping_bytes": experts_total, "tensor_bytes": tensors,
        "granule_bytes": fault, "write_s": write_s, "prompt_ids": PROMPT, "tokens": args.tokens,
        "notes": "bound = page-rounded resident runs (header + never-evicted tensors + the resident units' tensors, "
                 "merged where they touch), from the window's record at each sample; excess = RSS - bound. "
                 "Budgets are in cpu_ref's float32 buffer bytes, the mapping holds bf16 (half). bytes uploaded are "
                 "float32 buffer bytes. Random routers, not uniform (see each row's routing): hit rates are above a "
                 "uniform router's, and say nothing of a trained model's.",
        "ids_identical_across_budgets": len({tuple(r["token_ids"]) for r in rows}) == 1,
        "rows": rows,
    }
    print("record:", write_record("rss_experts", record, [RESULTS])[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
