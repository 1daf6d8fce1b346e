"""JSON on standard output, as every command's ``--json`` writes it: strict JSON (NaN and infinity become null)."""

from __future__ import annotations

import json
import math
import sys


def finite(obj):
    """``obj`` with every NaN and infinity as None: JSON has no such numbers, and strict parsers reject the
    ``NaN`` Python's json writes (ms/token of a one-token run, a ratio over nothing)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def emit_json(obj) -> None:
    json.dump(finite(obj), sys.stdout, indent=1, allow_nan=False)
    sys.stdout.write("\n")
