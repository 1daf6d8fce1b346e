"""Tool calls read from a chat reply, as OpenAI's ``tool_calls``.

Two formats, the ones kestrel's models write when their chat template is given ``tools``:

- Qwen3 (and Hermes-style templates): each call a JSON object ``{"name": ..., "arguments": {...}}`` between
  ``<tool_call>`` and ``</tool_call>``, anywhere in the reply; the text outside them is the reply's content.
- Llama 3.1: the whole reply one JSON object ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), optionally
  after ``<|python_tag|>``.

A block that does not hold such an object stays in the content, so nothing the model wrote is lost. Each call gets
an id of its own (``call_`` and 24 hex digits); its ``arguments`` are a JSON string, as OpenAI sends them.
"""

from __future__ import annotations

import json
import re
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.S)
PYTHON_TAG = "<|python_tag|>"


def _call(obj) -> dict | None:
    """An OpenAI tool call from a parsed object, or None where it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # already a JSON string (some models write it so): kept as written
        text = args
    else:
        text = json.dumps(args, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": obj["name"], "arguments": text}}


def _json(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def parse(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a reply: the content None where only calls were written."""
    calls, kept, at = [], [], 0
    for m in _BLOCK.finditer(text):
        call = _call(_json(m.group(1).strip()))
        if call is None:
            continue  # not a call: the block stays in the content
        calls.append(call)
        kept.append(text[at:m.start()])
        at = m.end()
    if calls:
        content = ("".join(kept) + text[at:]).strip()
        return content or None, calls
    bare = text.strip().removeprefix(PYTHON_TAG).strip()
    if bare.startswith("{"):
        call = _call(_json(bare))
        if call is not None:
            return None, [call]
    return text, []

