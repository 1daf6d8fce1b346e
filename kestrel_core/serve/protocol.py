"""OpenAI's shapes for kestrel serve: the request bodies it takes (checked, every error naming the parameter as OpenAI
does), the JSON it answers, and the error object.

Beyond OpenAI's parameters, a request may carry vLLM's extensions ``top_k``, ``repetition_penalty``, ``stop_token_ids``,
``ignore_eos``, ``return_token_ids`` and (chat) ``chat_template_kwargs``. Parameters kestrel does not implement
(``best_of`` above 1, ``suffix``) are refused with a 400 that says so, never ignored.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kestrel_core.config import parse_logit_bias
from kestrel_core.engine.sampling import MAX_TOP_LOGPROBS  # chat's top_logprobs, as OpenAI bounds it
from kestrel_core.errors import ConfigError
from kestrel_core.io.json_keys import TOO_MANY_DIGITS, RepeatedKey, past_int_limit, unique_keys

MAX_TOOLS = 128  # functions a request may offer
MAX_STOP = 16  # stop strings a request may give (OpenAI allows 4)
MAX_STOP_CHARS = 256  # characters of one stop string: the text held back per token is checked against each
MAX_STOP_IDS = 256
SEED_RANGE = 2**64  # the sampler's generator takes 0..2**64-1
MAX_N = 8  # choices a request may ask for: each is a sequence of the batch
MAX_COMPLETION_LOGPROBS = 5  # the completions API's logprobs (OpenAI's bound)
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # response_format.json_schema.name, as OpenAI bounds it


class APIError(Exception):
    """An answer other than 200, in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# --- requests -------------------------------------------------------------------------------------------

class _Strict(BaseModel):
    # strict: 1.0 is no max_tokens and "true" no bool; forbid: a misspelt parameter is an error, as with OpenAI
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchema(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class _Sampling(_Strict):
    """What completions and chat share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None  # OpenAI's abuse-monitoring tag: taken, not used

    def check(self) -> None:
        """Values in range, and refusals for what kestrel does not do."""
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise bad_request(f"n must be in 1..{MAX_N} (the choices, each a sequence of the batch), got {self.n}", "n")
        if self.max_tokens is not None and self.max_tokens < 1 and not self.scores_only:
            raise bad_request(f"max_tokens must be at least 1 (0 only with a completion's echo, which scores the prompt "
                              f"alone), got {self.max_tokens}", "max_tokens")
        if self.temperature is not None and not 0 <= self.temperature <= 2:
            raise bad_request(f"temperature must be in 0..2, got {self.temperature}", "temperature")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise bad_request(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k is not None and self.top_k < -1:
            raise bad_request(f"top_k must be -1 or 0 (no cut) or a positive count, got {self.top_k}", "top_k")
        if self.seed is not None and not 0 <= self.seed < SEED_RANGE:
            raise bad_request(f"seed must be in 0..2**64-1, got {self.seed}", "seed")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and not -2 <= value <= 2:
                raise bad_request(f"{name} must be in -2..2, got {value}", name)
        if self.repetition_penalty is not None and not 0 < self.repetition_penalty <= 10:
            raise bad_request(f"repetition_penalty must be in (0, 10] (1: off), got {self.repetition_penalty}",
                              "repetition_penalty")
        if self.logit_bias:
            try:
                parse_logit_bias(self.logit_bias)
            except ConfigError as exc:
                raise bad_request(str(exc), "logit_bias") from None
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        stops = self.stop_strings
        if len(stops) > MAX_STOP:
            raise bad_request(f"stop holds {len(stops)} strings; at most {MAX_STOP}", "stop")
        for s in stops:
            if not s or len(s) > MAX_STOP_CHARS:
                raise bad_request(f"each stop string must be 1..{MAX_STOP_CHARS} characters, got {len(s)}", "stop")
        if len(self.stop_token_ids or ()) > MAX_STOP_IDS:
            raise bad_request(f"stop_token_ids holds {len(self.stop_token_ids)} ids; at most {MAX_STOP_IDS}",
                              "stop_token_ids")
        self._check_format()

    def _check_format(self) -> None:
        fmt = self.response_format
        if fmt is None:
            return
        if (fmt.type == "json_schema") != (fmt.json_schema is not None):
            raise bad_request("response_format: json_schema ({\"name\", \"schema\"}) goes with type "
                              "\"json_schema\" and only with it", "response_format.json_schema")
        if fmt.json_schema is not None and not _SCHEMA_NAME.fullmatch(fmt.json_schema.name):
            raise bad_request("response_format.json_schema.name must be 1..64 letters, digits, _ or -",
                              "response_format.json_schema.name")
        if fmt.type != "text" and self.ignore_eos:
            raise bad_request("response_format ends the reply once its JSON value is whole, at an end-of-sequence "
                              "token; leave out ignore_eos", "ignore_eos")

    @property
    def output_schema(self) -> dict[str, Any] | None:
        """The JSON schema the output is held to (``{}``: any JSON value), or None: free text."""
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "object"}
        return fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {}

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def choices(self) -> int:
        return self.n or 1

    @property
    def top_count(self) -> int | None:
        """The alternatives each token's log-probabilities list, where the request asks for log-probabilities."""
        return None

    @property
    def scores_only(self) -> bool:
        """The request asks for its prompt back and nothing generated (a completion's echo with max_tokens 0): the
        prompt's log-probabilities, as evaluation harnesses score text."""
        return False

    def generation(self) -> dict[str, Any]:
        """The kestrel [generation] keys the request sets (the rest are the server's defaults; what ends it, the
        service's)."""
        out: dict[str, Any] = {}
        if self.temperature is not None:
            out["temperature"] = self.temperature
        if self.top_p is not None:
            out["top_p"] = self.top_p
        if self.top_k is not None:
            out["top_k"] = max(self.top_k, 0)  # vLLM's -1 is kestrel's 0: no cut
        if self.seed is not None:
            out["seed"] = self.seed
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.logit_bias:
            out["logit_bias"] = self.logit_bias
        return out


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        super().check()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise bad_request(f"logprobs must be in 0..{MAX_COMPLETION_LOGPROBS} (the alternatives listed beside each "
                              f"token), got {self.logprobs}", "logprobs")
        if self.best_of not in (None, 1):
            raise bad_request(f"best_of={self.best_of}: kestrel serve generates one sequence a request", "best_of")
        if self.suffix:
            raise bad_request("suffix (insertion) is not supported by kestrel serve; leave it out", "suffix")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            if len(self.prompt) != 1:
                raise bad_request(f"prompt holds {len(self.prompt)} prompts; kestrel serve takes one a request "
                                  "(a string, or a list of token ids)", "prompt")

    @property
    def top_count(self) -> int | None:
        return self.logprobs

    @property
    def scores_only(self) -> bool:
        return bool(self.echo) and self.max_tokens == 0


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class Function(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: Function


class ChosenFunction(_Strict):
    name: str


class ToolChoice(_Strict):
    type: Literal["function"]
    function: ChosenFunction


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(_Sampling):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: one call at most

    def check(self) -> None:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise bad_request("max_tokens and max_completion_tokens differ; send one", "max_completion_tokens")
            self.max_tokens = self.max_completion_tokens
        super().check()
        if not self.messages:
            raise bad_request("messages is empty; send at least one message", "messages")
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise bad_request(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.top_logprobs}",
                                  "top_logprobs")
            if not self.logprobs:
                raise bad_request("top_logprobs needs logprobs: true; send both, or leave top_logprobs out",
                                  "top_logprobs")
        choice = self.tool_choice
        if isinstance(choice, dict):
            try:
                named = ToolChoice.model_validate(choice).function.name
            except ValidationError:
                raise bad_request('tool_choice must be "auto", "none", "required" or {"type": "function", '
                                  '"function": {"name": NAME}}', "tool_choice") from None
            if named not in {t.function.name for t in self.tools or ()}:
                raise bad_request(f"tool_choice names the function {named!r}, which tools does not hold",
                                  "tool_choice")
        elif choice not in (None, "auto", "none", "required"):
            raise bad_request(f'tool_choice must be "auto", "none", "required" or a function, got {choice!r}',
                              "tool_choice")
        if choice not in (None, "none") and not self.tools:
            raise bad_request(f"tool_choice {json.dumps(choice)} needs tools; send tools, or leave tool_choice out",
                              "tool_choice")
        if self.parallel_tool_calls is not None and not self.tools:  # as OpenAI refuses it
            raise bad_request("parallel_tool_calls is only allowed with tools; send tools, or leave "
                              "parallel_tool_calls out", "parallel_tool_calls")
        if self.forces_call and self.response_format is not None and self.response_format.type != "text":
            raise bad_request("a tool_choice that forces a call and a JSON response_format each hold the reply to "
                              "a form; send one", "response_format")
        if self.tools is not None and len(self.tools) > MAX_TOOLS:
            raise bad_request(f"tools holds {len(self.tools)} functions; at most {MAX_TOOLS}", "tools")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) < len(names) or not all(names):
            raise bad_request("each tool needs a name of its own", "tools")
        for i, m in enumerate(self.messages):
            if m.role == "tool" and not m.tool_call_id:
                raise bad_request("a tool message needs the tool_call_id of the call it answers",
                                  f"messages.{i}.tool_call_id")
            if m.tool_calls and m.role != "assistant":
                raise bad_request("only an assistant message carries tool_calls", f"messages.{i}.tool_calls")

    @property
    def top_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def forces_call(self) -> bool:
        """Whether tool_choice forces a call: "required" (of any tool) or a named function."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, dict)

    @property
    def call_limit(self) -> int | None:
        """The tool calls a reply may hold: 1 with ``parallel_tool_calls: false``, else None (any number)."""
        return 1 if self.parallel_tool_calls is False else None

    @property
    def called_function(self) -> str | None:
        """The function tool_choice names, where it names one."""
        return self.tool_choice["function"]["name"] if isinstance(self.tool_choice, dict) else None

    @property
    def tool_defs(self) -> list[dict] | None:
        """The tools as a chat template takes them (OpenAI's shape), or None: none given, or tool_choice 'none'."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as a chat template takes them (OpenAI's developer role is the templates' system; an assistant's
        earlier calls with their arguments as objects, as the Hugging Face templates read them)."""
        out = []
        for m in self.messages:
            msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_calls:
                msg["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                     for c in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            out.append(msg)
        return out


def _arguments(text: str):
    """A call's arguments as an object where they are JSON of one (what templates render), else the text as sent."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


# Parameters whose error would otherwise list every branch of their union.
_SHAPES = {"prompt": "a string, a list of token ids, or a list of one of those",
           "stop": "a string or a list of strings", "messages": "a list of {\"role\", \"content\"} objects",
           "content": "a string or a list of {\"type\": \"text\", \"text\"} parts"}


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def parse(body: bytes, kind: type[_Sampling]) -> _Sampling:
    """The request ``body`` as ``kind``, checked; else a 400 naming the parameter."""
    try:
        data = json.loads(body, parse_constant=_reject_constant,  # NaN and Infinity are Python's, not JSON's
                          object_pairs_hook=unique_keys)
    except RecursionError:
        raise bad_request("the body is nested too deeply") from None
    except RepeatedKey as exc:
        raise bad_request(f"the key {exc.args[0]!r} appears twice in one object; send it once", exc.args[0]) from None
    except (ValueError, UnicodeDecodeError) as exc:
        why = TOO_MANY_DIGITS if past_int_limit(exc) else exc  # Python's own message tells a client of sys
        raise bad_request(f"the body is not valid JSON ({why})") from None
    if not isinstance(data, dict):
        raise bad_request(f"the body must be a JSON object, got {type(data).__name__}")
    try:
        req = kind.model_validate(data)
    except ValidationError as exc:
        raise _one_line(exc) from None
    except RecursionError:
        raise bad_request("the body is nested too deeply") from None
    req.check()
    return req


def _one_line(exc: ValidationError) -> APIError:
    err = exc.errors(include_url=False)[0]
    loc = [str(x) for x in err["loc"]]
    # a union's error names the branch it tried (prompt.str, prompt.list[int]): the path to the parameter stops there
    path = [x for x in loc if x.isdigit() or (x.isidentifier() and x not in _TYPE_NAMES)]
    param = ".".join(path) or None
    if err["type"] == "extra_forbidden":
        return bad_request(f"unrecognized request argument supplied: {param}", param, "unknown_parameter")
    if err["type"] == "missing":
        return bad_request(f"missing required parameter: {param}", param, "missing_parameter")
    last = next((x for x in reversed(path) if not x.isdigit()), None)
    if last in _SHAPES:
        return bad_request(f"{param} must be {_SHAPES[last]}", param)
    got = json.dumps(err.get("input"), default=str)
    return bad_request(f"{param}: {err['msg'].lower()}, got {got[:80]}", param)


# --- answers -------------------------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice(index: int, key: str, value, finish_reason: str | None, token_ids: list[int] | None = None,
           prompt_ids: list[int] | None = None, logprobs: dict | None = None) -> dict:
    """One choice of an answer or a chunk: its ``key`` (text, message or delta), its logprobs and the ids where asked
    for."""
    out = {"index": index, key: value, "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        out["token_ids"] = token_ids
    if prompt_ids is not None:
        out["prompt_token_ids"] = prompt_ids
    return out


def message(text: str | None, tool_calls: list[dict] | None = None) -> dict:
    out = {"role": "assistant", "content": text}
    if tool_calls:
        out["tool_calls"] = tool_calls
    return out


def _answer(obj: str, id: str, created: int, model: str, choices: list[dict], **usage) -> dict:
    return {"id": id, "object": obj, "created": created, "model": model, "choices": choices, **usage}


def completion(id: str, created: int, model: str, choices: list[dict], use: dict) -> dict:
    """A whole completion: its ``choices`` (``choice(i, "text", ...)``) and the usage of all of them."""
    return _answer("text_completion", id, created, model, choices, usage=use)


def completion_chunk(id: str, created: int, model: str, one: dict, usage_field: bool = False) -> dict:
    """One chunk of a completions stream, of ``one`` choice; ``usage_field``: the request asked for usage, so every
    chunk has it (null)."""
    return _answer("text_completion", id, created, model, [one], **({"usage": None} if usage_field else {}))


def chat(id: str, created: int, model: str, choices: list[dict], use: dict) -> dict:
    """A whole chat answer: its ``choices`` (``choice(i, "message", message(text), ...)``) and their usage."""
    return _answer("chat.completion", id, created, model, choices, usage=use)


def chat_chunk(id: str, created: int, model: str, one: dict, usage_field: bool = False) -> dict:
    """One chunk of a chat stream, of ``one`` choice (``choice(i, "delta", ...)``); ``usage_field``: the request asked
    for usage, so every chunk has it (null)."""
    return _answer("chat.completion.chunk", id, created, model, [one], **({"usage": None} if usage_field else {}))


def usage_chunk(id: str, created: int, model: str, obj: str, use: dict) -> dict:
    """The last chunk of a stream that asked for usage: no choices, the usage of the whole request."""
    return {"id": id, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


def models(name: str, created: int) -> dict:
    return {"object": "list", "data": [model_card(name, created)]}


def model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "kestrel"}
