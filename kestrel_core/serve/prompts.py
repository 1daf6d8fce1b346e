"""A request's prompt as token ids, and how many tokens it may generate, within the server's context."""

from __future__ import annotations

from typing import Any

from kestrel_core.formats.chat_template import RESERVED, ChatTemplate
from kestrel_core.errors import ConfigError
from kestrel_core.engine.limits import RequestLimits
from kestrel_core.formats.tokenizer import Tokenizer
from kestrel_core.serve.protocol import bad_request


def completion_ids(tokenizer: Tokenizer, limits: RequestLimits, prompt: str | list) -> list[int]:
    """A completions ``prompt`` (text, token ids, or a list holding one of those) as ids."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # the one prompt of a list of prompts (more are refused when the body is checked)
    if isinstance(prompt, str):
        try:
            ids = tokenizer.encode_at_most(prompt, limits.context)  # a prompt far past the context: not whole
        except ConfigError as exc:  # text that is not UTF-8 (lone surrogates from a \ud800 escape)
            raise bad_request(f"prompt: {exc}", "prompt") from None
        if ids is None:
            raise limits.too_long(None, "prompt")
    else:
        ids = limits.ids(prompt, "prompt")
    if not ids:
        raise bad_request("the prompt is empty; send some text or token ids", "prompt")
    return ids


def chat_ids(tokenizer: Tokenizer, template: ChatTemplate, conversation: list[dict], variables: dict[str, Any] | None,
             limits: RequestLimits, tools: list[dict] | None = None) -> list[int]:
    """The conversation rendered through the model's chat template, ready for the assistant's reply, as ids; ``tools``:
    the functions the reply may call, as the template lays them out."""
    text = render_chat(template, conversation, variables, tools=tools)
    if tools is not None and text == render_chat(template, conversation, variables):
        # The model would never see them: a reply could call none of them, and nothing said why
        raise bad_request(f"tools: this model's chat template ({template.where}) does not lay out tools, so the "
                          "model would never see them; leave tools out, or serve the model with a template that "
                          "renders its tools variable", "tools")
    try:
        ids = tokenizer.encode_at_most(text, limits.context)
    except ConfigError as exc:  # text that is not UTF-8
        raise bad_request(f"messages: {exc}", "messages") from None
    if ids is None:
        raise limits.too_long(None, "messages")
    if not ids:
        raise bad_request("the chat template rendered the conversation as nothing; send some messages", "messages")
    return ids


def render_chat(template: ChatTemplate, conversation: list[dict], variables: dict[str, Any] | None,
                add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
    """The conversation as the chat template lays it out (``add_generation_prompt``: ready for the assistant's reply),
    with the request's ``chat_template_kwargs``; a 400 where the template or a variable refuses it."""
    variables = dict(variables or {})
    for name in variables:
        if not name.isidentifier() or name in RESERVED or name == "tools":
            raise bad_request(f"chat_template_kwargs: {name!r} cannot be a template variable ({', '.join(RESERVED)} and "
                              "tools are the server's; names are identifiers)", "chat_template_kwargs")
    if tools is not None:
        variables["tools"] = tools
    try:
        return template.render(conversation, add_generation_prompt=add_generation_prompt, **variables)
    except ConfigError as exc:  # the template refused the conversation, or went past a bound
        raise bad_request(f"messages: {exc}", "messages") from None
