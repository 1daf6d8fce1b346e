"""The token loop and the explicit per-layer loop, where the residency window advances."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

import attrs
import torch

from .config import GenerationConfig
from .dtypes import itemsize
from .host import meminfo
from .errors import BudgetError, ConfigError, NonFiniteError
from .model import KVCache, decoder_layer, rope_tables
from .residency import delta
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


def forward(run: Run, ids: list[int], start: int, cache: list[KVCache], phase: str, probe=None) -> torch.Tensor:
    """Logits of the last position. The window advances at every layer boundary.

    ``probe(where, h)``, where given, sees the hidden state after the embedding and after each layer.
    """
    backend, window, cfg = run.backend, run.window, run.model.config
    positions = torch.arange(start, start + len(ids))
    rope = rope_tables(cfg, positions, backend.dtype, backend.device)
    h = backend.embed(torch.tensor(ids))
    if probe:
        probe("the embedding", h)
    for layer in range(cfg.num_hidden_layers):
        w = window.step(layer, phase)
        h = decoder_layer(h, w, backend.small[layer], cache[layer], start, rope, cfg, backend.linear)
        if probe:
            probe(f"layer {layer}", h)
    return backend.logits(h[-1:])[0]


def check_finite(run: Run, logits: torch.Tensor, ids: list[int], start: int, cache: list[KVCache], phase: str) -> None:
    """Stop at a logit row holding NaN or inf, naming the first part of the model whose output went non-finite.

    The search runs the step again with a probe: on the error path only, never on a good step.
    """
    if bool(torch.isfinite(logits).all()):
        return
    found: list[str] = []

    def probe(where: str, h: torch.Tensor) -> None:
        if not found and not bool(torch.isfinite(h).all()):
            found.append(where)

    forward(run, ids, start, cache, phase, probe)  # rewrites this step's K/V with the same values
    where = found[0] if found else "the final norm and lm_head"
    dtype = str(run.backend.dtype).replace("torch.", "")
    wider = ", or compute in float32 (--dtype float32)" if run.backend.dtype in (torch.float16, torch.bfloat16) else ""
    raise NonFiniteError(
        f"the logits at position {start + len(ids) - 1} hold NaN or inf, first in the output of {where}: "
        f"the weights there hold NaN/inf, or {dtype} overflowed; re-create or re-download the checkpoint{wider}"
    )


def generate(run: Run, prompt_ids: list[int], gen: GenerationConfig, keep_logits: bool = False) -> GenerationResult:
    try:
        return _generate(run, prompt_ids, gen, keep_logits)
    except torch.cuda.OutOfMemoryError:
        budget = run.backend.budget
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
    cache = allocate_cache(run, len(prompt_ids) + gen.max_new_tokens)
    all_logits = [] if keep_logits else None
    fixed = run.counters.resident_bytes
    with torch.inference_mode():
        run.window.preload()
        backend.synchronize()
        t0 = backend.start_timer()
        logits = forward(run, prompt_ids, 0, cache, "prefill")
        check_finite(run, logits, prompt_ids, 0, cache, "prefill")
        token = sampler(logits)
        prefill_ms = backend.stop_timer(t0)
        tokens = [token]
        if keep_logits:
            all_logits.append(logits.cpu())
        decode_ms, per_token = [], []
        pos = len(prompt_ids)
        while len(tokens) < gen.max_new_tokens and not (gen.stop_at_eos and token in eos_ids):
            run.window.next_token()
            before = run.counters.snapshot()
            t0 = backend.start_timer()
            logits = forward(run, [token], pos, cache, "decode")
            check_finite(run, logits, [token], pos, cache, "decode")
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
        fixed_resident_bytes=fixed,
        logits=all_logits,
    )
