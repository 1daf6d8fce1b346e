"""The README's picture: decode ms/token against keep, from a committed stream_bench record.

    python bench/plot_cost_curve.py [RECORD] [--out docs/cost-curve.png]

RECORD defaults to bench/results/stream_qwen3-8b_20261202T134400Z.json (Qwen3-8B shape, bf16,
one H200). Every figure drawn is read from the record; nothing is measured here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "bench" / "results" / "stream_qwen3-8b_20261202T134400Z.json"
OUT = ROOT / "docs" / "cost-curve.png"


def curves(rows: list[dict]) -> dict[str, list[dict]]:
    """The windowed rows grouped by setting (policy, allocator, prefetch), each sorted by keep."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if r["keep"] == "off":
            continue
        label = r["policy"] + (f", prefetch {r['prefetch']}" if r["prefetch"] else "") + \
            (f", {r['allocator']}" if r["allocator"] != "pool" else "")
        groups.setdefault(label, []).append(r)
    return {k: sorted(v, key=lambda r: r["keep"]) for k, v in groups.items()}


def plot(record: dict, name: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, peers = record["rows"], record.get("peers", {})
    model = record["model"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, rs in curves(rows).items():
        ax.plot([r["keep"] for r in rs], [r["ms_per_token"] for r in rs], marker="o", label=label)
    shown = None
    for r in curves(rows).get("asymmetric", []):  # what each keep costs in device memory, where it changes
        if r["peak_device_bytes"] == shown:
            continue
        shown = r["peak_device_bytes"]
        ax.annotate(f"{r['peak_device_bytes'] / 1e9:.1f} GB", (r["keep"], r["ms_per_token"]),
                    textcoords="offset points", xytext=(4, -12), fontsize=7)
    off = next(r for r in rows if r["keep"] == "off")
    ax.axhline(off["ms_per_token"], linestyle="--", linewidth=1, color="k",
               label=f"off: every layer resident ({off['peak_device_bytes'] / 1e9:.1f} GB)")
    if "hf_resident" in peers:
        ax.axhline(peers["hf_resident"]["ms_per_token"], linestyle=":", linewidth=1, color="gray",
                   label=f"transformers {peers.get('transformers_version', '')}, resident")
    note = ""
    if "accelerate_offload" in peers:
        note = (f"accelerate {peers.get('accelerate_version', '')} offload, every layer on the CPU: "
                f"{peers['accelerate_offload']['ms_per_token']:.0f} ms/token (off the chart)")
    ax.set_xlabel("keep (layers the window keeps resident)")
    ax.set_ylabel("decode ms/token (median)")
    gpu = record["hardware"].get("gpu", "?")
    ax.set_title(f"{model['preset']} shape, {model['dtype']}, {model['layers']} layers, one {gpu}: "
                 f"labels are peak device GB", fontsize=9)
    if note:
        ax.text(0.99, 0.98, note, transform=ax.transAxes, ha="right", va="top", fontsize=7)
    ax.set_ylim(0, None)
    ax.legend(fontsize=7, loc="center right")
    fig.text(0.01, 0.01, f"record: bench/results/{name} (commit {record['commit'][:7]})",
             fontsize=6, color="gray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, metadata={"Software": None})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("record", nargs="?", default=str(RECORD), help="a stream_bench record (bench/results/stream_*.json)")
    p.add_argument("--out", default=str(OUT), help="the PNG to write")
    args = p.parse_args(argv)
    record = json.loads(Path(args.record).read_text())
    plot(record, Path(args.record).name, Path(args.out))
    print(f"wrote {args.out} from {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
