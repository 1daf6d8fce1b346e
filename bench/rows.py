"""One kestrel row: a run opened with kestrel.toml's settings, one greedy generation, and what it measured.

    from kestrel_core import load
    model = load(path)
    off = row(model, {"backend": "cuda", "keep": "off"}, PROMPT, 34, label="off")
    r = row(model, {"backend": "cuda", "keep": 1, "prefetch": 1}, PROMPT, 34, label="asymmetric keep=1",
            baseline=off, pinned_GBps=ceilings["pinned_h2d"]["GBps"])

Built on the public API only (``model.open(**settings)``, ``run.generate``, the GenerationResult). A row keeps
every decode step's time and mode; its figure (``summary``: n, p10, p50, p90) is over the replayed steps where
the row replayed any, else over the eager steps after the first ``warmup``. The captured step and the eager
steps are listed apart (``captured_ms``, ``eager_ms``). Bytes uploaded a token are the mean over the same steps.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

from bench.stats import by_mode, leading_match, steady_steps, summary


def row(model, settings: dict, prompt_ids: Sequence[int], tokens: int, *, label: str | None = None, warmup: int = 1,
        baseline: dict | None = None, pinned_GBps: float | None = None,
        inspect: Callable | None = None) -> dict:
    """Open a run of ``model`` with ``settings``, generate ``tokens`` ids greedily from ``prompt_ids`` (no stop at
    EOS), and return the row. ``inspect(run, result)`` may add fields read from the open run."""
    t0 = time.perf_counter()
    with model.open(**settings) as run:
        res = run.generate(prompt_ids=list(prompt_ids), max_new_tokens=tokens, stop_at_eos=False)
        extra = inspect(run, res) if inspect else {}
    out = from_result(res, label or describe(settings), settings, warmup=warmup, baseline=baseline,
                      pinned_GBps=pinned_GBps)
    out["wall_s"] = time.perf_counter() - t0
    out.update(extra)
    return out


def from_result(res, label: str, settings: dict, *, warmup: int = 1, baseline: dict | None = None,
                pinned_GBps: float | None = None) -> dict:
    """A row from a GenerationResult (see ``row``)."""
    decode_ms = [float(x) for x in res.decode_ms]
    modes = list(res.step_modes) if len(res.step_modes) == len(decode_ms) else ["eager"] * len(decode_ms)
    mode, steady = steady_steps(modes, warmup)
    per = list(res.per_token)
    split = by_mode(decode_ms, modes)
    s = summary([decode_ms[i] for i in steady])
    bytes_tok = statistics.fmean(per[i]["bytes_uploaded"] for i in steady) if steady and per else 0.0
    out = {
        "label": label, "settings": dict(settings),
        "prompt_ids": list(res.prompt_ids), "token_ids": list(res.token_ids),
        "prefill_ms": res.prefill_ms, "decode_ms": decode_ms, "step_modes": modes, "steps": dict(res.steps),
        "steady_mode": mode, "steady_steps": steady, "warmup_steps": warmup if mode == "eager" else None,
        "summary": s, "captured_ms": split["captured"], "eager_ms": split["eager"],
        "per_mode": {m: summary(v) for m, v in split.items() if v},
        "bytes_uploaded_per_token": bytes_tok,
        "layer_uploads_per_token": statistics.fmean(per[i]["layer_uploads"] for i in steady) if steady and per else 0.0,
        "allocations_after_first_token": sum(p["allocations"] for p in per[1:]),
        "frees_after_first_token": sum(p["frees"] for p in per[1:]),
        "peak_resident_bytes": res.counters.get("peak_resident_bytes"),
        "peak_device_bytes": res.memory.get("device_peak_bytes"),
        "fixed_resident_bytes": res.fixed_resident_bytes,
        "effective_GBps": bytes_tok / s["p50"] / 1e6 if s["p50"] else None,
        "counters": dict(res.counters), "per_token": per, "memory": dict(res.memory),
    }
    if pinned_GBps:
        out["pinned_GBps"] = pinned_GBps
        out["of_pinned"] = out["effective_GBps"] / pinned_GBps if out["effective_GBps"] is not None else None
    if baseline is not None:
        out.update(compare_ids(out, baseline))
    return out


def compare_ids(r: dict, baseline: dict) -> dict:
    """Whether ``r``'s ids equal ``baseline``'s over the shorter of the two (a slow row may generate fewer)."""
    mine, theirs = r.get("token_ids"), baseline.get("token_ids")
    if mine is None or theirs is None:
        return {"baseline": baseline.get("label"), "ids_match_baseline": None}
    n = min(len(mine), len(theirs))
    return {"baseline": baseline.get("label"), "ids_compared": n, "ids_match_baseline": mine[:n] == theirs[:n],
            "leading_ids_match_baseline": leading_match(mine, theirs)}


def describe(settings: dict) -> str:
    """A row's label from its settings: ``off``, ``asymmetric keep=1 prefetch=1``, with what else differs."""
    s = dict(settings)
    s.pop("backend", None)
    keep = s.pop("keep", None)
    policy = s.pop("policy", "asymmetric" if keep not in (None, "off") else None)
    head = "off" if keep in (None, "off") else f"{policy} keep={keep}"
    return " ".join([head, *(f"{k}={v}" for k, v in s.items())])
