"""Batched decoding and the server, in one run: the engine at batch sizes B (bytes streamed a generated token, tokens/s,
each sequence's ids against its solo run), then ``kestrel serve`` under 1, 8 and 32 concurrent streaming clients
(the official openai client: tokens/s, time to first token and between tokens), beside the engine's own ms/token for
the same request, so the server's overhead at one client is measured against its baseline.

    python -m bench batch [--preset demo] [--backend cpu_ref] [--keep 1] [--batches 1,4,16] [--clients 1,8,32]
                          [--tokens 32] [--rows engine,server]
    python -m bench batch --preset qwen3-30b-a3b --layers 8 --backend cuda --keep off --expert-policy expert_lru \
                          --expert-budget-mib 683 --batches 1,8,32 --rows engine --prompts 32     # MoE through the table

The engine rows run ``Run.generate_batch`` over the same 16 prompts at each ``--batches`` B (``max_batch`` B), after a
warm-up batch; B = 1 is one sequence at a time, the baseline. Per row: wall time, tokens/s, bytes uploaded a
generated token over the whole job and over the steady passes (every row decoding), each sequence's decode times and
whether its ids equal B = 1's. The server rows start ``kestrel serve`` on a free loopback port with the same settings
and ``--max-batch`` the largest client count; each client streams one completion of ``--tokens`` tokens of its own
prompt, all clients started together, ``--repeats`` rounds. Per row: every client's time to first token and the gaps
between its tokens, p50 and p99 over all of them, and the round's tokens/s. The same scenario runs on cuda
(``--backend cuda``) unchanged.
"""

from __future__ import annotations

import argparse
import re
import statistics
import threading
import time
from pathlib import Path

from bench import models
from bench.errors import BenchError
from bench.log import log
from bench.options import keep, names, numbers
from bench.rss import process_memory
from bench.serve_process import ServeProcess
from bench.stats import summary
from kestrel_core.engine.plan import bytes_streamed, delta

ROOT = Path(__file__).resolve().parents[2]


def add_arguments(p) -> None:
    models.add_arguments(p)
    p.add_argument("--preset", default="demo")
    p.add_argument("--backend", default="cpu_ref")
    p.add_argument("--keep", default="1", type=keep)
    p.add_argument("--layers", type=int, default=None, help="keep only the first N layers of the preset")
    p.add_argument("--expert-policy", default="", help="a MoE preset's expert policy (e.g. expert_lru; empty: none)")
    p.add_argument("--expert-budget-mib", type=float, default=0.0, help="its budget in MiB")
    p.add_argument("--expert-landing", default=None, type=landings,
                   help="with --expert-policy: on or off, or several in turn (on,off,off,on): the engine rows of "
                        "each, one run after the other in this process; the first's are the record's engine rows")
    p.add_argument("--batches", type=numbers(int, 1), default=[1, 4, 16])
    p.add_argument("--clients", type=numbers(int, 1), default=[1, 8, 32])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompts", type=int, default=16, help="prompts in each engine row")
    p.add_argument("--repeats", type=int, default=3, help="rounds of each server row")
    p.add_argument("--rows", type=names(("engine", "server", "choices")), default={"engine", "server"},
                   help="choices: one request of n = --choices sampled choices against that many requests of the "
                        "prompt at once and one after another, on one server")
    p.add_argument("--choices", type=int, default=4, help="n of the choices rows")
    p.add_argument("--choice-prompt", type=int, default=256, help="prompt tokens of the choices rows")
    p.add_argument("--max-seqs", type=numbers(int, 2), default=None,
                   help="the server rows at each of these --max-seq (default: 64 + --tokens), one server a value, in "
                        "one run: what a context a request does not use costs")


def landings(text: str) -> list[str]:
    """``--expert-landing``: on or off, comma-separated, in the order the runs go (a value may come again)."""
    got = [p.strip() for p in text.split(",") if p.strip()]
    if not got or set(got) - {"on", "off"}:
        raise argparse.ArgumentTypeError(f"{text!r}: give on or off, or several comma-separated (on,off,off,on)")
    return got


def landing_runs(args) -> list[str]:
    """The landing setting of each engine run, in turn (``--expert-landing``, on where not given)."""
    return args.expert_landing or ["on"]


def needs_gpu(args) -> str | None:
    if args.backend == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "--backend cuda needs a CUDA device"
    return None


def prompt_of(i: int) -> list[int]:
    return [(7 * i + k * 13) % 250 + 1 for k in range(3 + i % 5)]


def settings(args, landing: str | None = None) -> dict:
    out = {"backend": args.backend, "keep": args.keep if args.keep == "off" else int(args.keep)}
    if args.expert_policy:
        out.update(expert_policy=args.expert_policy, expert_budget_mb=args.expert_budget_mib,
                   expert_landing=(landing or landing_runs(args)[0]) == "on")
    return out


def serve_flags(args) -> list[str]:
    """The same settings as ``kestrel serve``'s flags."""
    flags = ["--backend", args.backend, "--keep", args.keep]
    if args.expert_policy:
        flags += ["--expert-policy", args.expert_policy, "--expert-budget-mb", repr(args.expert_budget_mib)]
    return flags


def engine_rows(args, path: Path, record, landing: str | None = None) -> tuple[list[dict], dict, list[list[int]]]:
    from kestrel_core import load

    rows = []
    with load(path) as model, model.open(**settings(args, landing)) as run:
        reqs = [dict(prompt_ids=prompt_of(i), max_new_tokens=args.tokens, stop_at_eos=False) for i in range(args.prompts)]
        for b in args.batches:  # warm-up: each B's graphs captured and kernels compiled before any row is timed
            run.generate_batch([dict(r, max_new_tokens=4) for r in reqs[:b]], max_batch=b)
        solo = None
        for b in args.batches:
            before = run.runner.counters.snapshot()
            t0 = time.perf_counter()
            got = run.generate_batch(reqs, max_batch=b)
            wall = time.perf_counter() - t0
            moved = delta(run.runner.counters.snapshot(), before)
            streamed, uploaded = bytes_streamed(moved), moved["bytes_uploaded"]
            bad = [r for r in got if isinstance(r, Exception)]
            if bad:
                raise BenchError(f"the B={b} row failed: {bad[0]}")
            tokens = sum(len(r.token_ids) for r in got)
            steady = [p for r in got for p in r.per_token if p["sequences_in_step"] == b]
            ids = [r.token_ids for r in got]
            solo = ids if solo is None else solo
            row = {"batch": b, "sequences": len(got), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
                   # uploads alone (a batch through the expert table also reads its misses from host copies)
                   "bytes_uploaded": uploaded, "bytes_per_generated_token": uploaded / tokens,
                   "steady_bytes_per_generated_token": (sum(p["bytes_uploaded"] for p in steady) / len(steady) / b
                                                        if steady else None),
                   # what crossed from the host: uploads and the host copies the steps read (plan.bytes_streamed)
                   "bytes_streamed": streamed, "streamed_per_generated_token": streamed / tokens,
                   "steady_streamed_per_generated_token": (sum(bytes_streamed(p) for p in steady) / len(steady) / b
                                                           if steady else None),
                   "decode_ms": [r.decode_ms for r in got], "step_ms": summary([ms for r in got for ms in r.decode_ms]),
                   "ids_equal_one_at_a_time": ids == solo,
                   "first_difference": [next((k for k, (x, y) in enumerate(zip(a, b_)) if x != y), None)
                                        for a, b_ in zip(ids, solo)]}
            rows.append(row)
            log(f"engine B={b:3}: {row['tokens_per_s']:8.1f} tokens/s, {row['streamed_per_generated_token'] / 1e6:8.3f} MB "
                f"crossed a generated token ({row['bytes_per_generated_token'] / 1e6:.3f} uploaded), ids equal B=1's: "
                f"{row['ids_equal_one_at_a_time']}")
            record.save_partial({"engine": rows})
        one = run.generate(prompt_ids=prompt_of(0), max_new_tokens=args.tokens, stop_at_eos=False)
        base = {"decode_ms": one.decode_ms, "summary": summary(one.decode_ms), "ms_per_token": one.ms_per_token}
    return rows, base, solo or []


def one_stream(client, name: str, i: int, tokens: int, start: threading.Barrier) -> dict:
    start.wait()
    t0 = time.perf_counter()
    stamps, ids = [], []
    stream = client.completions.create(model=name, prompt=prompt_of(i), max_tokens=tokens, stream=True,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    for chunk in stream:
        got = [t for c in chunk.choices for t in (getattr(c, "token_ids", None) or [])]
        if got:
            stamps += [time.perf_counter()] * len(got)
            ids += got
    return {"ttft_ms": (stamps[0] - t0) * 1e3 if stamps else None,
            "gaps_ms": [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:]) if b > a],
            "tokens": len(ids), "wall_s": time.perf_counter() - t0, "ids": ids}


def server_rows(args, path: Path, record, engine: list[dict], solo: list[list[int]]) -> list[dict]:
    """``solo``: the engine's one-at-a-time ids of the first prompts, which the clients of those prompts must equal.
    One server a ``--max-seqs`` value, each row saying its ``max_seq``."""
    rows: list[dict] = []
    for max_seq in args.max_seqs or [64 + args.tokens]:
        rows += server_rows_at(args, path, record, engine, solo, max_seq, rows)
    return rows


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f} MiB"


def memory(server: ServeProcess) -> dict:
    """The server process's resident memory (now and its high-water mark), and from its /metrics the bytes its KV
    cache holds and the device memory's peak (None where the backend reports none)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": "Bearer bench"}, timeout=30).text
    got = {f.name: f.samples[0].value for f in text_string_to_metric_families(text)
           if f.name in ("kestrel_kv_cache_bytes", "kestrel_device_peak_bytes")}
    return {**process_memory(server.proc.pid), "kv_cache_bytes": got.get("kestrel_kv_cache_bytes"),
            "device_peak_bytes": got.get("kestrel_device_peak_bytes")}


def server_rows_at(args, path: Path, record, engine: list[dict], solo: list[list[int]], max_seq: int,
                   before: list[dict]) -> list[dict]:
    need_openai()
    clients = args.clients
    server = ServeProcess(path, *serve_flags(args), "--max-batch", str(max(clients)),
                          "--max-seq", str(max_seq), env={"KESTREL_API_KEY": "bench"}, timeout=300)
    rows = []
    try:
        client = server.client("bench", timeout=600)
        name = str(path)
        one_stream(client, name, 0, 4, threading.Barrier(1))  # warm-up
        warm = memory(server)
        for n in clients:
            rounds = []
            for _ in range(args.repeats):
                barrier = threading.Barrier(n)
                out: list[dict | None] = [None] * n

                def go(i: int) -> None:
                    out[i] = one_stream(client, name, i, args.tokens, barrier)

                t0 = time.perf_counter()
                threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                wall = time.perf_counter() - t0
                if any(o is None for o in out):
                    raise BenchError(f"a client of the {n}-client row got no answer")
                rounds.append({"wall_s": wall, "tokens": sum(o["tokens"] for o in out),
                               "tokens_per_s": sum(o["tokens"] for o in out) / wall,
                               "clients": [{k: v for k, v in o.items() if k != "ids"} for o in out],
                               "ids_equal_engine": [o["ids"] == solo[i] for i, o in enumerate(out) if i < len(solo)]})
            ttft = [c["ttft_ms"] for r in rounds for c in r["clients"] if c["ttft_ms"] is not None]
            gaps = [g for r in rounds for c in r["clients"] for g in c["gaps_ms"]]
            row = {"clients": n, "max_seq": max_seq, "rounds": rounds, "tokens_per_s_runs": [r["tokens_per_s"] for r in rounds],
                   "tokens_per_s_p50": statistics.median(r["tokens_per_s"] for r in rounds),
                   "ttft_ms": percentiles(ttft), "between_tokens_ms": percentiles(gaps),
                   "ids_compared": sum(len(r["ids_equal_engine"]) for r in rounds),
                   "ids_equal_engine": all(all(r["ids_equal_engine"]) for r in rounds),
                   # the server's memory once warm, and after this row (its high-water marks since it started)
                   "server_memory": {"after_warmup": warm, "after_row": memory(server)}}
            rows.append(row)
            log(f"server {n:3} clients, max_seq {max_seq}: {row['tokens_per_s_p50']:8.1f} tokens/s, first token p50 "
                f"{row['ttft_ms']['p50']:.1f} p99 {row['ttft_ms']['p99']:.1f} ms, between p50 "
                f"{row['between_tokens_ms']['p50']:.2f} p99 {row['between_tokens_ms']['p99']:.2f} ms, KV cache "
                f"{mib(row['server_memory']['after_row']['kv_cache_bytes'])}, device peak "
                f"{mib(row['server_memory']['after_row']['device_peak_bytes'])}")
            record.save_partial({"engine": engine, "server": before + rows})
    finally:
        server.stop()
    return rows


def need_openai() -> None:
    try:
        import openai  # noqa: F401 - ServeProcess.client's
    except ImportError:
        raise BenchError("the server rows need the openai client: pip install -e '.[test]'") from None


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0, "p50": None, "p99": None}
    s = sorted(xs)
    q = statistics.quantiles(s, n=100, method="inclusive") if len(s) > 1 else [s[0]] * 99
    return {"n": len(s), "p50": statistics.median(s), "p99": q[98], "max": s[-1]}


def choices_rows(args, path: Path, record) -> dict:
    """One request of n sampled choices against n requests of the same prompt with the choices' seeds, sent at once
    and one after another, interleaved round by round on one server: wall time and tokens/s of each, and whether each
    choice's ids equal its seed's request's."""
    need_openai()
    n, prompt = args.choices, [(13 * k) % 250 + 1 for k in range(args.choice_prompt)]
    server = ServeProcess(path, *serve_flags(args), "--max-batch", str(n),
                          "--max-seq", str(args.choice_prompt + args.tokens + 8), env={"KESTREL_API_KEY": "bench"},
                          timeout=300)
    client = server.client("bench", timeout=600)
    body = dict(model=str(path), prompt=prompt, max_tokens=args.tokens, temperature=0.8,
                extra_body={"ignore_eos": True, "return_token_ids": True})

    def one(seed: int) -> list[int]:
        return client.completions.create(seed=seed, **body).choices[0].token_ids

    def at_once() -> list[list[int]]:
        out: list = [None] * n
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, one(100 + i))) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    ways = {"one_request_n": lambda: [c.token_ids for c in sorted(
                client.completions.create(seed=100, n=n, **body).choices, key=lambda c: c.index)],
            "requests_at_once": at_once,
            "requests_one_after_another": lambda: [one(100 + i) for i in range(n)]}
    rows: dict[str, dict] = {k: {"wall_s": [], "ids": None} for k in ways}
    try:
        one(1)  # warm-up
        for _ in range(args.repeats):
            for name, way in ways.items():
                t0 = time.perf_counter()
                ids = way()
                rows[name]["wall_s"].append(time.perf_counter() - t0)
                rows[name]["ids"] = ids
            record.save_partial({"choices": rows})
    finally:
        server.stop()
    base = rows["requests_one_after_another"]["ids"]
    out = {"n": n, "prompt_tokens": len(prompt), "tokens": args.tokens, "rows": {}}
    for name, row in rows.items():
        wall = statistics.median(row["wall_s"])
        out["rows"][name] = {"wall_s_runs": row["wall_s"], "wall_s_p50": wall,
                             "tokens_per_s_p50": n * args.tokens / wall, "ids_equal_seeds_requests": row["ids"] == base}
        log(f"{name:27} {n * args.tokens / wall:8.1f} tokens/s (wall p50 {wall:.2f} s), ids equal each seed's "
            f"request: {row['ids'] == base}")
    return out


def run(args, record) -> dict:
    if args.expert_landing and not args.expert_policy:
        raise BenchError("--expert-landing sets how an expert policy's misses cross to the device: give --expert-policy "
                         "and --expert-budget-mib with it, or leave it out")
    if "server" in args.rows and args.max_seqs:
        from kestrel_core.tools.presets import preset_config

        most = preset_config(args.preset).max_position_embeddings
        past = [m for m in args.max_seqs if m > most]
        if past:  # the server would refuse it at start, after every row before it had run
            raise BenchError(f"--max-seqs {past[0]:,} is past the {args.preset} preset's {most:,} positions "
                             f"(max_position_embeddings): give at most {most:,}, or a preset with more")
    path = models.ensure_preset(args.models, args.preset, layers=args.layers)
    wanted = args.rows
    engine, base, solo = engine_rows(args, path, record) if "engine" in wanted else ([], None, [])
    landing = [{"expert_landing": landing_runs(args)[0], "rows": engine, "ids_equal_first": True}]
    for other in landing_runs(args)[1:] if "engine" in wanted and args.expert_policy else ():
        log(f"engine rows with expert_landing {other}")
        rows, _, ids = engine_rows(args, path, record, other)
        # the first B's ids: landing changes what is cached, never a result
        landing.append({"expert_landing": other, "rows": rows, "ids_equal_first": ids == solo})
        log(f"expert_landing {other}: the first B's ids equal the first run's: {ids == solo}")
    server = server_rows(args, path, record, engine, solo) if "server" in wanted else []
    result = {"preset": args.preset, "backend": args.backend, "keep": args.keep, "tokens": args.tokens,
              "engine": engine, "engine_one_request": base, "server": server}
    if args.expert_policy:
        result["expert_landing"] = landing_runs(args)
        result["engine_by_landing"] = landing
    if "choices" in wanted:
        result["choices"] = choices_rows(args, path, record)
    seqs = sorted({r["max_seq"] for r in server})
    if len(seqs) > 1:  # the longest context against the shortest, client count by client count: target <= 1.1x
        lo, hi = seqs[0], seqs[-1]
        result["max_seq_cost"] = [
            {"clients": n, "max_seq": [lo, hi], "tokens_per_s": [a["tokens_per_s_p50"], b["tokens_per_s_p50"]],
             "short_over_long": a["tokens_per_s_p50"] / b["tokens_per_s_p50"],
             "met": a["tokens_per_s_p50"] / b["tokens_per_s_p50"] <= 1.1}
            for n in args.clients
            for a in [next(r for r in server if r["clients"] == n and r["max_seq"] == lo)]
            for b in [next(r for r in server if r["clients"] == n and r["max_seq"] == hi)]]
        for c in result["max_seq_cost"]:
            log(f"{c['clients']} clients: max_seq {lo} gives {c['short_over_long']:.3f}x the tokens/s of {hi} "
                f"(target <= 1.1x: {'met' if c['met'] else 'not met'})")
    one = next((r for r in server if r["clients"] == 1), None)
    if one and base:
        result["server_over_engine_at_one_client"] = one["between_tokens_ms"]["p50"] / base["summary"]["p50"]
    if engine:
        b1 = next((r for r in engine if r["batch"] == 1), None)
        if b1 and b1["streamed_per_generated_token"]:  # nothing crossed where every weight stays resident
            result["bytes_per_generated_token_over_b1"] = {r["batch"]: r["streamed_per_generated_token"] /
                                                           b1["streamed_per_generated_token"] for r in engine}
    return result
