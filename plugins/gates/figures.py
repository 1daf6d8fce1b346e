"""The gates' vocabulary: units, verdicts, the kinds of figure, a figure (``Quantity``), the defaults, and how a
figure is written."""

from __future__ import annotations

from typing import Any

import attrs

GiB = 2**30
MiB = 2**20

BUILD, DONT_BUILD, REMEASURE = "build", "don't build", "re-measure"
VERDICTS = (BUILD, DONT_BUILD, REMEASURE)
SHORT = {BUILD: "B", DONT_BUILD: "D", REMEASURE: "R"}

# How a figure was obtained; every quantity in the output carries one.
COMPUTED, MEASURED, GIVEN, ASSUMED = "computed", "measured", "given", "assumed"
KINDS = (COMPUTED, MEASURED, GIVEN, ASSUMED)

DEFAULT_THRESHOLD = 0.10  # re-measure once the bound exceeds ~10% of what it competes with
DEFAULT_MAX_SEQ = 8192
# An RTX 5090 as nvidia-smi reports it: the seed's card, assumed when no total is given or visible.
ASSUMED_TOTAL_MIB = 32_607
# Pinned host->device copy measured on the H200 machine (DESIGN.md, "Limits").
DEFAULT_H2D_GBPS = 55.0

# Bytes per weight in the device weight cache. int8 is kestrel's q8 at its default group of 32
# (one f32 scale per 32 weights); int4 approximates Q4_K (about 4.5 bits), the seed's q4.
WEIGHT_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "int8": 1.125, "int4": 0.5625}
KV_LAYOUTS = ("int8", "bfloat16", "float16", "float32", "runner")


def fmt_mib(n: float) -> str:
    """Bytes for a sentence: MiB with thousands separators (as nvidia-smi), small ones in bytes."""
    return f"{n / MiB:,.1f} MiB" if abs(n) >= MiB else f"{n:,.0f} B"


def fmt_bytes(n: float) -> str:
    if abs(n) >= GiB:
        return f"{n / MiB:,.1f} MiB ({n / GiB:,.2f} GiB)"
    if abs(n) >= MiB:
        return f"{n / MiB:,.1f} MiB"
    return f"{n:,.0f} B"


def fmt_ratio(r: float | None) -> str:
    if r is None:
        return "n/f"
    if r >= 10:
        return f"{r:,.0f}x"
    return f"{r:.1%}" if r < 1 else f"{r:.0%}"


def fmt_value(q) -> str:
    """A Quantity's value in its unit; a slot's bytes also exact, as the seed wrote them."""
    v = q.value
    if v is None:
        return "n/a"
    if q.unit == "B":
        s = fmt_bytes(v)
        return f"{v:,.0f} B ({v / MiB:,.1f} MiB)" if q.key.endswith("slot") and MiB <= abs(v) < GiB else s
    if q.unit == "ratio":
        return f"{v:.1%}"
    if q.unit == "ms":
        return f"{v:,.2f} ms"
    if q.unit == "GB/s":
        return f"{v:,.1f} GB/s"
    if q.unit in ("count", "tokens") and isinstance(v, (int, float)):
        return f"{v:,}" if isinstance(v, int) else f"{v:,.2f}"
    return str(v)


@attrs.frozen
class Quantity:
    key: str
    label: str
    value: Any
    unit: str  # "B", "count", "ratio", "ms", "GB/s", "tokens", "" (a label)
    kind: str  # computed | measured | given | assumed
    source: str = ""

    def share(self, total: float | None) -> float | None:
        if self.unit != "B" or not total or not isinstance(self.value, (int, float)):
            return None
        return self.value / total
