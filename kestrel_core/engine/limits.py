"""What one request may ask of a run: ids inside the vocabulary, a prompt and its generation inside the context, and at
most so many tokens generated. Checked here once, in one wording, whichever door the request came through (a flag,
kestrel.toml, Python, HTTP); each door maps a ``LimitError`` to its own error shape (a one-line error, a 400)."""

from __future__ import annotations

import attrs

from kestrel_core.errors import ConfigError

CONTEXT_CODE = "context_length_exceeded"  # OpenAI's code for a request past the context


class LimitError(ConfigError):
    """A request past a limit: the message names the limit and the fix; ``param``: the request field it is about;
    ``code``: OpenAI's error code where one applies."""

    def __init__(self, message: str, param: str = "prompt", code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


@attrs.frozen
class RequestLimits:
    """``context``: positions a sequence may use, ``whose`` ("the model", "this server"); ``vocab``: ids are
    0..vocab-1; ``max_tokens``: the most one request may generate (None: the context's room); ``tokens``: what the
    door calls the tokens asked for."""

    context: int
    whose: str
    vocab: int | None = None
    max_tokens: int | None = None
    tokens: str = "max_new_tokens"
    source: str = ""  # where the context's size is set (max_position_embeddings, --max-seq)

    def ids(self, ids, param: str = "prompt") -> list[int]:
        """``ids`` (token ids), each in the vocabulary."""
        ids = list(ids)
        bad = next((i for i in ids if not 0 <= i < self.vocab), None)
        if bad is not None:
            raise LimitError(f"{param}: token id {bad} is outside the vocabulary (0..{self.vocab - 1})", param)
        return ids

    def too_long(self, prompt: int | None, param: str = "prompt", asked: int | None = None) -> LimitError:
        """The error for a prompt of ``prompt`` tokens (None: more than the context holds) that leaves no room, or no
        room for ``asked`` tokens."""
        size = f"{prompt:,}" if prompt is not None else f"over {self.context - 1:,}"
        wanted = f" and {asked:,} to generate ({self.tokens})" if asked is not None else ", leaving no room to generate"
        fix = "shorten the prompt" + (f" or lower {self.tokens}" if asked is not None else "")
        source = f" ({self.source})" if self.source else ""
        return LimitError(f"{self.whose}'s context is {self.context:,} tokens{source}; the prompt takes {size}{wanted}; "
                          f"{fix}", param, CONTEXT_CODE)

    def budget(self, asked: int | None, prompt: int, param: str = "prompt", default: int | None = None) -> int:
        """The tokens a request generates: ``asked`` if it fits, else a LimitError; unasked, ``default`` (None: as
        many as fit), within ``max_tokens`` and the context's room."""
        room = self.context - prompt
        if room < 1:
            raise self.too_long(prompt, param)
        limit = self.max_tokens if self.max_tokens is not None else room
        if asked is None:
            return min(default or limit, limit, room)
        if asked < 1:
            raise LimitError(f"{self.tokens} must be at least 1, got {asked}", self.tokens)
        if self.max_tokens is not None and asked > self.max_tokens:
            raise LimitError(f"{self.tokens} is {asked:,}; {self.whose} generates at most {self.max_tokens:,} tokens "
                             "a request", self.tokens)
        if asked > room:
            raise self.too_long(prompt, param, asked)
        return asked


def check_max_seq(max_seq: int | None, positions: int | None = None, model: str = "the model") -> None:
    """``--max-seq`` as kestrel serve and generate take it: at least 2 positions (a prompt token and one generated)
    and, once the model is known, at most its ``positions`` (max_position_embeddings): never cut to them unsaid."""
    if max_seq is None:
        return
    if max_seq < 2:
        raise ConfigError(f"--max-seq must be at least 2 positions, got {max_seq}")
    if positions is not None and max_seq > positions:
        raise ConfigError(f"--max-seq {max_seq:,} is past {model}'s {positions:,} positions (max_position_embeddings); "
                          f"give at most {positions:,}, or leave it out")
