"""The token loop: prefill layer by layer, then one decode step per token (``decode.py``), read back a step late.

Greedy decoding never waits on a token to launch the next step: each step's token (and whether
its logits were finite) is copied to host memory without a wait and read one step later, so a
step may run past an end-of-sequence token. That step is dropped, with its counters, and
``on_token`` hears of a token only once it is read back: exactly the tokens of the result, in order.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Callable, Iterable

import attrs
import torch

from .config import GenerationConfig
from .dtypes import itemsize
from .errors import BudgetError, ConfigError, NonFiniteError
from .host import meminfo
from .decode import MODES, DecodeState, StepRunner, experts_of
from .model import Attend, KVCache, RopeTable, decoder_layer
from .plan import delta
from .sampling import Sampler

if TYPE_CHECKING:
    from .engine import Run


@attrs.frozen
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]  # generated ids only
    prefill_ms: float
    decode_ms: list[float]  # one per decode step (the first token comes from prefill)
    counters: dict[str, int]
    per_token: list[dict[str, int]]  # counter deltas of each decode step
    memory: dict[str, int]
    fixed_resident_bytes: int = 0  # never-evicted weights (embeddings, norms, lm_head): the peak less these is streamed
    steps: dict[str, int] = attrs.Factory(dict)  # how the decode steps ran: eager, captured (then replayed), replayed
    step_modes: list[str] = attrs.Factory(list)  # each decode step's mode, in order (one of MODES)
    logits: list[torch.Tensor] | None = None
    text: str | None = None  # the generated ids decoded, where the model has a tokenizer

    @property
    def ms_per_token(self) -> float:
        """Median decode ms/token (prefill is reported apart)."""
        return statistics.median(self.decode_ms) if self.decode_ms else float("nan")

    def to_json(self) -> dict:
        per = self.per_token
        return {
            "prompt_ids": self.prompt_ids,
            "token_ids": self.token_ids,
            "prefill_ms": round(self.prefill_ms, 3),
            "ms_per_token": round(self.ms_per_token, 3),
            "decode_ms": [round(x, 3) for x in self.decode_ms],
            "peak_resident_bytes": self.counters["peak_resident_bytes"],
            "peak_resident_entries": self.counters["peak_resident_entries"],
            "uploads_per_token": [p["layer_uploads"] for p in per],
            "bytes_uploaded_per_token": [p["bytes_uploaded"] for p in per],
            "allocations_per_token": [p["allocations"] for p in per],
            "counters": self.counters,
            "steps": self.steps,
            "step_modes": self.step_modes,
            "memory": self.memory,
            **({"text": self.text} if self.text is not None else {}),
        }


def check_prompt(run: Run, prompt_ids: list[int], gen: GenerationConfig) -> None:
    cfg = run.model.config
    if not prompt_ids:
        raise ConfigError("the prompt is empty: pass --prompt TEXT or --prompt-ids 1,2,3")
    bad = [i for i in prompt_ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise ConfigError(f"prompt id {bad[0]} is outside the vocabulary (0..{cfg.vocab_size - 1})")
    if gen.max_new_tokens < 1:
        raise ConfigError(f"max-new-tokens must be >= 1, got {gen.max_new_tokens}")
    total = len(prompt_ids) + gen.max_new_tokens
    if total > cfg.max_position_embeddings:
        raise ConfigError(
            f"prompt ({len(prompt_ids)}) + max-new-tokens ({gen.max_new_tokens}) = {total} exceeds "
            f"max_position_embeddings={cfg.max_position_embeddings}; lower --max-new-tokens"
        )


def allocate_cache(run: Run, max_seq: int) -> list[KVCache]:
    """The run's static KV cache; one that cannot be had is a BudgetError, checked before touching host memory."""
    cfg, backend = run.model.config, run.backend
    need = 2 * cfg.num_hidden_layers * max_seq * cfg.kv_dim * itemsize(backend.dtype)
    where = f"{backend.device}"
    avail = meminfo().get("MemAvailable") if backend.device.type == "cpu" else None
    too_big = BudgetError(
        f"the KV cache for {max_seq} positions needs {need / 2**20:,.0f} MiB, more than {where} can give"
        f"{f' ({avail / 2**20:,.0f} MiB available)' if avail is not None else ''}; lower --max-new-tokens or shorten the prompt"
    )
    if avail is not None and need > avail:
        raise too_big  # zero-filling it would page the machine into the OOM killer
    try:
        return KVCache.allocate(cfg, max_seq, backend.dtype, backend.device)
    except (torch.cuda.OutOfMemoryError, MemoryError):
        raise too_big from None
    except RuntimeError as exc:
        if "alloc" not in str(exc).lower():
            raise
        raise too_big from None


def forward(run: Run, ids: list[int], start: int, cache: list[KVCache], rope: RopeTable, phase: str,
            probe=None) -> torch.Tensor:
    """Logits of the last position, the window advancing boundary by boundary (prefill, and the error path).

    ``probe(where, h)``, where given, sees the hidden state after the embedding and after each layer.
    """
    backend, window, cfg = run.backend, run.window, run.model.config
    at = Attend.prefill(rope, start, len(ids), backend.device)
    h = backend.embed(torch.tensor(ids))
    if probe:
        probe("the embedding", h)
    for layer in range(cfg.num_hidden_layers):
        w = window.step(layer, phase)
        h = decoder_layer(h, w, backend.small[layer], cache[layer], at, cfg, backend.linear, experts_of(run, layer, phase))
        if probe:
            probe(f"layer {layer}", h)
    return backend.logits(h[-1:])[0]


def check_finite(run: Run, logits: torch.Tensor, ids: list[int], start: int, cache: list[KVCache], rope: RopeTable,
                 phase: str) -> None:
    """Stop at a logit row holding NaN or inf (see ``nonfinite``)."""
    if not bool(torch.isfinite(logits).all()):
        raise nonfinite(run, ids, start, cache, rope, phase)


def nonfinite(run: Run, ids: list[int], start: int, cache: list[KVCache], rope: RopeTable, phase: str) -> NonFiniteError:
    """The error for non-finite logits at this step, naming the first part of the model whose output went non-finite.

    The search runs the step again with a probe: on the error path only, never on a good step.
    """
    found: list[str] = []

    def probe(where: str, h: torch.Tensor) -> None:
        if not found and not bool(torch.isfinite(h).all()):
            found.append(where)

    forward(run, ids, start, cache, rope, phase, probe)  # rewrites this step's K/V with the same values
    where = found[0] if found else "the final norm and lm_head"
    dtype = str(run.backend.dtype).replace("torch.", "")
    wider = ", or compute in float32 (--dtype float32)" if run.backend.dtype in (torch.float16, torch.bfloat16) else ""
    return NonFiniteError(
        f"the logits at position {start + len(ids) - 1} hold NaN or inf, first in the output of {where}: "
        f"the weights there hold NaN/inf, or {dtype} overflowed; re-create or re-download the checkpoint{wider}"
    )


def generate(run: Run, prompt_ids: list[int], gen: GenerationConfig, keep_logits: bool = False,
             on_token: Callable[[int], None] | None = None, stop_ids: Iterable[int] = ()) -> GenerationResult:
    """Generate from ``prompt_ids``. ``on_token(id)`` is called with each token of the result as soon as it is
    read back (the first from the prefill); ``stop_ids`` end the generation as config.json's eos_token_id
    does, where ``gen.stop_at_eos``."""
    try:
        return _generate(run, prompt_ids, gen, keep_logits, on_token, frozenset(stop_ids))
    except torch.cuda.OutOfMemoryError:
        budget = run.backend.budget
        hint = f" (weight-cache budget {budget // 2**20} MiB)" if budget else ""
        raise BudgetError(
            f"CUDA out of memory during generation{hint}: lower --budget-mb / KESTREL_WCACHE_MB, keep, or --max-new-tokens"
        ) from None


@attrs.define
class _Step:
    before: dict[str, int]  # counters before its plans
    after: dict[str, int]  # and after (planning is where they move)
    mode: str  # how it ran: eager, captured or replayed
    mark: object  # the backend's marker, recorded once its token was on its way to the host
    logits: torch.Tensor | None  # kept for keep_logits, on the device


class _Readback:
    """Each step's [token, non-finite flag] copied into (pinned) host memory without a wait, read a step or more later."""

    def __init__(self, run: Run, state: DecodeState, depth: int = 4):
        self.backend, self.state = run.backend, state
        self.ring = torch.zeros((depth, 2), dtype=torch.long, pin_memory=run.backend.device.type == "cuda")

    def push(self, k: int):
        self.ring[k % len(self.ring)].copy_(self.state.io, non_blocking=True)
        return self.backend.mark()

    def read(self, k: int, mark) -> tuple[int, bool]:
        self.backend.wait(mark)
        token, bad = self.ring[k % len(self.ring)].tolist()
        return token, bool(bad)


def _generate(run: Run, prompt_ids: list[int], gen: GenerationConfig, keep_logits: bool,
              on_token: Callable[[int], None] | None, stop_ids: frozenset[int]) -> GenerationResult:
    check_prompt(run, prompt_ids, gen)
    cfg, backend, window, counters = run.model.config, run.backend, run.window, run.counters
    sampler = Sampler(gen)
    eos_ids = set(run.model.eos_ids) | stop_ids  # config.json's and generation_config.json's
    max_seq = len(prompt_ids) + gen.max_new_tokens
    cache = allocate_cache(run, max_seq)
    fixed = counters.resident_bytes
    greedy = gen.temperature == 0
    with torch.inference_mode():
        rope = RopeTable(cfg, max_seq, backend.dtype, backend.device)
        window.preload()
        backend.synchronize()
        t0 = backend.mark()
        logits = forward(run, prompt_ids, 0, cache, rope, "prefill")
        check_finite(run, logits, prompt_ids, 0, cache, rope, "prefill")
        token = sampler(logits)
        prefill_end = backend.mark()
        prefill_ms = backend.elapsed_ms(t0, prefill_end)
        tokens = [token]
        if on_token:
            on_token(token)
        state = DecodeState(backend.device, rope, max_seq, greedy)
        state.start(token, len(prompt_ids))
        runner = StepRunner(run, state, cache, graphs=run.config.backend.graphs == "auto")
        readback = _Readback(run, state)
        lag = 1 if greedy else 0  # a sampled token is on the host already
        steps: list[_Step] = []
        stop = gen.stop_at_eos and token in eos_ids

        def take(k: int) -> bool:
            """Read step k's token; whether it ends the generation."""
            token, bad = readback.read(k, steps[k].mark)
            if bad:
                raise nonfinite(run, [tokens[k]], len(prompt_ids) + k, cache, rope, "decode")
            tokens.append(token)
            if on_token:
                on_token(token)
            return gen.stop_at_eos and token in eos_ids

        try:
            while not stop and 1 + len(steps) < gen.max_new_tokens:
                window.next_token()
                before = counters.snapshot()
                mode = runner()
                after = counters.snapshot()
                if not greedy:  # the sampler reads the logits on the host anyway: check them there
                    check_finite(run, state.logits, [tokens[-1]], len(prompt_ids) + len(steps), cache, rope, "decode")
                    state.io[0].fill_(sampler(state.logits))
                mark = readback.push(len(steps))
                steps.append(_Step(before, after, mode, mark, state.logits.clone() if keep_logits else None))
                while len(tokens) - 1 < len(steps) - lag and not stop:
                    stop = take(len(tokens) - 1)
            while len(tokens) - 1 < len(steps) and not stop:
                stop = take(len(tokens) - 1)
        finally:
            runner.close()
        kept = steps[: len(tokens) - 1]  # a step launched past the end of sequence is dropped
        marks = [prefill_end] + [s.mark for s in kept]
        decode_ms = [backend.elapsed_ms(a, b) for a, b in zip(marks, marks[1:])]
        all_logits = [logits.cpu()] + [s.logits.cpu() for s in kept] if keep_logits else None
    return GenerationResult(
        prompt_ids=list(prompt_ids),
        token_ids=tokens,
        prefill_ms=prefill_ms,
        decode_ms=decode_ms,
        counters=kept[-1].after if kept else counters.snapshot(),
        per_token=[delta(s.after, s.before) for s in kept],
        memory=backend.memory_stats(),
        fixed_resident_bytes=fixed,
        logits=all_logits,
        steps={m: sum(s.mode == m for s in kept) for m in MODES},
        step_modes=[s.mode for s in kept],
    )
