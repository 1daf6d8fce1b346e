"""The NaN probe: where a step's logits are not finite, the step runs again through the runner's one layer loop with a
probe that sees each part's output, and the error names the first part of the model whose output went non-finite (on
the error path only)."""

from __future__ import annotations

from typing import Callable

import torch

from kestrel_core.engine.slots import Slots
from kestrel_core.errors import NonFiniteError

Probe = Callable[[str, torch.Tensor], None]  # (where, hidden state): sees each layer's output on the error path


def nonfinite(runner, s: Slots, ids: list[int], start: int, phase: str, slot: int = 0) -> NonFiniteError:
    """The error for non-finite logits at this step, naming the first part of the model whose output went non-finite.

    The search runs the step again through the same layer loop with a probe: on the error path only.
    """
    runner.tell("nonfinite", s.sid, list(ids), start, phase, slot, now=True)
    found: list[str] = []

    def probe(where: str, h: torch.Tensor) -> None:
        if not found and not bool(torch.isfinite(h).all()):
            found.append(where)

    runner.forward(ids, start, s.cache, s.rope, phase, probe, slot)  # rewrites this step's K/V with the same values
    where = found[0] if found else None
    if runner.pipeline is not None:  # every rank probed its part: the earliest rank's finding
        where = runner.pipeline.first_found(where)
    where = where or "the final norm and lm_head"
    dtype = str(runner.backend.dtype).replace("torch.", "")
    wider = ", or compute in float32 (--dtype float32)" if runner.backend.dtype in (torch.float16, torch.bfloat16) else ""
    return NonFiniteError(
        f"the logits at position {start + len(ids) - 1} hold NaN or inf, first in the output of {where}: "
        f"the weights there hold NaN/inf, or {dtype} overflowed; re-create or re-download the checkpoint{wider}"
    )
