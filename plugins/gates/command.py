"""``kestrel gate``: an optimisation's upper bound against what it competes with, and the verdict, before building it.

A command registered through ``register_commands``: ``HELP``, ``add_arguments(parser)``, ``run(args)``.
"""

from __future__ import annotations

from kestrel_core import plugins

from kestrel_core.io import newfile
from kestrel_core.config import parse_ids
from kestrel_core.io.jsonout import emit_json
from kestrel_core.errors import ConfigError

from .context import GateContext, GateOptions
from .figures import KV_LAYOUTS, WEIGHT_BYTES
from .framework import instantiate, make_gate, run_gate
from .render import render

HELP = "benefit gates: compute an optimisation's upper bound and say build / don't build / re-measure, with the flip table"


def add_arguments(p):
    p.add_argument("name", nargs="?", metavar="NAME", help="the gate: see --list (built in: kv-paging, l3-residency, window)")
    p.add_argument("--list", action="store_true", help="list the registered gates")
    p.add_argument("--model", help="model directory; config.json alone is enough without --measure")
    p.add_argument("--max-seq", type=int, help="context length of a KV slot (default 8192, capped at max_position_embeddings)")
    p.add_argument("--slots", type=int, default=1, help="concurrent KV states (default 1)")
    p.add_argument("--fill", type=float, default=0.0, help="written fraction of the context, 0..1 (kv-paging; default 0: the largest bound)")
    p.add_argument("--kv-layout", default="int8", choices=KV_LAYOUTS,
                   help="KV mirror layout: int8 (+ f32 scale per kv head, the seed's), bfloat16/float16/float32, "
                        "or runner (kestrel's KVCache in the backend's compute dtype)")
    p.add_argument("--total-mb", type=float, help="total device memory in MiB (default: measured, a visible GPU, or 32,607)")
    p.add_argument("--peak-mb", type=float, help="peak used in MiB, measured elsewhere (e.g. the seed's 19,625)")
    p.add_argument("--budget-mb", type=int, help="weight-cache budget in MiB (else free memory less a 2 GiB reserve; KESTREL_WCACHE_MB wins)")
    p.add_argument("--weight-dtype", choices=tuple(WEIGHT_BYTES), help="bytes per weight in the device cache (default bfloat16)")
    p.add_argument("--threshold", type=float, help="the gate's threshold (default 0.10, the 10%% rule)")
    p.add_argument("--h2d-gbps", type=float, default=55.0, help="host->device bandwidth for the window's cost (default 55)")
    p.add_argument("--measure", action="store_true", help="run a real generate workload with the memory sampler on")
    p.add_argument("--backend", help="backend for --measure (default cuda where a GPU is visible, else cpu_ref)")
    p.add_argument("--dtype", help="compute dtype for --measure")
    p.add_argument("--device", help="device for --measure, e.g. cuda:1")
    p.add_argument("--prompt-ids", help="prompt of the measured workload (default 1..8)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens the measured workload generates (default 16)")
    p.add_argument("--period-ms", type=float, default=500.0, help="memory sampling period (default 500 ms)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--report", metavar="FILE.md", help="also write a markdown report to this new file (an existing one is never replaced)")


def _list(as_json: bool) -> int:
    regs = plugins.registry("gates")
    rows = []
    for reg in regs.values():
        try:
            rows.append((reg, instantiate(reg), None))
        except Exception as exc:  # one broken plugin must not hide the others
            rows.append((reg, None, f"broken: {exc}"))
    if as_json:
        emit_json([{**(gate.describe() if gate else {"error": err}), "name": reg.name, "package": reg.package,
                    "version": reg.version, "plugin": reg.plugin} for reg, gate, err in rows])
        return 0
    print(f"{'gate':14} {'package':28} {'version':8} what it gates")
    for reg, gate, err in rows:
        print(f"{reg.name:14} {reg.package:28} {reg.version:8} {gate.title if gate else err}")
        if gate:
            print(f"{'':14} bound: {gate.formula}")
            print(f"{'':14} threshold {gate.threshold:.0%}; flip variables: {', '.join(a.name for a in gate.flip_axes)}")
    return 0


def options_from_args(args) -> GateOptions:
    kw = {}
    if args.prompt_ids is not None:
        ids = parse_ids(args.prompt_ids)
        kw["prompt_ids"] = tuple(ids)
    return GateOptions(
        max_seq=args.max_seq, slots=args.slots, fill=args.fill, kv_layout=args.kv_layout,
        total_mb=args.total_mb, peak_mb=args.peak_mb, budget_mb=args.budget_mb, weight_dtype=args.weight_dtype,
        threshold=args.threshold, measure=args.measure, backend=args.backend, dtype=args.dtype, device=args.device,
        max_new_tokens=args.max_new_tokens, period_s=args.period_ms / 1e3, h2d_gbps=args.h2d_gbps, **kw,
    )


def run(args) -> int:
    if args.list:
        return _list(args.json)
    if not args.name:
        raise ConfigError("name a gate (kestrel gate --list shows them), e.g. kestrel gate kv-paging --model DIR")
    gate = make_gate(args.name)  # an unknown name first: "no gate named", not "no model given"
    if not args.model:
        raise ConfigError(f"no model given: kestrel gate {args.name} --model DIR (a directory with config.json)")
    if args.report:
        newfile.check_new(args.report, "--report")  # before the gate runs (--measure takes a while)
    ctx = GateContext(args.model, options_from_args(args), gate.name)
    result = run_gate(gate, ctx)
    if args.report:
        newfile.write_text_new(args.report, render(result, markdown=True), "--report")
    if args.json:
        emit_json(result.to_json())
    else:
        print(render(result), end="")
        if args.report:
            print(f"report written to {args.report}")
    return 0
