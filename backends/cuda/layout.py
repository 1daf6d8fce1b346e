"""The cuda backend's device layout: a unit's roles fused into the entries the math reads.

A dense layer is qkv, o, gate_up, down; a sparse layer's own unit qkv, o, router; an expert
gate_up, down. The window gate counts entries with the same function.
"""

from __future__ import annotations

FUSED = (("qkv", ("q", "k", "v")), ("o", ("o",)), ("gate_up", ("gate", "up")), ("down", ("down",)),
         ("router", ("router",)))


def fusion(tensors: dict) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The entries of a unit with these roles (UnitSpec.tensors), in compute order: (entry name, roles)."""
    return tuple((name, roles) for name, roles in FUSED if all(r in tensors for r in roles))


def slot_entries(tensors: dict) -> list:
    """The unit's entries as the host tier stages them (``SlotEntry``): each fused entry's shape and the
    checkpoint tensors stacked into it, in ``fusion`` order."""
    from backends.cuda.host.tier import SlotEntry

    return [SlotEntry(name, (sum(tensors[r][1][0] for r in roles), tensors[roles[0]][1][1]),
                      tuple(tensors[r][0] for r in roles)) for name, roles in fusion(tensors)]
