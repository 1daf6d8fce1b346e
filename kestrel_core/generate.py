"""The token loop and the explicit per-layer loop, where the residency window advances."""

from __future__ import annotations

import statistics

import attrs
import torch

from .config import GenerationConfig
from .engine import Run
from .errors import BudgetError, ConfigError
from .model import KVCache, decoder_layer, rope_tables
from .residency import delta
from .sampling import Sampler


@attrs.frozen
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]  # generated ids only
    prefill_ms: float
    decode_ms: list[float]  # one per decode step (the first token comes from prefill)
    counters: dict[str, int]
    per_token: list[dict[str, int]]  # counter deltas of each decode step
    memory: dict[str, int]
    logits: list[torch.Tensor] | None = None

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
            "memory": self.memory,
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


def forward(run: Run, ids: list[int], start: int, cache: list[KVCache], phase: str) -> torch.Tensor:
    """Logits of the last position. The window advances at every layer boundary."""
    backend, window, cfg = run.backend, run.window, run.model.config
    positions = torch.arange(start, start + len(ids))
    rope = rope_tables(cfg, positions, backend.dtype, backend.device)
    h = backend.embed(torch.tensor(ids))
    for layer in range(cfg.num_hidden_layers):
        window.advance(layer, phase)
        w = window.acquire(layer)
        h = decoder_layer(h, w, backend.small[layer], cache[layer], start, rope, cfg, backend.linear)
    return backend.logits(h[-1:])[0]


def generate(run: Run, prompt_ids: list[int], gen: GenerationConfig, keep_logits: bool = False) -> GenerationResult:
    try:
        return _generate(run, prompt_ids, gen, keep_logits)
    except torch.cuda.OutOfMemoryError:
        budget = getattr(run.backend, "budget", None)
        hint = f" (weight-cache budget {budget // 2**20} MiB)" if budget else ""
        raise BudgetError(
            f"CUDA out of memory during generation{hint}: lower --budget-mb / KESTREL_WCACHE_MB, keep, or --max-new-tokens"
        ) from None


def _generate(run: Run, prompt_ids: list[int], gen: GenerationConfig, keep_logits: bool) -> GenerationResult:
    check_prompt(run, prompt_ids, gen)
    cfg, backend = run.model.config, run.backend
    sampler = Sampler(gen)
    eos = cfg.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    cache = KVCache.allocate(cfg, len(prompt_ids) + gen.max_new_tokens, backend.dtype, backend.device)
    all_logits = [] if keep_logits else None
    with torch.inference_mode():
        run.window.preload()
        backend.synchronize()
        t0 = backend.start_timer()
        logits = forward(run, prompt_ids, 0, cache, "prefill")
        token = sampler(logits)
        prefill_ms = backend.stop_timer(t0)
        tokens = [token]
        if keep_logits:
            all_logits.append(logits.cpu())
        decode_ms, per_token = [], []
        pos = len(prompt_ids)
        while len(tokens) < gen.max_new_tokens and not (gen.stop_at_eos and token in eos_ids):
            run.window.token += 1
            before = run.counters.snapshot()
            t0 = backend.start_timer()
            logits = forward(run, [token], pos, cache, "decode")
            token = sampler(logits)
            decode_ms.append(backend.stop_timer(t0))
            per_token.append(delta(run.counters.snapshot(), before))
            tokens.append(token)
            pos += 1
            if keep_logits:
                all_logits.append(logits.cpu())
    return GenerationResult(
        prompt_ids=list(prompt_ids),
        token_ids=tokens,
        prefill_ms=prefill_ms,
        decode_ms=decode_ms,
        counters=run.counters.snapshot(),
        per_token=per_token,
        memory=backend.memory_stats(),
        logits=all_logits,
    )
