"""kestrel chat against a hostile template, hostile text and hostile variables: bounded, one line, the right advice."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import pytest

from kestrel_core.formats import template_limits
from kestrel_core.formats.chat_template import ChatTemplate
from kestrel_core.errors import ConfigError
from cli_helpers import fails

QWEN = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def with_template(tiny_ckpt, tmp_path, template: str):
    d = shutil.copytree(tiny_ckpt, tmp_path / "chat")
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<|endoftext|>"}))
    return d


def chat_fails(monkeypatch, capsys, model_dir, stdin: str, *needles: str, flags=()) -> str:
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    return fails(["chat", "--model", str(model_dir), "--max-new-tokens", "2", *flags], capsys, *needles)


# --- templates that would run forever or build gigabytes -----------------------------------

BOUNDED = [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x", "rendering ran past"),
    ("{% for i in range(100000) %}{{ 'x' * 5000 }}{% endfor %}", "the rendered conversation would be"),
    ("{{ 'x' * 1000000000 }}", "a repeated string or list would be 1,000,000,000 characters"),
    ("{{ ['x'] * 1000000000 }}", "a repeated string or list"),
    ("{% set ns = namespace(s='xx') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
     "a joined string or list would be"),
    ("{{ 'x'|center(1000000000) }}", "a padded string"),
    ("{{ 'x'.ljust(1000000000) }}", "a padded string"),
    ("{{ 'x'.zfill(1000000000) }}", "a padded string"),
    ("{{ ('a' * 4000)|indent(1000000000) }}", "an indented string"),
    ("{% set s = 'a' * 100000 %}{{ s|replace('a', s) }}", "a replaced string"),
    ("{% set s = 'a' * 100000 %}{{ s.replace('a', s) }}", "a replaced string"),
    ("{{ range(100000)|join('y' * 1000) }}", "a joined string would be"),
    ("{{ ('y' * 1000).join(range(100000)|map('string')) }}", "a joined string would be"),
    ("{{ '%999999999s' % 'x' }}", "a format width or precision"),
    ("{{ '{:>999999999}'.format('x') }}", "a format width or precision"),
    ("{{ '%999999999s'|format('x') }}", "a format width or precision"),
    ("{{ messages|tojson(indent=1000000000) }}", "tojson indent"),
    ("{{ 10 ** 100000000 }}", "is too large a number"),
    ("{{ lipsum(1000000) }}", "lipsum would be"),
]


@pytest.mark.parametrize("template, needle", BOUNDED, ids=[t[:40] for t, _ in BOUNDED])
def test_a_template_is_bounded_in_time_and_size(template, needle, monkeypatch):
    """A template that renders 300 MB got kestrel OOM-killed after 94 s; a nested range(100000) loop never ended.
    The time case runs under a clock of a second and passes when that clock stopped it (the message says which bound
    did); a size case runs under a clock of ten minutes, so on a loaded machine the clock never fires before the size
    bound it tests."""
    timed = needle == "rendering ran past"
    monkeypatch.setattr(template_limits, "SECONDS", 1.0 if timed else 600.0)
    t = ChatTemplate(template, "tokenizer_config.json (chat_template)")
    with pytest.raises(ConfigError, match="the chat template went past a bound") as err:
        t.render([{"role": "user", "content": "hi"}])
    assert needle in str(err.value)  # the bound that stopped it: the clock (timed) or the size, not a crash


def test_a_template_that_recurses_without_end(monkeypatch):
    t = ChatTemplate("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "t")
    with pytest.raises(ConfigError, match="the chat template recursed without end"):
        t.render([{"role": "user", "content": "hi"}])


def test_ordinary_templates_still_render(monkeypatch):
    t = ChatTemplate(QWEN + "{{ 'ab' * 3 }}{{ ['x']|join(', ') }}{{ '%5s' % 'y' }}{{ 'z'.center(5) }}{{ 2 ** 10 }}"
                     "{{ 'a b'|replace(' ', '-') }}{{ messages|tojson(indent=2)|length > 0 }}", "t")
    out = t.render([{"role": "user", "content": "hi"}])
    assert out.endswith("<|im_start|>assistant\nababab" + "x" + "    y" + "  z  " + "1024" + "a-b" + "True")


def test_the_whole_chat_meets_the_bound_as_one_line(tiny_ckpt, tmp_path, monkeypatch, capsys):
    d = with_template(tiny_ckpt, tmp_path, "{% for i in range(100000) %}{{ 'x' * 5000 }}{% endfor %}")
    chat_fails(monkeypatch, capsys, d, "hi\n", "the chat template went past a bound", "replace it with the model's own")


# --- what a chat user is told ---------------------------------------------------------------

def test_a_template_that_renders_nothing_is_the_templates_fault(tiny_ckpt, tmp_path, monkeypatch, capsys):
    """It told a chat user to pass --prompt, which chat refuses."""
    d = with_template(tiny_ckpt, tmp_path, "{% if false %}{{ messages }}{% endif %}")
    err = chat_fails(monkeypatch, capsys, d, "hi\n", "the chat template rendered the conversation as nothing",
                     "fix the template")
    assert "--prompt" not in err


def test_a_message_longer_than_the_model_says_so_and_how_long_it_may_be(tiny_ckpt, tmp_path, monkeypatch, capsys):
    """It suggested /reset, which does not shorten a message."""
    d = with_template(tiny_ckpt, tmp_path, QWEN)  # tiny: 512 positions, a byte-level tokenizer
    frame = len("<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n".encode())
    err = chat_fails(monkeypatch, capsys, d, "x" * 600 + "\n", "this message alone is 600 tokens",
                     f"leave at most {512 - 1 - frame} for one message", "send a shorter message")
    assert "/reset" not in err


def test_a_conversation_that_fills_the_model_suggests_starting_over(tiny_ckpt, tmp_path, monkeypatch, capsys):
    d = with_template(tiny_ckpt, tmp_path, QWEN)
    chat_fails(monkeypatch, capsys, d, ("x" * 200 + "\n") * 3, "the conversation is over 511 tokens", "/reset",
               flags=["--max-new-tokens", "1"])


def test_a_template_that_alone_fills_the_model(tiny_ckpt, tmp_path, monkeypatch, capsys):
    d = with_template(tiny_ckpt, tmp_path, "{{ 'a' * 4000 }}" + QWEN)
    chat_fails(monkeypatch, capsys, d, "hi\n", "the chat template alone takes more than the model's 512 positions")


def test_a_huge_rendered_prompt_is_not_tokenized_whole(tiny_ckpt, tmp_path, monkeypatch, capsys):
    """Everything was tokenized before the length check: a 300 MB prompt ran out of memory in the tokenizer."""
    from kestrel_core.formats import tokenizer

    real, seen = tokenizer.HFTokenizer, []

    class Recording:  # the library's tokenizer, recording the length of each text it is given
        def __init__(self, tok):
            self.tok = tok

        def encode(self, text, **kwargs):
            seen.append(len(text))
            return self.tok.encode(text, **kwargs)

        def __getattr__(self, name):
            return getattr(self.tok, name)

    monkeypatch.setattr(tokenizer, "HFTokenizer", type("F", (), {"from_str": staticmethod(lambda s: Recording(real.from_str(s)))}))
    d = with_template(tiny_ckpt, tmp_path, "{{ 'x' * 10000000 }}" + QWEN)
    chat_fails(monkeypatch, capsys, d, "hi\n", "the chat template alone takes more than the model's 512 positions")
    assert seen and max(seen) < 10_000  # prefixes decided it; the 10-million-character prompt was never tokenized


# --- text that is not UTF-8 ----------------------------------------------------------------

def test_a_prompt_that_is_not_utf8(tiny_ckpt, capsys):
    """`--prompt $'caf\\xe9'` raised TypeError: TextInputSequence must be str, from tokenizers."""
    fails(["generate", "--model", str(tiny_ckpt), "--prompt", "caf\udce9", "--max-new-tokens", "1"], capsys,
          "the text is not valid UTF-8 (byte 0xe9 at character 3)", "iconv")


@pytest.mark.parametrize("io_encoding", ["utf-8:surrogateescape", "utf-8:strict"])
def test_a_chat_line_that_is_not_utf8(tiny_ckpt, tmp_path, io_encoding):
    """`printf 'caf\\xe9\\n' | kestrel chat` raised a TypeError (a C.UTF-8 locale) or UnicodeDecodeError (strict)."""
    d = with_template(tiny_ckpt, tmp_path, QWEN)
    proc = subprocess.run([sys.executable, "-m", "kestrel_core.cli", "chat", "--model", str(d), "--max-new-tokens", "1"],
                          input=b"caf\xe9\n", capture_output=True, timeout=120,
                          env={**os.environ, "PYTHONIOENCODING": io_encoding})
    err = proc.stderr.decode()
    assert proc.returncode == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "not valid UTF-8 (byte 0xe9" in err and "iconv" in err


def test_a_closed_stdin_is_one_line(tiny_ckpt, tmp_path):
    d = with_template(tiny_ckpt, tmp_path, QWEN)
    proc = subprocess.run([sys.executable, "-m", "kestrel_core.cli", "chat", "--model", str(d)], capture_output=False,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120,
                          preexec_fn=lambda: os.close(0))
    assert proc.returncode == 2
    assert proc.stderr.startswith("kestrel: error: standard input is closed") and proc.stderr.count("\n") == 1


# --- template variables ---------------------------------------------------------------------

@pytest.mark.parametrize("var", ["messages=[]", "add_generation_prompt=false", "self=1"])
def test_reserved_template_variables_are_refused(tiny_ckpt, tmp_path, monkeypatch, capsys, var):
    """They clashed with render()'s own arguments (a TypeError, or the conversation silently replaced)."""
    d = with_template(tiny_ckpt, tmp_path, QWEN)
    name = var.split("=")[0]
    chat_fails(monkeypatch, capsys, d, "hi\n", f"--template-var {name} is what kestrel chat passes the template itself",
               "pick another name", flags=["--template-var", var])


def test_a_template_variable_nested_too_deeply(tiny_ckpt, tmp_path, monkeypatch, capsys):
    d = with_template(tiny_ckpt, tmp_path, QWEN)
    chat_fails(monkeypatch, capsys, d, "hi\n", "the JSON value is nested too deeply",
               flags=["--template-var", "x=" + "[" * 100000 + "]" * 100000])


def test_a_template_variable_given_twice(tiny_ckpt, tmp_path, monkeypatch, capsys):
    """The first was silently replaced by the second."""
    d = with_template(tiny_ckpt, tmp_path, QWEN)
    chat_fails(monkeypatch, capsys, d, "hi\n", "--template-var x is given twice",
               flags=["--template-var", "x=1", "--template-var", "x=2"])


def test_a_piped_line_longer_than_any_prompt_is_not_read_whole(tiny_ckpt, tmp_path, monkeypatch, capsys):
    from kestrel_core.commands import chat as chat_command

    monkeypatch.setattr(chat_command, "MAX_LINE", 1000)
    d = with_template(tiny_ckpt, tmp_path, QWEN)
    chat_fails(monkeypatch, capsys, d, "x" * 5000 + "\n", "a message on stdin is over 1,000 characters")


def test_a_message_that_cannot_fit_is_refused_before_the_template_renders_it(tiny_ckpt, tmp_path, monkeypatch, capsys):
    d = with_template(tiny_ckpt, tmp_path, QWEN)
    rendered = []
    real = ChatTemplate.render
    monkeypatch.setattr(ChatTemplate, "render", lambda self, messages, *a, **k: (
        rendered.append(sum(len(m["content"]) for m in messages)), real(self, messages, *a, **k))[1])
    chat_fails(monkeypatch, capsys, d, "x" * 100_000 + "\n", "this message alone is over 2,048 tokens")
    assert max(rendered) < 100  # only the empty frame was rendered, to count the template's own tokens


def test_max_seq_bounds_the_conversation_and_is_checked(tiny_ckpt, tmp_path, monkeypatch, capsys):
    """chat takes --max-seq as generate and serve do: the conversation's context, fewer positions than the model's;
    past it the message is refused naming --max-seq, with the way to start over; a bound out of range is refused
    before a reply."""
    d = with_template(tiny_ckpt, tmp_path, QWEN)
    frame = len("<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n".encode())
    # the same three messages fit the model's 512 positions (a reply of one token each)
    monkeypatch.setattr("sys.stdin", io.StringIO(("x" * 20 + "\n") * 3))
    from kestrel_core.cli import main

    assert main(["chat", "--model", str(d), "--max-new-tokens", "1", "--json"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3
    # within --max-seq 128: the third message is past it
    chat_fails(monkeypatch, capsys, d, ("x" * 20 + "\n") * 3, "the conversation is over 127 tokens",
               "--max-seq gives 128 positions", "/reset", flags=["--max-new-tokens", "1", "--max-seq", "128"])
    err = chat_fails(monkeypatch, capsys, d, "x" * 100 + "\n", "this message alone is 100 tokens",
                     f"--max-seq's 96 positions leave at most {96 - 1 - frame}", flags=["--max-seq", "96"])
    assert "the model's" not in err
    chat_fails(monkeypatch, capsys, d, "hi\n", "--max-seq must be at least 2 positions, got 1", flags=["--max-seq", "1"])
    chat_fails(monkeypatch, capsys, d, "hi\n", "--max-seq 513 is past", "512 positions", flags=["--max-seq", "513"])
