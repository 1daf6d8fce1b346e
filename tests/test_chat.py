"""kestrel chat and its chat templates: Qwen3's real template rendered exactly, the sandbox, the errors, and the
command end to end on the tiny model, driven through stdin."""

from __future__ import annotations

import io
import json
import shutil

import pytest

from cli_helpers import fails
from kestrel_core.formats.chat_template import ChatTemplate, end_ids, load_chat_template
from kestrel_core.cli import main
from kestrel_core.engine.run import Model
from kestrel_core.errors import ConfigError

# Qwen3's chat template, verbatim: the "chat_template" of Qwen/Qwen3-8B's tokenizer_config.json as released
# (Apache-2.0, the Qwen team); copied from optimum-intel's table of exact template strings.
QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

TWO_TURNS = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello!"},
    {"role": "user", "content": "Bye"},
]


def with_config(tmp_path, **config) -> ChatTemplate:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return load_chat_template(tmp_path)


# --- rendering --------------------------------------------------------------------------

def test_qwen3_renders_a_two_turn_conversation_exactly(tmp_path):
    template = with_config(tmp_path, chat_template=QWEN3, eos_token="<|im_end|>", bos_token=None)
    assert template.render(TWO_TURNS) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"  # an earlier turn's thinking is dropped
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert template.render(TWO_TURNS[1:2], enable_thinking=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # transformers' own output for this pair, as SkyRL's template notes quote it
    assert template.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
                           add_generation_prompt=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello<|im_end|>\n")


def test_special_tokens_come_from_tokenizer_config_as_strings_or_added_tokens(tmp_path):
    bos = {"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    template = with_config(tmp_path, chat_template="{{ bos_token }}{% for m in messages %}[{{ m.role }}:{{ m.content }}]"
                                                   "{% endfor %}{% if add_generation_prompt %}{{ eos_token }}{% endif %}",
                           bos_token=bos, eos_token="</s>")
    assert template.render(TWO_TURNS[1:2]) == "<s>[user:Hi]</s>"
    assert template.render(TWO_TURNS[1:2], add_generation_prompt=False) == "<s>[user:Hi]"


def test_named_templates_take_the_default(tmp_path):
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain {{ messages|length }}"}]
    assert with_config(tmp_path, chat_template=named).render(TWO_TURNS) == "plain 4"
    with pytest.raises(ConfigError, match="named tool_use, rag but none named 'default'"):
        with_config(tmp_path, chat_template=[named[0], {"name": "rag", "template": "x"}])
    with pytest.raises(ConfigError, match="must be a string or a list"):
        with_config(tmp_path, chat_template=[{"name": "default"}])


def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path):
    (tmp_path / "chat_template.jinja").write_text("from the file {{ eos_token }}")
    assert with_config(tmp_path, chat_template="from the config", eos_token="E").render(TWO_TURNS) == "from the file E"


def test_transformers_environment_tojson_loop_controls_and_generation_blocks(tmp_path):
    source = ("{{ {'a': '<é>'}|tojson }}|{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}"
              "{{ m.role[0] }}{% endfor %}|{% generation %}{{ messages[1].content }}{% endgeneration %}|"
              "{{ strftime_now('%Y')|length }}")
    assert ChatTemplate(source, "t").render(TWO_TURNS) == '{"a": "<é>"}|uau|Hi|4'  # jinja's tojson would escape < and >
    trimmed = ChatTemplate("{% for m in messages %}\n  {% if m.role == 'user' %}\n{{ m.content }}\n  {% endif %}\n{% endfor %}", "t")
    assert trimmed.render(TWO_TURNS) == "Hi\nBye\n"  # trim_blocks and lstrip_blocks, as transformers sets them


@pytest.mark.parametrize("source, needle", [
    ("{{ ''.__class__.__mro__ }}", "access to attribute '__class__' of 'str' object is unsafe"),
    ("{{ messages.append({'role': 'user'}) }}", "access to attribute 'append' of 'list' object is unsafe"),
    ("{{ cycler.__init__.__globals__ }}", "unsafe"),
])
def test_the_sandbox_refuses_attribute_access(source, needle):
    with pytest.raises(ConfigError, match="sandbox forbids") as err:
        ChatTemplate(source, "t").render(TWO_TURNS)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_an_unsafe_attribute_alone_renders_as_nothing():
    assert ChatTemplate("[{{ ''.__class__ }}]", "t").render(TWO_TURNS) == "[]"  # never "<class 'str'>"


def test_a_template_that_raises_is_a_one_line_error(tmp_path):
    alternate = ("{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
                 "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
                 "{% endif %}{% endfor %}")
    with pytest.raises(ConfigError, match=r"refused the conversation \(Conversation roles must alternate") as err:
        with_config(tmp_path, chat_template=alternate).render(TWO_TURNS)
    assert str(err.value).startswith(str(tmp_path / "tokenizer_config.json")) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"failed \(TypeError"):
        ChatTemplate("{{ 1 + messages[0].content }}", "t").render(TWO_TURNS)
    with pytest.raises(ConfigError, match="does not parse .*template line 2"):
        ChatTemplate("ok\n{% if %}", "t")


def test_no_template_says_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="has no chat template .*kestrel generate --prompt TEXT"):
        with_config(tmp_path, eos_token="</s>")
    with pytest.raises(ConfigError, match="has no chat template"):
        load_chat_template(tmp_path / "missing")


# --- kestrel chat, end to end on the tiny model -------------------------------------------

@pytest.fixture(scope="module")
def chat_model(tiny_ckpt, tmp_path_factory):
    """The tiny model (byte-level tokenizer, id 256 <|endoftext|>) with Qwen3's template."""
    d = shutil.copytree(tiny_ckpt, tmp_path_factory.mktemp("chat") / "tiny")
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": QWEN3, "eos_token": "<|endoftext|>"}))
    return d


def chat(monkeypatch, capsys, model_dir, stdin: str, *flags: str) -> tuple[int, str, str]:
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    rc = main(["chat", "--model", str(model_dir), *flags])
    out = capsys.readouterr()
    return rc, out.out, out.err


def reference(model_dir, turns: list[str], max_new_tokens: int, system: str | None = None) -> list[list[int]]:
    """Each reply's ids, through the Python API: the conversation rendered again for each turn."""
    template = load_chat_template(model_dir)
    messages = [{"role": "system", "content": system}] if system else []
    replies = []
    with Model(model_dir) as model, model.open(generation={"max_new_tokens": max_new_tokens}) as run:
        ends = end_ids(model, template)
        for turn in turns:
            messages.append({"role": "user", "content": turn})
            prompt = model.tokenizer.encode(template.render(messages))
            ids = run.generate(prompt_ids=prompt, stop_ids=ends).token_ids
            replies.append(ids)
            content = ids[:-1] if ids[-1] in ends else ids
            messages.append({"role": "assistant", "content": model.tokenizer.decode(content)})
    return replies


def test_chat_streams_each_reply_of_the_conversation(chat_model, monkeypatch, capsys):
    rc, out, err = chat(monkeypatch, capsys, chat_model, "Hi there\n\nAnd now?\n/exit\nnever read\n",
                        "--max-new-tokens", "7", "--system", "Be brief.")
    assert rc == 0, err
    replies = reference(chat_model, ["Hi there", "And now?"], 7, system="Be brief.")
    with Model(chat_model) as model:
        assert out == "".join(model.tokenizer.decode(r) + "\n" for r in replies)
    assert err.startswith("kestrel: note: 2 of 2 replies stopped at the 7-token cap") and err.count("\n") == 1
    rc, lines, _ = chat(monkeypatch, capsys, chat_model, "Hi there\nAnd now?\n", "--max-new-tokens", "7",
                        "--system", "Be brief.", "--json")
    records = [json.loads(line) for line in lines.splitlines()]
    assert rc == 0 and [r["token_ids"] for r in records] == replies
    assert out == "".join(r["reply"] + "\n" for r in records)  # what streamed is the reply, exactly
    assert records[1]["prompt_tokens"] > records[0]["prompt_tokens"] + len(replies[0])  # the conversation grew


def test_reset_starts_the_conversation_over(chat_model, monkeypatch, capsys):
    _, first, _ = chat(monkeypatch, capsys, chat_model, "Hi there\n", "--max-new-tokens", "5", "--json")
    _, again, _ = chat(monkeypatch, capsys, chat_model, "Other\n/reset\nHi there\n", "--max-new-tokens", "5", "--json")
    timeless = lambda record: {k: v for k, v in json.loads(record).items() if not k.endswith("_ms") and "ms_" not in k}  # noqa: E731
    assert timeless(again.splitlines()[1]) == timeless(first)


def test_a_reply_stops_at_generation_configs_end_of_turn(chat_model, tmp_path, monkeypatch, capsys):
    (free,) = reference(chat_model, ["Hi there"], 12)
    at = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    d = shutil.copytree(chat_model, tmp_path / "eos")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [256, free[at]]}))
    with Model(d) as model:
        assert end_ids(model, load_chat_template(d)) == {256, free[at]}
        text = model.tokenizer.decode(free[:at])
    rc, out, err = chat(monkeypatch, capsys, d, "Hi there\n", "--max-new-tokens", "12")
    assert rc == 0 and out == text + "\n" and err == ""  # the end-of-turn token is not shown, and nothing was cut
    _, line, _ = chat(monkeypatch, capsys, d, "Hi there\n", "--max-new-tokens", "12", "--json")
    record = json.loads(line)
    assert record["token_ids"] == free[: at + 1] and record["ended"] is True and record["reply"] == text


def test_the_tokenizer_configs_eos_token_ends_a_turn(chat_model, tmp_path):
    d = shutil.copytree(chat_model, tmp_path / "noeos")
    for name in ("config.json", "generation_config.json"):
        raw = json.loads((d / name).read_text())
        raw.pop("eos_token_id")
        (d / name).write_text(json.dumps(raw))
    with Model(d) as model:
        assert end_ids(model, load_chat_template(d)) == {256}  # <|endoftext|>, by its id in tokenizer.json
        (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": QWEN3}))
        with pytest.raises(ConfigError, match="names no end-of-sequence token"):
            end_ids(model, load_chat_template(d))


def test_chat_without_a_tokenizer_or_template(chat_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
    bare = shutil.copytree(chat_model, tmp_path / "bare")
    (bare / "tokenizer.json").unlink()
    fails(["chat", "--model", str(bare)], capsys, "has no tokenizer.json", "cannot chat",
          "kestrel generate --prompt-ids")
    base = shutil.copytree(chat_model, tmp_path / "base")
    (base / "tokenizer_config.json").unlink()
    fails(["chat", "--model", str(base)], capsys, "has no chat template", "kestrel generate --prompt TEXT")
    fails(["chat", "--model", str(chat_model), "--prompt", "Hi"], capsys, "reads its messages from stdin")
    fails(["chat", "--model", str(chat_model), "--template-var", "nope"], capsys, "NAME=VALUE")


def test_a_template_that_raises_mid_chat_is_one_line(chat_model, tmp_path, monkeypatch, capsys):
    d = shutil.copytree(chat_model, tmp_path / "strict")
    (d / "chat_template.jinja").write_text("{% if messages|length > 1 %}{{ raise_exception('one message only') }}"
                                           "{% endif %}{{ messages[0].content }}")
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\nAgain\n"))
    err = fails(["chat", "--model", str(d), "--max-new-tokens", "2"], capsys, "refused the conversation (one message only)")
    assert "chat_template.jinja" in err


def test_template_vars_reach_the_template(chat_model, tmp_path, monkeypatch, capsys):
    d = shutil.copytree(chat_model, tmp_path / "vars")
    (d / "chat_template.jinja").write_text("{{ raise_exception('thinking=' ~ enable_thinking ~ ' n=' ~ n) }}")
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
    fails(["chat", "--model", str(d), "--template-var", "enable_thinking=false", "--template-var", "n=2"], capsys,
          "thinking=False n=2")
