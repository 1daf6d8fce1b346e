"""One rank of ``python -m bench pipeline`` (``-m bench.pipeline_worker``, run by torchrun, or alone as the one-process
row): a warm-up, then one greedy generate, or with a batch of B > 1 one greedy batch of B sequences through
``generate_batch`` (timed whole: its prefills and steps); a later rank follows rank 0's. It writes its own figures as
``rank<R>.json`` in the directory given."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from bench.rss import process_memory


def main(model: str, keep: str, tokens: int, threads: int, out: str, batch: int = 1, micro: str = "auto") -> None:
    import torch

    from kestrel_core import load

    prompts = [[(13 * k + 7 * i) % 250 + 1 for k in range(16)] for i in range(batch)]
    prompt = prompts[0]
    wall_s = None
    with load(model) as m, m.open(backend="cpu_ref", keep=keep if keep == "off" else int(keep),
                                          micro_batches=micro, threads=threads) as run:  # the run sets its threads
        res = None
        if run.follows:  # a later rank: it makes rank 0's steps (both generates) until rank 0 closes its run
            run.follow()
        elif batch > 1:
            asks = [dict(prompt_ids=p, max_new_tokens=tokens, stop_at_eos=False) for p in prompts]
            run.generate_batch([dict(a, max_new_tokens=4) for a in asks], max_batch=batch)  # warm-up
            t0 = time.perf_counter()
            res = run.generate_batch(asks, max_batch=batch)
            wall_s = time.perf_counter() - t0
        else:
            run.generate(prompt_ids=prompt, max_new_tokens=4, stop_at_eos=False)  # warm-up
            res = run.generate(prompt_ids=prompt, max_new_tokens=tokens, stop_at_eos=False)
        pipe = run.pipeline.to_json() if run.pipeline is not None else {"rank": 0, "ranks": 1, "parts": []}
        peak_resident = run.counters.snapshot()["peak_resident_bytes"]
        computed_on = torch.get_num_threads()
    rank = int(os.environ.get("RANK", "0"))
    if batch > 1 and res is not None:  # the batch's ids, and its tokens over its wall time
        figures = {"token_ids": [r.token_ids for r in res], "wall_s": wall_s,
                   "tokens": sum(len(r.token_ids) for r in res)}
    else:
        figures = {"token_ids": res and res.token_ids, "decode_ms": res and res.decode_ms,
                   "prefill_ms": res and res.prefill_ms}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({  # the ids and times: rank 0's, which chose every step
        "rank": rank, "pipeline": pipe, **figures, "peak_rss_bytes": process_memory()["peak_rss_bytes"],
        "peak_resident_bytes": peak_resident, "threads": computed_on}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], int(sys.argv[6]), sys.argv[7])
