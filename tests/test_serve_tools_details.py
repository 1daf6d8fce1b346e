"""``serve.tool_calls.parse`` at its edges: what a call needs (a name), what its arguments are where none were written,
the call's id, the text around and after the calls, and a block the reply ended inside."""

from __future__ import annotations

import json
import re

import pytest

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


READS = ['  Before. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call> Between.\n\n'
         '<tool_call>{"name": "f", "arguments": {"a": 2}}</tool_call>\n After.  ',
         "plain text  with  ws ", "<tool_call>not json</tool_call> x", 'Sure.<tool_call>{"name": "f", "arguments": {}}',
         '{"name": "g", "parameters": {"x": 1}}', '<|python_tag|>{"name": "g", "arguments": {}}', "<tool_ca",
         "a <tool_c b", "", "<|python", "   ", '<tool_call>{"name": "f"}</tool_call>']


@pytest.mark.parametrize("text", READS)
def test_a_reply_read_in_pieces_gives_what_it_gives_whole(text):
    """``Reader`` at every cut into three pieces: its content events join to the whole reply's content, and its calls
    are the whole reply's, in order."""
    content, calls = tool_calls.parse(text)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 3):
            reader = tool_calls.Reader()
            events = [e for part in (text[:i], text[i:j], text[j:]) for e in reader.push(part)] + reader.finish()
            assert "".join(v for k, v in events if k == "content") == (content or "")
            assert [v["function"] for k, v in events if k == "call"] == [c["function"] for c in calls]
            assert reader.content() == content


def test_content_is_sent_before_the_reply_ends_and_a_call_once_its_block_closes():
    reader = tool_calls.Reader()
    assert reader.push("It is ") == [("content", "It is")]  # the space waits for what follows it
    assert reader.push("sunny. <tool_c") == [("content", " sunny.")]  # what may open a block waits
    assert reader.push('all>{"name": "f", "arguments": {"a": 1}}') == []  # a block not yet closed waits
    (kind, call), = reader.push("</tool_call>")
    assert kind == "call" and call["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert reader.finish() == [] and reader.content() == "It is sunny."


def test_the_content_begins_at_its_first_text_and_a_long_reply_keeps_only_what_is_unread():
    assert tool_calls.parse('  Sure.<tool_call>{"name": "f", "arguments": {}}</tool_call>')[0] == "Sure."
    reader = tool_calls.Reader()
    assert reader.push("\n Hi") + reader.finish() == [("content", "Hi")]
    reader = tool_calls.Reader()
    reader.push("x" * 10000)
    reader.push(" and y <tool")
    assert reader.text == "<tool"  # what may open a block: all it holds of 10,000 characters read
