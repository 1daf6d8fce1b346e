"""The scenarios ``python -m bench`` runs, by name. Each is a module of this package with a docstring (its
``--help``), ``add_arguments(parser)``, ``needs_gpu(args)`` (why it cannot run here, or None) and either
``run(args, record) -> result`` (a measurement: the harness writes its record) or ``main(args) -> exit code`` (a
tool that writes no record).
"""

from __future__ import annotations

import importlib

# name -> (module, one line for the overview)
SCENARIOS: dict[str, tuple[str, str]] = {
    "stream": ("stream", "dense decode: off, --compile, streaming keeps and policies, q8, beside the GEMV floor, "
                         "the pinned copy rate and the peers (from stream_bench.py, decode_graphs.py)"),
    "moe": ("moe", "Mixture-of-Experts: off, the expert cache per budget, policy and prefetch, uniform and skewed "
                   "routers, whole-layer streaming, q8, peers (from moe_bench.py)"),
    "moe-gate": ("moe_gate", "the gate for a MoE step's miss path: a kernel reading experts from mapped pinned memory, a "
                             "copy kernel into device slots, and the DMA copy, in one run"),
    "expert-rows": ("expert_rows", "a batched MoE step's experts: the grouped kernels (each expert read once for "
                                   "the rows routed to it) against the one-row kernels a row, from slots and host"),
    "moe-prefill": ("moe_prefill", "a MoE prompt's prefill through the expert cache against off per prompt length, "
                                   "beside the bytes it streamed over the pinned rate, and the prompt chunk swept"),
    "moe-host-cost": ("moe_host_cost", "uniform against skewed routing interleaved, device-busy time and kestrel's "
                                       "host functions of a decode step (from moe_host_cost.py)"),
    "host-tier": ("host_tier", "the cuda host tier at keep=1: all pinned against rings, pages hot and dropped, "
                               "against the copy and O_DIRECT ceilings (from host_tier_bench.py)"),
    "host-fill": ("host_fill", "the host ring's hot path alone: staging from the page cache by mapping, pread or "
                               "kept mapping (from host_fill_bench.py)"),
    "expert-staging": ("expert_staging", "one routed expert staged into the ring, by each of its steps "
                                         "(from expert_staging_bench.py)"),
    "map-register": ("map_register", "uploading from the registered file mapping against the ring's copy "
                                     "(from map_register_bench.py)"),
    "ring-copy": ("ring_copy", "a host-to-device copy from torch-pinned, registered and pageable memory "
                               "(from ring_copy_bench.py)"),
    "q8-gemv": ("q8_gemv", "the q8 GEMV kernel per split count against the torch path and the device copy "
                           "(from q8_gemv_bench.py)"),
    "gguf-gemv": ("gguf_gemv", "the GGUF block kernels (Q4_0 .. Q8_0) at Qwen3-8B and 30B-A3B expert shapes, M = 1, 8 "
                               "and 64, against the device copy and dequantize-then-linear"),
    "host-gemv": ("host_gemv", "the host GGUF GEMV (Q8_0, Q4_0, Q4_K, Q6_K; Q4_1, Q5_0, Q5_1, Q5_K by --types) on the "
                               "CPU's cores at Qwen3-30B-A3B expert and 8B shapes, M = 1 and 8, against the host copy "
                               "rate"),
    "rss-window": ("rss_window", "cpu_ref's mapping RSS per keep against the policy's peak (from rss_window.py)"),
    "rss-experts": ("rss_experts", "cpu_ref's mapping RSS under expert budgets against the resident bytes "
                                   "(from rss_experts.py)"),
    "real-model": ("real_model", "the real trained model (SmolLM2-135M from its GGUF) on cpu_ref: ms/token and peak "
                                 "RSS by keep, each row a fresh process"),
    "batch": ("batch", "batched decoding at B = 1, 4, 16 (bytes streamed a generated token, tokens/s, ids against "
                       "one at a time), then kestrel serve under 1, 8 and 32 streaming clients beside the engine"),
    "speculative": ("speculative", "speculative decoding on the real model (SmolLM2-135M, cpu_ref): plain greedy beside "
                                   "ngram prompt lookup and an always-right drafter, per prompt"),
    "quant-quality": ("quant_quality", "what `kestrel quantize --type` loses on the real model (SmolLM2-135M, cpu_ref): "
                                       "per type, bits a weight, every tensor's RMSE against float32, greedy ids"),
    "grammar": ("grammar", "output held to a JSON schema on the real model (SmolLM2-135M, cpu_ref): ms/token against "
                           "plain greedy in one run, and the grammar libraries' mask cost a token alone"),
    "keep-auto": ("keep_auto", "keep = auto against the keeps picked by hand under several device budgets: what it "
                               "chose, and its ms/token over the best hand-picked keep's"),
    "pipeline": ("pipeline", "layers split over ranks (torchrun, gloo, cpu_ref): one process against 2 and more ranks, "
                             "rank 0's ms/token and each rank's peak RSS, ids against one process's"),
    "verify": ("verify", "a speculative verify pass of K+1 tokens against a one-token step (K = 1, 4, 16, 32, an "
                         "always-right drafter) on a synthetic model, and a small draft model's ms a drafted token"),
    "demo": ("demo", "`kestrel demo --json` as a record (from demo_record.py)"),
    "plot": ("plot", "the README's cost curve from a chosen stream record; measures nothing (from plot_cost_curve.py)"),
}

# name -> (module, one line): commands that measure nothing
TOOLS: dict[str, tuple[str, str]] = {
    "stamp": ("bench.stamp_command", "write bench/results/.stamp.json for a machine that gets the tree without .git"),
    "render": ("bench.render", "render the docs' tables from the records (--check: say where they differ)"),
}


def module(name: str):
    if name in SCENARIOS:
        return importlib.import_module(f"bench.scenarios.{SCENARIOS[name][0]}")
    return importlib.import_module(TOOLS[name][0])
