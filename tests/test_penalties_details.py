"""The logit processors' edges: a repetition_penalty below 1 (which favours a seen token) processes too, the bias is
added before the repetition penalty as vLLM orders them, and ``parse_logit_bias``'s accepted and refused values."""

from __future__ import annotations

import pytest
import torch

from kestrel_core.config import LOGIT_BIAS_IDS, GenerationConfig, parse_logit_bias
from kestrel_core.engine.sampling import Sampler, process, processes
from kestrel_core.errors import ConfigError


def test_a_repetition_penalty_below_one_processes_and_chooses_on_the_host():
    gen = GenerationConfig(repetition_penalty=0.5)
    assert processes(gen) and Sampler(gen).on_host
    assert process(torch.tensor([2.0, 1.0]), gen, prompt=[0], generated=[]).tolist() == [4.0, 1.0]
    assert not Sampler(GenerationConfig()).on_host


def test_the_bias_is_added_before_the_repetition_penalty():
    gen = GenerationConfig(repetition_penalty=2.0, logit_bias={"0": 2.0})
    assert process(torch.tensor([2.0, 1.0]), gen, prompt=[0], generated=[]).tolist() == [2.0, 1.0]  # (2 + 2) / 2


def test_logit_bias_none_is_no_bias():
    assert parse_logit_bias(None) == () and GenerationConfig(logit_bias=None).logit_bias == ()


def test_logit_bias_is_sorted_pairs_of_ids_from_zero():
    assert parse_logit_bias({"9": 1, "0": -2.5, " 3 ": 100}) == ((0, -2.5), (3, 100.0), (9, 1.0))
    assert parse_logit_bias([(9, 1), (0, -2.5)]) == ((0, -2.5), (9, 1.0))  # (id, bias) pairs, as --logit-bias gives
    assert GenerationConfig(logit_bias={"9": 1, "3": 2}) == GenerationConfig(logit_bias={"3": 2, "9": 1})


def test_logit_bias_takes_as_many_ids_as_openai_does():
    assert len(parse_logit_bias({str(i): 1 for i in range(LOGIT_BIAS_IDS)})) == LOGIT_BIAS_IDS


@pytest.mark.parametrize("bias", [float("nan"), float("inf"), float("-inf"), True, "1"])
def test_a_bias_that_is_no_finite_number_is_refused(bias):
    with pytest.raises(ConfigError, match="must be a number in -100..100"):
        parse_logit_bias({"5": bias})
