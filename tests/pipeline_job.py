"""Run under torchrun by tests/test_pipeline.py: a batch of sequences (greedy and sampled, prompts in chunks) through
the Python API on rank 0, which the other ranks follow; rank 0 writes each sequence's ids as JSON to the path given
(with ``count`` after it: in micro-batches, and also how many rank 0 sent on, and its decode steps)."""

from __future__ import annotations

import json
import sys

from kestrel_core import load

PROMPTS = [[5, 17, 42, 99, 3], [1, 2, 3], [7, 8, 9, 10, 11, 12, 13], [7, 8, 9, 10, 11, 12, 13]]


def requests() -> list[dict]:
    settings = [dict(), dict(temperature=0.9, seed=4), dict(), dict(temperature=1.1, top_k=20, seed=9)]
    return [dict(prompt_ids=p, max_new_tokens=6 + i, stop_at_eos=False, **g)
            for i, (p, g) in enumerate(zip(PROMPTS, settings))]


def run(model_dir: str, keep: str, counts: dict | None = None) -> list[list[int]] | None:
    """Rank 0 (or one process) generates; a pipeline's other ranks follow its steps (None)."""
    micro = "on" if counts is not None else "auto"  # cpu_ref's auto: off (its ranks share one host)
    with load(model_dir) as model, model.open(backend="cpu_ref", keep=keep if keep == "off" else int(keep),
                                              micro_batches=micro) as r:
        if r.pipeline is not None and r.pipeline.rank > 0:
            r.follow()
            return None
        got = r.generate_batch(requests(), max_batch=3, prefill_chunk=4)
        if counts is not None:
            counts["decode_steps"] = r.runner.decode_steps
        return [x.token_ids for x in got]


if __name__ == "__main__":
    model_dir, keep, out = sys.argv[1:4]
    counts = {"sends": 0} if sys.argv[4:] == ["count"] else None
    if counts is not None:
        from kestrel_core.engine.pipeline import Pipeline

        send_on = Pipeline.send_on

        def counted(self, h):
            counts["sends"] += 1
            return send_on(self, h)

        Pipeline.send_on = counted
    ids = run(model_dir, keep, counts)
    import os

    if os.environ.get("RANK", "0") == "0":
        with open(out, "w") as f:
            json.dump(ids if counts is None else {"ids": ids, **counts}, f)
