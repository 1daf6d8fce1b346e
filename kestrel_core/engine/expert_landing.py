"""The expert table's side of a run's steps, each a function of the runner: the experts a table-read step landed in
the ring (``land``) and the ring's refill (``refill``), the table following a plan (``follow_plan``, ``replayed``), a
step's routing heard a step late (``hear_routing``), and a sparse layer's experts as the layer loop reads them:
through the table (``table_experts``) or routed on the host (``host_experts``, ``WaitedWeights``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable

import torch

from kestrel_core.engine.model import route
from kestrel_core.engine.plan import Plan
from kestrel_core.engine.slots import DecodeState
from kestrel_core.formats.units import is_expert


def land(runner, step: int, landed: list[tuple]) -> frozenset[int]:
    """Experts decode step ``step`` (or a step before it not read back) landed in the ring, (key, buffers) each:
    resident from here, read from their slots from the next step; one admitted meanwhile gives its slot's buffers
    back. The experts made resident."""
    window, out = runner.window, set()
    for key, buffers in landed:
        if window.land(key, buffers):
            runner.schedule.landed(key, step)
            out.add(key[1])
        else:
            window.free_slot(runner._slot_like, buffers)
    return frozenset(out)


def refill(runner) -> None:
    """Before a decode step is launched: the landing ring's free slots, up to its size ahead of the head heard."""
    landing, filled = runner.landing, []
    for position in landing.room():
        buffers = runner.window.slot(runner._slot_like)
        landing.filled(position, buffers)
        filled.append((position, buffers))
    if filled:
        runner.backend.landing_fill(filled, landing.tail)


def follow_plan(runner, plan: Plan) -> None:
    """The expert table, where there is one, follows a plan the backend has executed."""
    if runner.schedule is not None:
        host = [r.unit.key for r in plan.evict if is_expert(r.unit.key)]
        slots = [(f.unit.key, f.buffers) for f in plan.fetch if is_expert(f.unit.key)]
        if host or slots:
            runner.schedule.evict_now(host, plan.layer)
            runner.schedule.admit_now((key for key, _ in slots), plan.layer)
            runner.backend.point_experts(host, slots)


def replayed(runner, plans: list[Plan]) -> None:
    """A replayed step's plans: its graph carried them out, table writes included; the expert schedule records them
    as ``execute`` would have."""
    if runner.schedule is None:
        return
    for plan in plans:
        runner.schedule.evict_now([r.unit.key for r in plan.evict if is_expert(r.unit.key)], plan.layer)
        runner.schedule.admit_now([f.unit.key for f in plan.fetch if is_expert(f.unit.key)], plan.layer)


def hear_routing(runner, step: int, routed: list[list[int]], landed: list[tuple] | None = None) -> None:
    """Decode step ``step``'s routing, read back (each sparse layer's experts over the rows heard): the window plans
    on their union a step behind (the expert policy hears it, and the experts the step read from their host copies
    are its misses); the plan's uploads start at once on the side stream, and the table follows them on the
    schedule. ``landed``: where the step lands its misses, the (key, buffers) it landed, which become resident
    layer by layer as each is heard (so that no layer's hearing evicts a later layer's landed experts); the misses
    it could not land are not admitted."""
    window, schedule = runner.window, runner.schedule
    by_layer: dict[int, list] = {}
    for key, buffers in landed or ():
        by_layer.setdefault(key[0], []).append((key, buffers))
    for layer, chosen in zip(runner.sparse, routed):
        experts = sorted(set(chosen))
        missed = {e for e in experts if schedule.read_host((layer, e), step)}
        here = None if landed is None else land(runner, step, by_layer.pop(layer, ()))
        plan = window.hear(layer, experts, "decode", token=step + 1, missed=missed, landed=here)
        if plan.evict or plan.fetch:
            runner.backend.execute(plan)
            host = [r.unit.key for r in plan.evict if is_expert(r.unit.key)]
            schedule.evict_heard(host)
            for f in plan.fetch:
                if is_expert(f.unit.key):
                    schedule.admit_heard(f.unit.key, f.buffers)
            if host:
                runner.backend.point_experts(host, [])


def table_experts(runner, layer: int, state: DecodeState, first_row: int = 0):
    """A sparse layer's experts in a decode step that reads them through the expert table: no host in the loop.
    Each row's routed ids go to the step's output row (from ``first_row``: a micro-batch's), which the host reads
    back a step late."""
    backend, rows = runner.backend, state.routed[runner.sparse.index(layer)]

    def experts(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        rows[first_row:first_row + chosen.shape[0]].copy_(chosen)
        return backend.routed_experts(layer, x, weights, chosen)

    return experts


def host_experts(runner, layer: int, phase: str, prompt_from: int | None = None):
    """A sparse layer's experts routed on the host: at its decision point the host learns the routed experts (the
    one sync a sparse layer needs), the window plans their fetch (the union of the rows'), and the layer reads them
    from their buffers (rows from ``prompt_from`` on a prompt's: ``Backend.fetched_experts``).

    With speculative prefetch, a one-row decode step also applies the next layer's router to this layer's hidden
    state ``x`` and learns its guess in the same sync; their fetch runs on the side stream.
    """
    window, backend, cfg = runner.window, runner.backend, runner.cfg
    n = cfg.num_experts

    def decide(chosen: torch.Tensor, x: torch.Tensor) -> tuple[list[int], dict, Plan]:
        """``used``: one token's experts in slot order (``sparse_mlp`` reads its weights by slot), else the distinct ones."""
        ids = chosen[0] if chosen.shape[0] == 1 else torch.unique(chosen)  # one token's k experts are distinct
        guess = window.guess_router(layer) if phase == "decode" and chosen.shape[0] == 1 else None
        if guess is None:
            used = ids.tolist()
            plan, weights = window.route(layer, sorted(used), phase)
        else:
            key, router = guess
            backend.before_use(key)
            guessed = route(x, router, cfg, backend.linear)[1]
            both = torch.cat((ids, torch.unique(guessed) + n)).tolist()
            used = [e for e in both if e < n]
            plan, weights = window.route(layer, sorted(used), phase, guess=[e - n for e in both if e >= n])
        backend.execute(plan)
        return used, weights, plan

    def experts(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        used, routed, plan = decide(chosen, x)
        out = backend.fetched_experts(x, weights, chosen, used, WaitedWeights(routed, layer, backend.before_use),
                                      prompt_from=prompt_from)
        follow_plan(runner, plan)  # after the layer read its experts: pointing the table waits for their uploads
        return out

    return experts


class WaitedWeights(Mapping):
    """A sparse layer's fetched experts' weights (expert -> buffers), each read after ``before_use`` of its unit: the
    compute of an expert is ordered after its own upload alone, so a backend that streams a prompt chunk's experts on a
    side stream computes those already there (and each one landed) while the rest still cross."""

    def __init__(self, weights: dict, layer: int, before_use: Callable) -> None:
        self._weights, self._layer, self._before_use = weights, layer, before_use

    def __getitem__(self, e: int) -> dict:
        w = self._weights[e]
        self._before_use((self._layer, e))
        return w

    def __iter__(self):
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)
