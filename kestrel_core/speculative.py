"""Speculative decoding for one sequence: a drafter proposes K tokens, one pass of the target over the last token and
the drafts verifies them all, and the sequence keeps the drafts the target agrees with plus one token of its own.

When every layer streams, a pass costs the time to move the layers whether it carries one token or many, so a pass
that keeps several tokens divides that cost. The window and its policies see each verify pass as one pass, exactly as
a prompt chunk. Greedy: a draft is kept while it is the target's argmax, so the ids are plain greedy decoding's (on a
``row_exact`` backend, bitwise: a row's logits do not depend on its pass). Sampled: a draft ``d`` is kept with
probability min(1, p(d) / q(d)) (``q``: the drafter's distribution; a deterministic drafter's is one-hot), and at the
first rejection a token is drawn from the residual max(p - q, 0), normalised: the output follows the target's
distribution. The KV cache needs no copy to roll back: the positions of rejected drafts are overwritten by the next
pass before any query reads them.
"""

from __future__ import annotations

import time

import attrs
import torch

from .config import GenerationConfig
from .contracts import Drafter
from .errors import ConfigError
from .model import Span
from .plan import delta
from .results import GenerationResult
from .runner import Runner
from .sampling import Sampler


@attrs.define
class SpecStats:
    passes: int = 0  # verify passes of the target
    drafted: int = 0
    accepted: int = 0
    kept: int = 0  # tokens a pass kept (accepted drafts, and the target's own)
    draft_ms: float = 0.0  # the drafter's time (host clock)
    verify_ms: float = 0.0  # the verify passes' time (device marks)

    def to_json(self) -> dict:
        return {**attrs.asdict(self),
                "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
                "tokens_per_pass": self.kept / self.passes if self.passes else None}


def refused_in_a_batch(batcher: str, drop: str) -> ConfigError:
    """The one refusal of a draft wherever sequences are batched: the server, a batch job, a Scheduler, generate_batch."""
    return ConfigError(f"speculative decoding runs one sequence at a time, and {batcher} batches them: drop {drop}")


def accept(logits: torch.Tensor, draft: list[int], probs: list | None, sampler: Sampler, greedy: bool) -> tuple[int, int]:
    """(drafts kept, the target's own next token) for one verify pass: ``logits`` [1 + len(draft), vocab]."""
    if greedy:
        preds = torch.argmax(logits, dim=-1).tolist()
        n = 0
        while n < len(draft) and draft[n] == preds[n]:
            n += 1
        return n, preds[n]
    for i, d in enumerate(draft):
        p = sampler.probs(logits[i])
        q = probs[i] if probs is not None and probs[i] is not None else None
        qd = float(q[d]) if q is not None else 1.0
        if sampler.uniform() < min(1.0, float(p[d]) / qd):
            continue
        residual = (p - q).clamp_min(0) if q is not None else p.clone()
        if q is None:
            residual[d] = 0.0
        total = float(residual.sum())
        return i, sampler.draw(residual / total if total > 0 else p)
    return len(draft), sampler.draw(sampler.probs(logits[len(draft)]))


def generate_speculative(runner: Runner, prompt_ids: list[int], gen: GenerationConfig, eos_ids: frozenset[int],
                         drafter: Drafter, k: int, keep_logits: bool = False, on_token=None) -> GenerationResult:
    """Generate from ``prompt_ids`` (checked by the caller) with ``drafter`` proposing up to ``k`` tokens a pass."""
    cfg, backend, window, counters = runner.cfg, runner.backend, runner.window, runner.counters
    max_seq = len(prompt_ids) + gen.max_new_tokens + k  # a last pass may write drafts past the end
    sampler = Sampler(gen)
    greedy = gen.temperature == 0
    stats = SpecStats()
    with torch.inference_mode():
        slots = runner.open_slots(1, max_seq)
        state, cache = slots.state, slots.cache
        fixed = counters.resident_bytes
        runner.preload()
        backend.synchronize()
        t0 = backend.mark()
        prompt = list(prompt_ids)
        last = runner.decode_step(state, cache, window.boundaries("prefill"), 0, [(Span(0, 0, 0, len(prompt)), prompt)])[0][-1]
        if not bool(torch.isfinite(last).all()):
            raise runner.nonfinite(slots, prompt, 0, "prefill")
        tokens = [sampler(last)]
        prefill_end = backend.mark()
        prefill_ms = backend.elapsed_ms(t0, prefill_end)
        kept_logits = [last.cpu()] if keep_logits else None
        if on_token:
            on_token(tokens[0])
        done = gen.stop_at_eos and tokens[0] in eos_ids
        drafter.begin(prompt)
        marks, per_pass, kept_per_pass = [prefill_end], [], []
        while not done and len(tokens) < gen.max_new_tokens:
            room = gen.max_new_tokens - len(tokens) - 1  # the pass adds one token of the target's own
            t_draft = time.perf_counter()
            draft, probs = drafter.propose(prompt + tokens, min(k, room)) if room > 0 else ([], None)
            stats.draft_ms += (time.perf_counter() - t_draft) * 1e3
            window.next_token()
            before = counters.snapshot()
            start = len(prompt) + len(tokens) - 1
            ids = [tokens[-1], *draft]
            logits = runner.decode_step(state, cache, window.boundaries("prefill"), 0, [(Span(0, 0, start, len(ids)), ids)],
                                        frozenset({0}))[0]
            after = counters.snapshot()
            marks.append(backend.mark())
            if not bool(torch.isfinite(logits).all()):
                row = int((~torch.isfinite(logits).all(dim=-1)).nonzero()[0])
                raise runner.nonfinite(slots, ids[: row + 1], start, "decode")
            n, own = accept(logits, draft, probs, sampler, greedy)
            new = draft[:n] + [own]
            stats.passes += 1
            stats.drafted += len(draft)
            stats.accepted += n
            took = 0
            for i, token in enumerate(new):
                tokens.append(token)
                took += 1
                if keep_logits:
                    kept_logits.append(logits[i].cpu())
                if on_token:
                    on_token(token)
                if (gen.stop_at_eos and token in eos_ids) or len(tokens) >= gen.max_new_tokens:
                    done = True
                    break
            stats.kept += took
            kept_per_pass.append(took)
            per_pass.append(delta(after, before))
            drafter.accepted(prompt + tokens)
        decode_ms = [backend.elapsed_ms(a, b) for a, b in zip(marks, marks[1:])]
        stats.verify_ms = sum(decode_ms)
    return GenerationResult(
        prompt_ids=prompt, token_ids=tokens, prefill_ms=prefill_ms, decode_ms=decode_ms, counters=counters.snapshot(),
        per_token=per_pass, memory=backend.memory_stats(), fixed_resident_bytes=fixed, logits=kept_logits,
        steps={"eager": len(per_pass), "captured": 0, "replayed": 0}, step_modes=["eager"] * len(per_pass),
        tokens_per_step=kept_per_pass, speculative=stats.to_json())
