"""The one way a bench summarises a series of times: n, p10, p50, p90 (and min, max, mean), and how a decode
row's steps split by the way they ran (eager, captured, replayed)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def summary(values: Sequence[float]) -> dict:
    """n, p10, p50, p90, min, max and mean of ``values``. Percentiles are statistics.quantiles' inclusive method
    (p50 is the median); one value is its own p10, p50 and p90; none gives n=0 and None for the rest."""
    xs = [float(v) for v in values]
    if not xs:
        return {"n": 0, "p10": None, "p50": None, "p90": None, "min": None, "max": None, "mean": None}
    if len(xs) == 1:
        p10 = p90 = xs[0]
    else:
        deciles = statistics.quantiles(xs, n=10, method="inclusive")
        p10, p90 = deciles[0], deciles[-1]
    return {"n": len(xs), "p10": p10, "p50": statistics.median(xs), "p90": p90, "min": min(xs), "max": max(xs),
            "mean": statistics.fmean(xs)}


def by_mode(decode_ms: Sequence[float], step_modes: Sequence[str]) -> dict[str, list[float]]:
    """Each decode step's time under the mode it ran in: {"eager": [...], "captured": [...], "replayed": [...]}."""
    if len(decode_ms) != len(step_modes):
        raise ValueError(f"{len(decode_ms)} decode times but {len(step_modes)} step modes")
    out: dict[str, list[float]] = {"eager": [], "captured": [], "replayed": []}
    for ms, mode in zip(decode_ms, step_modes):
        out.setdefault(mode, []).append(float(ms))
    return out


def steady_steps(step_modes: Sequence[str], warmup: int = 1) -> tuple[str, list[int]]:
    """The decode steps a row's figure is taken over (their indices), and their mode: every replayed step where the
    row replayed any (the captured step and the eager ones are left out), else the eager steps after the first
    ``warmup`` (which fill the pool and, on cuda, pick kernels; all of them where there are no more)."""
    replayed = [i for i, mode in enumerate(step_modes) if mode == "replayed"]
    if replayed:
        return "replayed", replayed
    eager = [i for i, mode in enumerate(step_modes) if mode == "eager"]
    return "eager", eager[warmup:] if len(eager) > warmup else eager


def leading_match(a: Sequence[int] | None, b: Sequence[int] | None) -> int | None:
    """How many leading ids ``a`` and ``b`` share (None where either is missing)."""
    if a is None or b is None:
        return None
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
