"""Run under torchrun by tests/test_pipeline.py: a batch of sequences (greedy and sampled, prompts in chunks) through
the Python API on rank 0, which the other ranks follow; rank 0 writes each sequence's ids as JSON to the path given.

Given a micro-batches setting after the path (and optionally an expert_lru budget in MiB), it also counts: rank 0's
JSON is then {"ids", "sends", "pieces", "decode_steps", "micro_batches"} (micro-batches sent on; layer passes over a
micro-batch past the first row; decode steps; the run's resolved setting; the torch threads it computed on), and
every rank writes
``<path>.rank<R>.json`` with its expert counters and the same counts.

With ``GROW_FLOOR`` in the environment, every rank's KV cache opens at the key bound of one position with that floor
and grows as on a device (``slots.Slots.reach``), and every rank writes the capacities its cache held, in order, to
``<path>.rank<R>.grown.json``."""

from __future__ import annotations

import json
import sys

import torch

from kestrel_core import load

PROMPTS = [[5, 17, 42, 99, 3], [1, 2, 3], [7, 8, 9, 10, 11, 12, 13], [7, 8, 9, 10, 11, 12, 13]]
COUNTERS = ("expert_hits", "expert_misses", "bytes_read_host", "bytes_reread")


def requests() -> list[dict]:
    settings = [dict(), dict(temperature=0.9, seed=4), dict(), dict(temperature=1.1, top_k=20, seed=9)]
    return [dict(prompt_ids=p, max_new_tokens=6 + i, stop_at_eos=False, **g)
            for i, (p, g) in enumerate(zip(PROMPTS, settings))]


def run(model_dir: str, keep: str, micro: str = "auto", expert_mb: float = 0.0,
        counts: dict | None = None) -> list[list[int]] | None:
    """Rank 0 (or one process) generates; a pipeline's other ranks follow its steps (None). ``counts``, given, gets
    this process's expert counters and what it ran."""
    experts = dict(expert_policy="expert_lru", expert_budget_mb=expert_mb) if expert_mb else {}
    with load(model_dir) as model, model.open(backend="cpu_ref", keep=keep if keep == "off" else int(keep),
                                              micro_batches=micro, **experts) as r:
        if r.pipeline is not None and r.pipeline.rank > 0:
            r.follow()
            got = None
        else:
            got = [x.token_ids for x in r.generate_batch(requests(), max_batch=3, prefill_chunk=4)]
        if counts is not None:
            snap = r.runner.snapshot()
            counts.update({k: snap[k] for k in COUNTERS}, decode_steps=r.runner.decode_steps,
                          micro_batches=r.runner.settings.micro_batches, threads=torch.get_num_threads())
        return got


def growing(floor: int, held: list[int]) -> None:
    """Each rank's cache opens at one position's key bound (``floor`` the bound's floor) and grows; ``held`` gets the
    capacities it held, in order."""
    from kestrel_core.engine import model as model_math
    from kestrel_core.engine import slots as slots_mod

    reach = slots_mod.Slots.reach

    def recorded(self, need):
        reach(self, need)
        if not held or held[-1] != self.capacity:
            # a parked slot writes past what the grown cache holds, on the host's count and the device's
            assert all(self.positions[p] == self.park == int(self.state.positions[p]) for p in self.parked)
            held.append(self.capacity)

    model_math.BOUND_FLOOR = floor
    slots_mod.first_capacity = lambda max_seq, device: model_math.key_bound(1, max_seq)
    slots_mod.Slots.reach = recorded


def counting(counts: dict) -> None:
    """Count rank 0's micro-batches sent on, and its layer passes over a micro-batch past the first row."""
    from kestrel_core.engine.pipeline import Pipeline
    from kestrel_core.engine.runner import Runner

    send_on, layers = Pipeline.send_on, Runner.layers

    def counted_send(self, h):
        counts["sends"] += 1
        return send_on(self, h)

    def counted_layers(self, *args, **kw):
        counts["pieces"] += kw.get("first_row", 0) > 0
        return layers(self, *args, **kw)

    Pipeline.send_on, Runner.layers = counted_send, counted_layers


if __name__ == "__main__":
    import os

    model_dir, keep, out = sys.argv[1:4]
    micro = sys.argv[4] if len(sys.argv) > 4 else None
    counts = None if micro is None else {"sends": 0, "pieces": 0}
    if counts is not None:
        counting(counts)
    held: list[int] = []
    if os.environ.get("GROW_FLOOR"):
        growing(int(os.environ["GROW_FLOOR"]), held)
    ids = run(model_dir, keep, micro or "auto", float(sys.argv[5]) if len(sys.argv) > 5 else 0.0, counts)
    rank = os.environ.get("RANK", "0")
    if os.environ.get("GROW_FLOOR"):
        with open(f"{out}.rank{rank}.grown.json", "w") as f:
            json.dump(held, f)
    if counts is not None:
        with open(f"{out}.rank{rank}.json", "w") as f:
            json.dump(counts, f)
    if rank == "0":
        with open(out, "w") as f:
            json.dump(ids if counts is None else {"ids": ids, **counts}, f)
