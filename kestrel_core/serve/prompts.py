"""A request's prompt as token ids, and how many tokens it may generate, within the server's context."""

from __future__ import annotations

from typing import Any

from ..chat_template import RESERVED, ChatTemplate
from ..errors import ConfigError
from ..tokenizer import Tokenizer
from .protocol import bad_request


def _too_long(max_seq: int, prompt: int | None, param: str, asked: int | None = None):
    size = f"{prompt:,}" if prompt is not None else f"over {max_seq:,}"
    wanted = f" and {asked:,} to generate (max_tokens)" if asked is not None else ", leaving no room to generate"
    fix = "shorten the prompt" + (" or lower max_tokens" if asked is not None else "")
    return bad_request(f"this server's context is {max_seq:,} tokens; the prompt takes {size}{wanted}; {fix}", param,
                       "context_length_exceeded")


def completion_ids(tokenizer: Tokenizer, vocab: int, prompt: str | list, max_seq: int) -> list[int]:
    """A completions ``prompt`` (text, token ids, or a list holding one of those) as ids."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # the one prompt of a list of prompts (more are refused when the body is checked)
    if isinstance(prompt, str):
        try:
            ids = tokenizer.encode_at_most(prompt, max_seq)  # a prompt far past the context is not tokenized whole
        except ConfigError as exc:  # text that is not UTF-8 (lone surrogates from a \ud800 escape)
            raise bad_request(f"prompt: {exc}", "prompt") from None
        if ids is None:
            raise _too_long(max_seq, None, "prompt")
    else:
        ids = list(prompt)
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise bad_request(f"prompt: token id {bad} is outside the vocabulary (0..{vocab - 1})", "prompt")
    if not ids:
        raise bad_request("the prompt is empty; send some text or token ids", "prompt")
    return ids


def chat_ids(tokenizer: Tokenizer, template: ChatTemplate, conversation: list[dict], variables: dict[str, Any] | None,
             max_seq: int) -> list[int]:
    """The conversation rendered through the model's chat template, ready for the assistant's reply, as ids."""
    variables = dict(variables or {})
    for name in variables:
        if not name.isidentifier() or name in RESERVED:
            raise bad_request(f"chat_template_kwargs: {name!r} cannot be a template variable ({', '.join(RESERVED)} "
                              "are the server's; names are identifiers)", "chat_template_kwargs")
    try:
        text = template.render(conversation, add_generation_prompt=True, **variables)
        ids = tokenizer.encode_at_most(text, max_seq)
    except ConfigError as exc:  # the template refused the conversation, or went past a bound
        raise bad_request(f"messages: {exc}", "messages") from None
    if ids is None:
        raise _too_long(max_seq, None, "messages")
    if not ids:
        raise bad_request("the chat template rendered the conversation as nothing; send some messages", "messages")
    return ids


def stop_ids(ids: list[int] | None, vocab: int) -> list[int]:
    bad = next((i for i in ids or () if not 0 <= i < vocab), None)
    if bad is not None:
        raise bad_request(f"stop_token_ids: {bad} is outside the vocabulary (0..{vocab - 1})", "stop_token_ids")
    return list(ids or ())


def token_budget(asked: int | None, default: int | None, prompt: int, max_seq: int, limit: int, param: str) -> int:
    """The tokens a request generates: ``asked`` (max_tokens) if it fits, else a 400; unasked, ``default`` (None: as
    many as the context leaves), within ``limit`` and the context."""
    room = max_seq - prompt
    if room < 1:
        raise _too_long(max_seq, prompt, param)
    if asked is None:
        return min(default or limit, limit, room)
    if asked > limit:
        raise bad_request(f"max_tokens is {asked:,}; this server generates at most {limit:,} tokens a request",
                          "max_tokens")
    if asked > room:
        raise _too_long(max_seq, prompt, param, asked)
    return asked
