"""Built-in drafters for speculative decoding.

- ``ngram[:N]``: prompt lookup. Find the latest earlier place where the last N tokens (N down to 2; ``ngram:1``: one)
  occurred in the sequence so far, and propose what followed them there. It needs no model, and drafts
  deterministically. A one-token match is left out by default: it is rarely right, and a verify pass carrying drafts
  costs more than a plain step where the pass is compute-bound (bench speculative: story and chat prompts).
- ``model`` (``--draft MODEL``): a small model with the same vocabulary, kept resident on the run's device with its own
  KV cache; it drafts greedily (or, sampling, with the run's settings, giving each draft's distribution). The engine
  opens it (``drafts_with_a_model``) and its proposals go through the draft run's own batch: the one token loop.
"""

from __future__ import annotations

from kestrel_core.errors import ConfigError
from kestrel_core.hookspecs import hookimpl

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
    """A small model drafting for a larger one: the engine loads the model ``arg`` names, checks it (the target's
    vocabulary, smaller), opens it beside the run and hands it over as ``draft_run`` (``engine.draft_run.DraftRun``);
    each sequence drafts through that run's own batch."""

    name = "model"
    drafts_with_a_model = True  # the engine opens the draft run and passes it: factory(arg=, run=, draft_run=)

    def __init__(self, arg: str | None = None, run=None, draft_run=None):
        if draft_run is None:
            raise ConfigError("the model drafter drafts through the draft run the engine opens for it (draft_run=); "
                              "open the run with draft=MODEL")
        self.draft_run = draft_run

    def begin(self, prompt_ids):
        return self.draft_run.sequence()

    def close(self):
        pass  # the engine, which opened the draft run, closes it


@hookimpl
def register_drafters(register):
    register("ngram", NGram)
    register("model", DraftModel)
