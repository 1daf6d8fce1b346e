"""Speculative decoding: a drafter proposes K tokens for a sequence, its verify span (the last token and the drafts)
rides a step of the batch beside every other sequence's rows, and the sequence keeps the drafts the target agrees with
plus one token of its own (``batch.Batch`` asks and verifies; this module decides what is kept).

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

import attrs
import torch

from kestrel_core.engine.contracts import Drafter, Drafting
from kestrel_core.errors import KestrelError
from kestrel_core.engine.sampling import Sampler


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


def begin_drafting(drafter: Drafter, prompt_ids: list[int]) -> Drafting:
    """What drafts for a new sequence (``drafter.begin``), checked: a KestrelError naming the drafter where it is none."""
    drafting = drafter.begin(list(prompt_ids))
    if not isinstance(drafting, Drafting):
        name = getattr(drafter, "name", type(drafter).__name__)
        raise KestrelError(f"the drafter {name!r}: begin() returned {type(drafting).__name__}, not what drafts for the "
                           "sequence (an object with propose and accepted; the drafter itself where it keeps nothing "
                           "a sequence); fix the drafter, or run without --draft")
    return drafting


def check_draft(drafter: Drafter, draft, probs, k: int, vocab: int) -> list[int]:
    """A drafter's proposal, checked: at most ``k`` token ids of the vocabulary, and (where given) one distribution a
    draft. A KestrelError naming the drafter otherwise: a plugin's bug is the sequence's error, never a wrong id."""
    name = getattr(drafter, "name", type(drafter).__name__)
    draft = list(draft)
    if len(draft) > k or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in draft):
        raise KestrelError(f"the drafter {name!r} proposed {draft[:k + 1]!r}: a draft is at most {k} token ids in "
                           f"0..{vocab - 1}; fix the drafter, or run without --draft")
    if probs is not None and (len(probs) != len(draft)):
        raise KestrelError(f"the drafter {name!r} gave {len(probs)} distributions for {len(draft)} drafts: one a draft "
                           "(or None, proposing deterministically); fix the drafter, or run without --draft")
    return draft
