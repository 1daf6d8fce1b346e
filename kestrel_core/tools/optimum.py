"""The offline optimum of the cyclic layer loop (Belady's MIN): what no policy can beat at a byte budget.

The loop visits layers 0..L-1 every token, so every future use is known. When a layer must
come in and the budget is full, MIN evicts the resident layer used again farthest ahead. For
layers of one size that is optimal; for mixed sizes, farthest-first until the bytes fit is
the standard bound's heuristic.
"""

from __future__ import annotations

from typing import Iterable


def farthest_first(resident: Iterable[int], needed: set[int], layer: int, n_layers: int,
                   layer_bytes: dict[int, int], budget: int) -> list[int]:
    """The resident layers to evict before ``layer`` runs so that ``resident | needed`` fits in ``budget`` bytes."""
    keep = set(resident) | needed
    used = sum(layer_bytes[x] for x in keep)
    victims = []
    for x in sorted(set(resident) - needed, key=lambda x: (x - layer) % n_layers, reverse=True):
        if used <= budget:
            break
        victims.append(x)
        used -= layer_bytes[x]
    return victims


def min_bytes_by_pass(layer_bytes: dict[int, int], budget: int, passes: int) -> list[int]:
    """Bytes MIN uploads in each pass of the loop (pass 0 is the prefill) with ``budget`` bytes of streamed layers."""
    n = len(layer_bytes)
    resident: set[int] = set()
    out = []
    for _ in range(passes):
        moved = 0
        for layer in range(n):
            resident -= set(farthest_first(resident, {layer}, layer, n, layer_bytes, budget))
            if layer not in resident:
                resident.add(layer)
                moved += layer_bytes[layer]
        out.append(moved)
    return out
