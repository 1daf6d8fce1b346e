"""Built-in drafters for speculative decoding.

- ``ngram[:N]``: prompt lookup. Find the latest earlier place where the last N tokens (N down to 2; ``ngram:1``: one)
  occurred in the sequence so far, and propose what followed them there. It needs no model, and drafts
  deterministically. A one-token match is left out by default: it is rarely right, and a verify pass carrying drafts
  costs more than a plain step where the pass is compute-bound (bench speculative: story and chat prompts).
- ``model`` (``--draft MODEL``): a small model with the same vocabulary, kept resident on the run's device with its own
  KV cache; it drafts greedily (or, sampling, with the run's settings, giving each draft's distribution).
"""

from __future__ import annotations

import warnings

import torch

from kestrel_core.errors import BudgetError, ConfigError, KestrelNote
from kestrel_core.hookspecs import hookimpl
from kestrel_core.engine.model import Span
from kestrel_core.engine.runner import StepRequest
from kestrel_core.engine.sampling import Sampler

NGRAM_DEFAULT, NGRAM_MAX, NGRAM_SHORTEST = 3, 16, 2


class NGram:
    """Prompt-lookup drafting over the sequence so far."""

    name = "ngram"

    def __init__(self, arg: str | None = None, run=None):
        try:
            self.n = NGRAM_DEFAULT if arg in (None, "") else int(arg)
        except ValueError:
            self.n = None
        if self.n is None or not 1 <= self.n <= NGRAM_MAX:
            raise ConfigError(f"--draft ngram:N takes N in 1..{NGRAM_MAX} (the tokens matched), got {arg!r}")

    def begin(self, prompt_ids):
        return self  # it keeps nothing a sequence

    def propose(self, context, k):
        shortest = min(self.n, NGRAM_SHORTEST)
        for n in range(min(self.n, len(context) - 1), shortest - 1, -1):
            tail = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):  # the latest earlier match first
                if context[start : start + n] == tail:
                    follow = context[start + n : start + n + k]
                    if follow:
                        return follow, None
        return [], None

    def accepted(self, context):
        pass

    def close(self):
        pass


class DraftModel:
    """A small model drafting for a larger one: the same vocabulary, resident on the same device, its own KV cache."""

    name = "model"

    def __init__(self, arg: str | None = None, run=None):
        from kestrel_core import load

        if not arg:
            raise ConfigError("--draft model needs the draft model: --draft DIR (or a name in the Hugging Face cache)")
        target = run.model
        self.model = load(arg)
        try:
            self._check(target)
            backend = run.config.backend
            try:
                self.run = self.model.open(backend={"name": backend.name, "dtype": backend.dtype,
                                                    "device": backend.device, "graphs": backend.graphs}, keep="off",
                                           alone=True)  # beside a pipeline's rank 0: whole, on its device
            except BudgetError as exc:
                raise BudgetError(f"the draft model {self.model.dir} does not fit on the device beside the target: "
                                  f"{exc}") from None
        except BaseException:
            self.model.close()
            raise
        self.gen = run.config.generation
        self.max_seq = min(self.model.config.max_position_embeddings, target.config.max_position_embeddings)
        if self.max_seq < target.config.max_position_embeddings:
            warnings.warn(f"the draft model {self.model.dir} holds {self.max_seq:,} positions, fewer than the target's "
                          f"{target.config.max_position_embeddings:,}: past position {self.max_seq:,} the target decodes "
                          "one token a pass, undrafted", KestrelNote, stacklevel=2)
        runner = self.run.runner
        # One KV slot, its steps run as the target's do (one-token steps captured and replayed); the sequence whose
        # tokens it holds is its owner, and another sequence's proposal feeds its own context anew.
        with torch.inference_mode():
            self.slots = runner.open_slots(1, self.max_seq)
        self.owner: _Drafting | None = None

    def _check(self, target) -> None:
        draft = self.model
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

    def begin(self, prompt_ids):
        return _Drafting(self)

    def propose(self, seq: "_Drafting", context: list[int], k: int):
        k = min(k, self.max_seq - len(context) - 1)
        if k <= 0:
            return [], None
        runner, slots = self.run.runner, self.slots
        if self.owner is not seq:  # the slot holds another sequence's tokens
            self.owner, seq.fed = seq, []
        seq.accepted(context)
        fed = seq.fed[: len(context) - 1]  # at least the last token goes through: its logits give the first draft
        new = context[len(fed):]
        sampler = seq.sampler
        tokens, probs = [], []

        def draw(slot, logits):  # a sampled draft: drawn on the host, its distribution kept
            p = sampler.probs(logits)
            probs.append(p)
            tokens.append(sampler.draw(p))
            return tokens[-1]

        with torch.inference_mode():
            first = runner.step(slots, StepRequest(0, spans=((Span(0, 0, len(fed), len(new)), tuple(new)),)))
            logits = first.span_logits[0][-1]
            if sampler is None:
                tokens.append(int(torch.argmax(logits)))
            else:
                draw(0, logits)
            runner.place(slots, 0, len(context), tokens[0])
            step = StepRequest(1, frozenset({0}), sample=(0,) if sampler else ())
            last = None
            for _ in range(k - 1):  # greedy: each step's argmax is the next one's token, on the device; read a step late
                launched = runner.step(slots, step, draw)
                if last is not None:
                    self._read(last, tokens, sampler)
                last = launched
            if last is not None:
                self._read(last, tokens, sampler)
        seq.fed = list(context) + tokens[:-1]  # the last draft's K/V is not written
        return tokens, (probs if sampler is not None else None)

    def _read(self, launched, tokens: list[int], sampler) -> None:
        back = self.run.runner.read(self.slots, launched, hear=(0,))
        if sampler is None:
            tokens.append(back.tokens[0])

    def close(self):
        self.run.close()
        self.model.close()


class _Drafting:
    """One sequence's drafts from a draft model: the tokens whose K/V the model's slot holds for it, in order."""

    def __init__(self, model: DraftModel):
        self.model, self.fed = model, []
        self.sampler = Sampler(model.gen) if model.gen.temperature > 0 else None

    def propose(self, context, k):
        return self.model.propose(self, context, k)

    def accepted(self, context):
        keep = 0  # the slot is good up to the first token the kept sequence disagrees with
        while keep < min(len(self.fed), len(context)) and self.fed[keep] == context[keep]:
            keep += 1
        self.fed = self.fed[:keep]


@hookimpl
def register_drafters(register):
    register("ngram", NGram)
    register("model", DraftModel)
