"""kestrel generate: run one model with one residency setting and report the counters."""

from __future__ import annotations

from .. import traces
from ..errors import ConfigError
from ..modeldir import load
from .common import add_run_flags, config_from_args, emit_json, mib, model_dir

HELP = ("generate tokens with a policy, keep, allocator and backend; print the text as it is generated "
        "(the ids where the model has no tokenizer), then ms/token and counters")


def add_arguments(p):
    add_run_flags(p)
    p.add_argument("--trace", help="Mixture-of-Experts: record each decision point's routed experts to this new file "
                                   "(for kestrel replay)")


def run(args) -> int:
    cfg = config_from_args(args)
    with load(model_dir(cfg)) as model, model.open(cfg) as r:
        if args.trace:
            if not model.config.is_moe:
                raise ConfigError(f"--trace records expert routing, but {model.dir} ({model.config.model_type}) has no experts")
            traces.check_new(args.trace)
            r.window.routing = []
        if args.json:
            result = r.generate()
        else:
            echo = Echo()
            try:
                result = r.generate(on_text=echo.text) if model.tokenizer else r.generate(on_token=echo.token)
            finally:
                echo.end()
        policy = r.policy.name
        if args.trace:
            traces.write_new(args.trace, traces.trace_record(traces.model_info(r), r.window.routing))
    text, prompt = result.text, result.prompt_ids
    res = cfg.residency
    if args.json:
        emit_json({"model": cfg.model, "backend": cfg.backend.name, "policy": policy, "keep": res.keep,
                   "allocator": res.allocator, "prefetch": cfg.backend.prefetch, "graphs": cfg.backend.graphs, **result.to_json()})
        return 0
    c = result.counters
    steps = len(result.decode_ms)
    if text is not None:  # else the ids streamed as this very line
        print(f"token ids: {' '.join(map(str, result.token_ids))}")
    print(f"setting: backend={cfg.backend.name} policy={policy} keep={res.keep} allocator={res.allocator} "
          f"prefetch={cfg.backend.prefetch} graphs={cfg.backend.graphs}")
    print(f"prefill: {result.prefill_ms:.2f} ms for {len(prompt)} prompt tokens; decode: {result.ms_per_token:.2f} ms/token (median of {steps})")
    if steps:
        how = result.steps
        print(f"decode steps: {how['replayed'] + how['captured']} from a captured graph ({how['captured']} captured), {how['eager']} eager")
    print(f"uploaded: {c['layer_uploads']} layers, {c['uploads']} entries, {mib(c['bytes_uploaded'])}; "
          f"evicted: {c['layer_evictions']} layers, {mib(c['bytes_evicted'])}")
    if result.per_token:
        per = result.per_token[-1]
        print(f"per decoded token (last): {per['layer_uploads']} layers, {mib(per['bytes_uploaded'])} uploaded")
    print(f"peak resident: {mib(c['peak_resident_bytes'])} ({c['peak_resident_entries']} entries); "
          f"allocations: {c['allocations']}, pool hits: {c['pool_hits']}, real frees: {c['frees']}")
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
