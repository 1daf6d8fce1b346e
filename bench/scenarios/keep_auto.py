"""``keep = "auto"`` against the keeps a person would pick by hand, under several device budgets, in one run (issue
40: auto's ms/token within 1.1x of the best hand-picked keep's).

    python -m bench keep-auto --preset qwen3-8b --models /tmp/m --budgets 8192,16384,24576 --tokens 12
    python -m bench keep-auto --backend cpu_ref --preset tiny --budgets 0 --tokens 4     # on the CPU (a smoke run)

Each budget (MiB of the cuda weight-cache budget, ``budget_mb``; 0: the backend's default) gets, one after the other
on one loaded model:

- ``auto``: keep = "auto"; what it chose (``Run.keep_choice``: the keep, its peak of resident layers, the bytes, the
  KV cache counted, an expert cache where it gave one, its line) and the settings it resolved to;
- the hand-picked rows: asymmetric at every keep of {L, L-1, L/2, 8, 4, 2, 1} (and off), with prefetch 1 on cuda and
  the expert policy and budget auto resolved to (a MoE model's), each its ms/token; a keep the backend refuses under
  the budget is kept as refused, with its one-line reason.

Every row keeps every decode step (``bench.rows``). Per budget: auto's ms/token p50 over the best hand-picked row's,
and whether auto's ids equal that row's. On cpu_ref ``budget_mb`` bounds nothing (its budget is the host's available
memory), so the CPU run shows only that the rows run and agree.
"""

from __future__ import annotations

from bench import models
from bench.errors import cuda_backend_missing
from bench.log import log
from bench.prompt import prompt_for
from bench.rows import compare_ids, row
from bench.scenarios.stream import settle

TARGET = 1.1  # issue 40: keep = auto within 1.1x of the best keep picked by hand


def add_arguments(p) -> None:
    models.add_arguments(p)
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N layers of the preset")
    p.add_argument("--backend", default="cuda", choices=("cuda", "cpu_ref"))
    p.add_argument("--budgets", default="8192,16384,24576", help="weight-cache budgets in MiB, comma-separated (0: "
                   "the default)")
    p.add_argument("--tokens", type=int, default=12, help="new tokens a row generates")


def needs_gpu(args) -> str | None:
    return cuda_backend_missing(args, "--backend cpu_ref --preset tiny --budgets 0")


def hand_keeps(n_layers: int) -> list:
    return ["off", *sorted({k for k in (n_layers, n_layers - 1, n_layers // 2, 8, 4, 2, 1) if 1 <= k <= n_layers},
                           reverse=True)]


def _budgets(text: str) -> list[int]:
    from bench.errors import BenchError

    try:
        out = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        out = []
    if not out or any(b < 0 for b in out):
        raise BenchError(f"--budgets {text!r}: MiB as whole numbers >= 0, comma-separated (0: the default)")
    return out


def run(args, record) -> dict:
    from kestrel_core import load
    from kestrel_core.errors import BudgetError

    budgets = _budgets(args.budgets)
    path = models.ensure_preset(args.models, args.preset, layers=args.layers)
    cuda = args.backend == "cuda"
    out = []
    with load(path) as model:
        prompt = prompt_for(model.config.vocab_size)
        for budget in budgets:
            base = {"backend": args.backend, **({"budget_mb": budget} if budget else {})}

            def chose(run, res):
                res_cfg = run.config.residency
                return {"choice": run.keep_choice.to_json() if run.keep_choice else None,
                        "resolved": {"keep": res_cfg.keep, "expert_policy": res_cfg.expert_policy,
                                     "expert_budget_mb": res_cfg.expert_budget_mb, "budget_mb": res_cfg.budget_mb,
                                     "prefetch": run.config.backend.prefetch}}

            try:
                auto = row(model, {**base, "keep": "auto"}, prompt, args.tokens, label=f"auto @ {budget} MiB",
                           inspect=chose)
            except BudgetError as exc:
                log(f"{budget} MiB: keep = auto refused: {exc}")
                out.append({"budget_mb": budget, "auto": {"refused": str(exc)}, "hand": []})
                settle()
                continue
            settle()
            log(f"{budget} MiB: {auto['choice']['why'] if auto['choice'] else 'no choice'}: "
                f"{auto['summary']['p50']:.2f} ms/token p50")
            experts = {k: auto["resolved"][k] for k in ("expert_policy", "expert_budget_mb") if auto["resolved"][k]}
            hand = []
            for keep in hand_keeps(model.n_layers):
                settings = {**base, **experts, "keep": keep}
                if keep != "off":
                    settings.update(policy="asymmetric", prefetch=1 if cuda else 0)
                try:
                    r = row(model, settings, prompt, args.tokens, label=f"keep={keep} @ {budget} MiB", baseline=auto)
                    log(f"  keep={keep}: {r['summary']['p50']:.2f} ms/token p50, ids equal auto's: "
                        f"{r['ids_match_baseline']}")
                except BudgetError as exc:
                    r = {"label": f"keep={keep} @ {budget} MiB", "settings": settings, "refused": str(exc)}
                    log(f"  keep={keep}: refused")
                hand.append(r)
                settle()
            ran = [r for r in hand if "refused" not in r]
            best = min(ran, key=lambda r: r["summary"]["p50"]) if ran else None
            entry = {"budget_mb": budget, "auto": auto, "hand": hand}
            if best is not None:
                entry.update(best_hand=best["label"], auto_over_best=auto["summary"]["p50"] / best["summary"]["p50"],
                             ids_equal_best=compare_ids(auto, best)["ids_match_baseline"])
                log(f"{budget} MiB: auto over the best hand-picked ({best['label']}): {entry['auto_over_best']:.3f}x "
                    f"(target <= {TARGET}: {'met' if entry['auto_over_best'] <= TARGET else 'not met'})")
            out.append(entry)
    return {"preset": args.preset, "layers": args.layers, "backend": args.backend, "tokens": args.tokens,
            "target": TARGET, "budgets": out}
