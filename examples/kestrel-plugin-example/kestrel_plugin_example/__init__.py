"""An out-of-tree kestrel plugin: the ``mru`` residency policy.

Installed, it shows up in ``kestrel plugins`` and runs with ``kestrel generate --policy mru``.
"""

from __future__ import annotations

from kestrel_core.hookspecs import hookimpl
from kestrel_core.engine.plan import Advice

__version__ = "0.1.0"


class MostRecentlyUsed:
    """Hold at most ``keep`` layers; when a layer must come in, evict the most recently used first.

    The layer loop is a cyclic scan, 0..L-1 every token. In a cyclic scan the layer used most
    recently is the one needed again last, so evicting it is Belady's MIN: no policy with
    ``keep`` resident layers uploads fewer. On average it uploads ``L * (L - keep) / (L - 1)``
    layers a token, and its peak is exactly ``keep`` layers (``asymmetric`` peaks at ``2*keep``).
    It needs no knowledge of the loop: it learns the order from the boundaries it sees.
    """

    name = "mru"
    windowed = True

    def __init__(self, n_layers: int, keep: int):
        self.n_layers = n_layers
        self.keep = keep
        self._clock = 0
        self._last_use: dict[int, int] = {}

    def peak_layers(self) -> int:
        return self.keep

    @hookimpl
    def preload(self, window):
        return ()  # windowed: a preload would be evicted at once

    @hookimpl
    def on_layer_advance(self, window, layer, phase):
        needed = {layer, *window.horizon(layer)}  # the horizon is what a prefetching backend loads next
        resident = set(window.resident)
        over = len(resident | needed) - self.keep
        victims: list[int] = []
        if over > 0:
            by_recency = sorted(resident - needed, key=lambda l: self._last_use.get(l, -1), reverse=True)
            victims = by_recency[:over]
        self._clock += 1
        self._last_use[layer] = self._clock
        return Advice(evict=victims)


@hookimpl
def register_policies(register):
    register("mru", MostRecentlyUsed)
