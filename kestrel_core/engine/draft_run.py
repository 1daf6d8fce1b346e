"""A draft model's run beside the target's: what a drafter that drafts with a model proposes through.

The engine opens it (``assemble.make_drafter``, for a drafter factory that says ``drafts_with_a_model``) and hands it to
the drafter, which asks it for each sequence's proposals. It proposes through a ``Batch`` of its own on the draft
model's runner: its steps go through the one token loop (schedule, run, read; a greedy step read a step late) as the
target's do. Its one KV slot keeps the tokens of the sequence that drafted last, so a sequence drafting again feeds
only what is new since; another sequence's proposal feeds its own context anew.
"""

from __future__ import annotations

import warnings

import attrs
import torch

from kestrel_core.engine.batch import Batch, Request
from kestrel_core.engine.sampling import Sampler
from kestrel_core.errors import ConfigError, KestrelNote


def check_draft_model(draft, target) -> None:
    """A ConfigError where ``draft`` (a loaded Model) cannot draft for ``target``: another vocabulary, or not smaller."""
    mine, theirs = draft.tokenizer, target.tokenizer
    if mine is None or theirs is None:
        why = (draft if mine is None else target).no_tokenizer()  # a directory's, or a GGUF's own reason
        raise ConfigError(f"--draft {draft.dir}: {why}, so the vocabularies cannot be compared; "
                          "a draft model needs the target's vocabulary")
    if mine.vocab() != theirs.vocab() or draft.config.vocab_size != target.config.vocab_size:
        raise ConfigError(f"--draft {draft.dir}: its vocabulary differs from {target.dir}'s (the same ids must mean "
                          "the same tokens); draft with a model of the same family, or --draft ngram")
    sizes = [sum(f.size for f in m.checkpoint.files.values()) for m in (draft, target)]
    if sizes[0] >= sizes[1]:
        raise ConfigError(f"--draft {draft.dir}: the draft ({sizes[0] / 2**20:,.0f} MiB) is not smaller than the "
                          f"target ({sizes[1] / 2**20:,.0f} MiB); a draft pays off only when it costs far less")


class DraftRun:
    """The draft model's open run (``run``, resident, alone on the target's device) and the one-slot ``Batch`` its
    proposals go through. ``target``: the target model; ``gen``: the target run's generation settings, which a
    sampled draft is drawn with (temperature, top-k, top-p; no penalty: a draft is the model's own guess)."""

    def __init__(self, run, target, gen):
        self.run = run
        self.gen = attrs.evolve(gen, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                                logit_bias=())
        theirs = target.config.max_position_embeddings
        self.max_seq = min(run.model.config.max_position_embeddings, theirs)
        if self.max_seq < theirs:
            warnings.warn(f"the draft model {run.model.dir} holds {self.max_seq:,} positions, fewer than the target's "
                          f"{theirs:,}: past position {self.max_seq:,} the target decodes one token a pass, undrafted",
                          KestrelNote, stacklevel=3)
        with torch.inference_mode():
            self.batch = Batch(run.runner, slots=1, max_seq=self.max_seq)
        self.owner: DraftSequence | None = None  # the sequence whose tokens the slot holds

    def sequence(self) -> "DraftSequence":
        """What drafts for a new sequence (a ``contracts.Drafting``)."""
        return DraftSequence(self)

    def propose(self, seq: "DraftSequence", context: list[int], k: int) -> tuple[list[int], list | None]:
        """Up to ``k`` tokens the draft model generates after ``context`` for ``seq`` (greedy, or drawn with the run's
        settings: then each one's distribution), through the batch: one request of ``k`` tokens whose prompt is the
        context, the tokens the slot already holds for ``seq`` cached."""
        k = min(k, self.max_seq - len(context) - 1)
        if k <= 0:
            return [], None
        if self.owner is not seq:  # the slot holds another sequence's tokens
            self.owner, seq.fed = seq, []
        seq.accepted(context)
        cached = len(seq.fed[: len(context) - 1])  # at least the last token goes through: its logits give the first
        gen = attrs.evolve(self.gen, max_new_tokens=k, stop_at_eos=False)
        sampler = seq.sampler
        with torch.inference_mode():
            one = self.batch.add(Request(list(context), gen, keep_logits=sampler is not None, sampler=sampler,
                                         cached=cached))
            self.batch.run_until_done()
            self.batch.forget()
        if one.error is not None:
            raise one.error
        tokens = one.result.token_ids
        seq.fed = list(context) + tokens[:-1]  # the last draft's K/V is not written
        return tokens, ([sampler.probs(logits) for logits in one.result.logits] if sampler is not None else None)

    def close(self) -> None:
        """Close its batch's slots, its run and its model."""
        try:
            self.batch.dev.close()
            self.run.close()
        finally:
            self.run.model.close()


class DraftSequence:
    """One sequence's drafts from a draft run: the tokens whose K/V the run's slot holds for it, in order, and (where
    the run samples) its sampler, which draws on from one proposal to the next."""

    def __init__(self, run: DraftRun):
        self.run, self.fed = run, []
        self.sampler = Sampler(run.gen) if run.gen.temperature > 0 else None

    def propose(self, context: list[int], k: int) -> tuple[list[int], list | None]:
        return self.run.propose(self, context, k)

    def accepted(self, context: list[int]) -> None:
        keep = 0  # the slot is good up to the first token the kept sequence disagrees with
        while keep < min(len(self.fed), len(context)) and self.fed[keep] == context[keep]:
            keep += 1
        self.fed = self.fed[:keep]
