"""Hook specifications: discovery (``register_*``), and the hooks of every run.

A run's own policy, allocator, expert policy and backend are objects it owns (their contracts
are the Protocols in ``contracts.py``). The run's policy answers ``on_layer_advance`` and
``preload``, its expert policy ``on_experts_routed``, its allocator ``alloc`` and ``release``;
then every plugin registered in the manager when the run opens hears the same call, to advise
(``on_layer_advance``, ``on_experts_routed``, ``preload``) or to observe (``alloc``, ``release``).
"""

import pluggy

hookspec = pluggy.HookspecMarker("kestrel")
hookimpl = pluggy.HookimplMarker("kestrel")


@hookspec
def register_backends(register):
    """Register backend factories: ``register(name, factory)``; ``factory(ctx: BackendContext)`` returns a ``contracts.Backend``."""


@hookspec
def register_policies(register):
    """Register residency policy factories: ``register(name, factory)``; ``factory(n_layers=, keep=)`` returns a ``contracts.Policy``."""


@hookspec
def register_allocators(register):
    """Register allocator factories: ``register(name, factory)``; ``factory(counters=, slots=)`` returns a ``contracts.Allocator``."""


@hookspec
def register_expert_policies(register):
    """Register expert policy factories: ``register(name, factory)``; ``factory(budget=bytes)`` returns an object with
    ``name`` and ``on_experts_routed(window, layer, experts, phase)`` (an Advice or None), asked at each sparse layer."""


@hookspec
def register_drafters(register):
    """Register speculative-decoding drafters: ``register(name, factory)``; ``factory(arg=, run=)`` returns a
    ``contracts.Drafter`` (``--draft NAME`` or ``--draft NAME:ARG``); a factory with ``drafts_with_a_model = True``
    is also given ``draft_run=``, the model ``arg`` names, opened by the engine (``engine.draft_run.DraftRun``)."""


@hookspec
def register_gates(register):
    """Register benefit gates: ``register(name, gate)``; a gate computes an upper bound and a verdict."""


@hookspec
def register_commands(register):
    """Register subcommands: ``register(name, command)``; a command has ``HELP``, ``add_arguments(parser)`` and ``run(args)`` -> exit code."""


@hookspec
def on_layer_advance(window, layer, phase):
    """At the boundary before ``layer`` runs (phase 'prefill' or 'decode'), return an Advice naming layers (or unit keys) to evict and prefetch, or None; called on the run's policy, then on every registered plugin."""


@hookspec
def preload(window):
    """Return the layers to upload before the first token, or None; called on the run's policy, then on every registered plugin (a windowed policy returns none: preload would be evicted at once)."""


@hookspec
def alloc(entry):
    """A buffer is handed out for ``entry`` (its ``layer``, ``name``, ``geometry`` and ``unit``): answered by the run's
    allocator (its ``alloc(entry)`` returns the buffer), then heard by every registered plugin, which returns None."""


@hookspec
def release(entry, buffer):
    """An evicted entry's ``buffer`` is given back: taken by the run's allocator (kept for reuse, or freed for real),
    then heard by every registered plugin."""


@hookspec
def on_experts_routed(window, layer, experts, phase):
    """In a Mixture-of-Experts layer, once the router has chosen ``experts`` (the expert numbers the layer's
    tokens use, sorted) and before they are fetched: return an Advice naming unit keys ``(layer, e)`` (or
    layers) to evict and prefetch, or None; called on the run's expert policy, then on its policy (an optional
    method there), then on every registered plugin. The routed experts of ``layer`` may not be evicted."""
