"""The window's own cost per layer boundary, keep=L against off, on the CPU backend.

    python -m bench window-overhead [--preset demo] [--repeats 5] [--tokens 64]

Everything stays resident in both settings (keep=L holds every layer, so nothing uploads after the first token):
what a keep=L decode step does beyond off's is the window's bookkeeping at each of its L boundaries (the policy
hooks, the advice merge, the lookups). The two run one after the other, ``--repeats`` times; each repeat gives the
difference of the two runs' median decode steps, divided by L. Every step's time is kept.

Measured through runs (the public API), this includes the step's own noise: the per-boundary figure is resolved only
to about the spread of the repeats' differences, which the record gives beside it. (The older script timed
``Window.advance`` and ``acquire`` in a loop of their own, which reaches into the engine.)
"""

from __future__ import annotations

from bench import models
from bench.log import log
from bench.prompt import prompt_for
from bench.rows import row
from bench.stats import summary


def add_arguments(p) -> None:
    models.add_arguments(p)
    p.add_argument("--preset", default="demo")
    p.add_argument("--model", help="an existing model directory (instead of the preset)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tokens", type=int, default=64)


def run(args, record) -> dict:
    from kestrel_core import load

    path = args.model or models.ensure_preset(args.models, args.preset)
    runs: dict[str, list[dict]] = {"off": [], "keep_all": []}
    with load(path) as model:
        L = model.config.num_hidden_layers
        prompt = prompt_for(model.config.vocab_size)
        row(model, {"backend": "cpu_ref", "keep": "off"}, prompt, 4)  # warm-up, not recorded
        for _ in range(args.repeats):  # interleaved, so drift hits both alike
            for key, keep in (("off", "off"), ("keep_all", L)):
                r = row(model, {"backend": "cpu_ref", "keep": keep}, prompt, args.tokens, label=f"keep={keep}")
                runs[key].append({k: r[k] for k in ("decode_ms", "step_modes", "steady_steps", "summary",
                                                    "bytes_uploaded_per_token", "token_ids")})
    per_boundary_us = [(w["summary"]["p50"] - o["summary"]["p50"]) * 1e3 / L
                       for o, w in zip(runs["off"], runs["keep_all"])]
    out = {"model": str(path), "layers": L, "tokens": args.tokens, "repeats": args.repeats, "runs": runs,
           "off": summary([r["summary"]["p50"] for r in runs["off"]]),
           "keep_all": summary([r["summary"]["p50"] for r in runs["keep_all"]]),
           "window_minus_off_us_per_boundary": summary(per_boundary_us), "per_repeat_us_per_boundary": per_boundary_us,
           "keep_all_uploads_after_first_token": max(r["bytes_uploaded_per_token"] for r in runs["keep_all"]),
           "ids_identical": len({tuple(r["token_ids"]) for rs in runs.values() for r in rs}) == 1}
    s = out["window_minus_off_us_per_boundary"]
    log(f"window - off: {s['p50']:.3f} us per boundary (p10 {s['p10']:.3f}, p90 {s['p90']:.3f}, {args.repeats} repeats)")
    return out
