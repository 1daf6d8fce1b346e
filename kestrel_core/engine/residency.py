"""The residency window: the one record of what is resident, and the plan of each layer boundary. It only plans.

At the boundary before a layer runs, the window asks the run's policy (and every observer) for
advice, and turns the answers into a ``Plan``: the units to evict, the units to fetch, and the
buffer each fetched unit lands in (from the run's allocator). The runner executes every plan
through the backend. With a deterministic allocator, a window that repeats from token to token
repeats its buffers too.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, Callable

import numpy as np

from kestrel_core.engine.contracts import Allocator, BufferFactory, ExpertPolicy, Policy
from kestrel_core.errors import PluginError
from kestrel_core.engine.plan import Advice, Boundary, Counters, Entry, Fetch, Observers, Plan, Resident, TokenPlan
from kestrel_core.formats.units import Unit, UnitKey, UnitTable, is_expert

__all__ = ["Window"]

Router = Callable[[Any, int, list, str], Any]  # (window, layer, experts, phase) -> Advice | None


class Window:
    """What the layer loop asks at each boundary; what policies and observers see as ``window``."""

    def __init__(self, units: UnitTable, factory: BufferFactory, policy: Policy, allocator: Allocator,
                 counters: Counters, n_layers: int, observers: Observers, routers: Iterable[Router] = (),
                 expert_policy: ExpertPolicy | None = None, expert_prefetch: bool = False, whole_layers: bool = False,
                 prefetch_depth: int = 0):
        self.units, self.policy, self.allocator, self.counters = units, policy, allocator, counters
        self.expert_policy = expert_policy  # asked first at each sparse layer's decision point (one of ``routers``)
        self.expert_prefetch = expert_prefetch  # guess the next sparse layer's experts and upload them ahead
        self._guesses: dict[int, frozenset] = {}  # layer -> the expert units guessed for it
        self.whole_layers = whole_layers  # a boundary fetches every unit of its layer (experts too), not only its own
        self._routers = tuple(routers)  # who answers at a decision point before the observers
        self._observers = observers
        self.n_layers = n_layers
        self.sparse = [len(units.of_layer(layer)) > 1 for layer in range(n_layers)]  # a layer with experts
        self.keep = policy.keep
        self.phase = "prefill"
        self.token = 0
        self.routed_token = 0  # the pass whose routing is being answered: ``token``, or an earlier one heard late
        self.admits = True  # False while a landed step is heard: a routed expert not resident is not admitted
        self.signatures: list[tuple] = []  # this token's plans, as Plan.signature (no buffer kept alive)
        self.last_signatures: list[tuple] = []  # the previous token's
        self._resident: dict[UnitKey, Resident] = {}
        self._experts: dict[UnitKey, int] = {}  # the resident expert units and their bytes, kept as they change
        self._expert_bytes = 0
        self._idle: dict[tuple[int, str], Plan] = {}
        self._layers: frozenset[int] | None = frozenset()
        self._entries = {u.key: tuple(Entry(u.layer, e.name, e.geometry, factory, u.key) for e in u.entries)
                         for u in units.units.values()}
        # Layers a backend uploads ahead on a side stream (0 where it cannot overlap, or without a window).
        self.prefetch_depth = prefetch_depth if policy.windowed else 0

    # --- what policies read ---------------------------------------------------------------
    @property
    def resident(self) -> frozenset[int]:
        """The layers with a resident unit."""
        if self._layers is None:
            self._layers = frozenset(r.unit.layer for r in self._resident.values())
        return self._layers

    @property
    def resident_units(self) -> frozenset[UnitKey]:
        return frozenset(self._resident)

    @property
    def resident_bytes(self) -> int:
        return sum(r.unit.nbytes for r in self._resident.values())

    @property
    def resident_experts(self) -> Mapping[UnitKey, int]:
        """The resident expert units and each one's bytes (a live, read-only view: an expert policy asks at every
        sparse layer, and this costs nothing to read)."""
        return MappingProxyType(self._experts)

    @property
    def resident_expert_bytes(self) -> int:
        return self._expert_bytes

    def horizon(self, layer: int) -> list[int]:
        """The layers a prefetching backend wants next after ``layer`` (the loop wraps to the next token)."""
        return [(layer + d) % self.n_layers for d in range(1, self.prefetch_depth + 1)]

    # --- the boundary ---------------------------------------------------------------------
    def boundaries(self, phase: str) -> Iterator[Boundary]:
        """One token's boundaries in layer order, each planned as the loop reaches it (executing is the runner's)."""
        for layer in range(self.n_layers):
            plan = self.plan(layer, phase)
            reads = self._resident[(layer,)]
            self._note(plan, reads.buffers)
            # The weights as planned here: by the end of the token a later boundary may have evicted them.
            yield Boundary(plan, (layer,), reads.weights)

    def plan_token(self, phase: str) -> TokenPlan:
        """Every boundary of one token planned now, none executed: ``signatures`` then holds the whole token,
        which is what a captured step must match."""
        return TokenPlan(self.boundaries(phase))

    def _note(self, plan: Plan, reads: Iterable) -> None:
        """Note what must repeat for a captured step to be replayed: the plan (units and buffers), and the buffers the
        layer then reads, which a plan that changed nothing can still have handed to other units tokens ago."""
        self.signatures.append((plan.signature if plan.evict or plan.fetch else plan.layer, tuple(map(id, reads))))

    def plan(self, layer: int, phase: str) -> Plan:
        """Turn the policy's and observers' advice into this boundary's plan, updating the record."""
        self.phase = phase
        evict, ahead = self._merged(self._advice(layer, phase))
        # A sparse layer's experts are fetched once routed (``route``), unless whole layers stream.
        current = self.units.of_layer(layer) if self.whole_layers else (self.units[(layer,)],)
        if self.prefetch_depth:
            ahead += [u.key for d in self.horizon(layer) for u in
                      (self.units.of_layer(d) if self.whole_layers else (self.units[(d,)],))]
        resident = self._resident
        if not evict and not ahead and all(u.key in resident for u in current):
            idle = self._idle.get((layer, phase))  # the steady state of a resident layer: nothing to do
            if idle is None:
                idle = self._idle[layer, phase] = Plan(layer, phase)
            return idle
        if any(u.key in evict for u in current):
            raise PluginError(f"policy {self.policy.name!r} asked to evict layer {layer}, which is about to run")
        evicted = tuple(self._evict(key) for key in sorted(evict) if key in resident)
        fetch = [self._fetch(u, ahead=False) for u in current if u.key not in resident]
        for key in ahead:
            if key not in resident:
                fetch.append(self._fetch(self.units[key], ahead=True))
        return Plan(layer, phase, evicted, tuple(fetch))

    def guess_router(self, layer: int) -> tuple[UnitKey, Any] | None:
        """The next layer's unit key and router weights, where speculative prefetch is on, that layer is sparse and
        its unit is resident (a guess needs them); else None. The runner orders its read after the unit's upload."""
        nxt = layer + 1
        if not self.expert_prefetch or nxt >= self.n_layers or not self.sparse[nxt]:
            return None
        r = self._resident.get((nxt,))
        if r is None:
            return None
        return (nxt,), r.weights["router"]

    def route(self, layer: int, experts: list[int], phase: str, guess: Iterable[int] = ()) -> tuple[Plan, dict]:
        """The decision point after a sparse layer's router: plan the fetch of the routed ``experts`` (with what the
        expert policy, the policy and the observers advise); the plan and each routed expert's weights.

        ``guess``: the experts layer+1's router picks from this layer's hidden state; those not resident
        are fetched ahead (a side-stream backend overlaps them with this layer's experts). Recall is
        counted at layer+1's decision point.
        """
        routed = {(layer, e) for e in experts}
        guessed = self._guesses.pop(layer, None)
        if guessed is not None:
            self.counters.expert_guessed += len(routed)
            self.counters.expert_guess_hits += len(routed & guessed)
        self.routed_token = self.token
        evicted, fetch = self._routed(layer, experts, phase, now=True)
        resident = self._resident
        if guess:
            spec = self._guesses[layer + 1] = frozenset((layer + 1, e) for e in guess)
            ahead_now = [self._fetch(self.units[key], ahead=True) for key in sorted(spec) if key not in resident]
            self.counters.expert_prefetches += len(ahead_now)
            fetch += ahead_now
        plan = Plan(layer, phase, evicted, tuple(fetch))
        reads = [resident[(layer, e)] for e in experts]
        self._note(plan, [b for r in reads for b in r.buffers])
        return plan, {e: r.weights for e, r in zip(experts, reads)}

    def hear(self, layer: int, experts: list[int], phase: str, token: int, missed: set[int],
             landed: frozenset[int] | None = None) -> Plan:
        """A decode step's routing at a sparse layer, heard once the step is read back (it read its experts through the
        expert table): the same advice as ``route``, a step behind. ``missed``: the routed experts the step read from
        their host copies, its misses. The plan fetches ahead (for later steps) the routed experts that are not resident,
        of a layer still resident (an expert goes with its layer); the runner's schedule brings them to the table.
        ``token`` is the heard step's. ``landed``: where the step landed its misses (``engine.landing``), those it
        landed (resident already, by ``land``); the misses it could not land are not admitted (``admits``)."""
        self.routed_token = token
        self.admits = landed is None
        try:
            evicted, fetch = self._routed(layer, experts, phase, now=False, missed=missed, landed=landed or frozenset())
        finally:
            self.admits = True
        return Plan(layer, "heard", evicted, tuple(fetch))  # a backend uploads a heard plan where no step waits for it

    def land(self, key: UnitKey, buffers: tuple) -> bool:
        """A decode step landed expert ``key`` in ``buffers`` (a ring slot's, ``slot``): it is resident from here, its
        read the upload. False where it was resident already (admitted meanwhile): the slot's buffers are free again."""
        if key in self._resident:
            return False
        self._admit(self.units[key], buffers)
        self.counters.expert_landed += 1
        return True

    def slot(self, like: UnitKey) -> tuple:
        """Buffers for one expert of ``like``'s geometry that no unit holds yet (a landing ring's slot)."""
        return self._alloc(like, self._entries[like])

    def free_slot(self, like: UnitKey, buffers: tuple) -> None:
        for entry, buf in zip(self._entries[like], buffers):
            self._release(entry, buf)

    def _routed(self, layer: int, experts: list[int], phase: str, now: bool,
                missed: set[int] | None = None, landed: frozenset[int] = frozenset()) -> tuple[tuple, list]:
        """Ask the expert policy, the policy and the observers about a routing; count and plan it: (evicted, fetches).
        The routed experts that are not resident come in, for this step (``now``) or ahead, for later ones."""
        routed = {(layer, e) for e in experts}
        answers = [fn(self, layer, experts, phase) for fn in self._routers]
        answers += [fn(window=self, layer=layer, experts=experts, phase=phase) for fn in self._observers.on_experts_routed]
        evict, ahead = self._merged(self._checked(answers, "on_experts_routed"))
        clash = sorted(routed & evict)
        if clash:
            raise PluginError(f"policy {self.policy.name!r} asked to evict expert unit {clash[0]}, which layer {layer} "
                              "has just routed to")
        resident = self._resident
        evicted = tuple(self._evict(key) for key in sorted(evict) if key in resident)
        missing = sorted(key for key in routed if key not in resident)
        misses = len(missing) if missed is None else len(missed)  # heard late: what the step itself found
        c = self.counters
        c.expert_hits += len(routed) - misses
        c.expert_misses += misses
        if not now and ((layer,) not in resident or not self.admits):
            missing = []  # the layer left since the step (its experts would go with it), or the step landed its own
        if missed:  # heard: the step read these from their host copies (the landed ones into slots: their uploads);
            # an admission of one reads it again
            c.bytes_read_host += sum(self.units[(layer, e)].nbytes for e in missed if e not in landed)
            c.bytes_reread += sum(self.units[key].nbytes for key in missing if key[1] in missed)
        fetch = [self._fetch(self.units[key], ahead=not now) for key in missing]
        if not now and not self.admits:
            # A landed step admits nothing at its hearing, prefetch advice either: an expert admitted here would be
            # pointed at from a later step, while the table may still point at a slot the step landed it in
            ahead = []
        fetch += [self._fetch(self.units[key], ahead=True) for key in ahead if key not in resident and key not in routed]
        return evicted, fetch

    def preload(self) -> Plan | None:
        """Before a generation: the plan that uploads what the policy's and the observers' preload answers ask for."""
        layers: set[int] = set()
        for answer in [self.policy.preload(self), *(fn(window=self) for fn in self._observers.preload)]:
            if answer is None:
                continue
            if isinstance(answer, (str, bytes)) or not isinstance(answer, Iterable):
                raise PluginError(f"preload must return layer numbers (e.g. range(n) or []) or None, got {answer!r}")
            layers.update(self._layer(x, "preload") for x in answer)
        # With an expert policy, experts come in only when routed to: a preload brings the layers' own units.
        preloaded = (lambda u: not is_expert(u.key)) if self.expert_policy is not None else (lambda u: True)
        fetch = tuple(self._fetch(u, ahead=False) for layer in sorted(layers) for u in self.units.of_layer(layer)
                      if u.key not in self._resident and preloaded(u))
        return Plan(-1, "preload", (), fetch) if fetch else None

    def next_token(self) -> None:
        """The loop wraps: the token just finished's plans become the last token's (``step_graphs`` compares a
        token's plans with them)."""
        self.token += 1
        self.last_signatures, self.signatures = self.signatures, []

    def release_all(self) -> Plan | None:
        """The plan that evicts every resident unit (the run is closing)."""
        evicted = tuple(self._evict(key) for key in sorted(self._resident))
        return Plan(-1, "close", evicted, ()) if evicted else None

    # --- the record -------------------------------------------------------------------------
    def _fetch(self, unit: Unit, ahead: bool) -> Fetch:
        buffers = self._alloc(unit.key, self._entries[unit.key])
        self._admit(unit, buffers)
        return Fetch(unit, buffers, ahead)

    def _admit(self, unit: Unit, buffers: tuple) -> None:
        """``unit`` resident in ``buffers``, counted as an upload (a fetch's, or a landed step's read)."""
        self._resident[unit.key] = Resident(unit, buffers, {e.name: b for e, b in zip(self._entries[unit.key], buffers)})
        self._layers = None
        if is_expert(unit.key):
            self._experts[unit.key] = unit.nbytes
            self._expert_bytes += unit.nbytes
        c = self.counters
        c.uploads += len(buffers)
        c.layer_uploads += 1
        c.bytes_uploaded += unit.nbytes
        c.add_resident(unit.nbytes, len(buffers))

    def _alloc(self, key: UnitKey, entries: tuple) -> tuple:
        buffers = []
        for entry in entries:
            buf = self.allocator.alloc(entry)
            if buf is None:
                raise PluginError(f"allocator {self.allocator.name!r} returned no buffer for {key} {entry.name}")
            for fn in self._observers.alloc:
                if fn(entry=entry) is not None:
                    raise PluginError(f"an observer of alloc returned a value for {key} {entry.name}; observers "
                                      "return None (a buffer comes from the run's allocator: --allocator)")
            buffers.append(buf)
        return tuple(buffers)

    def _release(self, entry: Entry, buf: Any) -> None:
        self.allocator.release(entry, buf)
        for fn in self._observers.release:
            fn(entry=entry, buffer=buf)

    def _evict(self, key: UnitKey) -> Resident:
        r = self._resident.pop(key)
        self._layers = None
        if key in self._experts:
            self._expert_bytes -= self._experts.pop(key)
        for entry, buf in zip(self._entries[key], r.buffers):
            self._release(entry, buf)
        c = self.counters
        c.evictions += len(r.buffers)
        c.layer_evictions += 1
        c.bytes_evicted += r.unit.nbytes
        c.add_resident(-r.unit.nbytes, -len(r.buffers))
        return r

    def _advice(self, layer: int, phase: str) -> list[Advice]:
        answers = [self.policy.on_layer_advance(self, layer, phase)]
        for fn in self._observers.on_layer_advance:
            answers.append(fn(window=self, layer=layer, phase=phase))
        return self._checked(answers, "on_layer_advance")

    def _merged(self, advices: list[Advice]) -> tuple[set[UnitKey], list[UnitKey]]:
        """The units the advices name to evict (a set) and to prefetch (in order)."""
        evict: set[UnitKey] = set()
        ahead: list[UnitKey] = []
        for advice in advices:
            for x in advice.evict:
                evict.update(self._keys(x, "evict"))
            for x in advice.prefetch:
                ahead.extend(self._keys(x, "prefetch"))
        return evict, ahead

    @staticmethod
    def _checked(answers: list, hook: str) -> list[Advice]:
        out = []
        for advice in answers:
            if advice is None:
                continue
            if not isinstance(advice, Advice):
                raise PluginError(f"{hook} must return an Advice or None, got {type(advice).__name__}")
            if advice.evict or advice.prefetch:
                out.append(advice)
        return out

    def _keys(self, value: Any, what: str) -> tuple[UnitKey, ...]:
        """The units a plugin names: a layer number (every unit of it) or a unit key."""
        if isinstance(value, tuple):
            if value not in self.units.units:
                raise PluginError(f"policy {self.policy.name!r} asked to {what} unit {value!r}, which this model has not")
            return (value,)
        return tuple(u.key for u in self.units.of_layer(self._layer(value, what)))

    def _layer(self, value: Any, what: str) -> int:
        """A layer number from a plugin: any integral type (numpy's too), in range."""
        if isinstance(value, np.generic):
            value = value.item()  # so that a message says 7, not np.int64(7)
        try:
            layer = operator.index(value)
        except TypeError:
            layer = None
        if layer is None or isinstance(value, bool):
            raise PluginError(f"policy {self.policy.name!r} asked to {what} {value!r}, which is not a layer number; "
                              f"give whole numbers 0..{self.n_layers - 1}")
        if not 0 <= layer < self.n_layers:
            raise PluginError(f"policy {self.policy.name!r} asked to {what} layer {layer}; layers are 0..{self.n_layers - 1}")
        return layer
