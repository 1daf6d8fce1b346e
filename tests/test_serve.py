"""kestrel serve: a real server process on loopback (the tiny preset, cpu_ref), driven by the official openai client.

cpu_ref computes a batch's rows one at a time, so a sequence's greedy ids in the server's batch are its solo ids
exactly; the ids come back through the ``return_token_ids`` extension.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from bench.serve_process import ServeProcess
from serve_helpers import assert_openai_error, chat_model
from kestrel_core import cli
from kestrel_core.formats.chat_template import end_ids, load_chat_template
from kestrel_core.engine.run import load

KEY = "test-key-123"
POSITIONS = 4096  # the tiny preset's 512, raised: room for a generation long enough to interrupt
LONG = 3000  # tokens: seconds of work, far longer than any step of a test that cuts it


@pytest.fixture(scope="module")
def model_dir(tiny_ckpt, tmp_path_factory) -> Path:
    """The tiny preset with a chat template (its <|endoftext|> ends a turn) and 4096 positions."""
    return chat_model(tiny_ckpt, tmp_path_factory.mktemp("serve") / "tiny", POSITIONS)


class Server(ServeProcess):
    """``kestrel serve`` on cpu_ref in a subprocess on a free loopback port, with the clients the tests use."""

    def __init__(self, model: Path, *flags: str, env: dict | None = None):
        super().__init__(model, "--backend", "cpu_ref", *flags, env=env)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def stop(self) -> None:
        super().stop(30)


@pytest.fixture(scope="module")
def server(model_dir):
    """max_batch 8 (so 16 streams queue), a 512-token context, a 64 KiB body limit, the key from the environment."""
    s = Server(model_dir, "--max-seq", "512", "--max-body-mb", "0.0625", "--max-tokens-limit", "256",
               env={"KESTREL_API_KEY": KEY})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def single(model_dir):
    """One slot and no queue: a second request while one runs is refused."""
    s = Server(model_dir, "--max-batch", "1", "--max-queue", "0", "--max-tokens-limit", str(LONG))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def solo_server(model_dir):
    """The defaults: keyless, on loopback."""
    s = Server(model_dir)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def solo(model_dir):
    """``solo(prompt_ids, n, **kw)``: the greedy ids of one sequence alone, by run.generate in this process."""
    with load(model_dir) as model, model.open(backend="cpu_ref") as run:
        yield lambda ids, n, **kw: run.generate(prompt_ids=list(ids), max_new_tokens=n, **kw).token_ids


def prompt_of(i: int) -> list[int]:
    return [(7 * i + k * 13) % 250 + 1 for k in range(3 + i % 5)]


def text_of(model_dir: Path, ids: list[int]) -> str:
    with load(model_dir) as model:
        return model.tokenizer.decode([t for t in ids if t not in model.eos_ids])


def ids_of(chunks) -> list[int]:
    """The ids a stream's chunks carried (``return_token_ids``; the last chunk has none)."""
    return sum((getattr(c.choices[0], "token_ids", None) or [] for c in chunks if c.choices), [])


# --- completions and chat ---------------------------------------------------------------------------------

def test_a_completion_is_its_solo_greedy_run(server, solo, model_dir):
    prompt = prompt_of(1)
    want = solo(prompt, 12)
    got = server.client(KEY).completions.create(model=server.name, prompt=prompt, max_tokens=12,
                                                extra_body={"return_token_ids": True})
    choice = got.choices[0]
    assert choice.token_ids == want and choice.prompt_token_ids == prompt
    assert choice.text == text_of(model_dir, want)
    assert choice.finish_reason == ("stop" if len(want) < 12 else "length")
    assert (got.usage.prompt_tokens, got.usage.completion_tokens, got.usage.total_tokens) == \
        (len(prompt), len(want), len(prompt) + len(want))
    assert got.object == "text_completion" and got.id.startswith("cmpl-") and got.model == server.name


def test_a_streamed_completion_joins_to_the_whole_one(server, solo, model_dir):
    prompt = prompt_of(2)
    want = solo(prompt, 20)
    chunks = list(server.client(KEY).completions.create(
        model=server.name, prompt=prompt, max_tokens=20, stream=True, stream_options={"include_usage": True},
        extra_body={"return_token_ids": True}))
    *pieces, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == len(want)  # the usage chunk, as asked
    assert [c.choices[0].finish_reason for c in pieces][-1] in ("stop", "length")
    assert all(c.choices[0].finish_reason is None for c in pieces[:-1])
    assert ids_of(pieces) == want
    assert "".join(c.choices[0].text for c in pieces) == text_of(model_dir, want)
    assert len(pieces) > 2  # streamed as it came, not in one piece
    # Asking for ids streams each as it comes, its text empty while the text holds it back.
    assert [len(c.choices[0].token_ids or []) for c in pieces[:-1]] == [1] * len(want)


def test_a_text_prompt_goes_through_the_tokenizer(server, solo, model_dir):
    with load(model_dir) as model:
        ids = model.tokenizer.encode("The capital of France is")
    got = server.client(KEY).completions.create(model=server.name, prompt="The capital of France is", max_tokens=6,
                                                extra_body={"return_token_ids": True})
    assert got.choices[0].prompt_token_ids == ids and got.choices[0].token_ids == solo(ids, 6)


def chat_prompt(model_dir: Path, messages: list[dict]) -> tuple[list[int], frozenset[int]]:
    with load(model_dir) as model:
        template = load_chat_template(model_dir)
        return model.tokenizer.encode(template.render(messages)), end_ids(model, template)


def test_chat_whole_and_streamed_is_the_rendered_conversations_solo_run(server, solo, model_dir):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    prompt, ends = chat_prompt(model_dir, messages)
    want = solo(prompt, 16, stop_ids=ends)
    client = server.client(KEY)
    whole = client.chat.completions.create(model=server.name, messages=messages, max_tokens=16,
                                           extra_body={"return_token_ids": True})
    choice = whole.choices[0]
    assert choice.token_ids == want and choice.prompt_token_ids == prompt
    assert choice.message.role == "assistant" and choice.message.content == text_of(model_dir, want)
    assert whole.usage.prompt_tokens == len(prompt) and whole.object == "chat.completion"
    chunks = list(client.chat.completions.create(model=server.name, messages=messages, max_tokens=16, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_a_chat_reply_without_max_tokens_runs_to_the_context(server, model_dir):
    got = server.client(KEY).chat.completions.create(model=server.name, messages=[{"role": "user", "content": "hi"}],
                                                     extra_body={"ignore_eos": True})
    # a 512-token context and a 256-token limit: the limit binds
    assert got.usage.completion_tokens == 256 and got.choices[0].finish_reason == "length"


def test_settings_given_their_default_values_are_taken(model_dir, tmp_path):
    """--max-new-tokens 16 and a seed of 0 equal the defaults: they were ignored (chat ran to the context, and sampled
    requests without a seed drew anew) because the server asked whether they differed from the default."""
    (tmp_path / "kestrel.toml").write_text("[generation]\nseed = 0\n")
    s = Server(model_dir, "--max-new-tokens", "16", "--config", str(tmp_path / "kestrel.toml"))
    try:
        client = s.client()
        got = client.chat.completions.create(model=s.name, messages=[{"role": "user", "content": "hi"}],
                                             extra_body={"ignore_eos": True})
        assert got.usage.completion_tokens == 16 and got.choices[0].finish_reason == "length"
        draws = [client.completions.create(model=s.name, prompt=[1, 2, 3], max_tokens=8, temperature=1.0,
                                           extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0].token_ids
                 for _ in range(2)]
        assert draws[0] == draws[1]  # the operator's seed, 0, makes a request without one repeatable
    finally:
        s.stop()


def test_sixteen_concurrent_streams_each_equal_their_solo_run(server, solo):
    prompts = [prompt_of(i) for i in range(16)]
    want = [solo(p, 24) for p in prompts]
    client = server.client(KEY)

    def stream(i: int) -> list[int]:
        chunks = client.completions.create(model=server.name, prompt=prompts[i], max_tokens=24, stream=True,
                                           extra_body={"return_token_ids": True})
        return ids_of(chunks)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(stream, range(16)))
    assert got == want
    assert server.health()["running"] == 0


def test_a_sampled_request_with_a_seed_is_its_solo_run_and_one_without_draws_anew(server, solo):
    prompt = prompt_of(5)
    settings = {"temperature": 0.9, "top_p": 0.95, "seed": 7}
    want = solo(prompt, 20, top_k=50, stop_at_eos=False, **settings)
    client = server.client(KEY)
    ask = lambda **kw: client.completions.create(  # noqa: E731
        model=server.name, prompt=prompt, max_tokens=20,
        extra_body={"top_k": 50, "ignore_eos": True, "return_token_ids": True}, **kw).choices[0].token_ids
    assert ask(**settings) == want
    assert ask(temperature=0.9) != ask(temperature=0.9)  # each without a seed gets its own


# --- stop strings and ids ---------------------------------------------------------------------------------------

def test_a_stop_string_ends_the_text_before_it(server, solo, model_dir):
    prompt = prompt_of(3)
    full = text_of(model_dir, solo(prompt, 40, stop_at_eos=False))
    at = next(i for i in range(4, len(full) - 2) if "\ufffd" not in full[i:i + 2])  # two whole characters
    stop = full[at:at + 2]
    want = full[:full.index(stop)]
    client = server.client(KEY)
    whole = client.completions.create(model=server.name, prompt=prompt, max_tokens=40, stop=[stop, "never-there"],
                                      extra_body={"ignore_eos": True})
    assert whole.choices[0].text == want and whole.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=server.name, prompt=prompt, max_tokens=40, stop=stop, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == want  # held back, never sent and taken back
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_stop_token_id_ends_the_generation_and_is_not_in_the_text(server, solo, model_dir):
    prompt = prompt_of(4)
    ids = solo(prompt, 30, stop_at_eos=False)
    stop_id = ids[5]
    cut = ids[:ids.index(stop_id) + 1]
    got = server.client(KEY).completions.create(model=server.name, prompt=prompt, max_tokens=30,
                                                extra_body={"stop_token_ids": [stop_id], "ignore_eos": True,
                                                            "return_token_ids": True})
    choice = got.choices[0]
    assert choice.token_ids == cut and choice.finish_reason == "stop"
    assert choice.text == text_of(model_dir, cut[:-1]) and got.usage.completion_tokens == len(cut)


# --- who may reach it from a browser ---------------------------------------------------------------------

def test_a_keyless_loopback_server_answers_only_loopback_host_names(solo_server):
    """DNS rebinding: a page on attacker.example, its name pointed at 127.0.0.1, sends that Host and is refused."""
    url = solo_server.url
    for host in ("attacker.example", "attacker.example:8000", "192.168.1.9"):
        response = httpx.get(f"{url}/v1/models", headers={"Host": host}, timeout=10)
        error = assert_openai_error(response, 403, code="host_not_allowed")
        assert "--allowed-hosts" in error["message"]
    port = url.rsplit(":", 1)[1]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
        assert httpx.get(f"{url}/v1/models", headers={"Host": host}, timeout=10).status_code == 200, host
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert client.models.list().data  # the official client, through 127.0.0.1


def test_a_body_that_is_not_json_is_refused_and_no_cors_header_is_sent(solo_server):
    """A page may POST text/plain to any site without a preflight: the server refuses it before reading it."""
    body = json.dumps({"model": solo_server.name, "prompt": [1, 2], "max_tokens": 1})
    for media in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"Origin": "https://attacker.example", **({"Content-Type": media} if media else {})}
        response = httpx.post(f"{solo_server.url}/v1/completions", content=body, headers=headers, timeout=30)
        assert_openai_error(response, 415, code="unsupported_media_type")
        assert "access-control-allow-origin" not in response.headers
    ok = httpx.post(f"{solo_server.url}/v1/completions", content=body, timeout=30,
                    headers={"Origin": "https://attacker.example", "Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200 and "access-control-allow-origin" not in ok.headers
    preflight = httpx.options(f"{solo_server.url}/v1/completions", timeout=10,
                              headers={"Origin": "https://attacker.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers


def test_named_hosts_and_origins_are_answered(model_dir):
    s = Server(model_dir, "--allowed-hosts", "kestrel.lan", "--allowed-origins", "https://app.example")
    try:
        body = json.dumps({"model": s.name, "prompt": [1, 2], "max_tokens": 1})
        answer = httpx.post(f"{s.url}/v1/completions", content=body, timeout=30,
                            headers={"Host": "kestrel.lan:8000", "Origin": "https://app.example",
                                     "Content-Type": "application/json"})
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "https://app.example"
        preflight = httpx.options(f"{s.url}/v1/chat/completions", timeout=10,
                                  headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                                           "Access-Control-Request-Headers": "authorization, content-type"})
        assert preflight.status_code == 204 and "POST" in preflight.headers["access-control-allow-methods"]
        other = httpx.get(f"{s.url}/v1/models", headers={"Origin": "https://other.example"}, timeout=10)
        assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
        assert_openai_error(httpx.get(f"{s.url}/health", headers={"Host": "evil.lan"}, timeout=10), 403)
    finally:
        s.stop()


# --- errors -----------------------------------------------------------------------------------------------

def post(server, path: str, body, key: str | None = KEY, **kw) -> httpx.Response:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=data, headers=headers, timeout=30, **kw)


@pytest.mark.parametrize("body, param, code", [
    (b"{not json", None, None),
    (b'{"model": "M", "prompt": [1, 2], "temperature": NaN}', None, None),
    (b"[1, 2]", None, None),
    ({"prompt": [1, 2]}, "model", "missing_parameter"),
    ({"model": "M", "prompt": [1, 2], "frobnicate": 1}, "frobnicate", "unknown_parameter"),
    ({"model": "M", "prompt": [1, 2], "max_tokens": "many"}, "max_tokens", None),
    ({"model": "M", "prompt": [1, 2], "max_tokens": 0}, "max_tokens", None),
    ({"model": "M", "prompt": [1, 2], "max_tokens": 257}, "max_tokens", None),  # over --max-tokens-limit
    ({"model": "M", "prompt": [1, 2], "temperature": 5}, "temperature", None),
    ({"model": "M", "prompt": [1, 2], "top_p": 0}, "top_p", None),
    ({"model": "M", "prompt": [1, 2], "seed": -1}, "seed", None),
    ({"model": "M", "prompt": [1, 2], "n": 9}, "n", None),
    ({"model": "M", "prompt": [1, 2], "logprobs": 6}, "logprobs", None),
    ({"model": "M", "prompt": [1, 2], "echo": "yes"}, "echo", None),
    ({"model": "M", "prompt": [1, 2], "presence_penalty": 2.5}, "presence_penalty", None),
    ({"model": "M", "prompt": [1, 2], "frequency_penalty": -3}, "frequency_penalty", None),
    ({"model": "M", "prompt": [1, 2], "repetition_penalty": 0}, "repetition_penalty", None),
    ({"model": "M", "prompt": [1, 2], "logit_bias": {"5": 101}}, "logit_bias", None),
    ({"model": "M", "prompt": [1, 2], "logit_bias": {"five": 1}}, "logit_bias", None),
    ({"model": "M", "prompt": [1, 2], "logit_bias": {"99999": 1}}, "logit_bias", None),  # past the vocabulary
    ({"model": "M", "prompt": [1, 2], "stream_options": {"include_usage": True}}, "stream_options", None),
    ({"model": "M", "prompt": ["a", "b"]}, "prompt", None),
    ({"model": "M", "prompt": 7}, "prompt", None),
    ({"model": "M", "prompt": [1, 99999]}, "prompt", None),
    ({"model": "M", "prompt": ""}, "prompt", None),
    ({"model": "M", "prompt": [1] * 600}, "prompt", "context_length_exceeded"),
    ({"model": "M", "prompt": [1] * 500, "max_tokens": 100}, "prompt", "context_length_exceeded"),
    (b'{"model": "M", "prompt": [1, 2], "max_tokens": 2, "max_tokens": 3}', "max_tokens", None),  # was: the last
])
def test_a_bad_completion_body_is_a_400_in_openais_shape(server, body, param, code):
    if isinstance(body, dict) and "model" in body:
        body = {**body, "model": server.name}
    elif isinstance(body, bytes):
        body = body.replace(b'"M"', json.dumps(server.name).encode())
    error = assert_openai_error(post(server, "/v1/completions", body), 400, param, code)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("bias, says", [
    ({"\u0663": 5}, "'\u0663'"),  # an Arabic-Indic three was token 3
    ({" 3 ": 5}, "' 3 '"),  # so was a padded one
    ({"3.0": 5}, "'3.0'"), ({"-1": 5}, "'-1'"), ({"+3": 5}, "'+3'"), ({"3_0": 5}, "'3_0'"), ({"": 5}, "''"),
    ({"9" * 5000: 5}, "5,000 digits"),  # quoted cut short, not in full
    ({"3": 5, "03": -5}, "token 3 twice"),  # one token given two biases
])
def test_a_logit_bias_key_that_is_no_ascii_token_id_is_a_400_naming_it(server, bias, says):
    body = {"model": server.name, "prompt": [1, 2], "max_tokens": 1, "logit_bias": bias}
    error = assert_openai_error(post(server, "/v1/completions", body), 400, "logit_bias")
    assert says in error["message"] and "logit_bias" in error["message"] and len(error["message"]) < 200, error


def test_a_number_past_pythons_4300_digits_is_a_400_that_names_it():
    """The message was Python's, telling the client to call sys.set_int_max_str_digits()."""
    from kestrel_core.serve import protocol

    with pytest.raises(protocol.APIError) as refused:
        protocol.parse(b'{"model": "m", "prompt": [1], "max_tokens": ' + b"1" * 5000 + b"}", protocol.CompletionRequest)
    assert refused.value.status == 400
    assert refused.value.message == "the body is not valid JSON (a number of more than 4300 digits)"


@pytest.mark.parametrize("change, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, None),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, "tool_choice"),
    ({"chat_template_kwargs": {"messages": 1}}, "chat_template_kwargs"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
])
def test_a_bad_chat_body_is_a_400(server, change, param):
    body = {"model": server.name, "messages": [{"role": "user", "content": "hi"}], **change}
    assert_openai_error(post(server, "/v1/chat/completions", body), 400, param)


def test_the_openai_client_sees_400_404_and_401(server):
    client = server.client(KEY)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=server.name, prompt=[1, 2], max_tokens=5, temperature=3.5)
    assert bad.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-4", prompt=[1, 2], max_tokens=5)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert client.models.retrieve(server.name).id == server.name
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong-key").completions.create(model=server.name, prompt=[1, 2], max_tokens=5)


def test_the_api_key_guards_every_v1_route_but_not_health(server):
    for path in ("/v1/models", f"/v1/models/{server.name}"):
        assert_openai_error(httpx.get(f"{server.url}{path}", timeout=10), 401, code="invalid_api_key")
        keyed = httpx.get(f"{server.url}{path}", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        assert keyed.status_code == 200
    body = {"model": server.name, "prompt": [1, 2], "max_tokens": 2}
    assert_openai_error(post(server, "/v1/completions", body, key=None), 401)
    assert_openai_error(post(server, "/v1/completions", body, key=KEY + "x"), 401)
    response = post(server, "/v1/completions", b"x" * 10**6, key=None)  # refused before the body is read
    assert_openai_error(response, 401)
    assert response.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    models = server.client(KEY).models.list()
    assert [m.id for m in models.data] == [server.name]


def test_a_body_over_the_limit_is_a_413(server):
    huge = {"model": server.name, "prompt": "x" * 70_000}
    assert_openai_error(post(server, "/v1/completions", huge), 413, code="body_too_large")

    def chunked():  # no Content-Length: counted as it comes
        yield b'{"model": "m", "prompt": "'
        for _ in range(70):
            yield b"x" * 1024
        yield b'"}'
    response = httpx.post(f"{server.url}/v1/completions", content=chunked(), timeout=30,
                          headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert_openai_error(response, 413)


def test_a_body_that_stalls_is_a_408_not_a_connection_held_forever(model_dir):
    """A Content-Length above what was sent (or a slow-loris body) held its connection with no end."""
    import asyncio

    from kestrel_core.config import KestrelConfig
    from kestrel_core.serve.app import create_app
    from kestrel_core.serve.service import Limits, Service

    app = create_app(Service(KestrelConfig().override(model=str(model_dir)), "tiny", Limits()), body_timeout=0.2)
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "", "query_string": b"",
             "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"), (b"content-length", b"1000")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    parts = [{"type": "http.request", "body": b'{"model": "tiny", ', "more_body": True}]
    sent = []

    async def receive():
        if parts:
            return parts.pop(0)
        await asyncio.sleep(3600)  # the rest never comes

    async def send(message):
        sent.append(message)

    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))
    assert sent[0]["status"] == 408
    error = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["error"]
    assert error["code"] == "body_timeout" and "did not arrive within 0.2 s (18 bytes came)" in error["message"]


def test_unknown_routes_and_methods_answer_in_openais_shape(server):
    assert_openai_error(httpx.get(f"{server.url}/v1/engines", timeout=10), 404)
    assert_openai_error(httpx.get(f"{server.url}/v1/completions", timeout=10), 405)


# --- one slot: the queue and disconnects ------------------------------------------------------------------------

def test_queue_full_is_a_429_and_a_disconnect_frees_the_slot(single):
    client = single.client()
    stream = client.completions.create(model=single.name, prompt=[1, 2, 3], max_tokens=LONG, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    assert single.health() == {"status": "ok", "running": 1, "waiting": 0}
    with pytest.raises(openai.RateLimitError) as full:
        client.completions.create(model=single.name, prompt=[1, 2], max_tokens=2)
    assert full.value.code == "queue_full" and full.value.response.headers["retry-after"] == "1"
    stream.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 300  # minutes: only a slot never freed runs it out, never a loaded machine
    while single.health()["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert single.health()["running"] == 0
    line = single.wait_for("cut: the client disconnected")
    assert int(re.search(r"\+ (\d+) completion", line).group(1)) < LONG  # cut, not run to its end
    got = client.completions.create(model=single.name, prompt=[1, 2], max_tokens=3, extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == 3


def test_a_disconnect_cancels_a_whole_answer_too(single):
    with pytest.raises(httpx.TimeoutException):  # the client gives up, and closes the connection
        httpx.post(f"{single.url}/v1/completions", timeout=0.5,
                   json={"model": single.name, "prompt": [4, 5, 6, 7], "max_tokens": LONG, "ignore_eos": True})
    line = single.wait_for("4 prompt + ")
    assert "cut: the client disconnected" in line and int(re.search(r"\+ (\d+) completion", line).group(1)) < LONG
    assert single.health()["running"] == 0


# --- start, stop, safety ----------------------------------------------------------------------------------

def test_the_server_listens_before_the_model_loads_and_prints_its_settings(server):
    lines = server.lines
    listening = next(i for i, line in enumerate(lines) if "listening on http://127.0.0.1:" in line)
    ready = next(i for i, line in enumerate(lines) if "ready in" in line)
    assert listening < ready
    assert any(line.startswith("kestrel serve: residency: backend=cpu_ref policy=") for line in lines)
    assert any("memory (measured" in line and "KV cache" in line for line in lines)
    assert any(re.search(r"/v1/completions: \d+ prompt \+ \d+ completion tokens .*ms/token, .* streamed/token", line)
               for line in lines)


def test_health_is_503_while_the_model_loads(model_dir):
    from starlette.testclient import TestClient

    from kestrel_core.config import KestrelConfig
    from kestrel_core.serve.app import create_app
    from kestrel_core.serve.service import Limits, Service

    service = Service(KestrelConfig().override(model=str(model_dir), backend__name="cpu_ref"), "tiny", Limits())
    with TestClient(create_app(service), base_url="http://127.0.0.1", raise_server_exceptions=False) as http:
        assert http.get("/health").status_code == 503 and http.get("/health").json()["status"] == "loading"
        response = http.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2]})
        assert_openai_error(response, 503, code="model_loading")
        service.load()
        try:
            assert http.get("/health").json() == {"status": "ok", "running": 0, "waiting": 0}
            assert http.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2]}).status_code == 200
        finally:
            service.close()


def test_a_server_error_is_a_500_without_its_traceback(model_dir, monkeypatch, caplog):
    from starlette.testclient import TestClient

    from kestrel_core.config import KestrelConfig
    from kestrel_core.serve.app import create_app
    from kestrel_core.serve.service import Limits, Service

    service = Service(KestrelConfig().override(model=str(model_dir), backend__name="cpu_ref"), "tiny", Limits())
    service.load()

    def broken(req):
        raise RuntimeError("secret internals at /home/someone")

    monkeypatch.setattr(service, "plan", broken)
    try:
        with TestClient(create_app(service), base_url="http://127.0.0.1", raise_server_exceptions=False) as http:
            response = http.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2]})
    finally:
        service.close()
    error = assert_openai_error(response, 500, code="internal_error")
    assert error["type"] == "server_error" and "secret" not in response.text
    assert "RuntimeError" in caplog.text  # the server's log names it


def test_a_batch_stopped_by_an_error_is_logged_and_health_says_so(model_dir, monkeypatch, caplog):
    """The 503 said the error was in the server's log, and it was not; /health went on answering 200 "ok"."""
    import logging

    from starlette.testclient import TestClient

    from kestrel_core.engine.batch import Batch
    from kestrel_core.config import KestrelConfig
    from kestrel_core.serve.app import create_app
    from kestrel_core.serve.service import Limits, Service

    monkeypatch.setattr(logging.getLogger("kestrel.serve"), "propagate", True)  # to caplog, whatever ran before
    service = Service(KestrelConfig().override(model=str(model_dir), backend__name="cpu_ref"), "tiny", Limits())
    service.load()
    monkeypatch.setattr(Batch, "step", lambda self: (_ for _ in ()).throw(RuntimeError("the device fell off")))
    body = {"model": "tiny", "prompt": [1, 2], "max_tokens": 2}
    try:
        with TestClient(create_app(service), base_url="http://127.0.0.1", raise_server_exceptions=False) as http:
            assert_openai_error(http.post("/v1/completions", json=body), 500, code="generation_failed")
            health = http.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "batch_failed"
            assert_openai_error(http.post("/v1/completions", json=body), 503, code="batch_failed")
    finally:
        service.close()
    failed = next(r for r in caplog.records if "the batch stopped on an error" in r.getMessage())
    assert failed.exc_info and str(failed.exc_info[1]) == "the device fell off"


def test_a_model_file_cut_under_a_running_server_is_a_503_and_a_line_on_stderr(model_dir, tmp_path):
    """cp over a model file truncates it first: the server died of SIGBUS, logging nothing, its clients got empty
    replies. Now the batch stops with the reason, /health and every request say 503, and the process lives."""
    import os

    d = Path(shutil.copytree(model_dir, tmp_path / "tiny"))
    s = Server(d)
    try:
        client = s.client()
        assert client.completions.create(model=s.name, prompt=[1, 2], max_tokens=2).choices
        weights = sorted(d.glob("*.safetensors"))[0]
        os.truncate(weights, weights.stat().st_size // 2)
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model=s.name, prompt=[1, 2], max_tokens=2)
        assert err.value.status_code in (500, 503)
        assert s.health()["status"] == "batch_failed"
        assert_openai_error(httpx.post(f"{s.url}/v1/completions", timeout=30, headers={"Content-Type": "application/json"},
                                       content=json.dumps({"model": s.name, "prompt": [1], "max_tokens": 1})), 503)
        s.wait_for("was cut from")
        assert s.proc.poll() is None  # alive: no SIGBUS
    finally:
        s.stop()


def test_the_smallest_context_starts(model_dir):
    """--max-seq 2 passed the flag check, then failed at warm-up naming a prompt the user never sent."""
    s = Server(model_dir, "--max-seq", "2")
    try:
        got = s.client().completions.create(model=s.name, prompt=[5], max_tokens=1,
                                            extra_body={"return_token_ids": True})
        assert len(got.choices[0].token_ids) == 1
    finally:
        s.stop()


def test_a_context_past_the_models_positions_is_refused_not_cut(model_dir):
    """--max-seq 100000 on a model of 4096 positions served 4096 without a word."""
    from kestrel_core.config import KestrelConfig
    from kestrel_core.serve.service import FAILED, Limits, Service

    service = Service(KestrelConfig().override(model=str(model_dir), backend__name="cpu_ref"), "tiny",
                      Limits(max_seq=100_000))
    service.load()
    assert service.state == FAILED
    error = str(service.load_error)
    assert error.startswith("--max-seq 100,000 is past") and "4,096 positions" in error


def test_a_non_loopback_host_without_a_key_is_refused(model_dir, monkeypatch, capsys):
    monkeypatch.delenv("KESTREL_API_KEY", raising=False)
    assert cli.main(["serve", "--model", str(model_dir), "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "KESTREL_API_KEY" in err and "--allow-insecure" in err


def no_listening(*args):
    raise AssertionError("the server listened")


@pytest.mark.parametrize("flags, needle", [
    (["--max-batch", "0"], "--max-batch"), (["--max-queue", "-1"], "--max-queue"), (["--port", "70000"], "--port"),
    (["--prompt", "hi"], "--prompt"), (["--api-key", ""], "--api-key"),
    # each was a traceback (OverflowError), an "unrecognized arguments", or a server that could never be used
    (["--max-body-mb", "inf"], "--max-body-mb must be a number above 0 and at most 1,048,576 (1 TiB), got inf"),
    (["--max-body-mb", "1e308"], "--max-body-mb must be a number above 0 and at most 1,048,576"),  # a traceback
    (["--max-body-mb", "nan"], "--max-body-mb must be a number above 0"),
    (["--draft-tokens", "4"], "--draft-tokens sets how many tokens a drafter proposes, and no draft is set"),
    (["--draft", ""], "--draft is empty"),
    (["--served-model-name", " "], "--served-model-name ' ' holds an empty name"),
    (["--served-model-name", "a,,b"], "--served-model-name 'a,,b' holds an empty name"),
    (["--api-key", " key"], "--api-key: the API key must be printable ASCII with no space at either end"),
    (["--api-key", "clé"], "--api-key: the API key must be printable ASCII"),
])
def test_bad_flags_are_one_line_errors(model_dir, capsys, monkeypatch, flags, needle):
    monkeypatch.setattr("kestrel_core.serve.server.bind", no_listening)  # a flag let through fails, never serves
    assert cli.main(["serve", "--model", str(model_dir), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err


def test_a_key_from_the_environment_is_checked_before_listening(model_dir, monkeypatch, capsys):
    """A key ending in a newline could never match a header."""
    monkeypatch.setattr("kestrel_core.serve.server.bind", no_listening)
    monkeypatch.setenv("KESTREL_API_KEY", "key\n")
    assert cli.main(["serve", "--model", str(model_dir), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "KESTREL_API_KEY: the API key must be printable ASCII" in err


def test_a_model_that_is_not_there_is_one_line_before_the_address_is_announced(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kestrel_core.cli", "serve", "--model", str(tmp_path / "nothing"),
                           "--port", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "listening on" not in done.stderr and done.stderr.startswith("kestrel: error:")
    assert done.stderr.count("\n") == 1, done.stderr


@pytest.mark.parametrize("why", ["no tokenizer", "max-seq"])
def test_a_model_serve_cannot_use_is_one_line_before_the_address_is_announced(tmp_path, monkeypatch, capsys, why):
    """A GGUF without tokenizer metadata was announced (listening on ...), then exited 2 once it had loaded."""
    from gguf_files import write_model

    gone = dict.fromkeys(k for k in ("model", "pre", "tokens", "merges", "token_type", "bos_token_id",
                                     "eos_token_id"))
    meta = {f"tokenizer.ggml.{k}": None for k in gone} | {"tokenizer.chat_template": None} \
        if why == "no tokenizer" else {}
    path, _ = write_model(tmp_path / "m.gguf", meta=meta)
    monkeypatch.setattr("kestrel_core.serve.server.bind", no_listening)
    flags = ["--max-seq", "100000"] if why == "max-seq" else []
    assert cli.main(["serve", "--model", str(path), "--backend", "cpu_ref", "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kestrel: error: ") and err.count("\n") == 1 and "listening" not in err, err
    assert ("kestrel serve answers in text" if why == "no tokenizer" else "--max-seq 100,000 is past") in err


@pytest.mark.parametrize("keep, starts", [
    ("off", "the KV cache for 256 x 1,000,000,000 positions needs"),  # at its allocation
    ("auto", "keep = auto: a KV cache of 366,210.94 GiB (256 x 1,000,000,000 positions) leaves")])  # by the fit
def test_a_kv_cache_too_large_is_one_line_naming_the_servers_flags(model_dir, tmp_path, keep, starts):
    """It was a traceback, "the batch stopped on an error; restart the server" (it never started), and a hint naming
    --max-new-tokens, which is no server flag."""
    d = Path(shutil.copytree(model_dir, tmp_path / "tiny"))
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 10**9}))
    done = subprocess.run([sys.executable, "-m", "kestrel_core.cli", "serve", "--model", str(d), "--backend", "cpu_ref",
                           "--port", "0", "--max-seq", str(10**9), "--max-batch", "256", "--keep", keep],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "restart the server" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"kestrel: error: {starts}") and \
        "lower the context or the slots (kestrel serve: --max-seq, --max-batch)" in last


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_ends_running_streams_cleanly_and_exits_0(model_dir, how):
    s = Server(model_dir, "--shutdown-timeout", "0")
    try:
        stream = iter(s.client().completions.create(model=s.name, prompt=[1, 2, 3], max_tokens=LONG, stream=True,
                                                    extra_body={"ignore_eos": True, "return_token_ids": True}))
        first = next(stream)
        s.proc.send_signal(how)
        rest = list(stream)  # ends with its last chunk and [DONE]: no error
        tokens = ids_of([first, *rest])
        assert rest[-1].choices[0].finish_reason == "abort" and 0 < len(tokens) < LONG
        assert s.proc.wait(30) == 0
        s.wait_for(f"{how.name}: taking no new requests")
        assert "Traceback" not in "\n".join(s.lines)
    finally:
        s.stop()


SLOW_LOAD = """
import sys, time, torch
from kestrel_core import cli
from kestrel_core.serve import service
real = service.Service._load
def slow(self):  # torch at work on the loading thread, as a large model's load is, for seconds
    t, a = time.monotonic(), torch.randn(256, 256)
    while time.monotonic() - t < 30:
        a = torch.tanh(a @ a)
    real(self)
service.Service._load = slow
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_signal_while_the_model_loads_exits_0(model_dir):
    """The interpreter's exit destroyed torch's threads under the loading thread: "terminate called without an active
    exception", and SIGABRT (exit -6) instead of 0."""
    proc = subprocess.Popen([sys.executable, "-c", SLOW_LOAD, "serve", "--model", str(model_dir), "--port", "0",
                             "--backend", "cpu_ref"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert "listening on" in proc.stderr.readline()
        time.sleep(1)  # the loading thread is in torch
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        err = proc.stderr.read()
        assert "stopped (the model was still loading)" in err and "terminate called" not in err
    finally:
        proc.kill()
        proc.wait()


def test_a_stream_running_at_sigterm_finishes_within_the_grace_period(model_dir):
    s = Server(model_dir, "--shutdown-timeout", "60")
    try:
        stream = iter(s.client().completions.create(model=s.name, prompt=[1, 2, 3], max_tokens=200, stream=True,
                                                    extra_body={"ignore_eos": True}))
        next(stream)
        s.proc.send_signal(signal.SIGTERM)
        s.wait_for("taking no new requests")
        with pytest.raises(httpx.HTTPError):  # 503, or no longer listening
            httpx.get(f"{s.url}/health", timeout=5).raise_for_status()
        chunks = list(stream)
        assert chunks[-1].choices[0].finish_reason == "length"  # finished in the grace period: its own reason
        assert s.proc.wait(30) == 0
        assert any("3 prompt + 200 completion tokens (length)" in line for line in s.lines)
    finally:
        s.stop()


# --- text held back at stop strings ------------------------------------------------------------------------

def test_text_that_may_begin_a_stop_string_is_held_until_decided(model_dir):
    from kestrel_core.serve.stops import TextOutput

    with load(model_dir) as model:
        tok = model.tokenizer
        out = TextOutput(tok, ["STOP", "xyz"])
        sent = [out.push(t) for t in tok.encode("abc ST")]
        assert "".join(sent) == "abc " and not out.stopped  # "ST" may begin STOP: held
        sent += [out.push(t) for t in tok.encode("ART x")]
        assert "".join(sent) == "abc START " and not out.stopped  # decided: not a stop; " x" may begin xyz
        sent += [out.push(t) for t in tok.encode("yzzz")]
        assert out.stopped and out.text == "abc START " and "".join(sent) + out.finish() == "abc START "
        plain = TextOutput(tok, [])
        assert "".join(plain.push(t) for t in tok.encode("no stops")) + plain.finish() == "no stops"


@pytest.fixture
def slow_app_server():
    """uvicorn with kestrel's header deadline (0.3 s here) in front of an app that answers after 0.6 s."""
    import asyncio
    import socket

    import uvicorn

    from kestrel_core.serve.server import header_deadline

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await asyncio.sleep(0.6)  # longer than the deadline: a request being answered is not cut
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", http=header_deadline(0.3)))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve([sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(10)


def _closed_after(conn, timeout: float = 5.0) -> float:
    """Seconds until the server closed ``conn`` (it sends nothing first); fails if it is still open after ``timeout``."""
    conn.settimeout(timeout)
    t0 = time.monotonic()
    assert conn.recv(100) == b""
    return time.monotonic() - t0


def test_headers_that_never_finish_lose_their_connection(slow_app_server):
    import socket

    port = slow_app_server
    partial = socket.create_connection(("127.0.0.1", port))
    partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
    assert 0.25 <= _closed_after(partial) < 3
    silent = socket.create_connection(("127.0.0.1", port))  # connects, sends nothing
    assert 0.25 <= _closed_after(silent) < 3
    kept = socket.create_connection(("127.0.0.1", port))  # a whole request, answered after the deadline had passed
    kept.settimeout(5)
    for _ in range(2):  # and again on the same connection, its next headers within the deadline
        kept.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while not answer.endswith(b"ok"):
            answer += kept.recv(200)
        assert answer.startswith(b"HTTP/1.1 200 OK")
    kept.sendall(b"GET / HTTP/1.1\r\n")  # then a request that stops mid-headers
    assert _closed_after(kept) < 3


def test_the_served_name_is_the_models_own_and_its_path_is_accepted(solo_server, model_dir):
    """The default name is the directory's base name (a full path in /v1/models told a page the user's files); a
    request may still name the model by the path it was given, and gets answers named by the served name."""
    client = solo_server.client()
    assert [m.id for m in client.models.list().data] == ["tiny"] == [solo_server.name]
    got = client.completions.create(model=str(model_dir), prompt="hi", max_tokens=2)
    assert got.model == "tiny"
    assert client.models.retrieve(str(model_dir)).id == "tiny"
    with pytest.raises(openai.NotFoundError, match="this server serves 'tiny'"):
        client.completions.create(model="tiny-other", prompt="hi", max_tokens=2)


def test_served_names_take_aliases(tmp_path):
    from kestrel_core.commands.serve import served_names

    d = tmp_path / "Qwen3-8B"
    d.mkdir()
    assert served_names(None, str(d)) == ("Qwen3-8B", frozenset({str(d), str(d.resolve())}))
    assert served_names("qwen, my-model", str(d)) == ("qwen", frozenset({"my-model", str(d), str(d.resolve())}))
    assert served_names(None, "Qwen/Qwen3-8B-not-here") == ("Qwen/Qwen3-8B-not-here", frozenset({"Qwen/Qwen3-8B-not-here"}))


def test_a_gguf_files_name_is_served_without_gguf_and_its_file_name_accepted(tmp_path, monkeypatch):
    """A client asking for smol-q4_1 got a 404 where the file was smol-q4_1.gguf."""
    from kestrel_core.commands.serve import served_names
    from kestrel_core.config import KestrelConfig
    from kestrel_core.serve.protocol import APIError
    from kestrel_core.serve.service import Limits, Service

    f = tmp_path / "smol-q4_1.gguf"
    f.write_bytes(b"GGUF")
    name, aliases = served_names(None, str(f))
    assert name == "smol-q4_1" and {"smol-q4_1.gguf", str(f)} <= aliases
    service = Service(KestrelConfig(), name, Limits(), aliases=aliases)
    for asked in ("smol-q4_1", "smol-q4_1.gguf", str(f)):
        service.check_model(asked)
    with pytest.raises(APIError, match="this server serves 'smol-q4_1'"):
        service.check_model("smol-q4_1.gguf.gguf")
    # other suffixes: only the last .gguf goes (any case); a name that is all suffix, and a directory, keep theirs
    for file, served in (("smol.Q4_K_M.gguf", "smol.Q4_K_M"), ("Smol.GGUF", "Smol"), (".gguf", ".gguf"),
                         ("smol.bin", "smol.bin")):
        (tmp_path / file).write_bytes(b"GGUF")
        assert served_names(None, str(tmp_path / file))[0] == served
    (tmp_path / "dir.gguf").mkdir()
    assert served_names(None, str(tmp_path / "dir.gguf"))[0] == "dir.gguf"
    # the name as given, not a link's target (a Hugging Face snapshot links each file to a blob named by its hash)
    blob = tmp_path / "blobs" / ("0" * 64)
    blob.parent.mkdir()
    blob.write_bytes(b"GGUF")
    (tmp_path / "snap").mkdir()
    (tmp_path / "snap" / "tiny-q8_0.gguf").symlink_to(blob)
    name, aliases = served_names(None, str(tmp_path / "snap" / "tiny-q8_0.gguf"))
    assert name == "tiny-q8_0" and str(blob) in aliases and "0" * 64 not in aliases
    monkeypatch.chdir(tmp_path / "snap")
    assert served_names(None, ".")[0] == "snap" and served_names(None, "tiny-q8_0.gguf")[0] == "tiny-q8_0"


def test_penalties_and_logit_bias_reach_the_generation(server, solo):
    """The OpenAI penalties, vLLM's repetition_penalty and logit_bias are applied as the engine applies them (each
    request's ids equal a run's with the same [generation] settings), and a +100 bias forces its token."""
    client = server.client(KEY)
    prompt = [5, 17, 42, 5, 17]
    asks = {"presence_penalty": 1.5, "frequency_penalty": 0.5}
    got = client.completions.create(model=server.name, prompt=prompt, max_tokens=12, **asks,
                                    extra_body={"repetition_penalty": 1.3, "ignore_eos": True, "return_token_ids": True})
    want = solo(prompt, 12, stop_at_eos=False, repetition_penalty=1.3, **asks)
    assert got.choices[0].token_ids == want != solo(prompt, 12, stop_at_eos=False)
    forced = client.completions.create(model=server.name, prompt=prompt, max_tokens=4, logit_bias={"77": 100},
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    assert forced.choices[0].token_ids == [77] * 4

