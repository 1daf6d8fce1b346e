"""Routing traces of Mixture-of-Experts runs, and their offline replay against any expert policy.

``kestrel generate --trace FILE`` records, at each sparse layer's decision point, which experts
the router chose. ``kestrel replay`` feeds such a trace to an expert policy at a byte budget
with no model weights and no GPU, and reports its hit rate and bytes a token next to
``expert_belady``, the offline optimum over the same trace (a bound, not a policy to serve with).
"""

from __future__ import annotations

import bisect
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import attrs

from .errors import ConfigError
from .expert_cache import ExpertCache
from .expert_schedule import ExpertSchedule
from .hookspecs import hookimpl

FORMAT = "kestrel-expert-trace"
VERSION = 1


def trace_record(model_info: dict, events: list[tuple[str, int, int, list[int]]]) -> dict:
    return {"format": FORMAT, "version": VERSION, "model": model_info,
            "events": [{"phase": p, "token": t, "layer": layer, "experts": list(e)} for p, t, layer, e in events]}


class TraceRecorder:
    """An observer of one run (``model.open(cfg, observers=[recorder])``): each decision point's routed experts, as
    (phase, token, layer, experts), in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, int, list[int]]] = []

    @hookimpl
    def on_experts_routed(self, window, layer, experts, phase):
        self.events.append((phase, window.routed_token, layer, list(experts)))


def model_info(run) -> dict:
    """What a replay needs of the model and the run: the expert count, top-k, each expert unit's bytes in the run's
    layout, and whether its decode steps read the expert table (heard ``lag`` steps late: 1 greedy, 0 sampled)."""
    cfg = run.model.config
    table = run.runner.schedule is not None
    return {"dir": str(run.model.dir), "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
            "sparse_layers": [layer for layer in range(cfg.num_hidden_layers) if cfg.moe_layer(layer)],
            "expert_bytes": {f"{k[0]}.{k[1]}": u.nbytes for k, u in run.backend.units.units.items() if len(k) == 2},
            "backend": run.backend.name, "expert_decode": "table" if table else "host",
            "lag": 1 if run.config.generation.temperature == 0 else 0}


def check_new(path: str | Path) -> Path:
    """Refuse, before any work, a trace path that exists or whose directory does not."""
    if not str(path):
        raise ConfigError("--trace needs a file name, got an empty one; name a new file, e.g. --trace routing.json")
    path = Path(path)
    if path.exists() or path.is_symlink():
        raise ConfigError(f"--trace {path} already exists; name a new file (a trace never replaces one)")
    if not path.parent.is_dir():
        raise ConfigError(f"--trace {path}: the directory {path.parent} does not exist")
    return path


def write_new(path: str | Path, record: dict) -> Path:
    """Write ``record`` as JSON to a path that does not exist yet: whole or not at all, never over a file."""
    path = check_new(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)  # fails if the name appeared meanwhile: nothing is overwritten
    except FileExistsError:
        raise ConfigError(f"--trace {path} already exists; name a new file (a trace never replaces one)") from None
    except OSError as exc:
        raise ConfigError(f"cannot write --trace {path}: {exc.strerror or exc}") from None
    finally:
        os.unlink(tmp)
    return path


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
    """Run ``policy`` over the trace's decision points, with the live run's timing; the hit rate and the bytes fetched,
    per decoded token too.

    Where the run's decode steps read the expert table, a step's routing is heard ``lag`` steps late, a miss is a routed
    expert the step read from its host copy, and evictions and admissions reach the table on the run's schedule
    (``expert_schedule``); elsewhere (the prefill, and host-routed decode steps) a miss is a routed expert that was not
    resident, fetched before use."""
    window = ReplayWindow(trace["sizes"])
    model = trace["model"]
    table = model.get("expert_decode") == "table"
    lag = int(model.get("lag", 1))
    schedule = ExpertSchedule()
    hits = misses = 0
    fetched = 0
    decode_bytes: dict[int, int] = {}
    for phase, token, layer, experts in trace["events"]:
        heard = table and phase == "decode"
        if heard:
            while schedule.next_step <= token - 1 + lag:  # the steps launched before this one (token - 1) is read back
                schedule.begin_step()
        advice = policy.on_experts_routed(window, layer, experts, phase)
        routed = {(layer, e) for e in experts}
        evicted = []
        for key in (advice.evict if advice else ()):
            if key in routed:
                raise ConfigError(f"expert policy {policy.name!r} asked to evict {key}, which layer {layer} has just routed to")
            if tuple(key) in window.resident_units:
                window.resident_units.discard(tuple(key))
                evicted.append(tuple(key))
        if heard:
            missed = sum(schedule.read_host(key, token - 1) for key in routed)
            schedule.evict_heard(evicted)
        else:
            missed = sum(key not in window.resident_units for key in routed)
            schedule.evict_now(evicted, layer)
        hits += len(routed) - missed
        misses += missed
        for key in sorted(routed):
            if key not in window.resident_units:
                n = window.units[key].nbytes
                fetched += n
                if phase == "decode":
                    decode_bytes[token] = decode_bytes.get(token, 0) + n
                window.resident_units.add(key)
                if heard:
                    schedule.admit_heard(key)
                else:
                    schedule.admit_now([key], layer)
    decode_tokens = sorted({t for p, t, _, _ in trace["events"] if p == "decode"})
    per_token = [decode_bytes.get(t, 0) for t in decode_tokens]
    return {"policy": policy.name, "hits": hits, "misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else float("nan"), "bytes_fetched": fetched,
            "decode_tokens": len(decode_tokens),
            "bytes_per_decoded_token": sum(per_token) / len(per_token) if per_token else 0.0}
