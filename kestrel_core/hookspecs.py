"""Hook specifications: discovery (``register_*``) and the observers of every run's boundaries.

A run's own policy, allocator and backend are objects it owns (their contracts are the
Protocols in ``contracts.py``); these hooks are how plugins make them known, and how a
plugin registered in the manager watches and advises every run.
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
def on_experts_routed(window, layer, experts, phase):
    """In a Mixture-of-Experts layer, once the router has chosen ``experts`` (the expert numbers the layer's
    tokens use, sorted) and before they are fetched: return an Advice naming unit keys ``(layer, e)`` (or
    layers) to evict and prefetch, or None; called on the run's policy where it has this method, then on
    every registered plugin. The routed experts of ``layer`` may not be evicted."""
