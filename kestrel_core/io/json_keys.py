"""JSON from outside, read strictly and refused in kestrel's words.

``json.loads(text, object_pairs_hook=unique_keys)`` raises ``RepeatedKey`` where Python's default would let a second
value silently shadow the first (a request's ``max_tokens`` given twice, a prompts line's ``seed``, a safetensors
header defining one tensor twice). ``past_int_limit(exc)`` tells Python's integer limit (int() refuses more than 4300
digits with a ValueError that json.loads lets through) from the other ValueErrors a parse raises, so that a reader
says ``TOO_MANY_DIGITS`` and not Python's own message, which tells the reader to call sys.set_int_max_str_digits()."""

from __future__ import annotations

import json

TOO_MANY_DIGITS = "a number of more than 4300 digits"


class RepeatedKey(Exception):
    """``args[0]``: the first key an object gives twice."""


def unique_keys(pairs: list) -> dict:
    """json object_pairs_hook: the object as a dict, or RepeatedKey naming the first key given twice."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        raise RepeatedKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return out


def past_int_limit(exc: BaseException) -> bool:
    """Whether a parse's ValueError is Python's limit on an integer's digits (and not bad JSON, or a hook's refusal)."""
    return (isinstance(exc, ValueError) and not isinstance(exc, (json.JSONDecodeError, UnicodeDecodeError))
            and str(exc).startswith("Exceeds the limit"))
