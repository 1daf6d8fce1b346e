"""A pipeline's steps on the runner's side, each a function of the runner: the ranks past the first make rank 0's
calls as it tells them (``follow``, ended by ``end_following``), a decode step of several rows goes through the ranks
in micro-batches (``micro_batched``), and each rank times its part of a decode step (``timed``, ``part_summary``,
``rank_parts``). The hops themselves are ``pipeline.py``'s."""

from __future__ import annotations

import statistics
from typing import Callable, Iterable

import torch

from kestrel_core.engine.kvcache import KVCache
from kestrel_core.engine.model import Attend
from kestrel_core.engine.pipeline import micro_batches
from kestrel_core.engine.plan import Boundary
from kestrel_core.engine.probe import nonfinite
from kestrel_core.engine.slots import DecodeState, Slots
from kestrel_core.errors import ConfigError


def follow(runner) -> None:
    """A rank past the first: make rank 0's calls after it, as it tells them, until it ends (``stop``). The
    steps' tokens are rank 0's to choose (it embeds them); a rank past the first runs its layers on the hidden
    state it gets."""
    slots: dict[int, Slots] = {}
    steps: dict[tuple[int, int], object] = {}  # (slots, index) -> the ``runner.Launched`` step, until it is read
    runner.following = True
    try:
        while True:
            for name, *args in runner.pipeline.hear():
                if name == "stop":
                    return
                if name == "open":
                    s = runner.open_slots(*args)
                    slots[s.sid] = s
                elif name == "close":
                    slots.pop(args[0]).close()
                elif name == "step":
                    s = slots[args[0]]
                    step = runner.step(s, args[1], lambda slot, logits: None)
                    steps[s.sid, step.index] = step
                    steps.pop((s.sid, step.index - 2 * s.RING), None)  # a step rank 0 never read back
                elif name == "read":
                    runner.read(slots[args[0]], steps.pop((args[0], args[1])), args[2])
                elif name in ("place", "park", "copy_prefix"):
                    getattr(runner, name)(slots[args[0]], *args[1:])
                elif name == "nonfinite":
                    nonfinite(runner, slots[args[0]], *args[1:])
                elif name == "parts":
                    runner.pipeline.gather(part_summary(runner))
                else:
                    raise RuntimeError(f"rank 0 told an unknown runner call {name!r}: run one kestrel on every rank")
    finally:
        runner.following = False
        for s in slots.values():
            s.close()


def end_following(runner) -> None:
    """Rank 0, its run closing: the other ranks' ``follow`` returns."""
    runner.tell("stop", now=True)


def part_summary(runner) -> dict:
    """This pipeline rank's part of the decode steps read back: its layers (the model's numbers, first and last),
    and the milliseconds its layers took a step, each step's and their median (None: no decode step yet)."""
    pipe, ms = runner.pipeline, list(runner.part_ms)
    return {"rank": pipe.rank, "layers": [pipe.first_layer, pipe.first_layer + pipe.n_layers - 1],
            "decode_steps": len(ms), "median_ms": round(statistics.median(ms), 3) if ms else None,
            "part_ms": [round(x, 3) for x in ms]}


def rank_parts(runner) -> list[dict]:
    """Rank 0 of a pipeline: every rank's ``part_summary``, in rank order (the others send theirs over the
    channel rank 0 tells its steps on). A step's whole time is rank 0's, from step to step."""
    if not runner.leads:
        raise ConfigError("rank_parts() is asked of rank 0 of a pipeline, which leads its steps")
    runner.tell("parts", now=True)
    return runner.pipeline.gather(part_summary(runner))


def micro_batched(runner, state: DecodeState, cache: list[KVCache], boundaries: Iterable[Boundary], rows: int,
                  layer_fn, table: DecodeState | None, bound: int | None, sliced: bool) -> torch.Tensor:
    """A pipeline's decode step in micro-batches (``pipeline.micro_batches``), so that the ranks work at once: a
    rank sends each micro-batch's hidden state on as soon as it has run its layers over it, and the next rank starts
    on it while this one runs the next. A rank whose layers are all resident runs its layers once a micro-batch;
    one whose window streams them runs every row in one pass (a second pass would stream them again), then sends
    the micro-batches in order. Rows are row-exact, so the cut changes no bit. The step's logits, [rows, vocab]
    float32 (zeros past rank 0, which alone chooses tokens). ``sliced``: the rows read their keys in use on the host
    (``runner._sliced``)."""
    pipe, backend, cfg = runner.pipeline, runner.backend, runner.cfg
    cuts = micro_batches(rows, pipe.ranks)

    def attend(lo: int, hi: int) -> Attend:
        return Attend.static(state.rope, state.positions[lo:hi], state.slot_ids[lo:hi], state.key_positions,
                             row_exact=backend.row_exact, live=state.live[lo:hi] if sliced else None,
                             sliced=sliced, first_slot=lo, bound=bound)

    def arriving(lo: int, hi: int) -> torch.Tensor:
        if pipe.first:
            return backend.embed(state.tokens[lo:hi])
        return pipe.hidden_in(hi - lo, cfg.hidden_size, backend.dtype, backend.device)

    resident = not runner.window.policy.windowed
    if resident:  # no window: the whole token's plans at once (empty, unless an observer asked for something)
        boundaries = list(boundaries)
        resident = not any(b.plan is not None and (b.plan.evict or b.plan.fetch) for b in boundaries)
    if resident:  # each micro-batch runs the layers as it arrives
        def run_layers(lo: int, hi: int) -> torch.Tensor:
            x = arriving(lo, hi)
            return timed(runner, lambda: runner.layers(x, attend(lo, hi), cache, boundaries, "decode", layer_fn,
                                                   table=table, first_row=lo))

        ran = (run_layers(lo, hi) for lo, hi in cuts)
    else:  # one pass over every row once all have arrived: a plan is executed once
        h = torch.cat([arriving(lo, hi) for lo, hi in cuts])
        h = timed(runner, lambda: runner.layers(h, attend(0, rows), cache, boundaries, "decode", layer_fn, table=table))
        ran = iter([h[lo:hi] for lo, hi in cuts])
    sending, logits = [], []
    for h in ran:  # each micro-batch goes on (or, on the last rank, its logits to rank 0) as soon as it is done
        if not pipe.last:
            h = h.contiguous()
            sending.append((h, pipe.send_on(h)))
        else:
            out = backend.logits(h).float().contiguous()
            logits.append(out)
            if not pipe.first:
                sending.append((out, pipe.logits_to_first(out)))
    pipe.sent([work for _, work in sending])
    vocab = cfg.vocab_size
    if pipe.first and not pipe.last:
        logits = [pipe.logits_from_last(hi - lo, vocab, backend.device) for lo, hi in cuts]
    elif not pipe.last:
        return torch.zeros((rows, vocab), dtype=torch.float32, device=backend.device)
    return torch.cat(logits)


def timed(runner, run_layers: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``run_layers()``, its marks kept where the step being launched times this rank's part (``_part``)."""
    if runner._part is None:
        return run_layers()
    start = runner.backend.mark()
    h = run_layers()
    runner._part.append((start, runner.backend.mark()))
    return h
