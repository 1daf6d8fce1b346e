"""A completion's text as its tokens arrive, cut before the first stop string, as OpenAI cuts it.

Text that may be the start of a stop string is held back until a later token decides it, so that a stream never
sends what the final text leaves out; the tokenizer's stream already holds back an incomplete character.
"""

from __future__ import annotations

from kestrel_core.formats.tokenizer import Tokenizer


class TextOutput:
    def __init__(self, tokenizer: Tokenizer, stop: list[str]):
        self._stream = tokenizer.stream()
        self.stop = [s for s in stop if s]
        self.text = ""  # decoded so far; once stopped, the final text
        self.sent = 0  # characters of ``text`` given out
        self.stopped = False  # a stop string was found: the text ends before it

    def push(self, token: int) -> str:
        """Take a token; the text that is now safe to send ("" while held back)."""
        if self.stopped:
            return ""
        self.text += self._stream.push(token)
        return self._release(final=False)

    def finish(self) -> str:
        """The generation ended: what is left to send."""
        if not self.stopped:
            self.text += self._stream.finish()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stop and not self.stopped:
            # Nothing sent can start a match (it would have been held), so the search starts at what is unsent.
            hits = [i for s in self.stop if (i := self.text.find(s, self.sent)) >= 0]
            if hits:
                self.text, self.stopped, final = self.text[:min(hits)], True, True
        end = len(self.text) if final else len(self.text) - self._held()
        piece = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return piece

    def _held(self) -> int:
        """The length of the longest unsent tail that a stop string begins with."""
        unsent = len(self.text) - self.sent
        for k in range(min(unsent, max(map(len, self.stop), default=1) - 1), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0
