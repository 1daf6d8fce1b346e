"""A gate's result as text or markdown: the quantities table, the verdict, the flip tables, the measured runs."""

from __future__ import annotations

import itertools

from .figures import BUILD, DONT_BUILD, KINDS, REMEASURE, SHORT, fmt_ratio, fmt_value
from .framework import GateResult


def _table(header: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def quantities_table(result: GateResult, markdown: bool = False) -> str:
    total = result.total_bytes
    rows = []
    for q in result.quantities:
        share = q.share(total)
        rows.append([q.label, fmt_value(q), "" if share is None else f"{share:.1%}", q.kind, q.source])
    return _table(["quantity", "value", "share of total", "kind", "source"], rows, markdown)


def flip_tables(result: GateResult, markdown: bool = False) -> list[tuple[str, str]]:
    """(caption, table) pairs: rows are the first flip variable, columns the second, one table per other value."""
    axes = result.gate.flip_axes
    cells = {tuple(c.point.get(a.name) for a in axes): c for c in result.cells}
    if not axes:
        return []
    rows_axis, col_axis, rest = axes[0], (axes[1] if len(axes) > 1 else None), axes[2:]
    out = []
    for rest_values in itertools.product(*(a.values for a in rest)) or [()]:
        caption = ", ".join(f"{a.label} {a.fmt(v)}" for a, v in zip(rest, rest_values))
        limit = result.max_position_embeddings
        if limit and any(a.name == "max_seq" and v > limit for a, v in zip(rest, rest_values)):
            caption += f" (beyond this model's max_position_embeddings={limit})"
        header = [rows_axis.label] + ([f"{col_axis.label} {col_axis.fmt(v)}" for v in col_axis.values] if col_axis else ["ratio"])
        rows = []
        for rv in rows_axis.values:
            row = [rows_axis.fmt(rv)]
            for cv in (col_axis.values if col_axis else [None]):
                key = (rv,) + ((cv,) if col_axis else ()) + tuple(rest_values)
                c = cells[key]
                row.append(f"{fmt_ratio(c.evaluation.ratio)} {SHORT[c.evaluation.verdict]}{'*' if c.flips else ''}")
            rows.append(row)
        out.append((caption, _table(header, rows, markdown)))
    return out


def _flip_line(result: GateResult) -> str:
    parts = []
    for axis in result.gate.flip_axes:
        vals = result.flips_one_at_a_time.get(axis.name, [])
        if vals:
            parts.append(f"{axis.label} " + ", ".join(axis.fmt(v) for v in vals))
    if not parts:
        return "no single flip variable on the grid changes the verdict"
    return "; ".join(parts)


def render(result: GateResult, markdown: bool = False) -> str:
    g = result.gate
    h = (lambda s, lvl=2: f"{'#' * lvl} {s}") if markdown else (lambda s, lvl=2: s)
    kinds = {k: sum(q.kind == k for q in result.quantities) for k in KINDS}
    lines = [
        h(f"gate {g.name}: {g.title}", 1),
        "",
        f"model: {result.model} ({result.model_facts})",
        f"mode: {result.mode}; figures: " + ", ".join(f"{n} {k}" for k, n in kinds.items()),
        "",
        quantities_table(result, markdown),
        "",
        f"upper bound: {g.formula}",
        f"against: {g.against}; bound / against = {fmt_ratio(result.current.ratio)} (threshold {result.threshold:.0%})",
        "",
        ("**verdict: " + result.verdict + "**") if markdown else f"verdict: {result.verdict.upper()}",
        result.sentence,
        "",
        f"flips (one variable at a time): {_flip_line(result)}",
        "",
        h("flip table", 2),
        f"bound / against at each point, then the verdict: {SHORT[BUILD]} build, {SHORT[DONT_BUILD]} don't build, "
        f"{SHORT[REMEASURE]} re-measure; * where it differs from the verdict above; n/f: does not fit, nothing left to compete with. "
        "Cards are nominal sizes taken as GiB, idle when fresh.",
    ]
    for caption, table in flip_tables(result, markdown):
        lines += ["", (f"*{caption}*" if markdown else caption) if caption else "", table]
    if result.workloads:
        lines += ["", h("measured runs", 2)]
        for w in result.workloads:
            head = f"- {w.backend}, keep={w.keep}, {w.compute_dtype}: "
            if w.error:
                lines.append(head + f"refused: {w.error}")
            else:
                lines.append(head + f"{w.result.ms_per_token:.2f} ms/token, "
                             f"{w.result.counters['peak_resident_entries']} resident entries at peak")
            if w.memory:
                lines.append("  " + w.memory.describe())
    if result.notes:
        lines += ["", h("notes", 2)] + [f"- {n}" for n in result.notes]
    return "\n".join(lines).replace("\n\n\n", "\n\n") + "\n"
