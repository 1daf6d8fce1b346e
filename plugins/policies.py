"""Built-in residency policies.

The layer loop is cyclic: 0..L-1 every token. A policy answers, at the boundary
before ``layer`` runs, which resident layers to evict.
"""

from __future__ import annotations

import attrs

from kestrel_core.hookspecs import hookimpl
from kestrel_core.tools.optimum import farthest_first
from kestrel_core.engine.plan import Advice


@attrs.define
class Off:
    """No window: every layer is preloaded and stays resident."""

    n_layers: int
    keep: int | str = "off"
    name = "off"
    windowed = False

    def peak_layers(self) -> int:
        return self.n_layers

    def preload(self, window):
        return range(self.n_layers)

    def on_layer_advance(self, window, layer, phase):
        return None


@attrs.define
class Asymmetric:
    """Evict only past layers, ``l < cur - keep + 1``; keep ``cur`` and everything upcoming.

    After a token the last ``keep`` layers stay, so each token re-uploads ``L - keep``
    layers, and up to ``2*keep`` are resident at the peak.
    """

    n_layers: int
    keep: int
    name = "asymmetric"
    windowed = True

    def peak_layers(self) -> int:
        return min(self.n_layers, 2 * self.keep)

    def preload(self, window):
        return ()  # a preload would be evicted at the first boundary

    def on_layer_advance(self, window, layer, phase):
        victims = [l for l in window.resident if l < layer - self.keep + 1]
        return Advice(evict=victims) if victims else None


@attrs.define
class FutureEvicting(Asymmetric):
    """The pitfall baseline: also evicts upcoming layers, so every token re-uploads every layer."""

    name = "future_evicting"

    def on_layer_advance(self, window, layer, phase):
        return Advice(evict=[l for l in window.resident if l < layer - self.keep + 1 or l > layer])


@attrs.define
class PinnedSet:
    """At asymmetric's peak budget, pin a fixed set and stream the rest through one slot.

    With a budget of ``P = min(L, 2*keep)`` layers (asymmetric's peak at the same keep),
    ``P - 1`` layers stay for good and one slot streams the others: ``L - P + 1`` uploads
    a token instead of ``L - keep``. Not optimal: ``belady`` at the same peak moves fewer.
    """

    n_layers: int
    keep: int
    name = "pinned_set"
    windowed = True

    @property
    def budget(self) -> int:
        return min(self.n_layers, 2 * self.keep)

    @property
    def pinned(self) -> frozenset[int]:
        if self.budget >= self.n_layers:
            return frozenset(range(self.n_layers))
        return frozenset(range(self.n_layers - self.budget + 1, self.n_layers))

    def peak_layers(self) -> int:
        return self.budget

    def preload(self, window):
        return ()

    def on_layer_advance(self, window, layer, phase):
        keep = self.pinned | {layer, *window.horizon(layer)}  # the horizon is being prefetched
        return Advice(evict=[l for l in window.resident if l not in keep])


@attrs.define
class Belady:
    """The offline optimum for the known cyclic order (Belady's MIN) at a budget of ``keep`` layers' bytes.

    When a layer must come in and the budget is full, evict the resident layer whose next
    use is farthest away. Its peak is ``keep`` layers (the largest ones' bytes), plus the
    horizon a prefetching backend loads ahead.
    """

    n_layers: int
    keep: int
    name = "belady"
    windowed = True

    def peak_layers(self) -> int:
        return self.keep

    def preload(self, window):
        return ()

    def on_layer_advance(self, window, layer, phase):
        units = window.units
        needed = {layer, *window.horizon(layer)}
        return Advice(evict=farthest_first(window.resident, needed, layer, self.n_layers, units.layer_bytes,
                                           units.peak_bytes(self.keep)))


@hookimpl
def register_policies(register):
    register("asymmetric", Asymmetric)
    register("future_evicting", FutureEvicting)
    register("pinned_set", PinnedSet)
    register("belady", Belady)
    register("off", Off)
