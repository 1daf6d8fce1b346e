"""A model directory's chat template, rendered with jinja2 in a sandbox as Hugging Face transformers renders it.

The template comes from ``chat_template.jinja`` where the directory has one (transformers writes it
there since 4.43, and it wins), else from ``tokenizer_config.json``'s ``chat_template``: a string, or a
list of ``{"name", "template"}`` of which the one named ``default`` is taken. Rendering follows
transformers' ``render_jinja_template``: an ``ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True)`` with loop controls and ``{% generation %}`` blocks, the ``raise_exception`` and
``strftime_now`` globals, a ``tojson`` filter that leaves non-ASCII and HTML characters alone, and
``messages``, ``tools=None``, ``documents=None``, ``add_generation_prompt`` and the special tokens
(``bos_token``, ``eos_token``, ...) as strings. A template is code that comes with a download: its time,
output and the strings it builds are bounded (``template_limits``).
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import SecurityError

from kestrel_core.formats import template_limits
from kestrel_core.errors import ConfigError
from kestrel_core.formats.modelconfig import read_json
from kestrel_core.io.readfile import read_bounded
from kestrel_core.formats.template_limits import BoundedSandbox, TemplateLimit

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_LIMIT = 4 * 2**20  # real templates are a few KiB
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with."""

    def __init__(self, source: str, where: str, special: dict[str, Any] | None = None):
        self.source, self.where = source, where
        self.special = dict(special or {})  # bos_token, eos_token, ... as strings
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(f"{where}: the chat template does not parse ({_one_line(exc.message)}, template line "
                              f"{exc.lineno}); fix the template or take the model's own from its Hugging Face repo") from None

    @property
    def eos_token(self) -> str | None:
        return self.special.get("eos_token")

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True, **variables: Any) -> str:
        """The conversation as the model's prompt text; ``variables`` are the template's own (``enable_thinking``).
        Bounded in time and size (``template_limits``)."""
        context = {"tools": None, "documents": None, **self.special, **variables,
                   "messages": messages, "add_generation_prompt": add_generation_prompt}
        try:
            return template_limits.render(self._template, context)
        except TemplateLimit as exc:
            raise ConfigError(f"{self.where}: the chat template went past a bound ({_one_line(exc.message)}); "
                              "replace it with the model's own template") from None
        except RecursionError:
            raise ConfigError(f"{self.where}: the chat template recursed without end; "
                              "replace it with the model's own template") from None
        except TemplateRaised as exc:
            raise ConfigError(f"{self.where}: the chat template refused the conversation ({_one_line(exc.message)}); "
                              "change the conversation (its roles and their order) or the template") from None
        except SecurityError as exc:
            raise ConfigError(f"{self.where}: the chat template did what the sandbox forbids ({_one_line(exc.message)}); "
                              "replace it with the model's own template") from None
        except Exception as exc:  # an undefined name, or the template's own arithmetic or string handling
            raise ConfigError(f"{self.where}: the chat template failed ({type(exc).__name__}: {_one_line(str(exc))}); "
                              "fix the template, or change the conversation") from None


# What render() passes the template itself, and jinja's name for the template: no template variable may take them.
RESERVED = ("messages", "add_generation_prompt", "self")


def end_ids(model, template: ChatTemplate) -> frozenset[int]:
    """The ids that end a reply of ``model`` (a loaded ``engine.Model``): eos_token_id in config.json and
    generation_config.json, and the template's eos_token (Qwen3's <|im_end|>, say); a model that names none cannot
    end a turn."""
    ids = set(model.eos_ids)
    if template.eos_token:
        token = model.tokenizer.token_to_id(template.eos_token)
        if token is not None:
            ids.add(token)
    if not ids:
        raise ConfigError(f"{model.dir} names no end-of-sequence token (eos_token_id in config.json or "
                          "generation_config.json, eos_token in tokenizer_config.json), so a reply could not end; add one")
    return frozenset(ids)


def load_chat_template(model_dir: str | Path) -> ChatTemplate:
    """The directory's chat template; a directory without one is a ConfigError that says what to do instead."""
    d = Path(model_dir)
    config_path = d / TOKENIZER_CONFIG
    config = read_json(config_path) if os.path.lexists(config_path) else {}  # there but unreadable: an error
    if not isinstance(config, dict):
        raise ConfigError(f"{config_path}: must hold a JSON object, got {type(config).__name__}")
    special = {key: tok for key in SPECIAL_TOKENS if (tok := _token_text(config.get(key), config_path, key)) is not None}
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list):
        special["additional_special_tokens"] = [_token_text(t, config_path, "additional_special_tokens") for t in extra]
    file = d / TEMPLATE_FILE
    if os.path.lexists(file):
        try:
            text = read_bounded(file, TEMPLATE_LIMIT, str(file), "a chat template is a few KiB: take the model's own")
            return ChatTemplate(text.decode("utf-8"), str(file), special)
        except UnicodeDecodeError:
            raise ConfigError(f"{file}: not UTF-8 text; re-download the model's chat template") from None
    raw = config.get("chat_template")
    if raw is None:
        raise ConfigError(f"{d} has no chat template (no {TEMPLATE_FILE}, and no chat_template in {TOKENIZER_CONFIG}), "
                          "so kestrel cannot lay out a conversation for it: a base model may have none; use "
                          "`kestrel generate --prompt TEXT` for plain continuation, or add the chat model's "
                          f"chat_template to {TOKENIZER_CONFIG}")
    return ChatTemplate(_pick(raw, config_path), f"{config_path} (chat_template)", special)


def _pick(raw: Any, where: Path) -> str:
    """The template text: a string as it is, or the ``default`` of a list of named templates."""
    if isinstance(raw, str):
        return raw
    named = {}
    if isinstance(raw, list):
        for entry in raw:
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("template"), str)):
                named = None
                break
            named[entry["name"]] = entry["template"]
    if not named:
        raise ConfigError(f"{where}: chat_template must be a string or a list of {{\"name\": ..., \"template\": ...}} "
                          f"objects, got {json.dumps(raw)[:80]}; fix tokenizer_config.json")
    if "default" not in named:
        raise ConfigError(f"{where}: chat_template holds templates named {', '.join(named)} but none named 'default' "
                          f"for a plain chat; rename the chat one to 'default', or put it in {TEMPLATE_FILE}")
    return named["default"]


def _token_text(value: Any, where: Path, key: str) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, an AddedToken object, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ConfigError(f"{where}: {key} must be a string or an object with a \"content\" string, got {json.dumps(value)[:80]}")


# --- the environment: transformers' --------------------------------------------------------

class TemplateRaised(jinja2.TemplateError):
    """What a template's ``raise_exception(message)`` raises (a TemplateError, as in transformers)."""


def _raise_exception(message: str):
    raise TemplateRaised(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja2's own tojson escapes <, >, & and ' for HTML, which a prompt must not see
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _tojson_indent(value, ensure_ascii=False, indent=None, *args, **kwargs) -> None:
    if isinstance(indent, int) and indent > 64:  # a huge indent is a huge string at once
        raise TemplateLimit(f"tojson indent {indent} is over 64")


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's tokens with it (for training
    masks); rendering a prompt only needs its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def _environment() -> BoundedSandbox:
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, "jinja2.ext.loopcontrols"])
    env.set_filter("tojson", _tojson, _tojson_indent)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _one_line(text: str) -> str:
    return " ".join(str(text).split())
