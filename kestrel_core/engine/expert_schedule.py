"""When a decode step reads each expert from its device buffer (its slot) or from its host copy: the expert table's timing.

In a decode step that reads its experts through the expert table (``expert_decode = "table"``), the
host learns a step's routing only when it reads that step back, after it has launched the next
step (greedy decoding reads a step late; a sampled step is read at once). What the window then
plans is applied at fixed points, so that no step reads a slot while it is refilled and no step
waits for an upload:

- an eviction points the expert at its host copy before the next step is launched (the step in
  flight may still read the slot; the refill of that slot waits for it on the side stream);
- an admission uploads the expert into its slot at once, on the side stream, and the expert reads
  its slot from the step after the next one launched: its upload has a whole step to land.

Where a plan is executed inside a step (a prefill's routing, a layer's boundary), the table
follows it at once, in stream order. ``ExpertSchedule`` keeps the host's record of this timing:
what must point where before each step, and whether a step read an expert from its host copy (a
miss, counted when the step is heard). ``kestrel replay`` models a run with the same class.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterable

from kestrel_core.formats.units import UnitKey, is_expert

NEVER = 1 << 62


class ExpertSchedule:
    """The host's record of where each expert is read from, step by step (decode steps 0, 1, ...; the prefill is before
    step 0)."""

    def __init__(self) -> None:
        self.next_step = 0  # the decode step launched next
        self._due: dict[UnitKey, tuple[int, Any]] = {}  # admitted, not yet read: key -> (first step, what the backend needs)
        self._spans: dict[UnitKey, deque] = {}  # key -> its recent (first step, end step) spans in its slot

    # --- in stream order: a prefill's routing, a boundary (``boundary``: the layer it comes before) ---------------
    def evict_now(self, keys: Iterable[UnitKey], boundary: int) -> None:
        """Read from the host copy from here on: in the step in flight, by the layers from ``boundary`` on."""
        step = self.next_step - 1  # the step in flight; -1: the prefill
        for key in keys:
            self._end(key, 0 if step < 0 else step + (boundary > key[0]))

    def admit_now(self, keys: Iterable[UnitKey], boundary: int) -> None:
        """Read from the slot from here on: in the step in flight, by the layers from ``boundary`` on."""
        step = self.next_step - 1
        for key in keys:
            self._start(key, 0 if step < 0 else step + (key[0] < boundary))

    # --- a step behind: a plan on a step's routing, read back ---------------------------------------
    def evict_heard(self, keys: Iterable[UnitKey]) -> None:
        """Read from the host copy from the next step launched (the backend points the table there before it)."""
        for key in keys:
            self._end(key, self.next_step)

    def admit_heard(self, key: UnitKey, payload: Any = None) -> None:
        """Uploading now; read from the slot from the step after the next one launched."""
        self._due[key] = (self.next_step + 1, payload)

    def landed(self, key: UnitKey, step: int) -> None:
        """Decode step ``step`` landed ``key`` in a slot as it read it (``engine.landing``): a miss in that step, read
        from its slot from the next."""
        self._due.pop(key, None)
        self._start(key, step + 1)

    def begin_step(self) -> list[tuple[UnitKey, Any]]:
        """Before launching the next step: the admissions whose slots it reads, with their payloads (the backend points
        the table at them, after their uploads)."""
        step = self.next_step
        now = [(key, payload) for key, (first, payload) in self._due.items() if first <= step]
        for key, _ in now:
            del self._due[key]
            self._start(key, step)
        self.next_step += 1
        return now

    def read_host(self, key: UnitKey, step: int) -> bool:
        """Whether decode step ``step`` read ``key`` from its host copy (a miss)."""
        return not any(first <= step < end for first, end in self._spans.get(key, ()))

    # --- the record ---------------------------------------------------------------------------------------
    def _start(self, key: UnitKey, step: int) -> None:
        spans = self._spans.setdefault(key, deque(maxlen=4))  # a step is heard at most two behind: a few spans do
        if spans and spans[-1][1] == NEVER:
            return  # already in its slot
        spans.append((step, NEVER))

    def _end(self, key: UnitKey, step: int) -> None:
        self._due.pop(key, None)  # evicted before its slot was ever read
        spans = self._spans.get(key)
        if spans and spans[-1][1] == NEVER:
            first, _ = spans.pop()
            if first < step:
                spans.append((first, step))
