"""Hook specifications: the whole contract between the core and its plugins."""

import pluggy

hookspec = pluggy.HookspecMarker("kestrel")
hookimpl = pluggy.HookimplMarker("kestrel")


@hookspec
def register_backends(register):
    """Register backend factories: ``register(name, factory)``; ``factory(ctx)`` returns a Backend."""


@hookspec
def register_policies(register):
    """Register residency policy factories: ``register(name, factory)``; ``factory(n_layers, keep)`` returns a policy."""


@hookspec
def register_allocators(register):
    """Register allocator factories: ``register(name, factory)``; ``factory(options)`` returns an allocator."""


@hookspec
def register_gates(register):
    """Register benefit gates: ``register(name, gate)``; a gate computes an upper bound and a verdict."""


@hookspec
def register_commands(register):
    """Register subcommands: ``register(name, command)``; a command has ``HELP``, ``add_arguments(parser)`` and ``run(args)`` -> exit code."""


@hookspec
def on_layer_advance(window, layer, phase):
    """At the boundary before ``layer`` runs (phase 'prefill' or 'decode'), return an Advice naming layers to evict and prefetch, or None."""


@hookspec(firstresult=True)
def alloc(entry):
    """Return a buffer for a weight-cache entry (its geometry is ``entry.geometry``), or None to let the next allocator answer."""


@hookspec
def release(entry, buffer):
    """Take back the buffer of an evicted entry: keep it for reuse or free it for real."""


@hookspec
def preload(window):
    """Return the layers to upload before the first token, or None; a windowed policy returns none (preload would be evicted at once)."""
