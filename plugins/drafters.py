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
from kestrel_core.kvcache import allocate_cache
from kestrel_core.config import DRAFT_TOKENS_MAX
from kestrel_core.model import RopeTable
from kestrel_core.step_graphs import StepGraphs
from kestrel_core.sampling import Sampler

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
        pass

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
                                                    "device": backend.device, "graphs": backend.graphs}, keep="off")
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
        b = runner.backend
        self.cache = allocate_cache(self.model.config, self.max_seq, b.dtype, b.device)
        with torch.inference_mode():
            self.rope = RopeTable(self.model.config, self.max_seq, b.dtype, b.device)
            # Its one-token steps run as the target's do: a decode state whose step a CUDA graph can capture and replay.
            self.state = runner.decode_state(self.rope, 1, self.max_seq)
            self.drafted = torch.zeros(DRAFT_TOKENS_MAX, dtype=torch.long, device=b.device)
        self.graphs = StepGraphs(runner.window, b, self.run.config.backend.graphs != "off",
                                 experts_in_step=runner.reads_table(1), on_replay=runner.replayed)
        self.fed: list[int] = []  # the tokens whose K/V the draft's cache holds, in order

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
        self.fed = []
        self.sampler = Sampler(self.gen) if self.gen.temperature > 0 else None

    def _feed(self, ids: list[int]) -> torch.Tensor:
        logits = self.run.runner.forward(ids, len(self.fed), self.cache, self.rope, "decode")
        self.fed += ids
        return logits

    def _step(self, token: int | None) -> None:
        """One token through the draft at the next position (``token``, or greedy: the last step's argmax, already in
        the state on the device); the step's argmax is left in the state."""
        runner, st = self.run.runner, self.state
        if token is not None:
            st.tokens[0].fill_(token)
        runner.window.next_token()
        runner.begin_step()
        self.graphs(lambda boundaries: runner.decode_step(st, self.cache, boundaries, 1))

    def propose(self, context, k):
        k = min(k, self.max_seq - len(context) - 1)
        if k <= 0:
            return [], None
        with torch.inference_mode():
            logits = self._feed(context[len(self.fed):])  # what the kept sequence added since: an eager pass
            st = self.state
            st.positions[0].fill_(len(self.fed))
            st.live.fill_(1)
            if self.sampler is None:  # greedy: the draft's steps chain on the device, read back once
                first = int(torch.argmax(logits))
                for i in range(k - 1):
                    self._step(first if i == 0 else None)
                    self.drafted[i].copy_(st.tokens[0])
                tokens = [first, *self.drafted[: k - 1].tolist()]
                self.fed += tokens[:-1]
                return tokens, None
            tokens, probs = [], []
            for i in range(k):
                p = self.sampler.probs(logits)
                tokens.append(self.sampler.draw(p))
                probs.append(p)
                if i < k - 1:
                    self._step(tokens[-1])
                    self.fed.append(tokens[-1])
                    logits = st.logits[0]
        return tokens, probs

    def accepted(self, context):
        keep = 0  # the draft's cache is good up to the first token the kept sequence disagrees with
        while keep < min(len(self.fed), len(context)) and self.fed[keep] == context[keep]:
            keep += 1
        self.fed = self.fed[:keep]

    def close(self):
        self.run.close()
        self.model.close()


@hookimpl
def register_drafters(register):
    register("ngram", NGram)
    register("model", DraftModel)
