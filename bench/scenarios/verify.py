"""What a speculative verify pass of K+1 tokens costs against a one-token decode step, on a synthetic (random-weights)
model, and what a small draft model costs a drafted token.

    python -m bench verify [--preset qwen3-8b] [--backend cuda] [--keep 1] [--ks 1,4,16,32] [--tokens 40]
                           [--repeats 3] [--draft-preset qwen3-0.6b] [--passes 3]

One open run of the target (``--keep``; on cuda with a window, prefetch 1, as the stream and batch scenarios stream).
A warm-up generate of plain greedy decoding gives the answer, which ``oracle`` (bench speculative's always-right
drafter, a drafter plugin) then proposes, so every pass keeps K+1 tokens: the ceiling, where a pass's time is all the
verify costs. Each K also runs once as warm-up. Then, repeat by repeat, plain (``--tokens`` new tokens), then each K
(at least ``--tokens``, and enough for ``--passes`` full passes: 1 + passes x (K+1)), so drift hits all alike. The
plain and drafted sequences run through ``Run.generate_batch`` of one request each (a batch of one, the door
``Run.generate`` takes), with the drafter set per request.

Per row: every pass's (step's) time and mode, each repeat's tokens a pass, p10/p50/p90 (``bench.stats.summary``) over
the plain run's steady steps (replayed where any, else eager after the first) and over the K rows' full passes (those
that kept K+1), ms a token, whether the ids equal plain greedy's (``ids_equal``), and ``pass_over_step``: the median
verify pass over the median one-token step. The target: "K=16 <= 1.15x a step".

``--draft-preset`` (default qwen3-0.6b, the Qwen3-0.6B shape, same vocabulary as the 8B; "" skips it): the draft model
opened as ``--draft MODEL`` opens it (the ``model`` drafter, resident beside the target with its own KV slot), asked
for ``--draft-proposals`` proposals at K = 4 and 16 over a context that grows as if every draft were kept; the row:
every proposal's time and ms a drafted token (median over proposals of time / K). ``--draft-layers`` cuts its depth
(a draft for the tiny preset: ``--draft-preset tiny --draft-layers 2``). On cpu_ref, ``--preset tiny`` runs it all in
seconds.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from bench import models
from bench.errors import BenchError, cuda_backend_missing
from bench.log import log
from bench.options import keep, numbers
from bench.prompt import prompt_for
from bench.scenarios.speculative import Oracle, OraclePlugin
from bench.stats import steady_steps, summary

TARGET_K, TARGET_RATIO = 16, 1.15
DRAFT_KS = (4, 16)

# Shapes the presets table lacks, written the same way (random weights, the byte-level tokenizer).
def add_arguments(p) -> None:
    models.add_arguments(p)
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--backend", default="cuda", choices=("cuda", "cpu_ref"))
    p.add_argument("--keep", default="1", type=keep, help="the target's keep (an int, or off)")
    p.add_argument("--ks", type=numbers(int, 1), default=[1, 4, 16, 32], help="draft tokens a pass, comma-separated")
    p.add_argument("--tokens", type=int, default=40, help="new tokens of the plain run")
    p.add_argument("--passes", type=int, default=3, help="full verify passes each K makes at least")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--draft-preset", default="qwen3-0.6b",
                   help="the draft model's shape, a preset (e.g. qwen3-0.6b); '' skips its row")
    p.add_argument("--draft-layers", type=int, default=None, help="keep only the first N layers of the draft preset")
    p.add_argument("--draft-proposals", type=int, default=8, help="timed proposals at each K (after 2 warm-up ones)")


def needs_gpu(args) -> str | None:
    return cuda_backend_missing(args)


def keep_of(text: str):
    if text == "off":
        return "off"
    try:
        return int(text)
    except ValueError:
        raise BenchError(f"--keep takes a layer count or off, got {text!r}") from None


def ensure_draft(args) -> Path:
    """The draft model's checkpoint: its preset's, written first where it is not there yet."""
    from kestrel_core.tools.presets import PRESETS

    if args.draft_preset not in PRESETS:
        raise BenchError(f"--draft-preset {args.draft_preset!r}: no such preset ({', '.join(PRESETS)}), or '' for none")
    return models.ensure_preset(args.models, args.draft_preset, layers=args.draft_layers)


def lengths(args) -> dict[int, int]:
    """New tokens of each K's runs: at least --tokens, and 1 + passes x (K+1) (the first token comes from prefill)."""
    return {k: max(args.tokens, 1 + args.passes * (k + 1)) for k in args.ks}


def once(run, prompt: list[int], tokens: int, k: int):
    """One sequence through the open run: plain (k = 0) or with the run's drafter at ``k`` drafts a pass."""
    import attrs

    req = run.request(prompt_ids=prompt, max_new_tokens=tokens, stop_at_eos=False)
    req = attrs.evolve(req, drafter=run.drafter if k else None, draft_tokens=k)
    res = run.generate_batch([req], max_batch=1)[0]
    if isinstance(res, Exception):
        raise res
    return res


def plain_entry(res, answer: list[int]) -> dict:
    modes = list(res.step_modes) if len(res.step_modes) == len(res.decode_ms) else ["eager"] * len(res.decode_ms)
    mode, steady = steady_steps(modes)
    return {"step_ms": [float(x) for x in res.decode_ms], "step_modes": modes, "steady_mode": mode,
            "steady_steps": steady, "prefill_ms": res.prefill_ms,
            "ids_equal": list(res.token_ids) == answer[: len(res.token_ids)]}


def verify_entry(res, k: int, answer: list[int]) -> dict:
    kept = list(res.tokens_per_step or [1] * len(res.decode_ms))
    return {"pass_ms": [float(x) for x in res.decode_ms], "tokens_per_pass": kept, "step_modes": list(res.step_modes),
            "full_passes": [i for i, n in enumerate(kept) if n == k + 1], "prefill_ms": res.prefill_ms,
            "ms_per_token": res.ms_per_token, "speculative": res.speculative,
            "ids_equal": list(res.token_ids) == answer[: len(res.token_ids)]}


def plain_row(reps: list[dict], tokens: int) -> dict:
    steady = [r["step_ms"][i] for r in reps for i in r["steady_steps"]]
    s = summary(steady)
    return {"label": "plain", "k": 0, "tokens": tokens, "repeats": reps, "step_ms": steady, "summary": s,
            "ms_per_token": s["p50"], "ids_equal": all(r["ids_equal"] for r in reps)}


def verify_row(k: int, reps: list[dict], tokens: int, step_p50: float | None) -> dict:
    full = [r["pass_ms"][i] for r in reps for i in r["full_passes"]]
    every = [ms for r in reps for ms in r["pass_ms"]]
    s = summary(full)
    kept = sum(sum(r["tokens_per_pass"]) for r in reps)
    return {"label": f"K={k}", "k": k, "tokens": tokens, "repeats": reps, "pass_ms": every, "full_pass_ms": full,
            "summary": s, "summary_all_passes": summary(every),
            "ms_per_token": sum(every) / kept if kept else None,
            "ms_per_token_runs": [r["ms_per_token"] for r in reps],
            "tokens_per_pass_p50": statistics.median(sum(r["tokens_per_pass"]) / len(r["tokens_per_pass"])
                                                     for r in reps if r["tokens_per_pass"]),
            "pass_over_step": s["p50"] / step_p50 if s["p50"] is not None and step_p50 else None,
            "ids_equal": all(r["ids_equal"] for r in reps)}


def draft_row(run, path: Path, prompt: list[int], answer: list[int], proposals: int) -> dict:
    """The draft model as ``--draft MODEL`` opens it (the engine's draft run, handed to the ``model`` drafter), asked
    for proposals directly: each one's time at K = 4 and 16."""
    import attrs

    from kestrel_core.engine.assemble import make_drafter

    drafter, draft_run = make_drafter(attrs.evolve(run.config.speculative, draft=str(path)), run)
    out: dict = {"path": str(path), "weight_bytes": models.weight_bytes(path), "rows": []}
    try:
        for k in DRAFT_KS:
            seq = drafter.begin(prompt)
            context = list(prompt) + answer[:1]
            times = []
            for i in range(2 + proposals):
                t0 = time.perf_counter()
                tokens, _ = seq.propose(context, k)
                ms = (time.perf_counter() - t0) * 1e3
                if len(tokens) != k:
                    raise BenchError(f"the draft model proposed {len(tokens)} of {k} tokens at context {len(context)}")
                if i >= 2:
                    times.append(ms)
                context = context + list(tokens) + [tokens[-1]]  # as if every draft were kept, and one of the target's
            per = [t / k for t in times]
            row = {"k": k, "proposal_ms": times, "summary": summary(times), "ms_per_drafted_token": per,
                   "ms_per_drafted_token_p50": statistics.median(per), "context_end": len(context)}
            out["rows"].append(row)
            log(f"draft model K={k:2}: {row['summary']['p50']:9.3f} ms a proposal, "
                f"{row['ms_per_drafted_token_p50']:8.3f} ms a drafted token")
    finally:
        drafter.close()
        draft_run.close()
    return out


def fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def run(args, record) -> dict:
    from kestrel_core import load, plugins

    if max(args.ks) > 64:
        raise BenchError(f"--ks: at most 64 draft tokens a pass, got {max(args.ks)}")
    if args.tokens < 2 or args.passes < 1 or args.repeats < 1:
        raise BenchError("--tokens must be at least 2, --passes and --repeats at least 1")
    keep = keep_of(args.keep)
    cuda = args.backend == "cuda"
    settings = {"backend": args.backend, "keep": keep, "prefetch": 1 if cuda and keep != "off" else 0}
    n_of = lengths(args)
    n_answer = max([args.tokens, *n_of.values()])
    path = models.ensure_preset(args.models, args.preset)
    draft_path = ensure_draft(args) if args.draft_preset else None
    plugins.load_plugins()
    registered = plugins.pm.get_plugin("bench-oracle") is None and "oracle" not in plugins.registry("drafters")
    if registered:
        plugins.pm.register(OraclePlugin(), name="bench-oracle")
    result: dict = {"preset": args.preset, "backend": args.backend, "keep": args.keep, "settings": settings,
                    "ks": args.ks, "tokens": args.tokens, "tokens_of_k": n_of, "answer_tokens": n_answer,
                    "repeats": args.repeats, "model": {"path": str(path), "weight_bytes": models.weight_bytes(path)}}
    try:
        with load(path) as model:
            cfg = model.config
            prompt = prompt_for(cfg.vocab_size)
            if len(prompt) + n_answer > cfg.max_position_embeddings:
                raise BenchError(f"{len(prompt)} prompt + {n_answer} new tokens exceed the model's "
                                 f"{cfg.max_position_embeddings} positions: lower --tokens, --passes or --ks")
            result["model"].update(dtype=cfg.torch_dtype, layers=cfg.num_hidden_layers)
            result["prompt_ids"] = prompt
            with model.open(**settings, draft="oracle", draft_tokens=max(args.ks)) as run_:
                t0 = time.perf_counter()
                Oracle.answer = []
                answer = list(once(run_, prompt, n_answer, 0).token_ids)  # warm-up, and the oracle's answer
                Oracle.answer = answer
                for k in args.ks:  # warm-up
                    once(run_, prompt, n_of[k], k)
                result["warmup_s"] = time.perf_counter() - t0
                log(f"warm-up: {result['warmup_s']:.1f} s ({n_answer} tokens of answer)")
                plain: list[dict] = []
                spec: dict[int, list[dict]] = {k: [] for k in args.ks}
                for rep in range(args.repeats):
                    plain.append(plain_entry(once(run_, prompt, args.tokens, 0), answer))
                    for k in args.ks:
                        spec[k].append(verify_entry(once(run_, prompt, n_of[k], k), k, answer))
                    record.save_partial({**result, "partial_repeats": rep + 1})
                base = plain_row(plain, args.tokens)
                step = base["summary"]["p50"]
                rows = [base]
                log(f"plain    step p50 {step:9.3f} ms (p10 {base['summary']['p10']:.3f}, p90 "
                    f"{base['summary']['p90']:.3f}, n={base['summary']['n']})  ids equal: {base['ids_equal']}")
                for k in args.ks:
                    r = verify_row(k, spec[k], n_of[k], step)
                    rows.append(r)
                    s = r["summary"]
                    log(f"K={k:<3}    pass p50 {fmt(s['p50'])} ms (p10 {fmt(s['p10'])}, p90 {fmt(s['p90'])}, "
                        f"n={s['n']} full)  x{fmt(r['pass_over_step'])} a step  {fmt(r['ms_per_token'])} ms/token  "
                        f"tokens a pass {r['tokens_per_pass_p50']:.2f}  ids equal: {r['ids_equal']}")
                result["rows"] = rows
                result["ids_equal"] = all(r["ids_equal"] for r in rows)
                at = next((r for r in rows if r["k"] == TARGET_K), None)
                ratio = at["pass_over_step"] if at else None
                result["target"] = {"statement": f"K={TARGET_K} <= {TARGET_RATIO}x a step", "pass_over_step": ratio,
                                    "met": (ratio <= TARGET_RATIO) if ratio is not None else None}
                log(f"target {result['target']['statement']}: {ratio if ratio is None else round(ratio, 3)} "
                    f"met: {result['target']['met']}")
                record.save_partial(result)
                if draft_path is not None:
                    result["draft"] = {"preset": args.draft_preset, "layers": args.draft_layers,
                                       **draft_row(run_, draft_path, prompt, answer, args.draft_proposals)}
    finally:
        if registered:
            plugins.pm.unregister(name="bench-oracle")
    return result
