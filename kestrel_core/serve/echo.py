"""Completions' ``echo``: the prompt laid before each choice's text, and, where the request asks for logprobs, its
tokens first in the choice's ``logprobs`` (the first with none: nothing comes before it), as OpenAI's legacy API
gives them."""

from __future__ import annotations

from kestrel_core.engine.results import TokenLogprobs
from kestrel_core.formats.tokenizer import Tokenizer
from kestrel_core.serve.logprobs import LogprobText


class Echo:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        """The prompt's text as its ids decode (so each token's offset is where its text begins in it)."""
        self.prompt_ids = list(prompt_ids)
        stream, text, self.offsets = tokenizer.stream(), [], []
        length = 0
        for token in self.prompt_ids:
            self.offsets.append(length)
            piece = stream.push(token)
            text.append(piece)
            length += len(piece)
        text.append(stream.finish())
        self.text = "".join(text)

    def logprobs(self, names: LogprobText, prompt_logprobs: list[TokenLogprobs]) -> dict:
        """The completions API's ``logprobs`` of the prompt's tokens: the first's null, as OpenAI's."""
        rest = names.completion(prompt_logprobs, self.offsets[1:])
        first = names.token(self.prompt_ids[0])[0] if self.prompt_ids else None
        return {"tokens": [first, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
                "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": self.offsets[:1] + rest["text_offset"]}

    def before(self, logprobs: dict | None) -> dict | None:
        """A choice's (or a chunk's) ``logprobs`` with its text offsets moved past the prompt's text."""
        if logprobs is None:
            return None
        return {**logprobs, "text_offset": [o + len(self.text) for o in logprobs["text_offset"]]}


def joined(a: dict, b: dict) -> dict:
    """Two completions ``logprobs`` objects, one after the other."""
    return {k: a[k] + b[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
