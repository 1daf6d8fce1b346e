"""``serve.tool_calls.parse`` at its edges: what a call needs (a name), what its arguments are where none were written,
the call's id, the text around and after the calls, and a block the reply ended inside."""

from __future__ import annotations

import json
import re

from kestrel_core.serve import tool_calls


def test_a_call_needs_a_name_that_is_not_empty():
    text = '<tool_call>{"name": "", "arguments": {}}</tool_call>'
    assert tool_calls.parse(text) == (text, [])


def test_a_call_without_arguments_has_an_empty_object_and_an_id_of_24_hex_digits():
    content, (call,) = tool_calls.parse('<tool_call>{"name": "now"}</tool_call>')
    assert content is None  # only calls written: no content
    assert call["function"] == {"name": "now", "arguments": "{}"}
    assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"])


def test_arguments_keep_their_characters_as_written():
    _, (call,) = tool_calls.parse('{"name": "get_weather", "parameters": {"city": "Zürich"}}')
    assert call["function"]["arguments"] == '{"city": "Zürich"}'


def test_the_text_before_between_and_after_the_calls_is_the_content():
    call = '<tool_call>{"name": "f", "arguments": {"a": %d}}</tool_call>'
    content, calls = tool_calls.parse(f"Before. {call % 1} Between. {call % 2} After.")
    assert content == "Before.  Between.  After."
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 1}, {"a": 2}]


def test_a_whole_call_in_a_block_the_reply_ended_inside_is_read():
    content, (call,) = tool_calls.parse('Sure.<tool_call>{"name": "f", "arguments": {"a": 1}}')
    assert content == "Sure." and call["function"]["name"] == "f"
