"""A step's types: the run's step settings, what a batch asks a step for (``StepRequest``), the step as launched
(``Launched``) and as read back (``Readback``); the runner takes and gives them (``runner.Runner.step``, ``read``)."""

from __future__ import annotations

import attrs
import torch

from kestrel_core.engine.model import Span


@attrs.frozen
class StepSettings:
    """How a run's steps run, from its config (``assemble.make_runner``)."""

    graphs: bool  # replay a repeating decode step as a captured graph, where the backend can
    compile: bool  # the decode step's layer math through torch.compile
    expert_table: bool = False  # a decode step reads its routed experts through the backend's expert table
    micro_batches: bool = False  # in a pipeline, a decode step of several rows goes through the ranks in micro-batches
    landing: int = 0  # slots of the ring a table-read decode step lands its misses in (``engine.landing``); 0: none
    staged: int = 0  # slots beside the ring a backend may copy the misses it cannot land into (``landing.ring_size``)


@attrs.frozen
class StepRequest:
    """One step as a batch asks for it: the next token of each of the first ``rows`` slots (those in ``live`` decode:
    their positions move on), then ``spans``, each a sequence's tokens with their ids (a prompt chunk, or a verify
    pass: the last token and its drafts). ``every_row``: the spans whose every row's logits come back (a verify pass);
    the others give their last row. ``sample``: the slots whose next token the host draws from their logits (the rest
    take their argmax on the device; a grammar's row among the ids its mask allows, ``Runner.step``'s ``masks``)."""

    rows: int
    live: frozenset[int] = frozenset()
    spans: tuple[tuple[Span, tuple[int, ...]], ...] = ()
    every_row: frozenset[int] = frozenset()
    sample: tuple[int, ...] = ()


@attrs.define(eq=False)
class Launched:
    """A step as it was launched: its number in its slots, how it ran (one of ``results.MODES``), the counters around
    its plans, its mark, its number among the decode steps (-1 where it had spans), whether it read the expert table,
    and each span's logits rows ([1 or T, vocab] each, as the request asked, on the device)."""

    index: int
    mode: str
    before: dict[str, int]
    after: dict[str, int]
    mark: object
    decode_index: int
    table: bool
    span_logits: list[torch.Tensor]


@attrs.frozen
class Readback:
    """A step read back: each slot's token and whether its logits were not finite, and the counters of the plans made
    on hearing its routing (where it read the expert table)."""

    tokens: list[int]
    bad: list[bool]
    heard: dict[str, int]
