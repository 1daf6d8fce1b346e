"""The contracts between the core and what plugs into it: every attribute the core reads, declared here.

A run checks its policy, allocator, expert policy and backend against these Protocols once, when it
opens. A member listed in ``OPTIONAL`` may be left out: the run looks it up once, then, and a plugin
without it gets the default given there; nothing is probed after that. Backends subclass
``kestrel_core.engine.backend.Backend``, which implements ``Backend`` below.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Protocol, runtime_checkable

import torch

from kestrel_core.engine.plan import Advice, Counters, Plan
from kestrel_core.formats.units import Geometry, UnitKey, UnitSpec, UnitTable


@runtime_checkable
class WindowView(Protocol):
    """What a policy, an expert policy and an observer may read of the run's window (``window`` in every hook)."""

    units: UnitTable  # the run's residency units, in the backend's layout (bytes, keys, layers)
    counters: Counters
    n_layers: int
    keep: int | str
    phase: str  # "prefill" or "decode"
    token: int  # the pass over the layers: 0 is the prefill, then one a decoded token
    routed_token: int  # at a decision point: the pass whose routing it is (a table-read decode step is heard later)
    admits: bool  # at a decision point: whether a routed expert that is not resident will be admitted (a step that
    # landed its misses is heard with False: ``engine.landing``)
    sparse: list  # per layer: whether it has experts
    prefetch_depth: int  # the layers a backend uploads ahead on a side stream (0 without a window)

    @property
    def resident(self) -> frozenset[int]:
        """The layers with a resident unit."""

    @property
    def resident_units(self) -> frozenset[UnitKey]:
        """Every resident unit's key: ``(layer,)``, and ``(layer, expert)`` for an expert."""

    @property
    def resident_bytes(self) -> int: ...

    def horizon(self, layer: int) -> list[int]:
        """The layers a prefetching backend uploads next after ``layer``."""


@runtime_checkable
class Policy(Protocol):
    """Decides, at each layer boundary, which resident units go. ``factory(n_layers=, keep=)`` makes one."""

    name: str
    keep: int | str  # resident layers the window keeps, or "off"
    windowed: bool  # False: no window (every unit preloaded, nothing evicted)

    def peak_layers(self) -> int:
        """The most layers resident at once, before any prefetch: the run sizes its budget check by it."""

    def preload(self, window: WindowView) -> Iterable[int] | None:
        """Layers to upload before the first token (a windowed policy: none)."""

    def on_layer_advance(self, window: WindowView, layer: int, phase: str) -> Advice | None:
        """At the boundary before ``layer``: the layers (or unit keys) to evict and to prefetch."""

    def on_experts_routed(self, window: WindowView, layer: int, experts: list[int], phase: str) -> Advice | None:
        """Optional (default: no advice). At a sparse layer's decision point, after the expert policy."""


class BufferFactory(Protocol):
    """What an allocator asks for real buffers (``entry.factory``: the run's backend)."""

    def new_buffer(self, geometry: Geometry, raw: bool = False) -> Any:
        """A new buffer; ``raw`` bypasses any caching allocator (on CUDA: cudaMalloc)."""

    def free_buffer(self, buffer: Any) -> None:
        """Free a buffer for real."""


@runtime_checkable
class Allocator(Protocol):
    """Hands out weight buffers. ``factory(counters=, slots=)`` makes one."""

    name: str
    deterministic: bool  # the same request sequence always gets the same buffers (a captured step relies on it)

    def alloc(self, entry: Any) -> Any:
        """A buffer for ``entry`` (``entry.geometry``; real buffers from ``entry.factory.new_buffer``)."""

    def release(self, entry: Any, buffer: Any) -> None:
        """Take back an evicted entry's buffer: keep it for reuse, or free it for real."""

    def drain(self) -> None:
        """Free every buffer still held, at the end of the run."""


@runtime_checkable
class ExpertPolicy(Protocol):
    """Which experts of a Mixture-of-Experts model stay resident; a factory is called ``factory(budget=bytes)``."""

    name: str

    def on_experts_routed(self, window: WindowView, layer: int, experts: list[int], phase: str) -> Advice | None:
        """After ``layer``'s router chose ``experts``, before they are fetched: an ``Advice`` or None."""

    lands: bool  # optional (default False): it admits every routed expert and evicts by a rank until what is resident
    # fits its budget, so a decode step may land its own misses (``engine.landing``); it then takes ``hold_back``

    def hold_back(self, nbytes: int) -> None:
        """Optional, where ``lands``: keep ``nbytes`` of the budget free for the landing ring's slots."""


@runtime_checkable
class Drafting(Protocol):
    """What drafts for one sequence (``Drafter.begin``'s answer): asked before each step the sequence rides."""

    def propose(self, context: list[int], k: int) -> tuple[list[int], list | None]:
        """Up to ``k`` tokens to follow ``context``, and each one's distribution (a [vocab] tensor it was drawn from, for
        sampling), or None for a drafter that proposes deterministically."""

    def accepted(self, context: list[int]) -> None:
        """The sequence as kept after a verify pass (drafts past it were rejected)."""


@runtime_checkable
class Drafter(Protocol):
    """Proposes tokens for speculative decoding. A factory is called ``factory(arg=, run=)`` (``arg``: what follows
    the name in ``--draft NAME:ARG``, or the model of ``--draft MODEL``; ``run``: the target's run, read-only). A
    factory that says ``drafts_with_a_model = True`` drafts with the model ``arg`` names: the engine loads, checks and
    opens it and calls ``factory(arg=, run=, draft_run=)``; ``draft_run`` (``engine.draft_run.DraftRun``) proposes
    through its own batch (``draft_run.sequence()``: what drafts for a sequence), and the engine closes it."""

    name: str

    def begin(self, prompt_ids: list[int]) -> Drafting:
        """A new sequence starts from ``prompt_ids``: what drafts for it (the drafter itself, where it keeps nothing
        a sequence). Sequences of one batch draft side by side."""

    def close(self) -> None:
        """The run closes: let go of what it holds."""


@runtime_checkable
class Backend(Protocol):
    """Where the layer loop runs. A factory is a class: ``factory(ctx: BackendContext)`` makes one, and
    ``factory.available()`` / ``factory.check_prefetch(depth)`` answer before any is made; subclass ``backend.Backend``."""

    name: str
    device: torch.device
    dtype: torch.dtype
    prefetch_depth: int  # units uploaded ahead on a side stream (0: none)
    budget: int | None  # device bytes for weights, None where unbounded
    captures: bool  # whether ``capture`` can return a replayable decode step
    expert_table: bool  # whether a decode step can read its routed experts through ``routed_experts``
    expert_table_refusal: str  # where it cannot: why (the error for expert_decode = 'table' names it)
    lands: bool  # whether a table-read decode step can land its misses in a ring of slots (``landing_*``)
    row_exact: bool  # a row's result never depends on the rows beside it: a batch, a prompt, a drafted run change no bit
    device_per_rank: bool  # a pipeline's ranks each compute on a device of their own (not one host's shared cores)
    units: UnitTable  # the run's units, laid out by this backend
    globals: dict  # embed, norm, lm_head: resident for the run
    small: list  # per layer: its norms (and biases), resident for the run

    @classmethod
    def available(cls) -> bool:
        """Whether this machine can run the backend (``kestrel demo`` sweeps every available one)."""

    @classmethod
    def check_prefetch(cls, depth: int) -> None:
        """Refuse a prefetch depth this backend cannot honour (checked before a sweep starts)."""

    def layout(self, spec: UnitSpec) -> Iterable[Any]:
        """The buffers (``units.EntrySpec``) that hold one unit in this backend's compute layout."""

    def execute(self, plan: Plan) -> None:
        """Carry out one boundary's plan: retire the evicted units, then fill the fetched ones."""

    def before_use(self, key: UnitKey) -> None:
        """Order the compute after the unit's upload."""

    def new_buffer(self, geometry: Geometry, raw: bool = False) -> Any: ...

    def free_buffer(self, buffer: Any) -> None: ...

    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...

    @staticmethod
    def linear(x: torch.Tensor, w: Any) -> torch.Tensor: ...

    def prompt_linear(self, prompt_from: int) -> Callable[[torch.Tensor, Any], torch.Tensor]:
        """The linear of a pass whose rows from ``prompt_from`` on are a prompt's."""

    def logits(self, h: torch.Tensor) -> torch.Tensor: ...

    def synchronize(self) -> None: ...

    def mark(self) -> Any:
        """A point in the device's queue: ``elapsed_ms(a, b)`` times the work between two, ``wait(m)`` waits for one."""

    def elapsed_ms(self, start: Any, stop: Any) -> float: ...

    def wait(self, mark: Any) -> None: ...

    def capture(self, step: Callable[[], None], plans: list[Plan]) -> Any:
        """The decode step ``step()`` (whose plans are ``plans``) captured for ``replay``, or None: run it eagerly."""

    def replay(self, graph: Any) -> None: ...

    def memory_stats(self) -> dict[str, int]:
        """What the backend measured of its memory (and of its host tier), for the result and the CLI to report."""

    def point_experts(self, host: list[UnitKey], slots: list) -> None:
        """Where ``expert_table``: in stream order, point the table at the host copies of ``host`` and at the device
        buffers of ``slots`` ((key, buffers), each after its upload)."""

    def fetched_experts(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, used: list[int],
                        weights_of: dict, prompt_from: int | None = None) -> torch.Tensor:
        """A sparse layer's routed experts, routed on the host and fetched: ``weights_of[e]`` holds expert e's buffers;
        rows from ``prompt_from`` on are a prompt's."""

    def routed_experts(self, layer: int, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Where ``expert_table``: one token's routed experts of ``layer``, each read where the table points."""

    def landing_open(self, size: int, staged: int = 0) -> None:
        """Where ``lands``: a ring of ``size`` expert slots, head and tail 0, and up to ``staged`` staging slots."""

    def landing_fill(self, filled: list, tail: int) -> None:
        """Where ``lands``: in stream order, each (position, buffers) into slot position % size, then the tail."""

    def landing_state(self) -> torch.Tensor:
        """Where ``lands``: [1 + size] long on the device, the ring's head then each slot's owner expert."""

    def close(self) -> None: ...


def _no_advice(window: WindowView, layer: int, experts: list[int], phase: str) -> None:
    return None


# Members a plugin may leave out, by Protocol: the default that stands in for each.
def _holds_nothing(nbytes: int) -> None:
    raise AssertionError("hold_back is asked only of an expert policy that lands")


OPTIONAL: dict[type, dict[str, Any]] = {Policy: {"on_experts_routed": _no_advice},
                                        ExpertPolicy: {"lands": False, "hold_back": _holds_nothing}}


def member(protocol: type, obj: Any, name: str) -> Any:
    """``obj``'s member ``name``, or the protocol's default where the member is optional and left out."""
    default = OPTIONAL.get(protocol, {}).get(name)
    return getattr(obj, name) if default is None else getattr(obj, name, default)


def missing_members(protocol: type, obj: Any) -> list[str]:
    """The required members of ``protocol`` that ``obj`` lacks (for an error that names them)."""
    names = {n for n in vars(protocol) if not n.startswith("_")} | set(getattr(protocol, "__annotations__", {}))
    optional = OPTIONAL.get(protocol, {})
    return sorted(n for n in names if n not in optional and not hasattr(obj, n))


__all__ = ["OPTIONAL", "Allocator", "Backend", "BufferFactory", "Drafter", "ExpertPolicy", "Policy", "WindowView", "member",
           "missing_members"]
