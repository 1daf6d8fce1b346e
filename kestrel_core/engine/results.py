"""What a generation returns: the ids, the text, every step's time and counters, and the memory the backend measured."""

from __future__ import annotations

import statistics

import attrs
import torch

MODES = ("eager", "captured", "replayed")  # how a decode step ran: on its own, captured (then replayed), or replayed


@attrs.frozen
class TokenLogprobs:
    """A generated token's log-probability under the model (``sampling.token_logprobs``), and the ``top`` most likely
    ids with theirs, most likely first (as many as the request asked for)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_json(self) -> dict:
        return {"token": self.token, "logprob": self.logprob, "top": [list(t) for t in self.top]}


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
    tokens_per_step: list[int] | None = None  # speculative decoding: the tokens each pass kept (else one a step)
    speculative: dict | None = None  # speculative decoding: passes, drafted, accepted, acceptance, tokens a pass, ms
    logprobs: list[TokenLogprobs] | None = None  # each token's, where the request asked (``Request.logprobs``)
    # each prompt token's after the first (the first has no context), where the request asked (``prompt_logprobs``)
    prompt_logprobs: list[TokenLogprobs] | None = None

    @property
    def ms_per_token(self) -> float:
        """Median decode ms/token (prefill is reported apart); with speculative decoding, its passes' time over the
        tokens they kept."""
        if not self.decode_ms:
            return float("nan")
        if self.tokens_per_step:
            return sum(self.decode_ms) / sum(self.tokens_per_step)
        return statistics.median(self.decode_ms)

    def to_json(self) -> dict:
        per = self.per_token
        return {
            "prompt_ids": self.prompt_ids,
            "token_ids": self.token_ids,
            "prefill_ms": round(self.prefill_ms, 3),
            "ms_per_token": round(self.ms_per_token, 3) if self.decode_ms else None,  # None: no decode steps
            "decode_ms": [round(x, 3) for x in self.decode_ms],
            "peak_resident_bytes": self.counters["peak_resident_bytes"],
            "peak_resident_entries": self.counters["peak_resident_entries"],
            "uploads_per_token": [p["layer_uploads"] for p in per],
            "bytes_uploaded_per_token": [p["bytes_uploaded"] for p in per],
            "allocations_per_token": [p["allocations"] for p in per],
            "counters": self.counters,
            "steps": self.steps,
            "step_modes": self.step_modes,
            **({"speculative": self.speculative, "tokens_per_step": self.tokens_per_step} if self.speculative else {}),
            "memory": self.memory,
            **({"text": self.text} if self.text is not None else {}),
            **({"logprobs": [lp.to_json() for lp in self.logprobs]} if self.logprobs is not None else {}),
            **({"prompt_logprobs": [lp.to_json() for lp in self.prompt_logprobs]}
               if self.prompt_logprobs is not None else {}),
        }


def text_ids(token_ids: list[int], end_ids: frozenset[int]) -> list[int]:
    """The generated ids a text shows: an end-of-sequence id that ended the generation ends the text without being
    part of it (as the server's streams do)."""
    return token_ids[:-1] if token_ids and token_ids[-1] in end_ids else token_ids

