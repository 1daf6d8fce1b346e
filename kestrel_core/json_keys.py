"""JSON objects that name each key once: ``json.loads(text, object_pairs_hook=unique_keys)`` raises ``RepeatedKey``
where Python's default would let a second value silently shadow the first (a request's ``max_tokens`` given twice, a
prompts line's ``seed``, a safetensors header defining one tensor twice)."""

from __future__ import annotations


class RepeatedKey(Exception):
    """``args[0]``: the first key an object gives twice."""


def unique_keys(pairs: list) -> dict:
    """json object_pairs_hook: the object as a dict, or RepeatedKey naming the first key given twice."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        raise RepeatedKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return out
