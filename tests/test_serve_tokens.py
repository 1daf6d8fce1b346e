"""kestrel serve's /tokenize and /detokenize (vLLM's), against a server process on cpu_ref (the tiny preset with a chat
template): the ids are the model's tokenizer's, a chat's are what the chat route prefills, and every refusal is
OpenAI's error object behind the same key and Host rules as the /v1 routes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from starlette.testclient import TestClient

from bench.serve_process import ServeProcess
from serve_helpers import assert_openai_error, chat_model
from kestrel_core.engine.run import load
from kestrel_core.formats.chat_template import load_chat_template
from kestrel_core.serve.app import create_app
from kestrel_core.serve.metrics import ServeMetrics
from kestrel_core.serve.protocol import APIError

KEY = "tokens-key-1"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there, café ☕"}]
TEXTS = ["The capital of France is", "", "naïve café ☕ 東京\n\ttabs  and  spaces", "<|endoftext|> special"]
CONTEXT = 256


@pytest.fixture(scope="module")
def model_dir(tiny_ckpt, tmp_path_factory) -> Path:
    """The tiny preset with a chat template (its <|endoftext|> ends a turn)."""
    return chat_model(tiny_ckpt, tmp_path_factory.mktemp("tokens") / "tiny")


class Server(ServeProcess):
    def __init__(self, model: Path, *flags: str, key: str | None = KEY):
        super().__init__(model, "--backend", "cpu_ref", "--max-seq", str(CONTEXT), *flags,
                         env={"KESTREL_API_KEY": key} if key else None)
        self.key = key

    def post(self, path: str, body, key: str | None = "default", **headers) -> httpx.Response:
        key = self.key if key == "default" else key
        auth = {"Authorization": f"Bearer {key}"} if key else {}
        if isinstance(body, (bytes, str)):
            return httpx.post(f"{self.url}{path}", content=body, timeout=30,
                              headers={"Content-Type": "application/json", **auth, **headers})
        return httpx.post(f"{self.url}{path}", json=body, headers={**auth, **headers}, timeout=30)


@pytest.fixture(scope="module")
def server(model_dir):
    s = Server(model_dir)
    yield s
    s.stop(30)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    with load(model_dir) as model:
        yield model.tokenizer, model.config.vocab_size


# --- what they answer -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_is_the_models_tokenizer_and_detokenize_its_inverse(server, tokenizer, text):
    tok, _ = tokenizer
    got = server.post("/tokenize", {"model": server.name, "prompt": text})
    assert got.status_code == 200, got.text
    want = tok.encode(text)
    assert got.json() == {"count": len(want), "max_model_len": CONTEXT, "tokens": want}
    back = server.post("/detokenize", {"model": server.name, "tokens": want})
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": tok.decode(want)} and back.json()["prompt"] == text


def test_the_model_may_be_left_out_and_special_tokens_added_where_asked(server, tokenizer):
    tok, _ = tokenizer
    plain = server.post("/tokenize", {"prompt": "hello"}).json()
    assert plain["tokens"] == tok.encode("hello")
    special = server.post("/tokenize", {"prompt": "hello", "add_special_tokens": True}).json()
    assert special["tokens"] == tok.encode("hello", add_special_tokens=True)
    assert server.post("/detokenize", {"tokens": []}).json() == {"prompt": ""}


def test_a_prompts_count_is_what_a_completion_prefills(server):
    text = "Once upon a time, in a land far away"
    count = server.post("/tokenize", {"prompt": text}).json()["count"]
    done = server.post("/v1/completions", {"model": server.name, "prompt": text, "max_tokens": 2,
                                           "return_token_ids": True}).json()
    assert done["usage"]["prompt_tokens"] == count
    assert done["choices"][0]["prompt_token_ids"] == server.post("/tokenize", {"prompt": text}).json()["tokens"]


def test_messages_tokenize_as_the_chat_route_prefills_them(server, tokenizer, model_dir):
    tok, _ = tokenizer
    got = server.post("/tokenize", {"model": server.name, "messages": MESSAGES}).json()
    chat = server.post("/v1/chat/completions", {"model": server.name, "messages": MESSAGES, "max_tokens": 2,
                                                "return_token_ids": True}).json()
    assert got["count"] == chat["usage"]["prompt_tokens"]
    assert got["tokens"] == chat["choices"][0]["prompt_token_ids"]
    # OpenAI's developer role and text parts are the chat route's: system, and the parts' text joined
    parts = [{"role": "developer", "content": "be brief"},
             {"role": "user", "content": [{"type": "text", "text": "hello there, café ☕"}]}]
    assert server.post("/tokenize", {"messages": parts}).json()["tokens"] == got["tokens"]
    template = load_chat_template(model_dir)
    bare = server.post("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert bare["tokens"] == tok.encode(template.render(MESSAGES, add_generation_prompt=False))
    assert got["tokens"][: bare["count"]] == bare["tokens"] and got["count"] > bare["count"]


def test_a_count_past_the_context_is_answered_not_refused(server, tokenizer):
    tok, _ = tokenizer
    text = "lorem ipsum dolor sit amet " * 200
    got = server.post("/tokenize", {"prompt": text}).json()
    assert got["count"] == len(tok.encode(text)) > got["max_model_len"] == CONTEXT


# --- refusals ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, param, code", [
    ({}, "prompt", "missing_parameter"),
    ({"prompt": 5}, "prompt", None),
    ({"prompt": [1, 2, 3]}, "prompt", None),
    ({"prompt": "a", "messages": MESSAGES}, "messages", None),
    ({"messages": []}, "messages", None),
    ({"messages": [{"role": "robot", "content": "x"}]}, None, None),
    ({"messages": "hello"}, "messages", None),
    ({"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt", None),
    ({"prompt": "a", "chat_template_kwargs": {}}, "chat_template_kwargs", None),
    ({"messages": MESSAGES, "chat_template_kwargs": {"messages": 1}}, "chat_template_kwargs", None),
    ({"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens", None),
    ({"prompt": "a", "return_token_strs": True}, "return_token_strs", "unknown_parameter"),
    ({"prompt": "a", "model": 3}, "model", None),
])
def test_a_bad_tokenize_body_is_a_400_naming_the_field(server, body, param, code):
    error = assert_openai_error(server.post("/tokenize", body), 400, param, code)
    if param == "prompt" and code is None:
        assert error["message"] == "prompt must be a string (the text to tokenize)"


@pytest.mark.parametrize("body, param, code", [
    ({}, "tokens", "missing_parameter"),
    ({"tokens": "abc"}, "tokens", None),
    ({"tokens": [1, 1.5]}, "tokens.1", None),
    ({"tokens": [True]}, "tokens.0", None),
    ({"tokens": [-1]}, "tokens", None),
    ({"tokens": [1, 2, "VOCAB"]}, "tokens", None),
    ({"tokens": [1, 10**30]}, "tokens", None),
    ({"tokens": [1], "skip_special_tokens": True}, "skip_special_tokens", "unknown_parameter"),
])
def test_a_bad_detokenize_body_is_a_400_naming_the_field(server, tokenizer, body, param, code):
    _, vocab = tokenizer
    if body.get("tokens") == [1, 2, "VOCAB"]:
        body = {"tokens": [1, 2, vocab]}
    error = assert_openai_error(server.post("/detokenize", body), 400, param, code)
    if param == "tokens" and code is None and isinstance(body["tokens"], list):
        assert "outside the vocabulary" in error["message"] and str(vocab - 1) in error["message"]


def test_bodies_that_are_not_json_objects_are_400_and_another_media_type_415(server):
    for path in ("/tokenize", "/detokenize"):
        assert_openai_error(server.post(path, b"{not json"), 400)
        assert_openai_error(server.post(path, b"[1, 2]"), 400)
        response = httpx.post(f"{server.url}{path}", content=b'{"prompt": "a"}', timeout=30,
                              headers={"Content-Type": "text/plain", "Authorization": f"Bearer {KEY}"})
        assert_openai_error(response, 415, code="unsupported_media_type")
    assert_openai_error(server.post("/tokenize", b'{"prompt": "a\\ud800"}'), 400, "prompt")  # not UTF-8
    assert_openai_error(server.post("/tokenize", b'{"prompt": "a", "prompt": "b"}'), 400, "prompt")


def test_another_model_is_a_404(server):
    assert_openai_error(server.post("/tokenize", {"model": "gpt-4", "prompt": "a"}), 404, "model", "model_not_found")
    assert_openai_error(server.post("/detokenize", {"model": "gpt-4", "tokens": [1]}), 404, "model",
                        "model_not_found")
    assert server.post("/tokenize", {"model": server.path, "prompt": "a"}).status_code == 200  # --model as given


def test_the_key_guards_both_routes(server):
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        for key in (None, KEY + "x"):
            response = server.post(path, body, key=key)
            assert_openai_error(response, 401, code="invalid_api_key")
            assert response.headers["www-authenticate"] == "Bearer"
        assert_openai_error(server.post(path, b"x" * 10**6, key=None), 401)  # before the body is read
        assert server.post(path, body).status_code == 200


def test_host_names_and_cors_are_the_v1_routes_rules(server):
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        refused = server.post(path, body, Host="attacker.example")
        assert_openai_error(refused, 403, code="host_not_allowed")
        ok = server.post(path, body, Origin="https://attacker.example")
        assert ok.status_code == 200 and "access-control-allow-origin" not in ok.headers


def test_messages_on_a_model_without_a_chat_template_are_a_400(tiny_ckpt, tokenizer):
    tok, _ = tokenizer
    s = Server(tiny_ckpt, key=None)
    try:
        assert_openai_error(s.post("/tokenize", {"messages": MESSAGES}), 400, "messages", "no_chat_template")
        assert s.post("/tokenize", {"prompt": "hi"}).json()["tokens"] == tok.encode("hi")
    finally:
        s.stop(30)


def test_a_model_without_a_tokenizer_is_a_501_that_says_why():
    """A server refuses to load such a model; were one served, the routes say why they cannot answer."""

    def ready():
        pass

    def check_model(name):
        raise APIError(404, "no", param="model", code="model_not_found")

    model = SimpleNamespace(tokenizer=None, no_tokenizer=lambda: "/models/x has no tokenizer.json")
    service = SimpleNamespace(metrics=ServeMetrics(dict), model=model, check_ready=ready, check_model=check_model)
    client = TestClient(create_app(service, hosts=None))
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        response = client.post(path, json=body)
        assert response.status_code == 501
        error = response.json()["error"]
        assert error["code"] == "no_tokenizer" and "has no tokenizer.json" in error["message"]
