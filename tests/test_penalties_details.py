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
    assert parse_logit_bias({"9": 1, "0": -2.5, "03": 100}) == ((0, -2.5), (3, 100.0), (9, 1.0))
    assert parse_logit_bias([(9, 1), (0, -2.5)]) == ((0, -2.5), (9, 1.0))  # (id, bias) pairs, as --logit-bias gives
    assert GenerationConfig(logit_bias={"9": 1, "3": 2}) == GenerationConfig(logit_bias={"3": 2, "9": 1})


def test_logit_bias_takes_as_many_ids_as_openai_does():
    assert len(parse_logit_bias({str(i): 1 for i in range(LOGIT_BIAS_IDS)})) == LOGIT_BIAS_IDS


@pytest.mark.parametrize("bias", [float("nan"), float("inf"), float("-inf"), True, "1"])
def test_a_bias_that_is_no_finite_number_is_refused(bias):
    with pytest.raises(ConfigError, match="must be a number in -100..100"):
        parse_logit_bias({"5": bias})


@pytest.mark.parametrize("key", ["\u0663", " 3 ", "3 ", "\uff13", "3_0", "+3", "-1", "3.0", "1e3", "", -1, 2.0, True])
def test_only_ascii_digits_or_an_int_are_a_token_id(key):
    """str.isdigit and int() took "\u0663" (an Arabic-Indic three), a fullwidth 3 and " 3 " as token 3."""
    with pytest.raises(ConfigError, match="is not a token id; give ids as ASCII decimal digits"):
        parse_logit_bias({key: 1})


def test_a_key_of_more_digits_than_any_vocabulary_is_refused_quoted_short():
    with pytest.raises(ConfigError, match=r"has 5,000 digits; a token id has at most 18") as err:
        parse_logit_bias({"7" * 5000: 1})
    assert len(str(err.value)) < 150


def test_one_token_named_twice_is_refused():
    with pytest.raises(ConfigError, match=r"names token 3 twice \('3' and '003'\)"):
        parse_logit_bias({"3": 1, "003": -1})
    with pytest.raises(ConfigError, match="names token 3 twice"):
        parse_logit_bias([(3, 1), (3, -1)])


@pytest.mark.parametrize("text", ["\u0663:1", "3_0:1", "+3:1", "3:1_0", "3:\u0661", "3", "3:x", "x:1"])
def test_the_logit_bias_flag_takes_ascii_ids_and_numbers_only(text):
    from kestrel_core.commands.common import _logit_bias

    with pytest.raises(ConfigError, match="--logit-bias takes ID:BIAS pairs"):
        _logit_bias(text)


def test_the_logit_bias_flag_takes_spaces_around_its_parts():
    from kestrel_core.commands.common import _logit_bias

    assert parse_logit_bias(_logit_bias("3:1, 5 : -2.5")) == ((3, 1.0), (5, -2.5))
