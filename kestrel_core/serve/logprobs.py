"""OpenAI's logprobs objects from the log-probabilities the batch computed for each token (``TokenLogprobs``): chat's
``{"content": [{token, logprob, bytes, top_logprobs}]}`` and the completions API's
``{tokens, token_logprobs, top_logprobs, text_offset}``. A token's text is its own bytes decoded (a token that holds
part of a character reads as U+FFFD there; its ``bytes`` are exact)."""

from __future__ import annotations

from kestrel_core.engine.results import TokenLogprobs
from kestrel_core.formats.tokenizer import Tokenizer

FLOOR = -9999.0  # -inf is not JSON: an impossible token's log-probability reads as this, as vLLM's does


class LogprobText:
    """The tokens' text and bytes, as OpenAI spells them, remembered by id."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._seen: dict[int, tuple[str, list[int]]] = {}

    def token(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self._seen:
            raw = self.tokenizer.token_bytes(token_id)
            self._seen[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return self._seen[token_id]

    def chat(self, logprobs: list[TokenLogprobs]) -> dict:
        """Chat's ``logprobs`` of a choice (or a chunk's tokens)."""
        return {"content": [{**self._entry(lp.token, lp.logprob),
                             "top_logprobs": [self._entry(token, value) for token, value in lp.top]}
                            for lp in logprobs]}

    def completion(self, logprobs: list[TokenLogprobs], offsets: list[int]) -> dict:
        """The completions API's ``logprobs``: ``offsets``, each token's character offset in the choice's text. Each
        ``top_logprobs`` holds the top alternatives and the chosen token, as OpenAI's does (up to logprobs + 1)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": list(offsets)}
        for lp in logprobs:
            out["tokens"].append(self.token(lp.token)[0])
            out["token_logprobs"].append(max(lp.logprob, FLOOR))
            top: dict[str, float] = {}
            for token, value in (*lp.top, (lp.token, lp.logprob)):  # two ids of one text: the likelier one's
                top.setdefault(self.token(token)[0], max(value, FLOOR))
            out["top_logprobs"].append(top)
        return out

    def _entry(self, token_id: int, logprob: float) -> dict:
        text, raw = self.token(token_id)
        return {"token": text, "logprob": max(logprob, FLOOR), "bytes": raw}
