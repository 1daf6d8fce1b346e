"""The README's picture: decode ms/token against keep, drawn from a stream record (it measures nothing).

    python -m bench plot [RECORD] [--out docs/cost-curve.png]

RECORD defaults to the one the README's headline names: the newest complete ``python -m bench stream --rows sweep``
record of the Qwen3-8B shape on cuda, else the older harness's record of that shape (read through bench/legacy.py).
Each point is a setting's p50 over its replayed steps (graph rows), or over its eager steps where the record has no
graph rows. The picture names its record and commit; the command prints which it drew from.
"""

from __future__ import annotations

import json
from pathlib import Path

from kestrel_core.tools.presets import PRESETS
from bench import legacy, tables
from bench.records import Records, is_new
from bench.stamp import REPO

OUT = REPO / "docs" / "cost-curve.png"


def add_arguments(p) -> None:
    p.add_argument("record", nargs="?", help="a stream record (default: the README headline's)")
    p.add_argument("--out", type=Path, default=OUT, help="the PNG to write")


def source(record: str | None, recs: Records | None = None) -> tuple[str, dict, dict]:
    """(name, record, stream result) to draw: ``record``, else the one the README's headline names."""
    if record is None:
        return tables.stream_source(recs or Records.load(), "qwen3-8b", sweep=True)
    path = Path(record)
    rec = json.loads(path.read_text())
    if is_new(rec):
        return path.name, rec, rec["result"]
    if "shapes" in rec:
        return path.name, rec, legacy.stream_from_decode_graphs(rec, next(iter(rec["shapes"])))
    return path.name, rec, legacy.stream_from_stream_bench(rec)


def curves(rows: list[dict], graphs: str) -> dict[str, list[dict]]:
    """The windowed rows of one graphs mode, grouped by setting (policy, prefetch, allocator), each sorted by keep."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        s = r.get("settings", {})
        if "error" in r or r.get("graphs") != graphs or s.get("keep") in (None, "off") or s.get("compile"):
            continue
        label = s["policy"] + (f", prefetch {s['prefetch']}" if s.get("prefetch") else "") + \
            (f", {s['allocator']}" if s.get("allocator") else "")
        groups.setdefault(label, []).append(r)
    return {k: sorted(v, key=lambda r: r["settings"]["keep"]) for k, v in groups.items()}


def depth(result: dict) -> int | str:
    """The plotted model's layers: its record's, else its preset's (a legacy record names only the preset)."""
    return (result.get("model") or {}).get("layers") or PRESETS.get(result["preset"], {}).get("num_hidden_layers", "?")


def plot(name: str, rec: dict, result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    graphs = "auto" if any(r.get("graphs") == "auto" for r in rows) else "off"
    fig, ax = plt.subplots(figsize=(8, 4.5))
    groups = curves(rows, graphs)
    for label, rs in groups.items():
        ax.plot([r["settings"]["keep"] for r in rs], [r["summary"]["p50"] for r in rs], marker="o", label=label)
    shown = None
    for r in groups.get("asymmetric", []):  # what each keep costs in device memory, where it changes
        if r.get("peak_device_bytes") and round(r["peak_device_bytes"] / 1e8) != shown:
            shown = round(r["peak_device_bytes"] / 1e8)
            ax.annotate(f"{r['peak_device_bytes'] / 1e9:.1f} GB", (r["settings"]["keep"], r["summary"]["p50"]),
                        textcoords="offset points", xytext=(4, -12), fontsize=7)
    off = tables.find(rows, "off", graphs)
    ax.axhline(off["summary"]["p50"], linestyle="--", linewidth=1, color="k",
               label=f"off: every layer resident ({tables.gigabytes(off.get('peak_device_bytes'))})")
    peers = result.get("peers") or {}
    version = (peers.get("versions") or {}).get("transformers") or ""
    for key, text, style in (("transformers-static", "StaticCache + compile", ":"),
                             ("transformers", "DynamicCache, eager", "-.")):
        p = peers.get(key)
        if p and (p.get("summary") or {}).get("p50"):
            ax.axhline(p["summary"]["p50"], linestyle=style, linewidth=1, color="gray",
                       label=f"transformers {version}, resident, {text}")
    ax.set_xlabel("keep (layers the window keeps resident)")
    steps = "replayed steps (CUDA graph)" if graphs == "auto" else "eager steps"
    ax.set_ylabel(f"decode ms/token (p50 of {steps})")
    ax.set_title(f"{result['preset']} shape, {depth(result)} layers, one {tables.gpu_of(rec)}: labels are peak device GB",
                 fontsize=9)
    ax.set_ylim(0, None)
    ax.legend(fontsize=7, loc="upper right")
    commit = rec["stamp"]["commit"] if is_new(rec) else rec.get("commit")
    fig.text(0.01, 0.01, f"record: bench/results/{name} (commit {tables.short(commit)})", fontsize=6, color="gray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, metadata={"Software": None})
    plt.close(fig)


def main(args) -> int:
    name, rec, result = source(args.record)
    plot(name, rec, result, args.out)
    print(f"wrote {args.out} from bench/results/{name}")
    return 0
