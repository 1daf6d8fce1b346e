"""The logit processors a request may set (OpenAI's presence_penalty, frequency_penalty and logit_bias, vLLM's
repetition_penalty): their arithmetic, and that each token a run chooses is the argmax of its step's logits so
processed, whether the sequence runs alone or in a batch."""

from __future__ import annotations

import pytest
import torch

from kestrel_core import load
from kestrel_core.config import GenerationConfig
from kestrel_core.engine.sampling import process, processes
from kestrel_core.errors import ConfigError

PROMPT = [5, 17, 42, 5, 17, 99]


def test_each_processor_moves_the_logits_it_names():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    gen = GenerationConfig(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0,
                           logit_bias={"4": 10.0})
    out = process(logits, gen, prompt=[0], generated=[1, 1, 3])
    # 0: seen in the prompt (repetition only): 2 / 2; 1: generated twice, negative: -1 * 2 - 0.25 * 2 - 0.5
    # 2: untouched; 3: generated once, positive: 3 / 2 - 0.25 - 0.5; 4: biased, not seen: -2 + 10
    assert out.tolist() == [1.0, -3.0, 0.5, 0.75, 8.0]
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0, -2.0]  # a new tensor: the step's logits stay as they were
    assert not processes(GenerationConfig()) and processes(GenerationConfig(logit_bias={"1": 0.5}))


@pytest.mark.parametrize("bad, says", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"logit_bias": {"3": 100.5}}, "must be a number in -100..100"),
    ({"logit_bias": {"-1": 1}}, "is not a token id"), ({"logit_bias": [1, 2]}, "must map token ids to biases"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "at most 300"),
])
def test_a_bad_setting_is_one_line(bad, says):
    with pytest.raises(ConfigError, match=says):
        GenerationConfig(**bad)


SETTINGS = [
    {"presence_penalty": 1.5},
    {"frequency_penalty": 1.0},
    {"repetition_penalty": 1.8},
    {"presence_penalty": -0.5, "frequency_penalty": 0.7, "repetition_penalty": 1.2, "logit_bias": {"99": 0.3}},
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(s))
def test_each_token_is_the_argmax_of_its_processed_logits_alone_and_in_a_batch(tiny_ckpt, settings):
    gen = GenerationConfig(**settings)
    with load(tiny_ckpt) as model, model.open(backend="cpu_ref", keep=2) as run:
        res = run.generate(prompt_ids=PROMPT, max_new_tokens=12, stop_at_eos=False, keep_logits=True, **settings)
        plain = run.generate(prompt_ids=PROMPT, max_new_tokens=12, stop_at_eos=False).token_ids
        got = run.generate_batch([dict(prompt_ids=PROMPT, max_new_tokens=12, stop_at_eos=False, **settings),
                                  dict(prompt_ids=PROMPT, max_new_tokens=12, stop_at_eos=False),
                                  dict(prompt_ids=[7, 8], max_new_tokens=12, stop_at_eos=False, **settings)],
                                 max_batch=3)
        other = run.generate(prompt_ids=[7, 8], max_new_tokens=12, stop_at_eos=False, **settings).token_ids
    ids = res.token_ids
    for i, token in enumerate(ids):
        assert token == int(torch.argmax(process(res.logits[i], gen, PROMPT, ids[:i]))), i
    assert ids != plain  # the processors moved the choice
    assert [r.token_ids for r in got] == [ids, plain, other]


def test_a_bias_forces_or_bans_a_token_and_an_id_past_the_vocabulary_is_refused(tiny_ckpt):
    with load(tiny_ckpt) as model, model.open(backend="cpu_ref") as run:
        plain = run.generate(prompt_ids=PROMPT, max_new_tokens=6, stop_at_eos=False).token_ids
        assert run.generate(prompt_ids=PROMPT, max_new_tokens=6, stop_at_eos=False,
                            logit_bias={"123": 100}).token_ids == [123] * 6
        banned = run.generate(prompt_ids=PROMPT, max_new_tokens=6, stop_at_eos=False,
                              logit_bias={str(plain[0]): -100}).token_ids
        assert banned[0] != plain[0] and plain[0] not in banned
        with pytest.raises(ConfigError, match=r"logit_bias: token id 512 is outside the vocabulary \(0..511\)"):
            run.request(prompt_ids=PROMPT, logit_bias={"512": 1})


def test_a_penalised_sequence_decodes_without_drafts(tiny_ckpt):
    """A verify pass keeps a draft that is the target's argmax, which a penalty moves: such a sequence decodes plainly,
    its ids those of the same run without a drafter."""
    repeating = [5, 17, 42, 99, 3, 5, 17, 42, 99, 3, 5, 17]
    with load(tiny_ckpt) as model:
        with model.open(backend="cpu_ref") as run:
            want = run.generate(prompt_ids=repeating, max_new_tokens=10, stop_at_eos=False, frequency_penalty=1.0)
        with model.open(backend="cpu_ref", draft="ngram:1", draft_tokens=4) as run:
            got = run.generate(prompt_ids=repeating, max_new_tokens=10, stop_at_eos=False, frequency_penalty=1.0)
            drafted = run.generate(prompt_ids=repeating, max_new_tokens=10, stop_at_eos=False)
    assert got.token_ids == want.token_ids and not got.speculative
    assert drafted.speculative and drafted.speculative["drafted"] > 0
