"""Tools in kestrel serve's chat route: the functions reach the chat template, a reply's tool calls come back as
OpenAI's ``tool_calls`` (whole and streamed), earlier calls and tool answers go back into the template, and what
kestrel cannot do (a forced call) is a 400 that says so.

The tiny test model never writes a tool call of its own accord, so the answer tests give the server a reply's text
where the generation would (``Generation.pieces``): what they test is the server's reading of a reply, not the model.
"""

from __future__ import annotations

import json

import pytest

from kestrel_core.serve import tool_calls

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
            "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>"
            "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# --- reading a reply ----------------------------------------------------------------------------
def test_qwen_calls_are_read_and_the_rest_is_the_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    content, calls = tool_calls.parse(text)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather"] * 2
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_") and calls[0]["id"] != calls[1]["id"]


def test_llama_json_and_the_python_tag_are_read():
    for text in ('{"name": "get_weather", "parameters": {"city": "Rome"}}',
                 '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Rome"}}'):
        content, calls = tool_calls.parse(text)
        assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}


@pytest.mark.parametrize("text", [
    "The weather is fine.",
    "<tool_call>not json</tool_call> and more",  # a block that is no call stays in the content
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '{"temperature": 20}',  # a JSON reply that is no call
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa',  # cut off: not a call
])
def test_what_is_not_a_call_stays_the_content(text):
    assert tool_calls.parse(text) == (text, [])


def test_arguments_written_as_a_string_are_kept_as_written():
    _, calls = tool_calls.parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert calls[0]["function"]["arguments"] == '{"a": 1}'


# --- through the server ---------------------------------------------------------------------------
@pytest.fixture
def chat_service(tmp_path, tiny_ckpt):
    import shutil

    from starlette.testclient import TestClient

    from kestrel_core.config import KestrelConfig
    from kestrel_core.serve.app import create_app
    from kestrel_core.serve.service import Limits, Service

    d = shutil.copytree(tiny_ckpt, tmp_path / "tiny")
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|endoftext|>"}))
    service = Service(KestrelConfig().override(model=str(d), backend__name="cpu_ref"), "tiny", Limits())
    service.load()
    try:
        with TestClient(create_app(service), base_url="http://127.0.0.1") as http:
            yield service, http
    finally:
        service.close()


def ask(http, **body):
    return http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 4,
                                                   "messages": [{"role": "user", "content": "weather?"}], **body})


def test_the_tools_reach_the_template_and_tool_choice_none_keeps_them_out(chat_service):
    service, http = chat_service
    with_tools = ask(http, tools=[WEATHER], return_token_ids=True).json()
    without = ask(http, tools=[WEATHER], tool_choice="none", return_token_ids=True).json()
    tok = service.model.tokenizer
    assert "<tools>get_weather;</tools>" in tok.decode(with_tools["choices"][0]["prompt_token_ids"])
    assert "<tools>" not in tok.decode(without["choices"][0]["prompt_token_ids"])


@pytest.mark.parametrize("tool_choice", [None, "auto"])
def test_tools_a_template_does_not_lay_out_are_a_400_naming_tools_and_the_template(chat_service, tool_choice):
    """They were dropped without a word: the prompt was the same with them and without."""
    from serve_helpers import TEMPLATE as PLAIN

    from kestrel_core.formats.chat_template import ChatTemplate

    service, http = chat_service
    service.template = ChatTemplate(PLAIN, "plain.jinja")
    body = {"tool_choice": tool_choice} if tool_choice else {}
    response = ask(http, tools=[WEATHER], **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools" and "plain.jinja" in error["message"], error
    assert "does not lay out tools" in error["message"] and "\n" not in error["message"]
    assert ask(http, tools=[WEATHER], tool_choice="none").status_code == 200  # none: no tools for the template
    assert ask(http).status_code == 200


def test_earlier_calls_and_tool_answers_go_back_into_the_template(chat_service):
    service, http = chat_service
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    got = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "messages": messages,
                                                  "tools": [WEATHER], "return_token_ids": True}).json()
    prompt = service.model.tokenizer.decode(got["choices"][0]["prompt_token_ids"])
    call_text = prompt[prompt.index("<tool_call>"):prompt.index("</tool_call>")]
    assert json.loads(call_text.removeprefix("<tool_call>")) == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert "<|im_start|>tool\nsunny, 21 C<|im_end|>" in prompt


REPLY = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def _replying(monkeypatch, parts):
    from kestrel_core.serve.generation import Generation, Piece

    async def pieces(self, every_id=False):
        for i, part in enumerate(parts):
            yield Piece(part, [i], i)
        self.finish_reason = "stop"

    monkeypatch.setattr(Generation, "pieces", pieces)


@pytest.fixture
def replies(monkeypatch):
    """The generation's text replaced by ``REPLY``, in three pieces, ending as a stop."""
    _replying(monkeypatch, (REPLY[:5], REPLY[5:30], REPLY[30:]))


def test_a_reply_with_a_call_is_answered_with_tool_calls(chat_service, replies):
    _, http = chat_service
    got = ask(http, tools=[WEATHER]).json()["choices"][0]
    assert got["finish_reason"] == "tool_calls" and got["message"]["content"] == "Checking."
    (call,) = got["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    plain = ask(http).json()["choices"][0]  # no tools: the text is the text
    assert plain["message"]["content"] == REPLY and "tool_calls" not in plain["message"]


def _streamed(http, **body) -> list[dict]:
    lines = ask(http, tools=[WEATHER], stream=True, **body).text.splitlines()
    assert "data: [DONE]" in lines
    return [json.loads(x[6:])["choices"][0] for x in lines if x.startswith("data: {")]


def test_a_streamed_reply_with_a_call_sends_its_content_as_it_comes_then_its_calls(chat_service, replies):
    _, http = chat_service
    chunks = _streamed(http, return_token_ids=True)
    deltas = [c["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1] == {"content": "Check"}  # sent with the first piece, before the call is written
    assert "".join(d.get("content") or "" for d in deltas) == "Checking."
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1 and calls[0][0]["index"] == 0 and calls[0][0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0][0]["function"]["arguments"]) == {"city": "Paris"}
    assert chunks[-1]["finish_reason"] == "tool_calls"
    assert [t for c in chunks for t in c.get("token_ids") or []] == [0, 1, 2]  # each piece's ids once, in order


def test_a_reply_given_tools_that_calls_none_streams_piece_by_piece(chat_service, monkeypatch):
    """It was held whole to its end: a client given tools saw nothing until the reply was done."""
    _replying(monkeypatch, ("It is ", "sunny <tool", "_ in Paris. ", " "))
    _, http = chat_service
    chunks = _streamed(http, return_token_ids=True)
    assert [c["delta"] for c in chunks[1:-1]] == [{"content": "It is"}, {"content": " sunny"},
                                                  {"content": " <tool_ in Paris."}]
    assert chunks[-1]["finish_reason"] == "stop" and chunks[-1]["delta"] == {}
    assert [t for c in chunks for t in c.get("token_ids") or []] == [0, 1, 2, 3]


def test_two_calls_stream_each_once_whole_with_its_own_index(chat_service, monkeypatch):
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "%s"}}</tool_call>'
    reply = f"{call % 'Paris'}\n{call % 'Oslo'}"
    _replying(monkeypatch, [reply[i:i + 7] for i in range(0, len(reply), 7)])
    _, http = chat_service
    deltas = [c["delta"] for c in _streamed(http)]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [(c["index"], json.loads(c["function"]["arguments"])["city"]) for c in calls] == [(0, "Paris"), (1, "Oslo")]
    assert not any(d.get("content") for d in deltas)  # only calls: no content
    whole = ask(http, tools=[WEATHER]).json()["choices"][0]["message"]
    assert whole["content"] is None and [c["function"] for c in whole["tool_calls"]] == [c["function"] for c in calls]


# --- parallel_tool_calls ------------------------------------------------------------------------------------------
TWO_CALLS = ('First.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> then '
             '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')


def test_a_limit_of_one_keeps_the_first_call_and_drops_the_rest_whole_and_in_pieces():
    content, calls = tool_calls.parse(TWO_CALLS, limit=1)
    assert content == "First. then" and [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}]
    reader = tool_calls.Reader(limit=1)
    events = [e for i in range(0, len(TWO_CALLS), 5) for e in reader.push(TWO_CALLS[i:i + 5])] + reader.finish()
    assert [json.loads(v["function"]["arguments"]) for k, v in events if k == "call"] == [{"city": "Paris"}]
    assert "".join(v for k, v in events if k == "content") == "First. then" and len(reader.calls) == 1
    assert len(tool_calls.parse(TWO_CALLS)[1]) == 2  # no limit: both


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_answers_one_call_and_true_all(chat_service, monkeypatch, stream):
    """It was refused as an unknown parameter."""
    _replying(monkeypatch, [TWO_CALLS[i:i + 9] for i in range(0, len(TWO_CALLS), 9)])
    _, http = chat_service
    for parallel, cities in ((False, ["Paris"]), (True, ["Paris", "Oslo"]), (None, ["Paris", "Oslo"])):
        body = {"parallel_tool_calls": parallel} if parallel is not None else {}
        if stream:
            chunks = _streamed(http, **body)
            calls = [c for ch in chunks for c in ch["delta"].get("tool_calls", [])]
            assert [c["index"] for c in calls] == list(range(len(cities)))
            reason = chunks[-1]["finish_reason"]
        else:
            response = ask(http, tools=[WEATHER], **body)
            assert response.status_code == 200, response.text
            got = response.json()["choices"][0]
            calls, reason = got["message"]["tool_calls"], got["finish_reason"]
        assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == cities and reason == "tool_calls"


def test_parallel_tool_calls_false_holds_a_required_call_to_one(chat_service):
    _, http = chat_service
    assert tool_calls.forced(TEMPLATE, [CITY, TIME], None, one=True).startswith("start: block\n")
    for seed in range(2):
        got = ask(http, tools=[CITY, TIME], max_tokens=200, tool_choice="required", temperature=1.0, seed=seed,
                  parallel_tool_calls=False).json()["choices"][0]
        assert got["finish_reason"] == "tool_calls" and len(got["message"]["tool_calls"]) == 1, got


@pytest.mark.parametrize("body, says", [
    ({"parallel_tool_calls": False}, "only allowed with tools"),
    ({"tools": [WEATHER], "parallel_tool_calls": "false"}, "valid boolean"),
    ({"tools": [WEATHER], "parallel_tool_calls": 0}, "valid boolean"),
])
def test_a_parallel_tool_calls_without_tools_or_not_a_bool_is_a_400_naming_it(chat_service, body, says):
    _, http = chat_service
    response = ask(http, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "parallel_tool_calls" and says in error["message"], error


# --- a call forced by tool_choice --------------------------------------------------------------------------------
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
CITY = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"days": {"type": "integer"}}, "required": ["days"],
    "additionalProperties": False}}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_forces_one_call_of_it_with_arguments_its_schema_accepts(chat_service, stream):
    """The tiny model's random weights never write a call of their own: what comes back is the grammar's doing."""
    _, http = chat_service
    free = ask(http, tools=[CITY, TIME], max_tokens=30).json()["choices"][0]
    assert free["finish_reason"] != "tool_calls"
    response = ask(http, tools=[CITY, TIME], max_tokens=120, stream=stream,
                   tool_choice={"type": "function", "function": {"name": "get_time"}})
    if stream:
        deltas = [json.loads(x[6:])["choices"][0] for x in response.text.splitlines() if x.startswith("data: {")]
        calls = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
        reason = deltas[-1]["finish_reason"]
    else:
        got = response.json()["choices"][0]
        calls, reason = got["message"]["tool_calls"], got["finish_reason"]
        assert got["message"]["content"] is None
    assert reason == "tool_calls" and len(calls) == 1
    assert calls[0]["function"]["name"] == "get_time"
    assert json.loads(calls[0]["function"]["arguments"]) in ({"zone": "UTC"}, {"zone": "CET"})


def test_tool_choice_required_forces_calls_of_the_tools_given(chat_service):
    _, http = chat_service
    for seed in range(3):
        got = ask(http, tools=[CITY, TIME], max_tokens=200, tool_choice="required", temperature=1.0,
                  seed=seed).json()["choices"][0]
        assert got["finish_reason"] == "tool_calls", got
        for call in got["message"]["tool_calls"]:
            args = json.loads(call["function"]["arguments"])
            assert (call["function"]["name"], set(args)) in (("get_weather", {"days"}), ("get_time", {"zone"}))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parameters, says", [
    ({"$ref": "#"}, "its root (#) is only references"),
    ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "its root (#) is only references"),
    ({"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}, "#/properties/a is"),
    ({"type": "object", "properties": {"s": {"type": "string", "minLength": 5, "maxLength": 2}}, "required": ["s"]},
     "the parameters of the tool 'loop' cannot be used: Unsatisfiable schema: required property 's'"),
    ({"enum": []}, "Unsatisfiable"),
])
def test_a_forced_call_whose_parameters_no_value_matches_is_a_400_naming_tools(chat_service, parameters, says,
                                                                               stream):
    """It was a 500 with llguidance's parser state at the first token (streamed: a 200 and an error event)."""
    _, http = chat_service
    tool = {"type": "function", "function": {"name": "loop", "parameters": parameters}}
    response = ask(http, tools=[tool], tool_choice="required", stream=stream)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools" and says in error["message"] and "<state>" not in error["message"], error


def test_a_forced_calls_parameters_read_their_own_references():
    """A function's schema sits inside the call's: its #/$defs/... pointed at the call's root, which has none."""
    point = {"type": "object", "properties": {"at": {"$ref": "#/$defs/xy"}}, "required": ["at"],
             "$defs": {"xy": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
             "default": {"$ref": "#"}}
    grammar = tool_calls.forced(TEMPLATE, [CITY, {"type": "function", "function": {"name": "f", "parameters": point}}],
                                None)
    arguments = json.loads(grammar.split("%json ", 1)[1])["anyOf"][1]["properties"]["arguments"]
    assert arguments["properties"]["at"] == {"$ref": "#/anyOf/1/properties/arguments/$defs/xy"}
    assert arguments["default"] == {"$ref": "#"}  # a value, not a reference: as written


def test_a_forced_call_of_a_function_whose_parameters_use_defs_answers_it(chat_service):
    _, http = chat_service
    point = {"type": "function", "function": {"name": "go", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/zone"}}, "required": ["to"],
        "additionalProperties": False, "$defs": {"zone": {"enum": ["UTC", "CET"]}}}}}
    response = ask(http, tools=[point], max_tokens=120, temperature=0, tool_choice={"type": "function", "function": {"name": "go"}})
    assert response.status_code == 200, response.text
    (call,) = response.json()["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) in ({"to": "UTC"}, {"to": "CET"})


def test_a_forced_call_in_llama_format_is_a_bare_json_call():
    grammar = tool_calls.forced('{{ "parameters" }}', [TIME], "get_time")
    assert grammar.startswith("start: call\n") and '"parameters"' in grammar and "<tool_call>" not in grammar


def test_a_template_with_no_call_format_cannot_force_one(chat_service):
    service, http = chat_service
    with pytest.raises(tool_calls.NoCallFormat, match="use tool_choice 'auto'"):
        tool_calls.forced("{{ messages }}", [TIME], None)


@pytest.mark.parametrize("body, param, says", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "which tools does not hold"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", "must be"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "must be"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "ignore_eos": True}, "ignore_eos", "leave out ignore_eos"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "send one"),
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "a name of its own"),
    ({"tools": [{"type": "retrieval"}]}, None, None),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id", "tool_call_id"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "the server's"),
])
def test_what_kestrel_cannot_do_with_tools_is_a_400_that_says_so(chat_service, body, param, says):
    _, http = chat_service
    response = ask(http, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    if param is not None:
        assert error["param"] == param and says in error["message"]


# --- found by a mutation pass ---------------------------------------------------------------------------
def test_a_template_with_tool_call_blocks_is_hermes_even_where_it_shows_parameters():
    """Hermes-style templates lay out each tool's JSON, "parameters" and all, in the system prompt."""
    assert tool_calls.style('<tools>{"name": "f", "parameters": {}}</tools> <tool_call>...</tool_call>') == "hermes"
    assert tool_calls.style('{{ "<|python_tag|>" }}') == "llama"


def test_a_forced_grammar_lays_calls_out_as_the_template_does():
    named = tool_calls.forced(TEMPLATE, [CITY, TIME], "get_time")
    required = tool_calls.forced(TEMPLATE, [CITY, TIME], None)
    assert named.startswith("start: block\n")  # a named function: one call
    assert required.startswith('start: block ("\\n" block)*\n')  # required: one or more
    assert 'block: "<tool_call>\\n" call "\\n</tool_call>"' in named  # Qwen3's own layout of a call


def test_a_tool_without_parameters_is_called_with_an_object():
    grammar = tool_calls.forced(TEMPLATE, [{"type": "function", "function": {"name": "ping"}}], "ping")
    schema = json.loads(grammar.split("%json ", 1)[1])
    assert schema["anyOf"][0]["properties"]["arguments"] == {"type": "object"}
