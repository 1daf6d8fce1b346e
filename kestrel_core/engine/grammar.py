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
from urllib.parse import unquote

import numpy as np
import torch

from kestrel_core.errors import ConfigError, KestrelError
from kestrel_core.formats.tokenizer import Tokenizer

MAX_SCHEMA_CHARS = 256 * 2**10  # a schema's JSON text, at most: a compiled grammar grows with it
MAX_SCHEMA_DEPTH = 256  # subschemas within subschemas, at most, that the check of references walks
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
        check_refs(schema)
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
        grammar = Grammar(_llguidance(), tok, source, self.vocab_size, what)
        grammar.start().first()  # what fails only at its first token fails here, before the request is taken
        return grammar


# Where a schema holds schemas: keywords of one, of a list of them, of a name -> schema map
_ONE = ("additionalProperties", "items", "additionalItems", "contains", "propertyNames", "unevaluatedProperties",
        "unevaluatedItems", "if", "then", "else", "not")
_MANY = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_NAMED = ("properties", "patternProperties", "dependentSchemas", "$defs", "definitions")


def check_refs(schema: dict[str, Any], what: str = "the JSON schema") -> None:
    """A GrammarError naming the first subschema that is only references, round to itself (``{"$ref": "#"}``, or
    definitions that refer to each other and to nothing else): no value matches it, and llguidance finds that out
    only at the token that reaches it, after the request was taken. A reference that leaves the schema, or points at
    nothing, is left for llguidance to refuse."""
    nodes: dict[int, tuple[dict, str]] = {}  # id -> (subschema, its JSON pointer): every object subschema

    def target(node: dict) -> dict | None:
        ref = node.get("$ref")
        if not isinstance(ref, str) or (ref != "#" and not ref.startswith("#/")):
            return None
        at: Any = schema
        for part in ref[2:].split("/") if ref != "#" else ():
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(at, dict) and part in at:
                at = at[part]
            elif isinstance(at, list) and part.isdigit() and int(part) < len(at):
                at = at[int(part)]
            else:
                return None
        return at if isinstance(at, dict) else None

    def walk(node: Any, pointer: str, depth: int = 0) -> None:
        if not isinstance(node, dict) or id(node) in nodes or depth > MAX_SCHEMA_DEPTH:
            return
        nodes[id(node)] = (node, pointer)
        walk(target(node), node.get("$ref"), depth + 1)  # a reference's target, wherever it sits
        for key in _ONE:
            walk(node.get(key), f"{pointer}/{key}", depth + 1)
        for key in _MANY:
            if isinstance(node.get(key), list):
                for i, sub in enumerate(node[key]):
                    walk(sub, f"{pointer}/{key}/{i}", depth + 1)
        for key in _NAMED:
            if isinstance(node.get(key), dict):
                for name, sub in node[key].items():
                    walk(sub, f"{pointer}/{key}/{_escaped(name)}", depth + 1)

    walk(schema, "#")

    # A subschema has a value unless it is made of references alone and every way through them leads back: the least
    # fixed point, from those that have one outright (whatever else is wrong with them is llguidance's to say)
    def made(node: dict, ok: set[int]) -> bool:
        ref = target(node)
        if ref is not None and id(ref) not in ok:
            return False
        parts = {key: [s for s in node[key] if isinstance(s, dict)] for key in ("allOf", "anyOf", "oneOf")
                 if isinstance(node.get(key), list)}
        if any(id(s) not in ok for s in parts.pop("allOf", ())):
            return False
        return all(not subs or any(id(s) in ok for s in subs) for subs in parts.values())

    ok: set[int] = set()
    grew = True
    while grew:
        grew = False
        for key, (node, _) in nodes.items():
            if key not in ok and made(node, ok):
                ok.add(key)
                grew = True
    for key, (node, pointer) in nodes.items():
        if key not in ok:
            where = "its root (#)" if pointer == "#" else pointer
            raise GrammarError(f"{what} cannot be used: {where} is only references that lead back to it, so no "
                               "value can match it; give it a type or properties of its own")


def check_schema(schema: dict[str, Any], what: str) -> None:
    """A GrammarError, naming ``what``, where ``schema`` cannot hold a value on its own: what ``Grammars.json``
    refuses, less the vocabulary's part; for a schema that sits inside another (a tool's parameters in a call's),
    where the whole one's error would name only the place that holds it."""
    check_refs(schema, what)
    try:
        error = _llguidance().LLMatcher.validate_grammar(
            _llguidance().LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS), None)
    except Exception as exc:  # noqa: BLE001
        error = str(exc)
    if error and not error.startswith("WARNING"):
        raise GrammarError(f"{what} cannot be used: {_one_line(error)}")


def _escaped(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


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
        return Constraint(matcher, self.vocab_size, self.what)


class Constraint:
    """One sequence's place in its grammar."""

    def __init__(self, matcher, vocab_size: int, what: str = "the grammar"):
        self._matcher, self.vocab_size, self.what = matcher, vocab_size, what
        self._words = np.empty((vocab_size + 31) // 32, dtype=np.int32)

    def first(self) -> None:
        """The first token's mask computed, or a GrammarError: a grammar that allows no first token (a schema that
        is only a reference to itself) is found out when the request is checked, not once it runs."""
        m = self._matcher
        m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        if m.is_error() or not self._words.any():
            why = f" ({_one_line(m.get_error())})" if m.is_error() else ""
            raise GrammarError(f"{self.what} cannot be used: nothing can match it, it allows no first token{why}")

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
    """llguidance's message on one line, less the parser state it dumps after its reason (``<state>``: its lexer's
    and parser's internals, no help to whoever wrote the schema)."""
    return " ".join(str(message).split("<state>", 1)[0].split())[:300]

