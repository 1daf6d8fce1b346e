"""Layers split over ranks (torch.distributed, gloo, cpu_ref): one process against 2 and more ranks started by
torchrun, on one preset, interleaved repeat by repeat.

    python -m bench pipeline [--preset demo] [--ranks 2,4] [--keep off] [--tokens 32] [--repeats 3] [--threads 1]
                             [--batch 1]

Each rank is a fresh process (``bench.pipeline_worker``): a warm-up generate, then one greedy generate of
``--tokens``. Per row: rank 0's decode ms/token (p10/p50/p90 over its steps, every step kept), each rank's peak RSS
and peak resident weight bytes, the split, and whether the ids equal the one process's. The headline: the pipeline's
ms/token p50 over one process's (issue 44's target at keep off: <= 1.1x). On one host the ranks share its cores:
``--threads`` each (default 1), so a row of N ranks uses N threads where the one process uses one.

With ``--batch B`` > 1 each row is one greedy batch of B sequences through ``generate_batch``, timed whole, and each
rank count runs twice, its decode steps cut into micro-batches over the ranks (so the ranks work at once) and not;
the headline is each row's tokens/s over one process's (p50 of the repeats).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import models
from bench.errors import BenchError
from bench.log import log
from bench.options import keep, numbers
from bench.stats import summary

ROOT = Path(__file__).resolve().parents[2]


def add_arguments(p) -> None:
    models.add_arguments(p)
    p.add_argument("--preset", default="demo")
    p.add_argument("--ranks", type=numbers(int, 2), default=[2, 4])
    p.add_argument("--keep", default="off", type=keep)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads of each rank")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded at once (1: one generate)")


def needs_gpu(args) -> str | None:
    return None


def one_row(path: Path, ranks: int, args, micro: str = "auto") -> list[dict]:
    """Every rank's figures of one run of ``ranks`` ranks (1: a plain process), micro-batches ``micro``."""
    with tempfile.TemporaryDirectory(prefix="kestrel-pipeline-") as out:
        worker = ["-m", "bench.pipeline_worker", str(path), args.keep, str(args.tokens), str(args.threads), out,
                  str(args.batch), micro]
        cmd = [sys.executable, *worker] if ranks == 1 else \
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *worker]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800,
                              env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
        if done.returncode:
            raise BenchError(f"{ranks} rank(s) failed:\n{done.stderr[-3000:]}")
        return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(ranks)]


def run(args, record) -> dict:
    path = models.ensure_preset(args.models, args.preset)
    if args.batch > 1:
        return batch_run(args, record, path)
    counts = [1, *[n for n in args.ranks if n > 1]]
    runs: dict[int, list[list[dict]]] = {n: [] for n in counts}
    for _ in range(args.repeats):
        for n in counts:
            runs[n].append(one_row(path, n, args))
        record.save_partial({"runs": {str(n): r for n, r in runs.items()}})
    base_ids = runs[1][0][0]["token_ids"]
    rows = []
    for n in counts:
        steps = [ms for rep in runs[n] for ms in rep[0]["decode_ms"]]
        row = {"ranks": n, "parts": runs[n][0][0]["pipeline"]["parts"], "ms_per_token": summary(steps),
               "ms_per_token_p50_runs": [summary(rep[0]["decode_ms"])["p50"] for rep in runs[n]],
               "peak_rss_bytes_per_rank": [max(rep[r]["peak_rss_bytes"] for rep in runs[n]) for r in range(n)],
               "peak_resident_bytes_per_rank": [rep_r["peak_resident_bytes"] for rep_r in runs[n][0]],
               "ids_equal_one_process": all(rep[0]["token_ids"] == base_ids for rep in runs[n]),
               "runs": runs[n]}
        rows.append(row)
        log(f"{n} rank(s): {row['ms_per_token']['p50']:.2f} ms/token p50, peak RSS per rank "
            f"{[round(b / 2**20) for b in row['peak_rss_bytes_per_rank']]} MiB, ids equal one process's: "
            f"{row['ids_equal_one_process']}")
    one = rows[0]["ms_per_token"]["p50"]
    over = {str(r["ranks"]): r["ms_per_token"]["p50"] / one for r in rows[1:]}
    for n, x in over.items():
        log(f"{n} ranks over one process: {x:.3f}x ms/token (target at keep off <= 1.1x: {'met' if x <= 1.1 else 'not met'})")
    return {"preset": args.preset, "backend": "cpu_ref", "keep": args.keep, "tokens": args.tokens,
            "threads_per_rank": args.threads, "cores": os.cpu_count(), "rows": rows, "over_one_process": over}


def batch_run(args, record, path: Path) -> dict:
    """A batch's rows: one process, then each rank count with micro-batches on and off, interleaved repeat by repeat;
    each row's tokens/s over the repeats (tokens generated over the batch's wall time)."""
    configs = [(1, "off"), *[(n, m) for n in args.ranks if n > 1 for m in ("on", "off")]]
    runs: dict[tuple, list[list[dict]]] = {c: [] for c in configs}
    for _ in range(args.repeats):
        for n, micro in configs:
            runs[n, micro].append(one_row(path, n, args, micro))
        record.save_partial({"runs": {f"{n} {m}": r for (n, m), r in runs.items()}})
    base_ids = runs[1, "off"][0][0]["token_ids"]
    rows = []
    for n, micro in configs:
        rates = [rep[0]["tokens"] / rep[0]["wall_s"] for rep in runs[n, micro]]
        row = {"ranks": n, "micro_batches": micro if n > 1 else None, "parts": runs[n, micro][0][0]["pipeline"]["parts"],
               "tokens_per_s": summary(rates),
               "tokens_per_s_runs": rates, "wall_s_runs": [rep[0]["wall_s"] for rep in runs[n, micro]],
               "peak_rss_bytes_per_rank": [max(rep[r]["peak_rss_bytes"] for rep in runs[n, micro]) for r in range(n)],
               "ids_equal_one_process": all(rep[0]["token_ids"] == base_ids for rep in runs[n, micro]),
               "runs": runs[n, micro]}
        rows.append(row)
        what = f"{n} ranks, micro-batches {micro}" if n > 1 else "1 process"
        log(f"{what}, batch {args.batch}: {row['tokens_per_s']['p50']:.1f} tokens/s p50 "
            f"({', '.join(f'{r:.1f}' for r in rates)}), ids equal one process's: {row['ids_equal_one_process']}")
    one = rows[0]["tokens_per_s"]["p50"]
    over = {f"{r['ranks']} {r['micro_batches']}": r["tokens_per_s"]["p50"] / one for r in rows[1:]}
    for key, x in over.items():
        log(f"{key}: {x:.3f}x one process's tokens/s")
    return {"preset": args.preset, "backend": "cpu_ref", "keep": args.keep, "tokens": args.tokens, "batch": args.batch,
            "threads_per_rank": args.threads, "cores": os.cpu_count(), "rows": rows, "tokens_per_s_over_one_process": over}
