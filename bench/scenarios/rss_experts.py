"""cpu_ref's weights mapping RSS under an expert budget, on a Qwen3-30B-A3B-shaped MoE cut to a few layers (on the
CPU).

    python -m bench rss-experts [--layers 2] [--fractions 0.125,0.25,0.5] [--tokens 12] [--model DIR]
    python -m bench rss-experts --preset tiny-moe --layers 4 --tokens 6        # seconds

The model is the preset with ``--layers`` layers (every shape of a layer unchanged; qwen3-30b-a3b: 128 experts of
3 x [768, 2048], top-8, about 3.5 GiB of bf16 at 2 layers). Each run has keep=off (every layer's own unit resident)
and expert_lru with a budget of a fraction of one layer's experts, in cpu_ref's float32 buffers (the bf16 mapping
holds half those bytes), or no expert policy (every expert preloaded).

The mapping's RSS (/proc/self/smaps) is read at every decision point (an on_experts_routed observer, before that
point's fetch), every layer boundary, and after the run. Each sample is set against the bytes the window's record
holds then: bound = the page-rounded runs of the file that are resident (header, never-evicted tensors and every
resident unit's tensors, merged where they touch); excess = RSS - bound. The routing each run saw is recorded by
the same observer, and each row gives how uniform it was (random routers are not uniform).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from bench.options import numbers
from bench import models
from bench.log import log
from bench.observe import observing
from bench.prompt import prompt_for
from bench.rows import row
from bench.rss import ResidentRuns, fault_granule, tensor_table
from kestrel_core.formats.units import is_expert
from kestrel_core.hookspecs import hookimpl

MiB = 2**20


def add_arguments(p) -> None:
    models.add_arguments(p)
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--fractions", type=numbers(float, 0), default=[0.125, 0.25, 0.5],
                   help="expert budgets, as fractions of one layer's experts")
    p.add_argument("--tokens", type=int, default=12)
    p.add_argument("--model", type=Path, help="an existing qwen3_moe model directory (instead of the preset)")


class RssSampler:
    """The mapping's RSS against the resident runs at each decision point and boundary, and the routing seen."""

    def __init__(self, runs: ResidentRuns, names_of: dict, files: list[str]):
        self.runs, self.names_of, self.files = runs, names_of, files
        self.samples: list[dict] = []
        self.routing: list[tuple] = []
        self.window = None  # the last one seen: the end sample reads the window as the run leaves it

    def sample(self, window, where: str, phase: str) -> None:
        from kestrel_core.formats.checkpoint import mapping_rss

        self.window = window
        keys = list(window.resident_units)
        runs, bound, units = self.runs.of([n for key in keys for n in self.names_of[key]])
        self.samples.append({"where": where, "phase": phase, "token": window.token, "rss": mapping_rss(self.files),
                             "bound": bound, "unit_mapping_bytes": units, "runs": len(runs),
                             "experts": sum(map(is_expert, keys))})

    @hookimpl
    def on_experts_routed(self, window, layer, experts, phase):
        self.routing.append((phase, window.token, layer, list(experts)))
        self.sample(window, "routed", phase)

    @hookimpl
    def on_layer_advance(self, window, layer, phase):
        self.sample(window, "boundary", phase)


def routing_stats(routing) -> dict:
    """How uniform the decode routing was, per sparse layer: distinct experts, the busiest one's share of steps, and
    the share of a step's experts the step before also used (uniform top-k of n: k / n)."""
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


def run_one(model, sampler_args, tokens: int, settings: dict) -> dict:
    sampler = RssSampler(*sampler_args)
    t0 = time.perf_counter()
    with observing(sampler):
        r = row(model, {"backend": "cpu_ref", "keep": "off", **settings}, prompt_for(model.config.vocab_size), tokens,
                inspect=lambda run, res: sampler.sample(sampler.window, "end", "end") or {})
    wall = time.perf_counter() - t0
    s = sampler.samples
    decode = [x for x in s if x["phase"] in ("decode", "end")]
    steady = [x for x in decode if x["phase"] == "end" or x["token"] >= 2]  # the prefill's overshoot trimmed
    c = r["counters"]
    routed = c["expert_hits"] + c["expert_misses"]
    per_tok = [p["bytes_uploaded"] for p in r["per_token"]]
    worst = max(s, key=lambda x: x["rss"] - x["bound"])
    return {
        "peak_mapping_rss_bytes": max(x["rss"] for x in s), "peak_bound_bytes": max(x["bound"] for x in s),
        "peak_decode_mapping_rss_bytes": max(x["rss"] for x in decode),
        "median_decode_mapping_rss_bytes": statistics.median(x["rss"] for x in decode),
        "median_decode_bound_bytes": statistics.median(x["bound"] for x in decode),
        "max_excess_bytes": worst["rss"] - worst["bound"],
        "max_excess_at": {k: worst[k] for k in ("where", "phase", "rss", "bound", "runs", "experts")},
        "median_decode_excess_bytes": statistics.median(x["rss"] - x["bound"] for x in decode),
        "samples_over_bound": sum(x["rss"] > x["bound"] for x in s), "samples": len(s),
        "peak_resident_experts_decode": max(x["experts"] for x in decode),
        "peak_resident_experts_from_decode_token_2": max(x["experts"] for x in steady),
        "median_resident_expert_mapping_bytes_decode": statistics.median(x["unit_mapping_bytes"] for x in decode),
        "expert_hits": c["expert_hits"], "expert_misses": c["expert_misses"],
        "hit_rate": c["expert_hits"] / routed if routed else None,
        "decode_hit_rate": (sum(p["expert_hits"] for p in r["per_token"]) /
                            max(1, sum(p["expert_hits"] + p["expert_misses"] for p in r["per_token"]))),
        "median_bytes_uploaded_per_token": statistics.median(per_tok) if per_tok else 0,
        "mean_bytes_uploaded_per_token": statistics.fmean(per_tok) if per_tok else 0,
        **{k: r[k] for k in ("decode_ms", "step_modes", "steady_steps", "summary", "token_ids")}, "wall_s": wall,
        "routing": routing_stats(sampler.routing),
    }


def run(args, record) -> dict:
    from kestrel_core import load
    from kestrel_core.formats.tensor_table import unit_specs

    fractions = args.fractions
    if args.model:
        path, write_s = args.model, None
    else:
        t0 = time.perf_counter()
        path = models.ensure_preset(args.models, args.preset, layers=args.layers)
        write_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(dir=Path(path).parent) as tmp:
        granule = fault_granule(Path(tmp))  # the model's file system
    table, files = tensor_table(path)
    rows = []
    with load(path) as model:
        cfg = model.config
        specs = unit_specs(cfg)
        names_of = {spec.key: [name for name, _ in spec.tensors.values()] for spec in specs}
        unit_names = {n for names in names_of.values() for n in names}
        expert_specs = [s for s in specs if is_expert(s.key)]
        one_mapping = sum(table.info(n).nbytes for n, _ in expert_specs[0].tensors.values())
        one_buffer = sum(sh[0] * sh[1] for _, sh in expert_specs[0].tensors.values()) * 4  # cpu_ref float32
        sampler_args = (ResidentRuns(table, unit_names), names_of, files)
        for frac in fractions + [None]:
            if frac is None:
                settings, label, n = {}, "none", None
            else:
                n = max(1, round(frac * cfg.num_experts))
                settings = {"expert_policy": "expert_lru", "expert_budget_mb": n * one_buffer / MiB}
                label = f"{frac:g} layer ({n} experts)"
            r = {"budget": label, "budget_fraction_of_layer": frac, "budget_experts": n,
                 "budget_bytes_float32": None if frac is None else n * one_buffer,
                 **run_one(model, sampler_args, args.tokens, settings)}
            rows.append(r)
            log(f"{label:24} peak RSS {r['peak_mapping_rss_bytes'] / MiB:9.1f} MiB vs bound "
                f"{r['peak_bound_bytes'] / MiB:9.1f}; excess max {r['max_excess_bytes'] / MiB:6.2f} MiB; "
                f"hit {r['hit_rate']}")
            record.save_partial({"rows": rows})
    return {
        "model": str(path), "preset": None if args.model else args.preset, "layers": cfg.num_hidden_layers,
        "sparse_layers": sorted({s.key[0] for s in expert_specs}), "num_experts": cfg.num_experts,
        "top_k": cfg.num_experts_per_tok, "dtype": cfg.torch_dtype, "backend": "cpu_ref", "compute_dtype": "float32",
        "keep": "off", "expert_policy": "expert_lru", "expert_mapping_bytes": one_mapping,
        "expert_buffer_bytes_float32": one_buffer,
        "never_evicted_mapping_bytes": sum(table.info(n).nbytes for n in table.names() if n not in unit_names),
        "all_experts_mapping_bytes": sum(table.info(n).nbytes for s in expert_specs for n, _ in s.tensors.values()),
        "tensor_bytes": sum(table.info(n).nbytes for n in table.names()), "granule_bytes": granule,
        "write_s": write_s, "tokens": args.tokens,
        "notes": "bound = page-rounded resident runs (header + never-evicted tensors + the resident units' tensors, "
                 "merged where they touch), from the window's record at each sample; excess = RSS - bound. Budgets "
                 "are in cpu_ref's float32 buffer bytes; the mapping holds bf16 (half).",
        "ids_identical_across_budgets": len({tuple(r["token_ids"]) for r in rows}) == 1, "rows": rows,
    }
