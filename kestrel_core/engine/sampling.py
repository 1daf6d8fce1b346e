"""Next-token choice: greedy by default; temperature, top-k and top-p draw from a seeded generator; a constraint (a
grammar's, ``grammar.Constraint``) leaves only the ids it allows. Beside it, the log-probabilities a request may ask
for of the token chosen (``token_logprobs``)."""

from __future__ import annotations

import math
from typing import Protocol

import torch

from kestrel_core.config import GenerationConfig
from kestrel_core.errors import ConfigError


def check_sampling(gen: GenerationConfig) -> None:
    if not (math.isfinite(gen.temperature) and gen.temperature >= 0):
        raise ConfigError(f"temperature must be a finite number >= 0 (0 is greedy), got {gen.temperature}")
    if not 0 <= gen.seed < 2**64:
        raise ConfigError(f"seed must be in 0..2**64-1 (a 64-bit generator seed), got {gen.seed}")
    if gen.top_k < 0:
        raise ConfigError(f"top_k must be >= 0 (0 means no cut), got {gen.top_k}")
    if not 0 < gen.top_p <= 1:
        raise ConfigError(f"top_p must be in (0, 1], got {gen.top_p}")


def processes(gen: GenerationConfig) -> bool:
    """Whether ``gen`` changes the logits before a token is chosen (a penalty or a bias): its rows choose on the host."""
    return bool(gen.presence_penalty or gen.frequency_penalty or gen.repetition_penalty != 1 or gen.logit_bias)


def process(logits: torch.Tensor, gen: GenerationConfig, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """The logits a token is chosen from (a new [vocab] float32 tensor on the CPU), as vLLM orders its processors:
    ``logit_bias`` added; ``repetition_penalty`` on every token of the prompt and the generation (a positive logit
    divided by it, a negative one multiplied); then ``frequency_penalty`` times each token's count in the generation,
    and ``presence_penalty`` once for each token in it, subtracted."""
    out = logits.float().cpu().clone()
    if gen.logit_bias:
        ids = torch.tensor([i for i, _ in gen.logit_bias])
        out.index_add_(0, ids, torch.tensor([b for _, b in gen.logit_bias], dtype=out.dtype))
    if gen.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(prompt) | set(generated)), dtype=torch.long)
        if seen.numel():
            v = out[seen]
            out[seen] = torch.where(v > 0, v / gen.repetition_penalty, v * gen.repetition_penalty)
    if generated and (gen.frequency_penalty or gen.presence_penalty):
        counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=out.numel())[: out.numel()]
        out -= gen.frequency_penalty * counts.to(out.dtype) + gen.presence_penalty * (counts > 0).to(out.dtype)
    return out


class Constraint(Protocol):
    """Which ids may come next (a grammar's state for one sequence)."""

    def allowed(self) -> torch.Tensor: ...  # [vocab] bool, on the CPU

    def accept(self, token: int) -> None: ...  # the id chosen


class Sampler:
    def __init__(self, gen: GenerationConfig, constraint: Constraint | None = None, device_masks: bool = False):
        """``device_masks``: the step can hold a greedy row to its constraint's mask before its own argmax (the
        runner's ``masks_on_device``), so such a row's logits never come to the host."""
        check_sampling(gen)
        self.gen, self.constraint = gen, constraint
        self.rng = torch.Generator().manual_seed(gen.seed)
        self.processes = processes(gen)
        self.masks_on_device = device_masks and constraint is not None and gen.temperature == 0 and not self.processes
        # else the step's own argmax is the token
        self.on_host = gen.temperature > 0 or self.processes or (constraint is not None and not self.masks_on_device)

    def __call__(self, logits: torch.Tensor, prompt: list[int] = (), generated: list[int] = ()) -> int:
        """logits: [vocab] float32 (any device); ``prompt`` and ``generated``: the sequence's ids so far, which its
        penalties read."""
        if self.processes:
            logits = process(logits, self.gen, list(prompt), list(generated))
        if self.constraint is not None:
            logits = self._masked(logits)
        if self.gen.temperature == 0:
            token = int(torch.argmax(logits))
        else:
            token = self.draw(self.probs(logits))
        if self.constraint is not None:
            self.constraint.accept(token)
        return token

    def _masked(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits with every id the constraint forbids at -inf (a new CPU tensor: the step's stay as they are)."""
        return logits.float().cpu().masked_fill(~self.mask(logits.shape[-1]), float("-inf"))

    def mask(self, n: int) -> torch.Tensor:
        """The ids the constraint allows next, of ``n`` ([n] bool, on the CPU): the host's mask, or the one a step
        applies on the device (``masks_on_device``)."""
        allowed = self.constraint.allowed()
        if allowed.numel() != n:
            raise ValueError(f"the constraint covers {allowed.numel()} ids and the logits {n}")
        if not bool(allowed.any()):
            raise ValueError("the constraint allows no id here")
        return allowed

    def chosen(self, token: int) -> None:
        """The step chose ``token`` under this row's mask, on the device: the constraint moves on past it."""
        self.constraint.accept(token)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution a sampled token is drawn from: temperature, then top-k, then top-p ([vocab] float32, CPU)."""
        logits = logits.float().cpu()
        probs_logits = logits / self.gen.temperature
        if bool((torch.isfinite(logits) & ~torch.isfinite(probs_logits)).any()):
            # A temperature so small (1e-300) that logits / temperature overflow, whose softmax is NaN: its limit
            # instead, an even draw among the largest logits.
            probs_logits = torch.zeros_like(logits).masked_fill(logits < logits.max(), float("-inf"))
        if self.gen.top_k:
            kth = torch.topk(probs_logits, min(self.gen.top_k, probs_logits.numel())).values[-1]
            probs_logits = probs_logits.masked_fill(probs_logits < kth, float("-inf"))
        probs = torch.softmax(probs_logits, dim=-1)
        if self.gen.top_p < 1:
            sorted_p, order = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_p, dim=-1)
            drop = cum - sorted_p > self.gen.top_p  # keep the smallest prefix reaching top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
        return probs

    def draw(self, probs: torch.Tensor) -> int:
        """One id drawn from ``probs`` with this sampler's generator."""
        return int(torch.multinomial(probs, 1, generator=self.rng))

    def uniform(self) -> float:
        """A number in [0, 1) from the same generator (speculative sampling's acceptance test)."""
        return float(torch.rand(1, generator=self.rng))


def pick_masked(s, masks: tuple[tuple[int, torch.Tensor], ...], rows: int, backend) -> None:
    """The step's decode rows' argmax again, each masked row's among the ids its mask allows (every id elsewhere:
    the same argmax), in stream order after the pass. A mask goes up from a host row (pinned on cuda, so the
    upload does not wait for the pass); the rows are written again only once the last pick's uploads ran. ``s``: the
    batch's ``slots.Slots`` (its decode state, masks and mark), ``backend``: the run's."""
    now, state = dict(masks), s.state
    if not now and not s.masked:
        return
    if s.mask_mark is not None:
        backend.wait(s.mask_mark)
    if s.mask_rows is None:
        s.mask_rows = torch.empty(state.allowed.shape, dtype=torch.bool,
                                  pin_memory=backend.device.type == "cuda")
    for slot in s.masked - now.keys():
        state.allowed[slot].fill_(True)
    for slot, allowed in now.items():
        s.mask_rows[slot].copy_(allowed)
        state.allowed[slot].copy_(s.mask_rows[slot], non_blocking=True)
    s.masked = set(now)
    if now:
        state.tokens[:rows].copy_(torch.argmax(state.logits.masked_fill(~state.allowed[:rows], float("-inf")),
                                               dim=-1))
    s.mask_mark = backend.mark()


MAX_TOP_LOGPROBS = 20  # alternatives a token's log-probabilities may list (OpenAI's bound for chat)


def check_logprobs(k: int | None) -> None:
    """``k``: the alternatives each token's log-probabilities list (None: none asked)."""
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS):
        raise ConfigError(f"logprobs must be a whole number in 0..{MAX_TOP_LOGPROBS} (the alternatives listed beside "
                          f"each token), or None for none, got {k!r}")


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """The model's log-probabilities at ``logits`` [rows, vocab]: each row's chosen token's (``tokens`` [rows]), and
    its ``k`` most likely ids with theirs, most likely first: ([rows], [rows, k] values, [rows, k] ids), on the
    logits' device, without a wait.

    The distribution is the model's own: log_softmax over the whole vocabulary in float32 of the logits as the model
    gave them, before temperature, top-k and top-p (vLLM's default, ``logprobs_mode="raw_logprobs"``), so a token's
    log-probability is the same whatever the request's sampling settings."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, tokens.view(-1, 1).to(logprobs.device)).squeeze(-1)
    values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)  # k = 0: empty
    return chosen, values, ids
