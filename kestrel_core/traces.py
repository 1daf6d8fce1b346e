"""Routing traces of Mixture-of-Experts runs, and their offline replay against any expert policy.

``kestrel generate --trace FILE`` records, at each sparse layer's decision point, which experts
the router chose. ``kestrel replay`` feeds such a trace to an expert policy at a byte budget
with no model weights and no GPU, and reports its hit rate and bytes a token next to
``expert_belady``, the offline optimum over the same trace (a bound, not a policy to serve with).
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path
from typing import Any

import attrs

from . import newfile
from .errors import ConfigError
from .expert_cache import ExpertCache

FORMAT = "kestrel-expert-trace"
VERSION = 1


def trace_record(model_info: dict, events: list[tuple[str, int, int, list[int]]]) -> dict:
    return {"format": FORMAT, "version": VERSION, "model": model_info,
            "events": [{"phase": p, "token": t, "layer": layer, "experts": list(e)} for p, t, layer, e in events]}


def model_info(run) -> dict:
    """What a replay needs of the model: the expert count, top-k, and each expert unit's bytes in the run's layout."""
    cfg = run.model.config
    return {"dir": str(run.model.dir), "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
            "sparse_layers": [layer for layer in range(cfg.num_hidden_layers) if cfg.moe_layer(layer)],
            "expert_bytes": {f"{k[0]}.{k[1]}": u.nbytes for k, u in run.backend.units.units.items() if len(k) == 2},
            "backend": run.backend.name}


def check_new(path: str | Path) -> Path:
    """Refuse, before any work, a trace path that exists or whose directory does not (or is not writable)."""
    return newfile.check_new(path, "--trace")


def write_new(path: str | Path, record: dict) -> Path:
    """Write ``record`` as JSON to a path that does not exist yet: whole or not at all, never over a file."""
    return newfile.write_text_new(path, json.dumps(record, allow_nan=False), "--trace")


def read_trace(path: str | Path) -> dict:
    """A trace file, checked: a bad one is a one-line error naming what is wrong."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"--trace {path}: cannot read ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--trace {path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ConfigError(f"--trace {path}: not a kestrel expert trace (write one with kestrel generate --trace FILE)")
    if raw.get("version") != VERSION:
        raise ConfigError(f"--trace {path}: trace version {raw.get('version')!r}; this kestrel reads version {VERSION}")
    try:
        m = raw["model"]
        sizes = {tuple(map(int, k.split("."))): int(v) for k, v in m["expert_bytes"].items()}
        events = [(str(e["phase"]), int(e["token"]), int(e["layer"]), [int(x) for x in e["experts"]]) for e in raw["events"]]
        int(m["num_experts_per_tok"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(f"--trace {path}: malformed ({type(exc).__name__}: {exc})") from None
    unknown = [(layer, e) for _, _, layer, experts in events for e in experts if (layer, e) not in sizes]
    if unknown:
        raise ConfigError(f"--trace {path}: event names expert {unknown[0]}, which the trace's model has not")
    return {"model": m, "sizes": sizes, "events": events}


@attrs.define
class _Unit:
    nbytes: int


class ReplayWindow:
    """The part of a run's window an expert policy reads (``resident_units``, ``units``), without a model."""

    def __init__(self, sizes: dict[tuple, int]):
        self.units = {key: _Unit(n) for key, n in sizes.items()}
        self.resident_units: set[tuple] = set()


class ExpertBelady(ExpertCache):
    """The offline optimum over a known trace: evict the resident expert whose next routing is farthest away."""

    name = "expert_belady"

    def __init__(self, budget: int, events: list[tuple[str, int, int, list[int]]]):
        super().__init__(budget)
        self.next_uses: dict[tuple, list[int]] = {}  # expert unit -> the decision points (1, 2, ...) that route to it
        for i, (_, _, layer, experts) in enumerate(events, start=1):
            for e in experts:
                self.next_uses.setdefault((layer, e), []).append(i)

    def rank(self, key: tuple) -> tuple:
        uses = self.next_uses.get(key, [])
        j = bisect.bisect_right(uses, self.clock)  # the clock is the decision point being answered
        return (-(uses[j] if j < len(uses) else float("inf")), key)


def replay(trace: dict, policy: Any) -> dict:
    """Run ``policy`` over the trace's decision points; the hit rate and the bytes fetched, per decoded token too."""
    window = ReplayWindow(trace["sizes"])
    hits = misses = 0
    fetched = 0
    decode_bytes: dict[int, int] = {}
    for phase, token, layer, experts in trace["events"]:
        advice = policy.on_experts_routed(window, layer, experts, phase)
        routed = {(layer, e) for e in experts}
        for key in (advice.evict if advice else ()):
            if key in routed:
                raise ConfigError(f"expert policy {policy.name!r} asked to evict {key}, which layer {layer} has just routed to")
            window.resident_units.discard(tuple(key))
        for key in routed:
            if key in window.resident_units:
                hits += 1
            else:
                misses += 1
                n = window.units[key].nbytes
                fetched += n
                if phase == "decode":
                    decode_bytes[token] = decode_bytes.get(token, 0) + n
                window.resident_units.add(key)
    decode_tokens = sorted({t for p, t, _, _ in trace["events"] if p == "decode"})
    per_token = [decode_bytes.get(t, 0) for t in decode_tokens]
    return {"policy": policy.name, "hits": hits, "misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else float("nan"), "bytes_fetched": fetched,
            "decode_tokens": len(decode_tokens),
            "bytes_per_decoded_token": sum(per_token) / len(per_token) if per_token else 0.0}
