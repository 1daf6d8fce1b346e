"""Sequences with one prompt share its prefill (a request's n choices; two requests that send the same prompt): the
prompt goes through the layers once, the others take a copy of its keys and values and its last logits, and each
sequence's ids are still its solo run's, greedy or sampled with its own seed, dense and MoE, in one chunk or several,
and when the one that prefills leaves before its prefill ends (cpu_ref)."""

from __future__ import annotations

import pytest

from kestrel_core import load
from kestrel_core.engine.batch import Batch
from kestrel_core.tools.presets import preset_config, write_checkpoint

PROMPT = [7, 8, 9, 10, 11, 12, 13, 14, 15]
OTHER = [5, 17, 42]
SETTINGS = [dict(), dict(temperature=0.9, seed=1), dict(temperature=0.9, seed=2), dict(temperature=1.3, top_k=9, seed=3)]


@pytest.fixture(scope="module", params=["tiny", "tiny-moe"])
def model_dir(request, tmp_path_factory):
    return write_checkpoint(preset_config(request.param), tmp_path_factory.mktemp("shared") / request.param)


def prompt_tokens_stepped(run, monkeypatch) -> list[int]:
    """Every prompt token a step of ``run`` carried (a spy on the runner's steps)."""
    seen: list[int] = []
    step = run.runner.step

    def spy(s, request, sample=None):
        for span, ids in request.spans:
            seen.extend(ids)
        return step(s, request, sample)

    monkeypatch.setattr(run.runner, "step", spy)
    return seen


@pytest.mark.parametrize("chunk", [None, 4])
def test_one_prompts_sequences_prefill_it_once_and_each_keep_its_solo_ids(model_dir, chunk, monkeypatch):
    with load(model_dir) as model, model.open(backend="cpu_ref", keep=2) as run:
        alone = [run.generate(prompt_ids=PROMPT, max_new_tokens=6, stop_at_eos=False, keep_logits=True, **g)
                 for g in SETTINGS]
        other = run.generate(prompt_ids=OTHER, max_new_tokens=6, stop_at_eos=False).token_ids
        seen = prompt_tokens_stepped(run, monkeypatch)
        got = run.generate_batch([dict(prompt_ids=PROMPT, max_new_tokens=6, stop_at_eos=False, keep_logits=True, **g)
                                  for g in SETTINGS] + [dict(prompt_ids=OTHER, max_new_tokens=6, stop_at_eos=False)],
                                 max_batch=5, prefill_chunk=chunk)
    assert sorted(seen) == sorted(PROMPT + OTHER)  # each prompt through the layers once, not four times
    assert [r.token_ids for r in got[:4]] == [r.token_ids for r in alone] and got[4].token_ids == other
    assert len({tuple(r.token_ids) for r in got[:4]}) > 1  # the seeds drew apart: not one sequence copied
    for shared, solo in zip(got[:4], alone):  # the first token's logits are the prompt's own
        assert shared.logits[0].equal(solo.logits[0])


def test_when_the_one_that_prefills_leaves_the_others_prefill_on_their_own(model_dir):
    with load(model_dir) as model, model.open(backend="cpu_ref", keep=2) as run:
        want = run.generate(prompt_ids=PROMPT, max_new_tokens=5, stop_at_eos=False, **SETTINGS[1]).token_ids
        with Batch(run.runner, 2, 32, prefill_chunk=3) as b:
            lead = b.add(run.request(prompt_ids=PROMPT, max_new_tokens=5, stop_at_eos=False))
            follow = b.add(run.request(prompt_ids=PROMPT, max_new_tokens=5, stop_at_eos=False, **SETTINGS[1]))
            b.step()  # both admitted; the first's first chunk
            assert follow.leader is lead and 0 < lead.prefilled < len(PROMPT)
            lead.cancel()
            b.run_until_done()
    assert lead.finish_reason == "cancelled" and follow.leader is None
    assert follow.tokens == want and follow.error is None


def test_prompts_that_differ_or_ask_for_their_own_logprobs_are_not_shared(model_dir, monkeypatch):
    import attrs

    with load(model_dir) as model, model.open(backend="cpu_ref") as run:
        seen = prompt_tokens_stepped(run, monkeypatch)
        reqs = [run.request(prompt_ids=PROMPT, max_new_tokens=2), run.request(prompt_ids=PROMPT[:-1], max_new_tokens=2),
                attrs.evolve(run.request(prompt_ids=PROMPT, max_new_tokens=2), prompt_logprobs=1)]
        got = run.generate_batch(reqs, max_batch=3)
    assert sorted(seen) == sorted(PROMPT * 2 + PROMPT[:-1])
    assert len(got[2].prompt_logprobs) == len(PROMPT) - 1
