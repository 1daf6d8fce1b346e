"""The offline batch job: ``kestrel generate --prompts in.jsonl --out out.jsonl``.

Each input line is a JSON object with ``prompt`` (text) or ``prompt_ids`` (a list of ids), and optionally any of the
[generation] settings (max_new_tokens, temperature, top_k, top_p, seed, stop_at_eos) for that line alone. Every line
is checked before any work: a bad one is a one-line error naming its line number. The lines then run as one
continuous batch, and the output, one JSON object a line in input order (the ids, the text, the timings and
counters), is written whole at the end, to a new file that nothing replaces.
"""

from __future__ import annotations

import json
import time

from kestrel_core.engine.plan import bytes_streamed
from kestrel_core.io import progress
from kestrel_core.errors import ConfigError, KestrelError
from kestrel_core.io.json_keys import TOO_MANY_DIGITS, RepeatedKey, unique_keys
from kestrel_core.io.newfile import check_new, write_new
from kestrel_core.io.readfile import read_bounded

INPUT_LIMIT = 256 * 2**20  # bytes of prompts a job reads
MAX_LINES = 100_000
SETTINGS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop_at_eos")


def read_lines(path: str) -> list[tuple[int, dict]]:
    """Every line's number and object, each checked as far as no model is needed (read before the model loads); or
    the first bad line's error, naming it."""
    raw = read_bounded(path, INPUT_LIMIT, f"--prompts {path}", "split the prompts into several jobs")
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark (Notepad, PowerShell) is no part of the first line
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--prompts {path}: not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start}); "
                          "write the file as UTF-8") from None
    # Lines end at \n alone (a \r before it is JSON's whitespace): splitlines() would also split inside a string at
    # U+2028, U+0085 and the like, which JSON allows raw.
    lines = [(n, line) for n, line in enumerate(text.split("\n"), start=1) if line.strip()]
    if not lines:
        raise ConfigError(f"--prompts {path}: no prompts; write one JSON object a line, e.g. {{\"prompt\": \"hello\"}}")
    if len(lines) > MAX_LINES:
        raise ConfigError(f"--prompts {path}: {len(lines):,} prompts, over the {MAX_LINES:,} a job takes; split it")
    objs = []
    for n, line in lines:
        where = f"--prompts {path} line {n}"
        try:
            obj = json.loads(line, object_pairs_hook=unique_keys)
        except RepeatedKey as exc:
            raise ConfigError(f"{where}: the key {exc.args[0]!r} appears twice; give it once") from None
        except (ValueError, RecursionError) as exc:  # ValueError: an integer past Python's 4300 digits
            why = (exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
                   if isinstance(exc, RecursionError) else TOO_MANY_DIGITS)
            raise ConfigError(f"{where}: not valid JSON ({why}); write one JSON object a line") from None
        if not isinstance(obj, dict):
            raise ConfigError(f"{where}: a JSON object is needed, e.g. {{\"prompt\": \"hello\"}}, got {type(obj).__name__}")
        unknown = sorted(set(obj) - {"prompt", "prompt_ids", *SETTINGS})
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; a line takes prompt or prompt_ids and "
                              f"{', '.join(SETTINGS)}")
        if ("prompt" in obj) == ("prompt_ids" in obj):
            raise ConfigError(f"{where}: give exactly one of prompt (text) and prompt_ids (a list of ids)")
        if obj.get("prompt", "x") in (None, "") or obj.get("prompt_ids", [0]) in (None, []):
            # else the engine's hint, which names the --prompt and --prompt-ids flags
            raise ConfigError(f"{where}: the prompt is empty; give some text as prompt, or ids as prompt_ids")
        objs.append((n, obj))
    return objs


def requests_of(run, path: str, lines: list[tuple[int, dict]]) -> list:
    """Each line as a checked request (``run.request``: the model's vocabulary and context), or the first bad line's
    error, naming it."""
    requests = []
    for n, obj in lines:
        try:
            requests.append(run.request(**obj))
        except KestrelError as exc:
            raise type(exc)(f"--prompts {path} line {n}: {exc}") from None
    return requests


def read_requests(run, path: str) -> tuple[list, list[tuple[int, dict]]]:
    """``read_lines`` then ``requests_of``: every line as a checked request, and its number and object."""
    lines = read_lines(path)
    return requests_of(run, path, lines), lines


def run_job(run, prompts: str, lines: list[tuple[int, dict]], out: str, max_batch: int,
            prefill_chunk: int | None) -> dict:
    """Generate every line of ``prompts`` (``read_lines``' answer, read before the model loaded) and write ``out``;
    a summary of the job."""
    check_new(out, "--out")  # before any work
    requests = requests_of(run, prompts, lines)
    done, tokens, t0 = 0, 0, time.perf_counter()
    before = run.runner.snapshot()
    with progress.bar(len(requests), "batch", "seq") as bar:
        def on_done(i, result):
            nonlocal done, tokens
            done += 1
            tokens += 0 if isinstance(result, Exception) else len(result.token_ids)
            bar.update(1)
            bar.set_postfix_str(f"{tokens / max(time.perf_counter() - t0, 1e-9):.1f} tokens/s")

        results = run.generate_batch(requests, max_batch=max_batch, prefill_chunk=prefill_chunk, on_done=on_done)
    seconds = time.perf_counter() - t0
    streamed = bytes_streamed(run.runner.snapshot()) - bytes_streamed(before)
    rows = []
    for (n, line), result in zip(lines, results):
        if isinstance(result, Exception):
            rows.append({"line": n, "error": str(result)})
        else:
            rows.append({"line": n, **{k: line[k] for k in ("prompt",) if k in line}, **result.to_json()})

    def write(fh) -> None:
        for row in rows:
            fh.write((json.dumps(row) + "\n").encode())

    write_new(out, write, "--out")
    generated = sum(len(r.token_ids) for r in results if not isinstance(r, Exception))
    return {"sequences": len(results), "errors": sum(isinstance(r, Exception) for r in results),
            "tokens": generated, "seconds": seconds, "tokens_per_s": generated / seconds if seconds else None,
            "bytes_streamed": streamed, "bytes_per_generated_token": streamed / generated if generated else None,
            "out": str(out)}
