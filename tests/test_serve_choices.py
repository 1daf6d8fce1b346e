"""kestrel serve's logprobs / top_logprobs and n, through the official openai client against a server process on
cpu_ref (the tiny preset with a chat template): the log-probabilities are the engine's log_softmax of the logits of
each position (a solo run with keep_logits in this process is the reference), and n choices are sequences of the
batch, each its solo run with its own seed."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import torch

from bench.serve_process import ServeProcess
from serve_helpers import assert_openai_error, chat_model
from kestrel_core.engine.run import load

PROMPT = [5, 17, 42, 99, 3]
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def model_dir(tiny_ckpt, tmp_path_factory) -> Path:
    return chat_model(tiny_ckpt, tmp_path_factory.mktemp("choices") / "tiny")


class Server(ServeProcess):
    def __init__(self, model: Path, *flags: str):
        super().__init__(model, "--backend", "cpu_ref", "--max-seq", "256", *flags)

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json={"model": self.name, **body}, timeout=30)


@pytest.fixture(scope="module")
def server(model_dir):
    s = Server(model_dir)
    yield s
    s.stop(30)


@pytest.fixture(scope="module")
def reference(model_dir):
    """``reference(prompt_ids, n, **generation)``: a solo run in this process, its logits kept."""
    with load(model_dir) as model, model.open(backend="cpu_ref") as run:
        yield lambda ids, n, **kw: run.generate(prompt_ids=list(ids), max_new_tokens=n, keep_logits=True, **kw)
    # the server's ends are the model's end ids, as run.generate's


@pytest.fixture(scope="module")
def token_bytes(model_dir):
    with load(model_dir) as model:
        yield model.tokenizer.token_bytes


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


# --- logprobs ------------------------------------------------------------------------------------------------

def test_chat_logprobs_are_the_log_softmax_of_the_engines_logits(server, reference, token_bytes):
    reply = server.client().chat.completions.create(
        model=server.name, messages=MESSAGES, max_tokens=8, logprobs=True, top_logprobs=20,
        extra_body={"return_token_ids": True})
    choice = reply.choices[0]
    want = reference(choice.prompt_token_ids, 8)
    assert choice.token_ids == want.token_ids
    content = choice.logprobs.content
    assert len(content) == len(want.token_ids) == reply.usage.completion_tokens
    for token, entry, logits in zip(want.token_ids, content, want.logits):
        lp = log_softmax(logits)
        assert bytes(entry.bytes) == token_bytes(token)
        assert entry.token == token_bytes(token).decode("utf-8", errors="replace")
        assert entry.logprob == pytest.approx(float(lp[token]), abs=1e-5)
        top = entry.top_logprobs
        assert len(top) == 20
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        assert [t.logprob for t in top] == pytest.approx(torch.topk(lp, 20).values.tolist(), abs=1e-5)
        # greedy: the chosen token is the most likely, first among the alternatives
        assert (top[0].bytes, top[0].logprob) == (entry.bytes, entry.logprob)


def test_completion_logprobs_in_the_completions_shape(server, reference, token_bytes):
    got = server.client().completions.create(model=server.name, prompt=PROMPT, max_tokens=10, logprobs=5,
                                             extra_body={"return_token_ids": True})
    choice = got.choices[0]
    want = reference(PROMPT, 10)
    assert choice.token_ids == want.token_ids
    lps = choice.logprobs
    n = len(want.token_ids)
    assert len(lps.tokens) == len(lps.token_logprobs) == len(lps.top_logprobs) == len(lps.text_offset) == n
    for i, (token, logits) in enumerate(zip(want.token_ids, want.logits)):
        lp = log_softmax(logits)
        assert lps.tokens[i] == token_bytes(token).decode("utf-8", errors="replace")
        assert lps.token_logprobs[i] == pytest.approx(float(lp[token]), abs=1e-5)
        top = lps.top_logprobs[i]  # the top 5 and the chosen one, by text (byte tokens may share one: U+FFFD)
        assert max(top.values()) == pytest.approx(float(lp.max()), abs=1e-5)
        assert lps.tokens[i] in top and 1 <= len(top) <= 6
        allowed = torch.topk(lp, 5).values.tolist() + [float(lp[token])]
        assert all(any(abs(v - a) < 1e-5 for a in allowed) for v in top.values())
    assert lps.text_offset[0] == 0
    assert lps.text_offset == sorted(lps.text_offset) and lps.text_offset[-1] <= len(choice.text)


def test_echo_lays_the_prompt_before_the_completion_with_its_tokens_logprobs(server, reference, token_bytes):
    client = server.client()
    plain = client.completions.create(model=server.name, prompt=PROMPT, max_tokens=6, logprobs=2)
    echoed = client.completions.create(model=server.name, prompt=PROMPT, max_tokens=6, logprobs=2, echo=True)
    prompt_text = echoed.choices[0].text[: len(echoed.choices[0].text) - len(plain.choices[0].text)]
    assert echoed.choices[0].text == prompt_text + plain.choices[0].text and prompt_text
    lps, tail = echoed.choices[0].logprobs, plain.choices[0].logprobs
    n = len(PROMPT)
    assert lps.tokens[:n] == [token_bytes(t).decode("utf-8", errors="replace") for t in PROMPT]
    assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None  # nothing comes before the first
    for i in range(1, n):  # the prompt's token i given the i before it: a run of that prefix, its first position
        lp = log_softmax(reference(PROMPT[:i], 1).logits[0])
        assert lps.token_logprobs[i] == pytest.approx(float(lp[PROMPT[i]]), abs=1e-5)
        assert max(lps.top_logprobs[i].values()) == pytest.approx(float(lp.max()), abs=1e-5)
    assert lps.tokens[n:] == tail.tokens and lps.token_logprobs[n:] == tail.token_logprobs
    assert lps.text_offset[0] == 0 and lps.text_offset == sorted(lps.text_offset)
    assert lps.text_offset[n:] == [o + len(prompt_text) for o in tail.text_offset]  # moved past the prompt's text
    assert echoed.usage == plain.usage  # the prompt is counted once, as a prompt


def test_an_echoed_stream_joins_to_the_whole_answer(server):
    client = server.client()
    args = dict(model=server.name, prompt=PROMPT, max_tokens=8, logprobs=1, echo=True, n=2)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(stream=True, **args))
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(c.text for c in mine) == whole.choices[i].text
        parts = {k: sum((c.logprobs.model_dump()[k] for c in mine if c.logprobs), []) for k in
                 ("tokens", "token_logprobs", "text_offset")}
        assert parts == {k: whole.choices[i].logprobs.model_dump()[k] for k in parts}
    n = len(PROMPT)  # each choice's prompt logprobs are the prompt's, whichever sequence prefilled it
    assert whole.choices[1].logprobs.token_logprobs[:n] == whole.choices[0].logprobs.token_logprobs[:n]
    assert None not in whole.choices[1].logprobs.token_logprobs[1:n]


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_0_with_echo_scores_the_prompt_alone(server, stream):
    """How evaluation harnesses score text (lm-eval's loglikelihood): the prompt back with its tokens' logprobs, nothing
    generated, no completion tokens counted."""
    client = server.client()
    args = dict(model=server.name, prompt=PROMPT, logprobs=1, echo=True)
    longer = client.completions.create(max_tokens=3, **args)
    n = len(PROMPT)
    if stream:
        chunks = [c for c in client.completions.create(max_tokens=0, stream=True, **args) if c.choices]
        text = "".join(c.choices[0].text for c in chunks)
        lps = {k: sum((c.choices[0].logprobs.model_dump()[k] for c in chunks if c.choices[0].logprobs), [])
               for k in ("tokens", "token_logprobs")}
        assert chunks[-1].choices[0].finish_reason == "length"
    else:
        got = client.completions.create(max_tokens=0, extra_body={"return_token_ids": True}, **args)
        choice = got.choices[0]
        text, lps = choice.text, choice.logprobs.model_dump()
        assert choice.finish_reason == "length" and choice.token_ids == []
        assert got.usage.completion_tokens == 0 and got.usage.prompt_tokens == n
    assert text == longer.choices[0].text[:len(text)] and len(text) < len(longer.choices[0].text)
    assert lps["tokens"] == longer.choices[0].logprobs.tokens[:n] and len(lps["tokens"]) == n
    assert lps["token_logprobs"] == longer.choices[0].logprobs.token_logprobs[:n]


def test_a_scored_prompt_counts_no_generated_token_in_the_metrics(server):
    def generated() -> float:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("kestrel_generation_tokens_total"))

    before = generated()
    server.client().completions.create(model=server.name, prompt=PROMPT, max_tokens=2, echo=True,
                                       extra_body={"ignore_eos": True})
    assert generated() == before + 2  # the counter counts
    server.client().completions.create(model=server.name, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    assert generated() == before + 2


def test_max_tokens_0_without_echo_is_a_400_naming_echo(server):
    r = server.post("/v1/completions", {"model": server.name, "prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "0 only with a completion's echo" in r.json()["error"]["message"]
    chat = server.post("/v1/chat/completions", {"model": server.name, "max_tokens": 0,
                                                "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_tokens"


def test_sampled_logprobs_are_the_models_before_temperature(server, reference):
    """vLLM's default: the model's own distribution, not the one the token was drawn from."""
    settings = {"temperature": 0.7, "seed": 11}
    got = server.client().completions.create(model=server.name, prompt=PROMPT, max_tokens=8, logprobs=0,
                                             extra_body={"return_token_ids": True}, **settings)
    want = reference(PROMPT, 8, **settings)
    assert got.choices[0].token_ids == want.token_ids
    assert got.choices[0].logprobs.token_logprobs == pytest.approx(
        [float(log_softmax(lg)[t]) for t, lg in zip(want.token_ids, want.logits)], abs=1e-5)


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_logprobs_join_to_the_whole_answers(server, chat):
    client = server.client()
    if chat:
        args = dict(model=server.name, messages=MESSAGES, max_tokens=12, logprobs=True, top_logprobs=3)
        whole = client.chat.completions.create(**args).choices[0].logprobs.model_dump()["content"]
        chunks = list(client.chat.completions.create(stream=True, **args))
        parts = sum((c.choices[0].logprobs.model_dump()["content"] for c in chunks
                     if c.choices and c.choices[0].logprobs), [])
    else:
        args = dict(model=server.name, prompt=PROMPT, max_tokens=12, logprobs=2)
        whole = client.completions.create(**args).choices[0].logprobs.model_dump()
        chunks = list(client.completions.create(stream=True, **args))
        parts = {k: sum((c.choices[0].logprobs.model_dump()[k] for c in chunks if c.choices[0].logprobs), [])
                 for k in whole}
    assert parts == whole and whole


def test_no_logprobs_unless_asked(server):
    got = server.client().completions.create(model=server.name, prompt=PROMPT, max_tokens=4)
    assert got.choices[0].logprobs is None
    reply = server.client().chat.completions.create(model=server.name, messages=MESSAGES, max_tokens=4,
                                                    logprobs=False)
    assert reply.choices[0].logprobs is None


# --- n ---------------------------------------------------------------------------------------------------------

def test_n_greedy_choices_are_n_copies_of_the_one(server):
    client = server.client()
    one = client.completions.create(model=server.name, prompt=PROMPT, max_tokens=10, logprobs=1,
                                    extra_body={"return_token_ids": True})
    three = client.completions.create(model=server.name, prompt=PROMPT, max_tokens=10, n=3, logprobs=1,
                                      extra_body={"return_token_ids": True})
    assert [c.index for c in three.choices] == [0, 1, 2]
    for c in three.choices:
        assert (c.text, c.token_ids, c.finish_reason) == (one.choices[0].text, one.choices[0].token_ids,
                                                          one.choices[0].finish_reason)
        assert c.logprobs.token_logprobs == pytest.approx(one.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert three.usage.prompt_tokens == one.usage.prompt_tokens == len(PROMPT)
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert three.usage.total_tokens == three.usage.prompt_tokens + three.usage.completion_tokens


def test_n_sampled_choices_with_a_seed_are_reproducible_and_each_its_seeds_run(server, reference):
    client = server.client()
    settings = {"temperature": 1.0, "seed": 42}

    def ask():
        got = client.completions.create(model=server.name, prompt=PROMPT, max_tokens=16, n=2,
                                        extra_body={"return_token_ids": True}, **settings)
        return [c.token_ids for c in got.choices]

    first = ask()
    assert ask() == first  # the same seed, the same choices
    assert first[0] != first[1]  # seeds 42 and 43 draw differently
    assert first == [reference(PROMPT, 16, temperature=1.0, seed=42 + i).token_ids for i in range(2)]


def test_chat_n_choices(server):
    reply = server.client().chat.completions.create(model=server.name, messages=MESSAGES, max_tokens=6, n=2,
                                                    temperature=0.8, seed=3)
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.message.role == "assistant" for c in reply.choices)


@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_of_n_choices_tags_each_chunk_with_its_index(server, chat):
    client = server.client()
    common = dict(model=server.name, max_tokens=10, n=3, temperature=1.0, seed=5)
    if chat:
        args = dict(messages=MESSAGES, **common)
        whole = client.chat.completions.create(**args)
        texts = [c.message.content for c in whole.choices]
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
        piece = lambda ch: ch.delta.content or ""  # noqa: E731
    else:
        args = dict(prompt=PROMPT, **common)
        whole = client.completions.create(**args)
        texts = [c.text for c in whole.choices]
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
        piece = lambda ch: ch.text  # noqa: E731
    streamed, finished = ["", "", ""], [None, None, None]
    for chunk in chunks[:-1]:
        assert len(chunk.choices) == 1  # one choice a chunk, tagged with its index
        ch = chunk.choices[0]
        assert finished[ch.index] is None  # nothing of a choice after its last chunk
        streamed[ch.index] += piece(ch)
        finished[ch.index] = ch.finish_reason
    assert streamed == texts
    assert finished == [c.finish_reason for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    if chat:
        roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
        assert sorted(roles) == [0, 1, 2]


def test_n_choices_that_could_never_fit_are_a_400_naming_n_and_the_limits(model_dir):
    """Past --max-batch plus --max-queue no retry can fit them: a 429 with Retry-After sent clients retrying forever."""
    s = Server(model_dir, "--max-batch", "2", "--max-queue", "1")
    try:
        for path, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": MESSAGES})):
            response = s.post(path, {**body, "max_tokens": 4, "n": 4})
            error = assert_openai_error(response, 400, "n")
            assert "retry-after" not in response.headers
            assert "n at most 3" in error["message"] and "--max-batch" in error["message"], error
        assert len(s.client().completions.create(model=s.name, prompt=PROMPT, max_tokens=4, n=3).choices) == 3
    finally:
        s.stop(30)


# --- refusals --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path, change, param", [
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"logprobs": "3"}, "logprobs"),
    ("/v1/completions", {"logprobs": 2.5}, "logprobs"),
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"n": 9}, "n"),
    ("/v1/completions", {"n": "2"}, "n"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": "5"}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"n": 100}, "n"),
])
def test_out_of_range_logprobs_and_n_are_a_400_naming_the_field(server, path, change, param):
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES}
    response = server.post(path, {**body, "max_tokens": 2, **change})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param in error["message"] and "\n" not in error["message"]


def test_a_tokens_bytes_are_its_own(tmp_path, token_bytes):
    """Byte-level: a token's bytes through GPT-2's table (part of a character too); byte fallback: its one byte."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    from kestrel_core.formats.tokenizer import Tokenizer

    assert token_bytes(65) == b"A" and token_bytes(0xE2) == b"\xe2" and token_bytes(256) == b"<|endoftext|>"
    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"▁Hello": 256}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.save(str(tmp_path / "tokenizer.json"))
    fallback = Tokenizer(tmp_path / "tokenizer.json")
    assert fallback.token_bytes(0xE2) == b"\xe2" and fallback.token_bytes(256) == b" Hello"


# --- found by a mutation pass ---------------------------------------------------------------------------
def test_echo_offsets_are_where_each_prompt_tokens_text_begins(tiny_ckpt):
    from kestrel_core.engine.results import TokenLogprobs
    from kestrel_core.serve.echo import Echo
    from kestrel_core.serve.logprobs import LogprobText

    with load(tiny_ckpt) as model:
        tok = model.tokenizer
        ids = tok.encode("Hello, world")
        cut = tok.encode("Hi é")[:-1]  # ends inside é: its last byte is missing
        echo = Echo(tok, ids)
        got = echo.logprobs(LogprobText(tok), [TokenLogprobs(t, -1.0) for t in ids[1:]])
        assert echo.text == tok.decode(ids) and Echo(tok, cut).text == tok.decode(cut)  # a cut character shows
    assert got["text_offset"] == [len(tok.decode(ids[:i])) for i in range(len(ids))]
    assert got["tokens"] == list("Hello, world")
