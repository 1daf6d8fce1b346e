"""Tool calls read from a chat reply, as OpenAI's ``tool_calls``.

Two formats, the ones kestrel's models write when their chat template is given ``tools``:

- Qwen3 (and Hermes-style templates): each call a JSON object ``{"name": ..., "arguments": {...}}`` between
  ``<tool_call>`` and ``</tool_call>``, anywhere in the reply; the text outside them is the reply's content.
- Llama 3.1: the whole reply one JSON object ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), optionally
  after ``<|python_tag|>``.

A block that does not hold such an object stays in the content, so nothing the model wrote is lost. Each call gets
an id of its own (``call_`` and 24 hex digits); its ``arguments`` are a JSON string, as OpenAI sends them.

``forced(template_source, tools, name)`` is the grammar (llguidance's Lark) of a reply that is calls only, in the
format the template lays out: a ``tool_choice`` of ``required`` (one call or more, of any tool; one with ``one``) or
of one named function (one call of it), each call's arguments held to its function's ``parameters`` schema (its
references, ``#/$defs/...``, read within that schema, as they were written).

A request's ``parallel_tool_calls: false`` reads a reply with ``limit=1``: its first call is kept, and any later call
the model writes is dropped (neither a call nor content).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from kestrel_core.engine.grammar import check_schema

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.S)
PYTHON_TAG = "<|python_tag|>"
# A forced call's JSON laid out as the templates render earlier calls (Jinja's tojson: ", " and ": ", no other
# whitespace): what the models saw in training, and no room to pad the call until max_tokens.
CALL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class NoCallFormat(ValueError):
    """The chat template lays out no tool-call format kestrel knows."""


def style(template_source: str) -> str | None:
    """The call format a chat template asks its model for: "hermes" (``<tool_call>`` blocks), "llama" (a bare JSON
    object with ``parameters``), or None: neither shows."""
    if OPEN in template_source:
        return "hermes"
    if PYTHON_TAG in template_source or '"parameters"' in template_source:
        return "llama"
    return None


def forced(template_source: str, tools: list[dict], name: str | None, one: bool = False) -> str:
    """The Lark grammar of a reply that is only calls: of the function ``name`` (one call), or, None, of any of
    ``tools`` (one or more, Hermes, unless ``one``; one, Llama's format holds one)."""
    how = style(template_source)
    if how is None:
        raise NoCallFormat("this model's chat template shows no tool-call format kestrel can hold a reply to "
                           "(<tool_call> blocks, or Llama 3.1's JSON with parameters); use tool_choice 'auto'")
    key = "arguments" if how == "hermes" else "parameters"
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    for t in chosen:  # a GrammarError: the request's tools are at fault
        if isinstance(t["function"].get("parameters"), dict):
            check_schema(t["function"]["parameters"], f"the parameters of the tool {t['function']['name']!r}")
    # Each function's schema sits inside the call's: its own references (#, #/$defs/...) are moved to where it sits
    schema = {"x-guidance": CALL_JSON,
              "anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", key],
                         "properties": {"name": {"const": t["function"]["name"]},
                                        key: _rebased(t["function"].get("parameters") or {"type": "object"},
                                                      f"#/anyOf/{i}/properties/{key}")}}
                        for i, t in enumerate(chosen)]}
    call = "call: %json " + json.dumps(schema)
    if how == "llama":
        return "start: call\n" + call
    many = "" if name is not None or one else ' ("\\n" block)*'
    return f'start: block{many}\nblock: "{OPEN}\\n" call "\\n{CLOSE}"\n' + call


def _rebased(schema: Any, root: str) -> Any:
    """``schema`` with its references within itself (``#``, ``#/...``) made references within ``root``; the values
    a schema holds as data (const, enum, default, examples) are left as they are."""
    if isinstance(schema, list):
        return [_rebased(s, root) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
            out[k] = root + v[1:]
        elif k in ("const", "enum", "default", "examples"):
            out[k] = v
        else:
            out[k] = _rebased(v, root)
    return out


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


class Reader:
    """A reply read as it is written: ``push(text)`` and ``finish()`` give its events in order, ``("content", text)``
    (the content so far, less whitespace that may yet end it) and ``("call", call)`` (a call, once its block is
    closed), so a stream sends the content as it comes and each call as it is whole; ``parse`` is this over a whole
    reply, so a streamed reply and an answered one agree.

    A reply whose first text is ``{`` or ``<|python_tag|>`` may be one bare call (Llama 3.1's format): it is held to
    its end and read whole. ``limit``: the calls kept (None: all); a call past it is dropped, and not content."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.mode = "undecided"  # "blocks": content and <tool_call> blocks; "bare": held whole
        self.text = ""  # the pieces pushed (in "blocks": from the first not yet read)
        self.at = 0  # where the unread text starts (in "blocks")
        self.sent: list[str] = []  # the content sent
        self.tail = ""  # whitespace outside calls, sent once more content follows it
        self.calls: list[dict] = []

    def push(self, text: str) -> list[tuple[str, object]]:
        self.text += text
        if self.mode == "undecided":
            head = self.text.lstrip()
            if head.startswith("{") or head.startswith(PYTHON_TAG):
                self.mode = "bare"
            elif head and not PYTHON_TAG.startswith(head):
                self.mode = "blocks"
        if self.mode != "blocks":
            return []
        events = self._blocks(False)
        self.text, self.at = self.text[self.at:], 0  # what is read is not kept: a long reply costs no more a piece
        return events

    def finish(self) -> list[tuple[str, object]]:
        if self.mode != "blocks":  # a bare call, or text that never showed what it is: read whole
            content, calls = _whole(self.text)
            self.calls = calls = calls[:self.limit]
            return ([("content", content)] if content else []) + [("call", c) for c in calls]
        return self._blocks(True)

    def content(self) -> str | None:
        """The reply's content once finished: None where only calls were written."""
        if self.mode != "blocks":
            return _whole(self.text)[0]
        text = "".join(self.sent)
        return None if not text and self.calls else text

    def _blocks(self, last: bool) -> list[tuple[str, object]]:
        events: list[tuple[str, object]] = []
        while True:
            start = self.text.find(OPEN, self.at)
            if start < 0:  # no block opens: all but what may begin one is content
                end = len(self.text) if last else _held_from(self.text, self.at)
                events += self._content(self.text[self.at:end])
                self.at = end
                return events
            events += self._content(self.text[self.at:start])
            close = self.text.find(CLOSE, start + len(OPEN))
            if close < 0 and not last:
                self.at = start  # a block still being written: held
                return events
            body_end = len(self.text) if close < 0 else close
            after = body_end if close < 0 else close + len(CLOSE)
            call = _call(_json(self.text[start + len(OPEN):body_end].strip()))
            if call is None:
                events += self._content(self.text[start:after])  # not a call: the block stays in the content
            elif self.limit is None or len(self.calls) < self.limit:
                self.calls.append(call)
                events.append(("call", call))
            self.at = after

    def _content(self, text: str) -> list[tuple[str, object]]:
        """``text`` outside the calls as content to send: none of the reply's leading whitespace, and whitespace at
        the end held until more content follows it (the content is the text outside calls, stripped)."""
        if not self.sent:
            text = (self.tail + text).lstrip()
            self.tail = ""
        text = self.tail + text
        ready = text.rstrip()
        self.tail = text[len(ready):]
        if not ready:
            return []
        self.sent.append(ready)
        return [("content", ready)]


def _held_from(text: str, at: int) -> int:
    """Where an ``OPEN`` may be beginning at the end of ``text`` (its length where none may)."""
    for k in range(min(len(OPEN) - 1, len(text) - at), 0, -1):
        if OPEN.startswith(text[-k:]):
            return len(text) - k
    return len(text)


def parse(text: str, limit: int | None = None) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a reply: the content None where only calls were written (``Reader`` over it whole);
    ``limit``: the calls kept, as ``Reader``'s."""
    reader = Reader(limit)
    reader.push(text)
    reader.finish()
    return reader.content(), reader.calls


def _whole(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a reply read whole: its <tool_call> blocks, else the whole reply one bare call."""
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

