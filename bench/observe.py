"""Watching a run from inside: an observer plugin (``on_layer_advance``, ``on_experts_routed``, the documented
hooks) registered for the length of a ``with`` block.

    with observing(watch):
        r = row(model, settings, prompt, tokens)
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def observing(plugin, name: str | None = None):
    from kestrel_core import plugins

    plugins.load_plugins()
    name = name or f"bench-observer-{id(plugin)}"
    plugins.pm.register(plugin, name=name)
    try:
        yield plugin
    finally:
        plugins.pm.unregister(name=name)
