"""Landing: a decode step that reads a missed expert over the link leaves it in a device slot, so a miss crosses once.

A decode step that reads its experts through the expert table (``expert_schedule``) reads a miss from its pinned host
copy; the expert policy hears the routing a step later. Without landing, its admission uploads the expert again: the
miss crosses the link twice. With landing the host keeps a ring of free expert slots filled ahead (``Landing``); the
step copies each miss into the ring's next slot as it comes to it, points the expert's table row there and reads it
from the slot. The host reads back, with the step's tokens, the ring's head and which expert each slot now holds, and
makes those experts resident; the expert policy then evicts by its rank until what is resident fits its budget, which
is the expert budget less the ring's slots. A miss that finds the ring empty is read from its host copy only, and is
not admitted: it crosses again when it is next routed, never twice for one read.

The rule (``landings``), which each backend carries out inside the step (cpu_ref in Python, cuda in a kernel): at each
sparse layer, in the order the step runs them, the experts its rows routed to, distinct and in ascending order, each
that the table points at its host copy takes the ring's next slot while the head is below the tail. It fits an expert
policy that admits every routed expert and evicts by a rank (``ExpertCache``: ``lands``); any other keeps the
admission a step behind.
"""

from __future__ import annotations

from typing import Callable, Iterable

from kestrel_core.formats.units import UnitKey

SHARE = 4  # at most a quarter of the expert budget waits in the ring as free slots
STEPS = 2  # the ring holds up to two steps' routed experts: the step in flight lands from it while the host refills


def landings(experts: Iterable[int], miss: Callable[[int], bool], head: int, tail: int) -> list[tuple[int, int]]:
    """One sparse layer's landings: (expert, ring position) for each distinct routed expert in ascending order that
    ``miss``es (its table row points at its host copy), while positions ``head``.. are below ``tail``."""
    out = []
    for e in sorted(set(experts)):
        if head >= tail:
            break
        if miss(e):
            out.append((e, head))
            head += 1
    return out


def ring_size(budget: int, expert_bytes: int, total: int, per_token: int,
              sparse_layers: int, staging: bool = True) -> tuple[int, int, int]:
    """The ring's slots under an expert ``budget`` of experts of ``expert_bytes`` each (``total`` in all), the staging
    slots beside it, and the bytes the expert policy holds back for both. The ring: two steps' routed experts, at
    most ``SHARE`` of the budget, and no more than leaves the policy one token's routed experts. The staging slots: a
    backend may copy a layer's misses that find the ring empty into them for the step alone (cuda: a copy reads the
    link faster than its expert kernels do), up to one token's routed experts, in the room the policy's token leaves
    (none without ``staging``).
    A budget that holds every expert has no miss: a ring only in the room it leaves over, no staging, nothing held
    back. (0, 0, 0): no landing."""
    slots = budget // expert_bytes
    size = max(0, min(STEPS * per_token * sparse_layers, slots // SHARE, slots - per_token))
    if budget >= total:
        return min(size, (budget - total) // expert_bytes), 0, 0
    if not size:
        return 0, 0, 0
    staged = max(0, min(per_token, slots - per_token - size)) if staging else 0
    return size, staged, (size + staged) * expert_bytes


class Landing:
    """The host's record of the ring: which buffers it put at each position, how far it has filled it (``tail``) and
    how far a read-back step has consumed it (``head``). Positions count up; position p is slot p % size."""

    def __init__(self, size: int, experts: int):
        self.size, self.experts = size, experts
        self.slots: list[tuple | None] = [None] * size
        self.head = self.tail = 0

    def room(self) -> list[int]:
        """The positions to fill now: up to ``size`` ahead of the head the host has heard."""
        return list(range(self.tail, self.head + self.size))

    def filled(self, position: int, buffers: tuple) -> None:
        assert position == self.tail and self.slots[position % self.size] is None
        self.slots[position % self.size] = buffers
        self.tail += 1

    def consumed(self, head: int, owners: list[int]) -> list[tuple[UnitKey, tuple]]:
        """A read-back step's ring: its head and each slot's owner (an expert's flat number, layer * experts + expert);
        the experts landed since the last read, each with the buffers it landed in, in landing order."""
        if not self.head <= head <= self.tail:
            raise RuntimeError(f"the landing ring's head read back as {head}, outside {self.head}..{self.tail}: the "
                               "step and the host disagree on the ring")
        out = []
        for position in range(self.head, head):
            i = position % self.size
            owner, buffers = owners[i], self.slots[i]
            self.slots[i] = None
            out.append(((owner // self.experts, owner % self.experts), buffers))
        self.head = head
        return out

    def drained(self) -> list[tuple]:
        """Every slot filled and not consumed (the run is closing): their buffers."""
        out = [self.slots[p % self.size] for p in range(self.head, self.tail)]
        self.slots = [None] * self.size
        self.head = self.tail
        return out
