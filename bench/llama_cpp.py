"""llama.cpp as a peer: its own benchmark programs, run on the very GGUF file kestrel ran, in the same run, their
figures set beside kestrel's in the record. Nothing of llama.cpp is imported: the bench calls its binaries.

    bins = Binaries.find(bin_dir)                          # llama-bench and llama-batched-bench, or a BenchError
    peer = bins.bench(gguf, prompt=512, gen=128, reps=5)   # pp512 and tg128 at -ngl 99: every sample's tokens/s
    peer += bins.batched(gguf, (1, 8, 64), prompt=128, gen=128)   # S_TG at each B (llama-batched-bench)
    ours = kestrel_rows(model, settings, (1, 8, 64), prompt=128, gen=128, prefill=512)
    rows = versus(ours, peer, shape="qwen3-8b", file_type="Q4_K_M", card="NVIDIA H100 80GB HBM3")

Each row of either side is a dict with ``rows`` (the batch), ``phase`` (``decode`` or ``prefill``) and
``tokens_per_s``; ``versus`` pairs them and gives kestrel over llama.cpp. ``--llama-cpp`` is built on the GPU machine
by ``build-llama-cpp.sh`` (beside the peers' source); without flash-attention kernels, so both run plain attention.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path

from bench.errors import BenchError

PROGRAMS = ("llama-bench", "llama-batched-bench")
# the targets of issue 57: kestrel over llama.cpp on one card and file
TARGETS = {("decode", 1): 1.25, ("decode", "batched"): 1.2, ("prefill", None): 1.0}


class Binaries:
    """llama.cpp's two benchmark programs in one folder."""

    def __init__(self, folder: Path):
        self.folder = folder

    @classmethod
    def find(cls, folder: str | os.PathLike) -> "Binaries":
        folder = Path(folder)
        missing = [p for p in PROGRAMS if not os.access(folder / p, os.X_OK)]
        if missing:
            raise BenchError(f"--llama-cpp {folder}: no executable {' or '.join(missing)} there; build them with "
                             f"build-llama-cpp.sh DIR and pass DIR/llama.cpp/build/bin")
        return cls(folder)

    def _run(self, program: str, args: list[str], timeout: float) -> tuple[str, float]:
        cmd = [str(self.folder / program), *args]
        t0 = time.perf_counter()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise BenchError(f"{program} ran past {timeout:.0f} s: {' '.join(cmd)}") from None
        wall = time.perf_counter() - t0
        if done.returncode:
            tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
            raise BenchError(f"{program} failed (exit {done.returncode}): {tail[:400]}")
        return done.stdout + "\n" + done.stderr, wall

    def bench(self, gguf: Path, prompt: int = 512, gen: int = 128, reps: int = 5, gpu_layers: int = 99,
              timeout: float = 900) -> list[dict]:
        """``llama-bench -p PROMPT -n GEN``: a prefill row (pp) and a decode row (tg) at batch 1, every sample kept."""
        args = ["-m", str(gguf), "-p", str(prompt), "-n", str(gen), "-r", str(reps), "-ngl", str(gpu_layers),
                "-fa", "0", "-o", "json"]
        out, wall = self._run("llama-bench", args, timeout)
        return [dict(r, command=["llama-bench", *args], wall_s=wall) for r in parse_bench(out)]

    def batched(self, gguf: Path, batches: tuple[int, ...] = (1, 8, 64), prompt: int = 128, gen: int = 128,
                gpu_layers: int = 99, timeout: float = 900) -> list[dict]:
        """``llama-batched-bench``: B sequences of PROMPT tokens each, then GEN tokens each; S_TG at each B."""
        ctx = max(batches) * (prompt + gen)
        args = ["-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(prompt), "-ntg", str(gen),
                "-npl", ",".join(str(b) for b in batches), "-ngl", str(gpu_layers), "-fa", "off",
                "--output-format", "jsonl"]
        out, wall = self._run("llama-batched-bench", args, timeout)
        return [dict(r, command=["llama-batched-bench", *args], wall_s=wall) for r in parse_batched(out)]


def parse_bench(text: str) -> list[dict]:
    """llama-bench's ``-o json`` (a JSON list, among whatever else it printed) as rows: each test's phase, batch 1,
    the median of its samples' tokens/s, and the samples."""
    start, end = text.find("["), text.rfind("]")
    try:
        tests = json.loads(text[start:end + 1]) if start >= 0 else None
    except json.JSONDecodeError:
        tests = None
    if not isinstance(tests, list) or not tests:
        raise BenchError("llama-bench printed no JSON list of tests (was it given -o json?)")
    rows = []
    for t in tests:
        try:
            phase = "prefill" if t["n_gen"] == 0 else "decode" if t["n_prompt"] == 0 else None
            samples = [float(v) for v in t["samples_ts"]]
        except (KeyError, TypeError, ValueError):
            raise BenchError(f"llama-bench's test lacks n_prompt, n_gen or samples_ts: {str(t)[:200]}") from None
        if phase is None or not samples:
            continue  # a combined pp+tg test: neither phase alone
        rows.append({"program": "llama-bench", "phase": phase, "rows": 1, "n_prompt": t["n_prompt"],
                     "n_gen": t["n_gen"], "tokens_per_s": statistics.median(samples), "samples_ts": samples,
                     "gpu_info": t.get("gpu_info"), "model_type": t.get("model_type"),
                     "model_size": t.get("model_size"), "build_commit": t.get("build_commit"),
                     "n_gpu_layers": t.get("n_gpu_layers")})
    if not rows:
        raise BenchError("llama-bench's JSON held no prefill-only or decode-only test")
    return rows


def parse_batched(text: str) -> list[dict]:
    """llama-batched-bench's ``--output-format jsonl`` lines as decode rows at each batch (S_TG) with their prefill."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{") or '"speed_tg"' not in line:
            continue
        try:
            r = json.loads(line)
            rows.append({"program": "llama-batched-bench", "phase": "decode", "rows": int(r["pl"]),
                         "n_prompt": int(r["pp"]), "n_gen": int(r["tg"]), "tokens_per_s": float(r["speed_tg"]),
                         "prefill_tokens_per_s": float(r["speed_pp"]), "t_tg_s": float(r["t_tg"]),
                         "t_pp_s": float(r["t_pp"])})
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise BenchError(f"llama-batched-bench printed a line that is not its JSON row: {line[:200]}") from None
    if not rows:
        raise BenchError("llama-batched-bench printed no JSON rows (was it given --output-format jsonl?)")
    return rows


def kestrel_rows(model, settings: dict, batches: tuple[int, ...] = (1, 8, 64), prompt: int = 128, gen: int = 128,
                 prefill: int = 512, prefill_reps: int = 3) -> list[dict]:
    """kestrel's figures at llama.cpp's lengths on one open model: decode at each B (B sequences of ``prompt`` ids,
    ``gen`` new tokens each, one batch: tokens/s over the steps where all B decode, B over the step's median time) and a
    prefill of ``prefill`` ids (its median over ``prefill_reps`` runs). Each decode row's ids are checked against B = 1's
    for its first sequence. Warmed first (graphs captured, kernels compiled) at every B. Each row says which layer ops
    ran (``layer_ops``: the setting; ``layer_ops_ran``: torch's or the backend's fused ones)."""
    from bench.stats import summary

    vocab = model.config.vocab_size
    prompts = [[(7 * i + 13 * s + 3) % vocab for i in range(prompt)] for s in range(max(batches))]
    from kestrel_core.engine.model import TORCH_OPS

    out = []
    with model.open(**settings) as run:
        # the steps between the linears these rows ran: what was asked, and torch's ops or the backend's fused ones
        ops = {"layer_ops": run.config.backend.layer_ops,
               "layer_ops_ran": "torch" if getattr(run.backend, "layer_ops", TORCH_OPS) is TORCH_OPS else "fused"}
        for b in batches:  # warm-up: not timed
            run.generate_batch([dict(prompt_ids=p, max_new_tokens=4, stop_at_eos=False) for p in prompts[:b]],
                               max_batch=b)
        solo = None
        for b in batches:
            got = run.generate_batch([dict(prompt_ids=p, max_new_tokens=gen, stop_at_eos=False) for p in prompts[:b]],
                                     max_batch=b)
            bad = [r for r in got if isinstance(r, Exception)]
            if bad:
                raise BenchError(f"kestrel's B={b} row failed: {bad[0]}")
            first = got[0]  # its steps are the batch's: every sequence steps together
            steps = [ms for ms, p in zip(first.decode_ms, first.per_token) if p["sequences_in_step"] == b]
            steps = steps[1:] or steps  # the first step after the prefill warms what the prefill left
            s = summary([float(v) for v in steps])
            solo = solo or list(got[0].token_ids)
            out.append({"program": "kestrel", "phase": "decode", "rows": b, "n_prompt": prompt, "n_gen": gen,
                        "tokens_per_s": b * 1e3 / s["p50"], "step_ms": [float(v) for v in steps], "step": s,
                        "first_ids_equal_solo": list(got[0].token_ids) == solo, **ops})
        pp_ids = [(11 * i + 5) % vocab for i in range(prefill)]
        times = []
        for _ in range(prefill_reps + 1):
            r = run.generate(prompt_ids=pp_ids, max_new_tokens=1, stop_at_eos=False)
            times.append(float(r.prefill_ms))
        times = times[1:]  # the first: warm-up (a prompt this long compiles its own shapes)
        out.append({"program": "kestrel", "phase": "prefill", "rows": 1, "n_prompt": prefill, "n_gen": 0,
                    "tokens_per_s": prefill * 1e3 / statistics.median(times), "prefill_ms": times, **ops})
    return out


def versus(kestrel: list[dict], peer: list[dict], *, shape: str, file_type: str, card: str) -> list[dict]:
    """``result["vs_llama_cpp"]``: each kestrel row beside llama.cpp's row of the same phase and batch (llama-bench's
    at batch 1, llama-batched-bench's above it), with kestrel over llama.cpp and the target that ratio is held to."""
    rows = []
    for k in kestrel:
        phase, b = k["phase"], k["rows"]
        prog = "llama-bench" if b == 1 else "llama-batched-bench"
        twin = next((p for p in peer if p["phase"] == phase and p["rows"] == b and p["program"] == prog), None)
        if twin is None:
            continue
        target = TARGETS[("prefill", None)] if phase == "prefill" else TARGETS[("decode", 1 if b == 1 else "batched")]
        ratio = k["tokens_per_s"] / twin["tokens_per_s"]
        rows.append({"shape": shape, "file_type": file_type, "rows": b, "phase": phase, "card": card,
                     "kestrel_kernels": k.get("kernels", "float"),
                     "kestrel_tokens_per_s": k["tokens_per_s"], "llama_cpp_tokens_per_s": twin["tokens_per_s"],
                     "llama_cpp_program": prog, "ratio": ratio, "target": target, "met": ratio >= target})
    return rows


def add_argument(p) -> None:
    p.add_argument("--llama-cpp", default="", metavar="BIN_DIR",
                   help="also llama.cpp's llama-bench and llama-batched-bench from BIN_DIR on the same GGUF file, in "
                        "this run (needs --gguf); the comparison goes in the record's vs_llama_cpp")
    p.add_argument("--llama-cpp-batches", default="1,8,64", help="the batches B of that comparison")
    p.add_argument("--llama-cpp-kernels", default="auto", metavar="KERNELS",
                   help="kestrel's GGUF kernels for its side of that comparison, comma-separated: auto (float for decode "
                        "rows, int8 for a prompt's), float (the weights' blocks dequantized in the kernel), int8 (x "
                        "quantized, integer dot products); each a row set")
    p.add_argument("--llama-cpp-lengths", default="128:128:512", metavar="PROMPT:GEN:PREFILL",
                   help="the batched rows' prompt and new tokens a sequence (llama-batched-bench's -npp, -ntg; "
                        "llama-bench's tg is GEN) and the prefill row's prompt (llama-bench's pp)")


def check(args) -> Binaries | None:
    """The binaries ``--llama-cpp`` names (found before any row runs), or None where it is not given."""
    if not args.llama_cpp:
        return None
    if not args.gguf:
        raise BenchError("--llama-cpp runs llama.cpp on kestrel's GGUF file: give --gguf TYPE too")
    options(args)
    return Binaries.find(args.llama_cpp)


def options(args) -> dict:
    """The comparison's batches and lengths from ``--llama-cpp-batches`` and ``--llama-cpp-lengths``."""
    try:
        batches = tuple(int(v) for v in args.llama_cpp_batches.split(","))
    except ValueError:
        batches = ()
    if not batches or min(batches) < 1 or batches[0] != 1:
        raise BenchError(f"--llama-cpp-batches: comma-separated batches from 1 (e.g. 1,8,64), "
                         f"got {args.llama_cpp_batches!r}")
    try:
        prompt, gen, prefill = (int(v) for v in args.llama_cpp_lengths.split(":"))
    except ValueError:
        prompt = gen = prefill = 0
    if min(prompt, gen, prefill) < 1:
        raise BenchError(f"--llama-cpp-lengths: PROMPT:GEN:PREFILL, each at least 1 (e.g. 128:128:512), "
                         f"got {args.llama_cpp_lengths!r}")
    from kestrel_core.config import GGUF_KERNELS

    kernels = tuple(k.strip() for k in args.llama_cpp_kernels.split(",") if k.strip())
    if not kernels or any(k not in GGUF_KERNELS for k in kernels):
        raise BenchError(f"--llama-cpp-kernels: comma-separated, each one of {', '.join(GGUF_KERNELS)}, "
                         f"got {args.llama_cpp_kernels!r}")
    return {"batches": batches, "prompt": prompt, "gen": gen, "prefill": prefill, "kernels": kernels}


def compare(bins: Binaries, model, path: Path, settings: dict, *, shape: str, file_type: str, args, log) -> dict:
    """kestrel's rows on the open ``model`` (``kestrel_rows``), then llama.cpp's on its file ``path``, and the pairs,
    at the batches and lengths ``options(args)`` gives."""
    import torch

    o = options(args)
    ours = []
    for kernels in o["kernels"]:
        backend = {"name": settings.get("backend", "cpu_ref"), "gguf_kernels": kernels}
        for r in kestrel_rows(model, {**settings, "backend": backend}, o["batches"], o["prompt"], o["gen"],
                              o["prefill"]):
            ours.append(dict(r, kernels=kernels))
            log(f"kestrel ({kernels}) {r['phase']:7} B={r['rows']:<3} {r['tokens_per_s']:9.1f} tokens/s")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the peer's process needs the card's memory
    peer = bins.bench(path, o["prefill"], o["gen"]) + bins.batched(path, o["batches"], o["prompt"], o["gen"])
    for r in peer:
        log(f"{r['program']:19} {r['phase']:7} B={r['rows']:<3} {r['tokens_per_s']:9.1f} tokens/s")
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    rows = versus(ours, peer, shape=shape, file_type=file_type.upper(), card=card)
    for r in rows:
        log(f"vs llama.cpp: ({r['kestrel_kernels']}) {r['phase']:7} B={r['rows']:<3} x{r['ratio']:.3f} "
            f"(target {r['target']}x) met={r['met']}")
    return {"kestrel": ours, "llama_cpp": peer, "rows": rows, "card": card,
            "options": {**o, "batches": list(o["batches"]), "kernels": list(o["kernels"])}}
