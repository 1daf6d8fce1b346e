"""vLLM's ``/tokenize`` and ``/detokenize`` for kestrel serve: their request bodies (checked, every error naming the
field in OpenAI's shape) and their answers.

    POST /tokenize    {"model"?, "prompt": str, "add_special_tokens"?: bool}
                      {"model"?, "messages": [...], "add_generation_prompt"?: bool, "add_special_tokens"?: bool,
                       "chat_template_kwargs"?: {...}}
                      -> {"count", "max_model_len", "tokens": [ids]}
    POST /detokenize  {"model"?, "tokens": [ids]} -> {"prompt": str}

A prompt is tokenized as ``/v1/completions`` prefills it and messages as ``/v1/chat/completions`` does (the chat
template, then the tokenizer), so ``count`` is the ``usage.prompt_tokens`` those routes would answer. Unlike vLLM,
``add_special_tokens`` is false unless asked for, for a prompt too: kestrel prefills no token the tokenizer's
post-processor adds. The count is not bounded by the context (``max_model_len`` says what is).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from kestrel_core.engine.limits import LimitError, RequestLimits
from kestrel_core.errors import ConfigError
from kestrel_core.formats.chat_template import ChatTemplate
from kestrel_core.formats.tokenizer import Tokenizer
from kestrel_core.serve import protocol, prompts
from kestrel_core.serve.protocol import APIError, ChatRequest, Message, bad_request


class _Body(BaseModel):
    # strict: "true" is no bool and 1.0 no id; forbid: a misspelt field is an error, as on the /v1 routes
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None  # None: the served one

    def check(self) -> None:
        """Called by ``protocol.parse``; what the fields' types cannot say is checked in ``parse`` below."""


class TokenizeRequest(_Body):
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = False
    add_generation_prompt: bool | None = None  # messages only; left out: true, as vLLM
    chat_template_kwargs: dict[str, Any] | None = None  # messages only

    @property
    def chat(self) -> bool:
        return self.messages is not None

    def conversation(self) -> list[dict[str, str]]:
        """The messages as the chat route gives them to the template (its one rule for roles and parts)."""
        return ChatRequest.model_construct(messages=self.messages).conversation()


class DetokenizeRequest(_Body):
    tokens: list[int]


def parse(body: bytes, kind: type[_Body]) -> _Body:
    """The body as ``kind``, checked; else a 400 naming the field."""
    try:
        req = protocol.parse(body, kind)
    except APIError as exc:
        if exc.param == "prompt" and exc.code is None:  # protocol's wording lists the completions route's shapes
            raise bad_request("prompt must be a string (the text to tokenize)", "prompt") from None
        raise
    if isinstance(req, TokenizeRequest):
        if (req.prompt is None) == (req.messages is None):
            if req.prompt is None:
                raise bad_request("missing required parameter: prompt (a string) or messages (a conversation)",
                                  "prompt", "missing_parameter")
            raise bad_request("send prompt or messages, not both", "messages")
        if not req.chat:
            for name in ("add_generation_prompt", "chat_template_kwargs"):
                if getattr(req, name) is not None:
                    raise bad_request(f"{name} applies to messages, not to a prompt; leave it out", name)
        elif not req.messages:
            raise bad_request("messages is empty; send at least one message", "messages")
    return req


def tokenize(req: TokenizeRequest, tokenizer: Tokenizer, template: ChatTemplate | None, max_model_len: int) -> dict:
    """The ids of the prompt, or of the messages laid out by ``template`` (None: the model has no chat template, which
    the caller has refused already)."""
    if req.chat:
        add = True if req.add_generation_prompt is None else req.add_generation_prompt
        text, param = prompts.render_chat(template, req.conversation(), req.chat_template_kwargs, add), "messages"
    else:
        text, param = req.prompt, "prompt"
    try:
        ids = tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    except ConfigError as exc:  # text that is not UTF-8 (a lone surrogate from a \ud800 escape)
        raise bad_request(f"{param}: {exc}", param) from None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}


def detokenize(req: DetokenizeRequest, tokenizer: Tokenizer, vocab: int) -> dict:
    """The text of the ids, each in the model's vocabulary (0..vocab-1), special tokens included."""
    try:
        ids = RequestLimits(0, "this server", vocab).ids(req.tokens, "tokens")
    except LimitError as exc:
        raise bad_request(str(exc), exc.param) from None
    return {"prompt": tokenizer.decode(ids)}
