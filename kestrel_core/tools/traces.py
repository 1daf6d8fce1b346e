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

from kestrel_core.io import newfile
from kestrel_core.errors import ConfigError
from kestrel_core.engine.contracts import ExpertPolicy, member
from kestrel_core.engine.expert_cache import ExpertCache
from kestrel_core.engine.landing import ring_size
from kestrel_core.engine.expert_schedule import ExpertSchedule
from kestrel_core.hookspecs import hookimpl
from kestrel_core.formats.modelconfig import loads, shown
from kestrel_core.io.readfile import read_bounded

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
            "expert_bytes": {f"{u.key[0]}.{u.key[1]}": u.nbytes for u in run.backend.units.experts()},
            "backend": run.backend.name, "expert_decode": "table" if table else "host",
            "lag": 1 if run.config.generation.temperature == 0 else 0, "landing": run.lands,
            "staging": run.config.residency.expert_staging}


def check_new(path: str | Path) -> Path:
    """Refuse, before any work, a trace path that exists or whose directory does not (or is not writable)."""
    if not str(path):
        raise ConfigError("--trace needs a file name, got an empty one; name a new file, e.g. --trace routing.json")
    return newfile.check_new(path, "--trace")


def write_new(path: str | Path, record: dict) -> Path:
    """Write ``record`` as JSON to a path that does not exist yet: whole or not at all, never over a file."""
    return newfile.write_text_new(path, json.dumps(record, allow_nan=False), "--trace")


TRACE_LIMIT = 256 * 2**20  # about 3 million decision points; json.loads needs several times the file's size
PHASES = ("prefill", "decode")
MAX_EXPERTS = 2**14  # as config.json's num_experts
MAX_EXPERT_BYTES = 2**40


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Malformed(Exception):
    pass


def _int(v: Any, what: str, lo: int, hi: int) -> int:
    if not (_is_int(v) and lo <= v <= hi):
        raise _Malformed(f"{what} must be a whole number in {lo}..{hi}, got {shown(v)}")
    return v


def _field(d: dict, key: str, where: str) -> Any:
    if key not in d:
        raise _Malformed(f"{where}{key} is missing")
    return d[key]


def _model(m: Any) -> tuple[int, int, set[int] | None, dict[tuple[int, int], int]]:
    """num_experts, num_experts_per_tok, the sparse layers (None: not recorded) and each expert unit's bytes."""
    if not isinstance(m, dict):
        raise _Malformed(f"model must be an object, got {shown(m)}")
    n = _int(_field(m, "num_experts", "model."), "model.num_experts", 1, MAX_EXPERTS)
    k = _int(_field(m, "num_experts_per_tok", "model."), "model.num_experts_per_tok", 1, n)
    sparse = m.get("sparse_layers")
    if sparse is not None:
        if not (isinstance(sparse, list) and all(_is_int(x) and x >= 0 for x in sparse) and len(set(sparse)) == len(sparse)):
            raise _Malformed(f"model.sparse_layers must be a list of distinct layer numbers, got {shown(sparse)}")
        sparse = set(sparse)
    raw = _field(m, "expert_bytes", "model.")
    if not (isinstance(raw, dict) and raw):
        raise _Malformed(f"model.expert_bytes must be an object of \"layer.expert\": bytes, got {shown(raw)}")
    sizes = {}
    for key, nbytes in raw.items():
        layer, dot, expert = key.partition(".")
        if not (dot and layer.isdigit() and expert.isdigit() and layer.isascii() and expert.isascii()):
            raise _Malformed(f"model.expert_bytes: key {shown(key)} must be \"layer.expert\", e.g. \"1.0\"")
        unit = (int(layer), _int(int(expert), f"model.expert_bytes {key}: the expert", 0, n - 1))
        if sparse is not None and unit[0] not in sparse:
            raise _Malformed(f"model.expert_bytes: {key} is in layer {unit[0]}, which is not one of model.sparse_layers")
        sizes[unit] = _int(nbytes, f"model.expert_bytes {key}", 1, MAX_EXPERT_BYTES)
    return n, k, sparse, sizes


def _events(raw: Any, n: int, k: int, sizes: dict) -> list[tuple[str, int, int, list[int]]]:
    if not isinstance(raw, list):
        raise _Malformed(f"events must be a list, got {shown(raw)}")
    out, last = [], 0
    for i, e in enumerate(raw):
        at = f"event {i}: "
        if not isinstance(e, dict):
            raise _Malformed(f"{at}must be an object, got {shown(e)}")
        phase = _field(e, "phase", at)
        if phase not in PHASES:
            raise _Malformed(f"{at}phase must be one of {', '.join(PHASES)}, got {shown(phase)}")
        token = _int(_field(e, "token", at), f"{at}token", last, 2**62)  # in order: a replay walks them so
        layer = _int(_field(e, "layer", at), f"{at}layer", 0, 2**20)
        experts = _field(e, "experts", at)
        most = k if phase == "decode" else n  # a decode step routes top-k; the prefill, the union over the prompt
        if not (isinstance(experts, list) and all(_is_int(x) and 0 <= x < n for x in experts)
                and len(set(experts)) == len(experts) and 1 <= len(experts) <= most):
            raise _Malformed(f"{at}experts must be a list of 1..{most} distinct expert numbers in 0..{n - 1}, "
                             f"got {shown(experts)}")
        unknown = [x for x in experts if (layer, x) not in sizes]
        if unknown:
            raise _Malformed(f"{at}names expert {(layer, unknown[0])}, which model.expert_bytes has not")
        out.append((phase, token, layer, list(experts)))
        last = token
    return out


def read_trace(path: str | Path) -> dict:
    """A trace file, checked field by field: a bad one is a one-line error naming what is wrong."""
    path = Path(path)
    where = f"--trace {path}"
    raw = loads(read_bounded(path, TRACE_LIMIT, where, "replay a trace of fewer tokens"), where, finite=True)
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ConfigError(f"{where}: not a kestrel expert trace (write one with kestrel generate --trace FILE)")
    if raw.get("version") != VERSION:
        raise ConfigError(f"{where}: trace version {shown(raw.get('version'))}; this kestrel reads version {VERSION}")
    try:
        m = _field(raw, "model", "")
        n, k, _, sizes = _model(m)
        events = _events(_field(raw, "events", ""), n, k, sizes)
    except _Malformed as exc:
        raise ConfigError(f"{where}: malformed: {exc}; record it again with kestrel generate --trace FILE") from None
    return {"model": m, "sizes": sizes, "events": events}


@attrs.define
class _Unit:
    nbytes: int


class ReplayWindow:
    """The part of a run's window an expert policy reads (``resident_units``, ``resident_experts``, ``units``), without
    a model: every resident unit of a replay is an expert."""

    def __init__(self, sizes: dict[tuple, int]):
        self.units = {key: _Unit(n) for key, n in sizes.items()}
        self.resident_units: set[tuple] = set()
        self.admits = True

    @property
    def resident_experts(self) -> dict[tuple, int]:
        return {key: self.units[key].nbytes for key in self.resident_units}

    @property
    def resident_expert_bytes(self) -> int:
        return sum(self.units[key].nbytes for key in self.resident_units)


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
    resident, fetched before use. Where the run landed its misses (``engine.landing``), so does the replay: a ring of
    the size the run's rule gives at this budget, refilled before each step up to its size ahead of the steps read
    back; a step's misses land in it layer by layer, and a miss that finds it empty is not admitted."""
    window = ReplayWindow(trace["sizes"])
    model = trace["model"]
    table = model.get("expert_decode") == "table"
    lag = int(model.get("lag", 1))
    schedule = ExpertSchedule()
    size = 0
    if table and model.get("landing") and member(ExpertPolicy, policy, "lands"):
        sizes = trace["sizes"].values()
        size, _, hold = ring_size(policy.budget, max(sizes), sum(sizes), int(model["num_experts_per_tok"]),
                                  len(model["sparse_layers"]), bool(model.get("staging", True)))
        if hold:
            policy.hold_back(hold)
    head_after = {-1: 0}  # the ring's head after each decode step
    room: dict[int, int] = {}  # a step's free slots as it ran, what it has left of them
    hits = misses = 0
    fetched = read_host = reread = 0  # bytes: fetched; read by a step from host copies; fetched after such a read
    decode_bytes: dict[int, int] = {}
    for phase, token, layer, experts in trace["events"]:
        heard = table and phase == "decode"
        routed = {(layer, e) for e in experts}
        landed: set = set()
        if heard:
            while schedule.next_step <= token - 1 + lag:  # the steps launched before this one (token - 1) is read back
                schedule.begin_step()
            step = token - 1
            if size:
                if step not in room:  # filled at its launch up to ``size`` past the head of the steps read back then
                    head_after[step] = head_after[step - 1]
                    room[step] = head_after.get(step - 1 - lag, 0) + size - head_after[step - 1]
                for e in sorted(experts):
                    if room[step] and schedule.read_host((layer, e), step):
                        room[step] -= 1
                        head_after[step] += 1
                        landed.add((layer, e))
                for key in sorted(landed):
                    n = window.units[key].nbytes
                    fetched += n
                    decode_bytes[token] = decode_bytes.get(token, 0) + n
                    window.resident_units.add(key)
                window.admits = False
        advice = policy.on_experts_routed(window, layer, experts, phase)
        window.admits = True
        evicted = []
        for key in (advice.evict if advice else ()):
            if key in routed:
                raise ConfigError(f"expert policy {policy.name!r} asked to evict {key}, which layer {layer} has just routed to")
            if tuple(key) in window.resident_units:
                window.resident_units.discard(tuple(key))
                evicted.append(tuple(key))
        if heard:
            from_host = {key for key in routed if schedule.read_host(key, token - 1)}
            read_host += sum(window.units[key].nbytes for key in from_host - landed)
            for key in landed:
                schedule.landed(key, token - 1)
            schedule.evict_heard(evicted)
        else:
            from_host = {key for key in routed if key not in window.resident_units}
            schedule.evict_now(evicted, layer)
        hits += len(routed) - len(from_host)
        misses += len(from_host)
        for key in sorted(routed):
            if key not in window.resident_units and not (heard and size):
                n = window.units[key].nbytes
                fetched += n
                if heard and key in from_host:
                    reread += n
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
            "hit_rate": hits / (hits + misses) if hits + misses else None, "bytes_fetched": fetched,  # None: no events
            "bytes_read_host": read_host, "bytes_reread": reread,
            "decode_tokens": len(decode_tokens),
            "bytes_per_decoded_token": sum(per_token) / len(per_token) if per_token else 0.0}
