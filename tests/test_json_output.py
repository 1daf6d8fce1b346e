"""Output held to a JSON schema (``json_schema=`` in the Python API; ``response_format`` in kestrel serve): the sampler
chooses only among the ids the grammar allows, the value ends with an end id, a schema kestrel cannot use is a
one-line error naming it, and a constrained sequence leaves its batch companions' ids as they are.

The tiny presets' random weights would write anything: what they write under a schema is the grammar's doing. The
real model (SmolLM2-135M-Instruct) shows a schema's value filled in sensibly."""

from __future__ import annotations

import ctypes
import json
import types
from pathlib import Path

import attrs
import pytest
import torch

from bench.serve_process import ServeProcess
from kestrel_core.config import GenerationConfig
from kestrel_core.engine.grammar import MAX_SCHEMA_CHARS, GrammarError
from kestrel_core.engine.run import load
from kestrel_core.engine.sampling import Sampler
from kestrel_core.engine.scheduler import Scheduler
from kestrel_core.errors import ConfigError, KestrelError
from kestrel_core.tools.presets import preset_config, write_checkpoint
from conftest import BACKENDS, GPU_BACKENDS
from serve_helpers import assert_openai_error, chat_model
from tests.real_model import smollm2_gguf  # noqa: F401 - a fixture
from test_graphs import replaying  # noqa: F401 - a fixture (cpu_ref whose steps are captured and replayed)

YES_NO = {"enum": ["yes", "no"]}
FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
        "additionalProperties": False}
PROMPTS = [[5, 17, 42], [9, 9, 9, 100], [3, 1, 4, 1, 5, 9, 2, 6]]


class Only:
    """A constraint that allows one id, and records what it heard."""

    def __init__(self, allowed: int, vocab: int):
        self.mask = torch.zeros(vocab, dtype=torch.bool)
        self.mask[allowed] = True
        self.heard: list[int] = []

    def allowed(self) -> torch.Tensor:
        return self.mask

    def accept(self, token: int) -> None:
        self.heard.append(token)


# --- the sampler ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_the_sampler_chooses_only_what_the_constraint_allows(temperature):
    logits = torch.arange(10, dtype=torch.float32)  # 9 is the argmax
    only = Only(3, 10)
    sampler = Sampler(GenerationConfig(temperature=temperature), only)
    assert sampler.on_host  # a constrained row is chosen on the host, even greedy
    assert [sampler(logits) for _ in range(5)] == [3] * 5
    assert only.heard == [3] * 5
    assert torch.equal(logits, torch.arange(10, dtype=torch.float32))  # the step's logits are not written


def test_a_constraint_that_allows_nothing_or_covers_another_vocabulary_is_an_error():
    empty = Only(0, 10)
    empty.mask[:] = False
    with pytest.raises(ValueError, match="allows no id"):
        Sampler(GenerationConfig(), empty)(torch.zeros(10))
    with pytest.raises(ValueError, match="covers 12 ids and the logits 10"):
        Sampler(GenerationConfig(), Only(0, 12))(torch.zeros(10))


# --- the engine on the tiny presets --------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["tiny", "tiny-moe"])
def model_dir(request, tmp_path_factory) -> Path:
    return write_checkpoint(preset_config(request.param), tmp_path_factory.mktemp("json") / request.param)


@pytest.fixture(scope="module", params=[pytest.param(b, marks=[pytest.mark.cuda] if b in GPU_BACKENDS else [], id=b)
                                        for b in BACKENDS])
def run(model_dir, request):
    """An open run of each preset on each backend under test (cuda takes a greedy row's mask into its captured step)."""
    with load(model_dir) as model, model.open(backend=request.param) as r:
        yield r


@pytest.mark.parametrize("prompt", PROMPTS)
def test_a_schema_holds_random_weights_to_its_values_and_the_value_ends_the_sequence(run, prompt):
    free = run.generate(prompt_ids=prompt, max_new_tokens=12, stop_at_eos=False)
    assert free.text not in ('"yes"', '"no"')  # the weights alone write something else
    for schema, check in ((YES_NO, lambda v: v in ("yes", "no")), (FLAG, lambda v: isinstance(v["ok"], bool))):
        r = run.generate(prompt_ids=prompt, max_new_tokens=60, json_schema=schema)
        assert check(json.loads(r.text)), r.text
        assert r.token_ids[-1] in run.model.eos_ids  # ended at an end id once whole, not at max_new_tokens


def test_sampled_constrained_output_is_valid_and_reproducible(run):
    kw = dict(prompt_ids=PROMPTS[0], max_new_tokens=60, json_schema=FLAG, temperature=1.0, seed=7)
    a, b = run.generate(**kw), run.generate(**kw)
    assert a.token_ids == b.token_ids and isinstance(json.loads(a.text)["ok"], bool)


def test_a_constrained_sequence_leaves_its_batch_companions_ids_as_they_are(run):
    solo = [run.generate(prompt_ids=p, max_new_tokens=10, stop_at_eos=False).token_ids for p in PROMPTS[1:]]
    batch = run.generate_batch([dict(prompt_ids=PROMPTS[0], max_new_tokens=40, json_schema=YES_NO)]
                               + [dict(prompt_ids=p, max_new_tokens=10, stop_at_eos=False) for p in PROMPTS[1:]])
    assert json.loads(run.model.tokenizer.decode(batch[0].token_ids[:-1])) in ("yes", "no")
    assert [r.token_ids for r in batch[1:]] == solo


def test_a_greedy_constrained_row_is_masked_on_the_device_and_gives_the_hosts_ids(run, monkeypatch):
    """A greedy row held to a grammar takes its argmax among the allowed ids in the step itself: the same ids as the
    host's choice, and its logits never come to the host. A sampled one is still drawn on the host."""
    from kestrel_core.engine.batch import Batch
    from kestrel_core.engine.runner import Runner

    assert run.runner.masks_on_device
    assert Sampler(GenerationConfig(), Only(3, 10), device_masks=True).masks_on_device
    assert not Sampler(GenerationConfig(), Only(3, 10), device_masks=True).on_host
    assert Sampler(GenerationConfig(temperature=1.0), Only(3, 10), device_masks=True).on_host
    assert Sampler(GenerationConfig(presence_penalty=0.5), Only(3, 10), device_masks=True).on_host
    asks = [dict(prompt_ids=PROMPTS[0], max_new_tokens=40, json_schema=FLAG),
            dict(prompt_ids=PROMPTS[1], max_new_tokens=40, json_schema=YES_NO),
            dict(prompt_ids=PROMPTS[2], max_new_tokens=10, stop_at_eos=False)]
    drawn = []
    real = Batch._sample_row
    monkeypatch.setattr(Batch, "_sample_row", lambda self, slot, logits: drawn.append(slot) or real(self, slot, logits))
    on_device = [r.token_ids for r in run.generate_batch(asks)]
    assert drawn == []  # no row's logits came to the host
    monkeypatch.setattr(Runner, "masks_on_device", property(lambda self: False))
    on_host = [r.token_ids for r in run.generate_batch(asks)]
    assert drawn  # the host chose the constrained rows' tokens this time
    assert on_device == on_host
    assert on_device[1][-1] in run.model.eos_ids  # the enum's value whole, then an end id, as the grammar holds it
    assert json.loads(run.model.tokenizer.decode(on_device[1][:-1])) in ("yes", "no")


def overlapped(run, monkeypatch) -> None:
    """A greedy row held to FLAG: each of its steps is read back after the next step's pass is launched (a "pass"
    event once a step's pass is launched: eager, captured or replayed), and its ids are the host's choice's."""
    from kestrel_core.engine.runner import Runner
    from kestrel_core.engine.step_graphs import StepGraphs

    events, inside = [], []
    real_pass, real_graphs, real_read = Runner.decode_step, StepGraphs.__call__, Runner.read

    def decode_step(self, *a, **k):
        out = real_pass(self, *a, **k)
        if not inside:  # a step with spans: no graphs around it
            events.append("pass")
        return out

    def graphs(self, *a, **k):
        inside.append(1)
        try:
            return real_graphs(self, *a, **k)
        finally:
            inside.pop()
            events.append("pass")

    ask = dict(prompt_ids=PROMPTS[0], max_new_tokens=40, json_schema=FLAG)
    with monkeypatch.context() as m:
        m.setattr(Runner, "decode_step", decode_step)
        m.setattr(StepGraphs, "__call__", graphs)
        m.setattr(Runner, "read", lambda self, s, step, *a, **k: events.append(f"read {step.index}")
                  or real_read(self, s, step, *a, **k))
        got = run.generate_batch([ask])[0]
    decode = events[events.index("pass") + 1:]  # after the prompt's pass
    passes = [i for i, e in enumerate(decode) if e == "pass"]
    assert len(passes) >= 4, decode
    for k in range(1, len(got.token_ids) - 1):  # step k (step 0 is the prompt's) is read after step k + 1's pass
        assert decode.index(f"read {k}") > passes[k], decode
    with monkeypatch.context() as m:
        m.setattr(Runner, "masks_on_device", property(lambda self: False))
        assert got.token_ids == run.generate_batch([ask])[0].token_ids


def test_a_masked_rows_grammar_runs_while_the_next_pass_computes(run, monkeypatch):
    """A grammar's next mask needs the token before it; the host reads that token, moves the grammar on and makes the
    mask only once the next step's pass is launched (the device computes it meanwhile), so each step is read back
    after the next one's pass, as a plain greedy row's is, never before it: no wait a token. Its ids are the host's."""
    overlapped(run, monkeypatch)


def test_a_masked_row_in_captured_steps_is_picked_after_each_replay(model_dir, replaying, monkeypatch):
    """The same where the decode steps are captured and replayed (cpu_ref recording its steps as cuda captures them):
    the argmax under the mask is taken after each replay, outside the graph."""
    with load(model_dir) as model, model.open(backend="replaying") as r:
        overlapped(r, monkeypatch)
    assert "replay" in replaying.log


class Closing(Only):
    """Allows one id twice, then none: a grammar that fails mid-value."""

    def allowed(self) -> torch.Tensor:
        return self.mask if len(self.heard) < 2 else torch.zeros_like(self.mask)


def failing_beside_a_companion(run, constraint, stop_at_eos: bool = False):
    """A constrained request (``constraint()`` its grammar's state; ending at an end id where ``stop_at_eos``) and a
    plain one in one scheduler's batch: both finished, the scheduler's own error, and the plain one's solo ids."""
    failing = attrs.evolve(run.request(prompt_ids=PROMPTS[0], max_new_tokens=8, stop_at_eos=stop_at_eos),
                           constraint=constraint)
    other = run.request(prompt_ids=PROMPTS[1], max_new_tokens=6, stop_at_eos=False)
    sched = Scheduler(run, max_batch=2, max_queue=4)
    sched.start()
    try:
        a, b = sched.submit(failing), sched.submit(other)
        assert a.finished.wait(60) and b.finished.wait(60)
    finally:
        sched.stop(cancel=True)
    return a, b, sched.error, run.generate(prompt_ids=PROMPTS[1], max_new_tokens=6, stop_at_eos=False).token_ids


def test_a_mask_that_fails_mid_value_ends_its_sequence_and_its_companions_go_on(run):
    a, b, error, solo = failing_beside_a_companion(run, lambda: Closing(7, run.runner.vocab_size))
    assert a.finish_reason == "error" and "allows no id" in str(a.error) and a.tokens == [7, 7]
    assert error is None and b.error is None and b.tokens == solo


def test_a_slot_a_masked_sequence_left_allows_every_id_to_the_next(run):
    """Two slots: the enum's sequence ends, a plain one takes its slot while the other keeps its mask: the plain one's
    ids are its solo ids (a mask left on the slot would hold it to the enum's end ids)."""
    plain = dict(prompt_ids=PROMPTS[2], max_new_tokens=10, stop_at_eos=False)
    got = run.generate_batch([dict(prompt_ids=PROMPTS[0], max_new_tokens=40, json_schema=YES_NO),
                              dict(prompt_ids=PROMPTS[1], max_new_tokens=40, json_schema=FLAG), plain], max_batch=2)
    assert json.loads(run.model.tokenizer.decode(got[0].token_ids[:-1])) in ("yes", "no")
    assert got[2].token_ids == run.generate(**plain).token_ids


class Ending(Only):
    """Allows one id, then only an end id, then none: a grammar whose value is whole."""

    def __init__(self, allowed: int, end: int, vocab: int):
        super().__init__(allowed, vocab)
        self.end = torch.zeros(vocab, dtype=torch.bool)
        self.end[end] = True

    def allowed(self) -> torch.Tensor:
        return [self.mask, self.end][len(self.heard)] if len(self.heard) < 2 else torch.zeros_like(self.mask)


def test_a_masked_sequence_that_ends_asks_no_mask_past_its_end(run):
    """Its end id is read back in the step after it was chosen, once the next step's pass was launched: the sequence
    has ended there, and its grammar (which allows nothing past the end) is not asked for another mask."""
    end = min(run.model.eos_ids)
    a, b, error, solo = failing_beside_a_companion(run, lambda: Ending(7, end, run.runner.vocab_size), stop_at_eos=True)
    assert (a.finish_reason, a.error, a.tokens) == ("stop", None, [7, end])
    assert error is None and b.error is None and b.tokens == solo


class Refusing(Only):
    """Allows one id, and fails on hearing it the second time: a matcher that errs on a token the step chose."""

    def accept(self, token: int) -> None:
        super().accept(token)
        if len(self.heard) == 2:
            raise KestrelError("the grammar's matcher failed on a token")


def test_a_matcher_that_fails_on_the_devices_token_ends_only_its_sequence(run):
    a, b, error, solo = failing_beside_a_companion(run, lambda: Refusing(7, run.runner.vocab_size))
    assert a.finish_reason == "error" and "matcher failed" in str(a.error) and a.tokens == [7]
    assert error is None and b.error is None and b.tokens == solo


def test_a_grammar_that_fails_to_start_ends_its_request_and_the_scheduler_goes_on(run):
    def broken():
        raise GrammarError("the JSON schema cannot be used: broken")

    sched = Scheduler(run, max_batch=2, max_queue=4)
    sched.start()
    try:
        bad = sched.submit(attrs.evolve(run.request(prompt_ids=PROMPTS[0], max_new_tokens=4), constraint=broken))
        good = sched.submit(run.request(prompt_ids=PROMPTS[1], max_new_tokens=4, stop_at_eos=False))
        assert bad.finished.wait(60) and good.finished.wait(60)
    finally:
        sched.stop(cancel=True)
    assert bad.finish_reason == "error" and "broken" in str(bad.error)
    assert sched.error is None and good.error is None
    assert good.tokens == run.generate(prompt_ids=PROMPTS[1], max_new_tokens=4, stop_at_eos=False).token_ids


def test_a_constrained_request_is_not_drafted(tmp_path):
    d = write_checkpoint(preset_config("tiny"), tmp_path / "tiny")
    with load(d) as model, model.open(backend="cpu_ref", draft="ngram", draft_tokens=3) as run:
        assert run.request(prompt_ids=PROMPTS[0]).drafter is not None
        req = run.request(prompt_ids=PROMPTS[0], max_new_tokens=40, json_schema=YES_NO)
        assert req.drafter is None and req.draft_tokens == 0  # a verify pass keeps argmax drafts the grammar forbids
        assert json.loads(run.generate(prompt_ids=PROMPTS[0], max_new_tokens=40, json_schema=YES_NO).text) in ("yes",
                                                                                                          "no")


@pytest.mark.parametrize("schema, words", [
    ({"type": "foo"}, "foo"),
    ({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, "nowhere"),
    ([1, 2], "is an object"),
    ({"enum": ["x" * 1000] * (MAX_SCHEMA_CHARS // 1000 + 1)}, "characters; at most"),
])
def test_a_schema_kestrel_cannot_use_is_a_one_line_error_naming_it(run, schema, words):
    with pytest.raises(GrammarError) as err:
        run.request(prompt_ids=PROMPTS[0], json_schema=schema)
    assert words in str(err.value) and "\n" not in str(err.value)


SELF = [
    ({"$ref": "#"}, "its root (#)"),
    ({"$defs": {"a": {"$ref": "#/$defs/a"}}}, "#/$defs/a"),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}, "its root (#)"),
    ({"allOf": [{"$ref": "#"}]}, "its root (#)"),
    ({"$ref": "#/definitions/a", "definitions": {"a": {"anyOf": [{"$ref": "#/definitions/a"}]}}}, "its root (#)"),
    # an object that holds it: the first token was allowed, and the matcher failed at the value's
    ({"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}, "#/properties/a"),
    ({"type": "array", "prefixItems": [{"$ref": "#/prefixItems/0"}]}, "#/prefixItems/0"),
]


@pytest.mark.parametrize("schema, where", SELF)
def test_a_schema_that_is_only_references_to_itself_is_refused_naming_where(run, schema, where):
    """It was taken, then failed at the token that reached it with llguidance's parser state for a message."""
    with pytest.raises(GrammarError, match="only references that lead back to it") as err:
        run.request(prompt_ids=PROMPTS[0], json_schema=schema)
    assert f"cannot be used: {where} is" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("schema", [
    {"anyOf": [{"$ref": "#"}, {"type": "string"}]},  # recursion with a way out
    {"type": "object", "properties": {"name": {"type": "string"},
                                      "children": {"type": "array", "items": {"$ref": "#"}}}, "required": ["name"]},
    {"$ref": "#/$defs/leaf", "$defs": {"leaf": {"enum": ["a", "b"]}}},
])
def test_a_schema_that_recurses_with_a_way_out_is_taken(run, schema):
    run.request(prompt_ids=PROMPTS[0], json_schema=schema)


@pytest.mark.parametrize("schema, words", [
    ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength (5) is greater than maxLength (2)"),
    ({"enum": []}, "Unsatisfiable"),
    ({"type": "integer", "minimum": 5, "maximum": 2}, "minimum (5) is greater than maximum (2)"),
    ({"type": "array", "minItems": 3, "maxItems": 1}, "minItems (3)"),
    ({"type": []}, "Unsatisfiable"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "incompatible types"),
    ({"type": "object", "required": ["a"], "additionalProperties": False}, "'a' is unsatisfiable"),
])
def test_a_schema_no_value_can_match_is_refused_when_the_request_is_checked(run, schema, words):
    with pytest.raises(GrammarError, match="the JSON schema cannot be used") as err:
        run.request(prompt_ids=PROMPTS[0], json_schema=schema)
    assert words in str(err.value)


@pytest.mark.parametrize("grammar", ['start: a\na: a "x"', 'start: a\na: b\nb: a', 'start: %json {"$ref": "#"}'])
def test_a_grammar_that_allows_no_first_token_is_refused_before_it_runs(run, grammar):
    """Its first mask is computed when the request is checked: it failed at the first token, after a server's 200."""
    with pytest.raises(GrammarError, match="allows no first token") as err:
        run.request(prompt_ids=PROMPTS[0], grammar=grammar)
    assert "<state>" not in str(err.value) and "Parser" not in str(err.value)


def test_a_schema_without_an_end_is_refused(run):
    with pytest.raises(ConfigError, match="leave stop_at_eos on"):
        run.request(prompt_ids=PROMPTS[0], json_schema=YES_NO, stop_at_eos=False)


# --- the real model -----------------------------------------------------------------------------------------------
def test_the_real_model_fills_a_schema_in(smollm2_gguf):  # noqa: F811
    person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    prompt = "Describe a person named Bob who is 42 years old, as JSON:\n"
    with load(smollm2_gguf) as model, model.open(backend="cpu_ref") as run:
        free = run.generate(prompt=prompt, max_new_tokens=24)
        held = run.generate(prompt=prompt, max_new_tokens=24, json_schema=person)
    with pytest.raises(ValueError):
        json.loads(free.text)  # left alone it wraps its JSON in prose and a fence
    assert json.loads(held.text) == {"name": "Bob", "age": 42}


# --- kestrel serve -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tiny = write_checkpoint(preset_config("tiny"), tmp_path_factory.mktemp("json-serve") / "tiny")
    s = ServeProcess(chat_model(tiny, tiny.parent / "chat"), "--backend", "cpu_ref", "--max-seq", "256")
    yield s
    s.stop(30)


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_chat_answers_in_the_schema_whole_and_streamed(server):
    client = server.client()
    kw = dict(model=server.name, messages=[{"role": "user", "content": "Is it?"}], max_tokens=60, temperature=0,
              response_format=_schema_format(FLAG))
    whole = client.chat.completions.create(**kw)
    assert isinstance(json.loads(whole.choices[0].message.content)["ok"], bool)
    assert whole.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                       if c.choices)
    assert streamed == whole.choices[0].message.content


def test_completions_take_a_response_format_and_each_of_n_choices_keeps_it(server):
    reply = server.client().completions.create(model=server.name, prompt="Answer:", max_tokens=40, n=3,
                                               temperature=1.0, seed=3,
                                               extra_body={"response_format": _schema_format(YES_NO)})
    assert len(reply.choices) == 3
    assert all(json.loads(c.text) in ("yes", "no") and c.finish_reason == "stop" for c in reply.choices)


def test_json_object_is_an_object(server):
    reply = server.client().chat.completions.create(
        model=server.name, messages=[{"role": "user", "content": "JSON please"}], max_tokens=150, temperature=0,
        response_format={"type": "json_object"})
    text = reply.choices[0].message.content
    assert text.startswith("{")
    if reply.choices[0].finish_reason == "stop":  # random weights may write one long string to the limit
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("fmt, param, words", [
    ({"type": "json_schema"}, "response_format.json_schema", "goes with type"),
    ({"type": "json_object", "json_schema": {"name": "a", "schema": {}}}, "response_format.json_schema",
     "goes with type"),
    ({"type": "json_schema", "json_schema": {"name": "no spaces", "schema": {}}}, "response_format.json_schema.name",
     "letters"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "foo"}}}, "response_format", "foo"),
    ({"type": "xml"}, "response_format.type", None),
    ({"type": "json_object", "extra": 1}, "response_format.extra", "unrecognized"),
])
def test_a_response_format_kestrel_cannot_use_is_a_400_naming_it(server, fmt, param, words):
    import httpx

    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                   json={"model": server.name, "messages": [{"role": "user", "content": "x"}], "response_format": fmt})
    error = assert_openai_error(r, 400, param)
    if words:
        assert words in error["message"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("schema", [{"$ref": "#"}, {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
                                    {"type": "string", "minLength": 5, "maxLength": 2}])
def test_a_schema_no_value_matches_is_a_400_before_any_200_and_counted_as_one(server, schema, stream):
    """It was a 500 with llguidance's parser state (streamed: a 200, an error event and no [DONE]), counted as a 5xx."""
    import httpx

    def client_errors() -> float:
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        line = next((x for x in text.splitlines()
                     if x.startswith('kestrel_requests_total{route="/v1/chat/completions",status="4xx"}')), None)
        return float(line.split()[-1]) if line else 0.0

    before = client_errors()
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"model": server.name, "messages": [{"role": "user", "content": "x"}], "stream": stream,
                         "max_tokens": 8, "response_format": _schema_format(schema)})
    error = assert_openai_error(r, 400, "response_format")
    assert error["message"].startswith("response_format: the JSON schema cannot be used: ")
    assert "<state>" not in error["message"] and "Parser" not in error["message"]
    assert client_errors() == before + 1


def test_a_response_format_with_ignore_eos_is_a_400(server):
    import httpx

    r = httpx.post(f"{server.url}/v1/completions", timeout=30,
                   json={"model": server.name, "prompt": "x", "ignore_eos": True,
                         "response_format": {"type": "json_object"}})
    assert "leave out ignore_eos" in assert_openai_error(r, 400, "ignore_eos")["message"]


def test_the_vocabularies_kept_for_end_id_sets_are_bounded(run):
    """A request's own stop ids make a new set of end ids; a server must not keep a vocabulary for each forever."""
    from kestrel_core.engine.grammar import KEPT_VOCABULARIES

    grammars = run.model.grammars()
    eos = sorted(run.model.eos_ids)
    for extra in range(KEPT_VOCABULARIES + 5):
        grammars.json(YES_NO, [*eos, 100 + extra])
    assert len(grammars._tokenizers) == KEPT_VOCABULARIES
    assert frozenset([*eos, 100 + KEPT_VOCABULARIES + 4]) in grammars._tokenizers  # the latest kept


# --- found by a mutation pass ---------------------------------------------------------------------------
def test_an_end_id_set_in_use_is_kept_however_many_others_come(run):
    """The set of end ids that every plain request uses stays made while requests' own stop ids make new sets."""
    from kestrel_core.engine.grammar import KEPT_VOCABULARIES

    grammars = run.model.grammars()
    eos = sorted(run.model.eos_ids)
    grammars.json(YES_NO, eos)
    made = grammars._tokenizers[frozenset(eos)]
    for extra in range(KEPT_VOCABULARIES + 5):
        grammars.json(YES_NO, [*eos, 100 + extra])
        grammars.json(YES_NO, eos)  # in use all the while
    assert grammars._tokenizers[frozenset(eos)] is made  # never dropped, never made again


def test_every_end_id_may_end_a_whole_value(run):
    """A request's stop id ends a constrained value as config.json's end ids do (each of them, not one)."""
    ends = [0, *sorted(run.model.eos_ids)]  # 0 (a NUL byte) sorts first
    constraint = run.model.grammars().json(YES_NO, ends).start()
    for token in run.model.tokenizer.encode('"yes"'):
        constraint.accept(token)
    allowed = constraint.allowed()
    assert [bool(allowed[i]) for i in ends] == [True] * len(ends)


def test_a_grammar_with_no_end_id_is_refused(run):
    with pytest.raises(GrammarError, match="has none"):
        run.model.grammars().json(YES_NO, [])


def test_a_schema_of_the_largest_size_is_taken():
    from kestrel_core.engine.grammar import _bounded

    assert _bounded("x" * MAX_SCHEMA_CHARS, "the JSON schema")
    with pytest.raises(GrammarError, match="characters; at most"):
        _bounded("x" * (MAX_SCHEMA_CHARS + 1), "the JSON schema")


def test_a_constraints_mask_covers_a_vocabulary_that_is_no_multiple_of_32():
    """A vocabulary of 40 ids: two 32-bit words of mask, and 40 ids back."""
    from kestrel_core.engine.grammar import Constraint

    class Matcher:
        def unsafe_compute_mask_ptr(self, ptr, nbytes):
            assert nbytes >= 8, nbytes  # llguidance writes ceil(40 / 32) words
            ctypes.memset(ptr, 0xFF, 8)

        def is_error(self):
            return False

    allowed = Constraint(Matcher(), 40).allowed()
    assert allowed.shape == (40,) and bool(allowed.all())


def test_a_constraint_that_refused_a_token_stays_stopped(run):
    constraint = run.model.grammars().json(YES_NO, sorted(run.model.eos_ids)).start()
    bad = int((~constraint.allowed()).nonzero()[0])
    with pytest.raises(KestrelError, match="is not allowed here"):
        constraint.accept(bad)
    with pytest.raises(KestrelError, match="constrained output stopped"):
        constraint.allowed()


def test_a_grammar_whose_matcher_cannot_start_is_a_grammar_error(run):
    from kestrel_core.engine.grammar import Grammar, _llguidance

    tok = run.model.grammars()._for(frozenset(run.model.eos_ids))
    with pytest.raises(GrammarError, match="the grammar cannot be used") as err:
        Grammar(_llguidance(), tok, "not a grammar", run.model.config.vocab_size, "the grammar").start()
    assert "\n" not in str(err.value)


def test_the_librarys_messages_come_back_on_one_line_and_bounded():
    from kestrel_core.engine.grammar import _one_line

    assert _one_line("1(5): Expected ':'\n1 | not a grammar\n  ^") == "1(5): Expected ':' 1 | not a grammar ^"
    assert len(_one_line("x " * 1000)) == 300


def test_a_schema_and_a_grammar_together_are_refused(run):
    with pytest.raises(ConfigError, match="both json_schema and grammar"):
        run.request(prompt_ids=PROMPTS[0], json_schema=YES_NO, grammar='start: "a"')
