"""kestrel generate: run one model with one residency setting and report the counters."""

from __future__ import annotations

import warnings

from kestrel_core.tools import traces
from kestrel_core.config import model_dir
from kestrel_core.engine.batch import SOLO_KV_FIX
from kestrel_core.engine.fit import KVRoom
from kestrel_core.engine.follower import rank_parts
from kestrel_core.engine.limits import RequestLimits, check_max_seq
from kestrel_core.engine.pipeline import launched_rank
from kestrel_core.engine.run import load
from kestrel_core.errors import ConfigError, KestrelNote
from kestrel_core.io.jsonout import emit_json
from kestrel_core.commands.common import add_draft_flags, add_run_flags, check_batch_flags, config_from_args, mib, with_draft

MAX_BATCH = 8  # a batch job's default --max-batch

HELP = ("generate tokens with a policy, keep, allocator and backend; print the text as it is generated "
        "(the ids where the model has no tokenizer), then ms/token and counters")


def add_arguments(p):
    add_run_flags(p)
    p.add_argument("--trace", help="Mixture-of-Experts: record each decision point's routed experts to this new file "
                                   "(for kestrel replay)")
    add_draft_flags(p)
    p.add_argument("--max-seq", type=int, help="the context: positions the sequence may use, prompt and generation, "
                   "at least 2 and at most the model's (default: the model's); a prompt and --max-new-tokens past it "
                   "are refused. Not with --prompts: a batch job sizes each sequence to its line")
    p.add_argument("--prompts", metavar="IN.jsonl", help="a batch job: one JSON object a line ({\"prompt\": ...} or "
                   "{\"prompt_ids\": [...]}, with any [generation] setting), run as a continuous batch (needs --out)")
    p.add_argument("--out", metavar="OUT.jsonl", help="where a batch job writes its results, one line a prompt, in "
                   "input order (a new file: never replaced)")
    p.add_argument("--max-batch", type=int, help=f"a batch job's sequences decoding together (default {MAX_BATCH})")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="a batch job's prompt tokens a step takes beside the decoding ones (default: a whole prompt)")


def run(args) -> int:
    if args.prompts is not None or args.out is not None:
        return run_batch_job(args)
    batch_flags = [f for f, v in (("--max-batch", args.max_batch), ("--prefill-chunk", args.prefill_chunk))
                   if v is not None]
    if batch_flags:
        one = len(batch_flags) == 1
        raise ConfigError(f"{' and '.join(batch_flags)} {'sets' if one else 'set'} a batch job's batch: add --prompts "
                          f"IN.jsonl --out OUT.jsonl, or drop {'it' if one else 'them'}")
    check_max_seq(args.max_seq)  # before the model loads
    cfg = with_draft(config_from_args(args), args)
    recorder = None
    if args.trace is not None:
        if launched_rank()[1] > 1:  # each rank routes its own layers' experts: rank 0's trace would hold a part
            raise ConfigError("--trace records the expert routing of every layer, but over several ranks each holds "
                              "a part of the layers; record the trace as one process")
        traces.check_new(args.trace)  # before any work: an empty name, or one that exists, is refused
        recorder = traces.TraceRecorder()
    with load(model_dir(cfg)) as model:
        if recorder is not None and not model.config.is_moe:
            raise ConfigError(f"--trace records expert routing, but {model.dir} ({model.config.model_type}) has no experts")
        gen = cfg.generation  # read once: keep = auto leaves room for this prompt's KV cache, and the run takes it
        ids = model.prompt_ids(list(gen.prompt_ids), gen.prompt)
        positions = model.config.max_position_embeddings
        if args.max_seq is not None:  # as kestrel serve bounds its context: the prompt and its tokens within it
            check_max_seq(args.max_seq, positions, str(model.dir))
            RequestLimits(args.max_seq, "this run", tokens="--max-new-tokens", source="--max-seq").budget(
                gen.max_new_tokens, len(ids), "the prompt")
            positions = args.max_seq
        kv = KVRoom(1, min(len(ids) + gen.max_new_tokens, positions), SOLO_KV_FIX)
        with model.open(cfg, observers=[recorder] if recorder else (), kv=kv) as r:
            if r.follows:  # a pipeline's later rank: rank 0 generates, this one makes its steps after it
                r.follow()
                return 0
            if args.json:
                result = r.generate(prompt_ids=ids)
            else:
                echo = Echo()
                try:
                    result = (r.generate(prompt_ids=ids, on_text=echo.text) if model.tokenizer
                              else r.generate(prompt_ids=ids, on_token=echo.token))
                finally:
                    echo.end()
            policy, expert_policy = r.policy.name, r.expert_policy.name if r.expert_policy else None
            cfg, keep_choice = r.config, r.keep_choice  # keep = "auto" resolved
            pipe = r.pipeline.to_json() if r.pipeline is not None else None
            if pipe:  # each rank's part of a step, sent to rank 0; the step's whole time is ms_per_token
                pipe["rank_parts"] = rank_parts(r.runner)
            if recorder is not None:
                traces.write_new(args.trace, traces.trace_record(traces.model_info(r), recorder.events))
        moe = model.config.is_moe
        ends = model.eos_ids if gen.stop_at_eos else frozenset()
    text, prompt = result.text, result.prompt_ids
    if result.token_ids[:1] and result.token_ids[0] in ends:  # else the text streamed was empty, and nothing said why
        warnings.warn(f"the model ended at once (end of sequence): its first token was the end id "
                      f"{result.token_ids[0]}, so nothing was generated; --ignore-eos generates past it", KestrelNote)
    res = cfg.residency
    if args.json:
        emit_json({"model": cfg.model, "backend": cfg.backend.name, "policy": policy, "keep": res.keep,
                   **({"keep_auto": keep_choice.to_json()} if keep_choice else {}),
                   "allocator": res.allocator, "prefetch": cfg.backend.prefetch, "graphs": cfg.backend.graphs,
                   "expert_policy": expert_policy, **({"pipeline": pipe} if pipe else {}), **result.to_json()})
        return 0
    c = result.counters
    steps = len(result.decode_ms)
    if text is not None:  # else the ids streamed as this very line
        print(f"token ids: {' '.join(map(str, result.token_ids))}")
    print(f"setting: backend={cfg.backend.name} policy={policy} keep={res.keep} allocator={res.allocator} "
          f"prefetch={cfg.backend.prefetch} graphs={cfg.backend.graphs}")
    if pipe:  # the counters below are this rank's, of its part
        print(f"pipeline: {pipe['ranks']} ranks, layers " + ", ".join(f"{a}-{a + n - 1}" for a, n in pipe["parts"])
              + " (the ms/token below: the whole step's; the counters: rank 0's part)")
        print("each rank's part of a decode step (median ms its layers took): " + ", ".join(
            f"rank {p['rank']} (layers {p['layers'][0]}-{p['layers'][1]}) "
            + (f"{p['median_ms']:.2f}" if p["median_ms"] is not None else "-") for p in pipe["rank_parts"]))
    if not steps:
        decode = "no decode steps (the first token comes from the prefill)"
    elif result.tokens_per_step:  # speculative: a mean over tokens, not a median over steps
        decode = (f"{result.ms_per_token:.2f} ms/token (the {steps} passes' time over the "
                  f"{sum(result.tokens_per_step)} tokens they kept)")
    else:
        decode = f"{result.ms_per_token:.2f} ms/token (median of {steps} decode steps)"
    print(f"prefill: {result.prefill_ms:.2f} ms for {len(prompt)} prompt tokens; decode: {decode}")
    if steps:
        how = result.steps
        print(f"decode steps: {how['replayed'] + how['captured']} from a captured graph ({how['captured']} captured), {how['eager']} eager")
    print(f"uploaded: {c['layer_uploads']} layers, {c['uploads']} entries, {mib(c['bytes_uploaded'])}; "
          f"evicted: {c['layer_evictions']} layers, {mib(c['bytes_evicted'])}")
    if c["bytes_read_host"]:
        print(f"read by decode steps from host copies (expert table misses): {mib(c['bytes_read_host'])}; of the "
              f"uploads, {mib(c['bytes_reread'])} were experts a step had read so (their second crossing)")
    if result.speculative:
        s = result.speculative
        rate = f"{100 * s['acceptance_rate']:.1f}%" if s["acceptance_rate"] is not None else "nothing drafted"
        per_pass = f"{s['tokens_per_pass']:.2f}" if s["tokens_per_pass"] is not None else "-"
        print(f"speculative: {cfg.speculative.draft} drafting up to {cfg.speculative.draft_tokens}: {s['passes']} passes, "
              f"{s['drafted']} drafted, {s['accepted']} accepted (acceptance {rate}), {per_pass} tokens a pass; "
              f"draft {s['draft_ms']:.1f} ms, verify {s['verify_ms']:.1f} ms")
    if result.per_token:
        per = result.per_token[-1]
        print(f"per decoded token (last): {per['layer_uploads']} layers, {mib(per['bytes_uploaded'])} uploaded")
    print(f"peak resident: {mib(c['peak_resident_bytes'])} ({c['peak_resident_entries']} entries); "
          f"allocations: {c['allocations']}, pool hits: {c['pool_hits']}, real frees: {c['frees']}")
    if moe:
        routed = c["expert_hits"] + c["expert_misses"]
        rate = f"{100 * c['expert_hits'] / routed:.1f}% hits" if routed else "no routed experts"
        print(f"experts ({expert_policy or 'with their layer'}): {c['expert_hits']} found resident, "
              f"{c['expert_misses']} fetched ({rate}); {c['expert_prefetches']} prefetched on a guess")
    for k, v in result.memory.items():
        print(f"{k.replace('_', ' ')}: {mib(v)}")
    return 0


class Echo:
    """Prints a generation as it comes, on stdout: the text as it grows, or ``token ids:`` and each id."""

    def __init__(self):
        self.started = False

    def text(self, piece: str) -> None:
        print(piece, end="", flush=True)
        self.started = True

    def token(self, token: int) -> None:
        print(f" {token}" if self.started else f"token ids: {token}", end="", flush=True)
        self.started = True

    def end(self) -> None:
        """End the streamed line, so that what follows (the report, or an error) starts on its own."""
        if self.started:
            print(flush=True)


def run_batch_job(args) -> int:
    if args.prompts is None or args.out is None:
        raise ConfigError("a batch job needs both --prompts IN.jsonl and --out OUT.jsonl")
    if args.prompt is not None or args.prompt_ids is not None or args.trace is not None:
        raise ConfigError("--prompts reads its prompts from the file: drop --prompt, --prompt-ids and --trace")
    if args.max_seq is not None:
        raise ConfigError("--max-seq bounds one prompt's context; a batch job sizes each sequence to its line's prompt "
                          "and max_new_tokens: drop --max-seq (or give a line a smaller max_new_tokens)")
    from kestrel_core.tools.batch_job import read_lines, run_job
    from kestrel_core.io.newfile import check_new

    check_new(args.out, "--out")  # before the model loads
    cfg = with_draft(config_from_args(args), args)
    max_batch = MAX_BATCH if args.max_batch is None else args.max_batch
    check_batch_flags(max_batch, args.prefill_chunk, left_out="a whole prompt a step")
    lines = read_lines(args.prompts)  # every line read and checked before the model loads (on cuda: pins its weights)
    with load(model_dir(cfg)) as model, model.open(cfg, kv=KVRoom(max_batch, fix="lower --max-batch")) as r:
        if r.follows:  # a pipeline's later rank: rank 0 runs the job and writes it, this one makes its steps after it
            r.follow()
            return 0
        summary = run_job(r, args.prompts, lines, args.out, max_batch, args.prefill_chunk)
    if args.json:
        emit_json(summary)
    else:
        print(f"wrote {summary['sequences']} results ({summary['errors']} errors, {summary['tokens']} tokens, "
              f"{summary['tokens_per_s']:.1f} tokens/s, {summary['bytes_per_generated_token'] or 0:,.0f} bytes streamed a "
              f"generated token) to {summary['out']}")
    return 0
