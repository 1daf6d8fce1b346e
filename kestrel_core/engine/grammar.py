"""Output held to a JSON schema or a grammar: constrained decoding through llguidance.

    grammars = Grammars(tokenizer, vocab_size)            # once a model: the vocabulary as llguidance reads it
    grammar = grammars.json(schema, end_ids)              # once a request: compiled and checked (a GrammarError if not)
    grammar = grammars.lark(text, end_ids)                # or a grammar of llguidance's Lark
    constraint = grammar.start()                          # once a sequence: its own matcher state

At each token the sequence's sampler asks ``constraint.allowed()`` for the ids that keep the text a prefix of a value
the schema accepts (a [vocab] bool tensor), chooses among them, and tells ``constraint.accept(id)``. Once the value is
whole only ``end_ids`` are allowed, so the sequence ends with it. The ids a vocabulary pads past its tokenizer's are
never allowed.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Iterable

import numpy as np
import torch

from kestrel_core.errors import ConfigError, KestrelError
from kestrel_core.formats.tokenizer import Tokenizer

MAX_SCHEMA_CHARS = 256 * 2**10  # a schema's JSON text, at most: a compiled grammar grows with it
KEPT_VOCABULARIES = 8  # end-id sets whose vocabulary is kept made (a chat's and a completion's are the usual two)
# Whitespace between tokens of the value: some, so a model may lay it out as it learned to, but never unbounded (a
# model that would rather not end the value could pad it with whitespace until max_tokens). A schema's own
# "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_pattern": r"[ \n\t]{0,12}"}


class GrammarError(ConfigError):
    """A schema kestrel cannot hold output to (the request's fault, not the model's)."""


def _llguidance():
    try:
        import llguidance
    except ImportError:  # a dependency of kestrel's: only a broken install lacks it
        raise ConfigError("constrained output needs the llguidance package; pip install llguidance") from None
    return llguidance


class Grammars:
    """A model's vocabulary as llguidance reads it, one for each set of end ids (made once, a fraction of a second
    for 150k ids)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._tokenizers: dict[frozenset[int], Any] = {}
        self._lock = threading.Lock()

    def _for(self, end_ids: frozenset[int]):
        with self._lock:
            tok = self._tokenizers.pop(end_ids, None)
            if tok is None:
                llg = _llguidance()
                tok = llg.LLTokenizer(self.tokenizer.hf.to_str(), n_vocab=self.vocab_size,
                                      eos_token=sorted(end_ids))
            self._tokenizers[end_ids] = tok  # the most recent last
            while len(self._tokenizers) > KEPT_VOCABULARIES:  # requests' own stop ids make new sets: bounded
                del self._tokenizers[next(iter(self._tokenizers))]
            return tok

    def json(self, schema: dict[str, Any], end_ids: Iterable[int]) -> "Grammar":
        """The grammar of the JSON values ``schema`` accepts (``{}``: any JSON value), its end marked by any of
        ``end_ids``; a GrammarError naming what is wrong with the schema."""
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema is an object, got {type(schema).__name__}")
        text = _bounded(json.dumps(schema), "the JSON schema")
        llg = _llguidance()
        try:
            source = llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        except Exception as exc:  # noqa: BLE001 - the library's own message names the schema's fault
            raise GrammarError(f"the JSON schema cannot be used: {_one_line(exc)}") from None
        return self._compiled(source, end_ids, "the JSON schema")

    def lark(self, text: str, end_ids: Iterable[int]) -> "Grammar":
        """The grammar ``text`` (llguidance's Lark: rules, regular expressions, ``%json {schema}``), its end marked by
        any of ``end_ids``."""
        _bounded(text, "the grammar")
        try:
            source = _llguidance().LLMatcher.grammar_from_lark(text)
        except Exception as exc:  # noqa: BLE001
            raise GrammarError(f"the grammar cannot be used: {_one_line(exc)}") from None
        return self._compiled(source, end_ids, "the grammar")

    def _compiled(self, source: str, end_ids: Iterable[int], what: str) -> "Grammar":
        ends = frozenset(end_ids)
        if not ends:
            raise GrammarError("constrained output ends at an end-of-sequence id, and this request has none; "
                               "leave out ignore_eos")
        tok = self._for(ends)
        error = _llguidance().LLMatcher.validate_grammar(source, tok)
        if error and not error.startswith("WARNING"):
            raise GrammarError(f"{what} cannot be used: {_one_line(error)}")
        return Grammar(_llguidance(), tok, source, self.vocab_size, what)


def _bounded(text: str, what: str) -> str:
    if len(text) > MAX_SCHEMA_CHARS:
        raise GrammarError(f"{what} is {len(text):,} characters; at most {MAX_SCHEMA_CHARS:,}")
    return text


class Grammar:
    """One compiled grammar; ``start()`` gives each sequence its own state."""

    def __init__(self, llg, tokenizer, source: str, vocab_size: int, what: str):
        self._llg, self._tokenizer, self.source, self.vocab_size, self.what = llg, tokenizer, source, vocab_size, what

    def start(self) -> "Constraint":
        matcher = self._llg.LLMatcher(self._tokenizer, self.source, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{self.what} cannot be used: {_one_line(matcher.get_error())}")
        return Constraint(matcher, self.vocab_size)


class Constraint:
    """One sequence's place in its grammar."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher, self.vocab_size = matcher, vocab_size
        self._words = np.empty((vocab_size + 31) // 32, dtype=np.int32)

    def allowed(self) -> torch.Tensor:
        """[vocab_size] bool: the ids that may come next."""
        m = self._matcher
        m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        if m.is_error():
            raise KestrelError(f"constrained output stopped: {_one_line(m.get_error())}")
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")[: self.vocab_size]
        return torch.from_numpy(bits.astype(bool))

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise KestrelError(f"constrained output: token {token} is not allowed here "
                              f"({_one_line(self._matcher.get_error())})")


def _one_line(message: Any) -> str:
    return " ".join(str(message).split())[:300]
