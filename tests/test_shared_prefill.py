"""Sequences with one prompt share its prefill (a request's n choices; two requests that send the same prompt): the
prompt goes through the layers once, the others take a copy of its keys and values and its last logits, and each
sequence's ids are still its solo run's, greedy or sampled with its own seed, dense and MoE, in one chunk or several,
and when the one that prefills leaves before its prefill ends (cpu_ref)."""

from __future__ import annotations

import attrs
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

    def spy(s, request, *rest):
        for span, ids in request.spans:
            seen.extend(ids)
        return step(s, request, *rest)

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
            for _ in range(200):  # bounded: a follower left waiting on a leader that left would step for ever
                if not b.busy:
                    break
                b.step()
            assert not b.busy
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


# --- found by a mutation pass ---------------------------------------------------------------------------
def test_prompts_that_differ_only_in_their_last_token_are_not_shared(model_dir):
    last = PROMPT[:-1] + [PROMPT[-1] + 1]
    kw = dict(max_new_tokens=5, stop_at_eos=False, keep_logits=True)
    with load(model_dir) as model, model.open(backend="cpu_ref") as run:
        solo = [run.generate(prompt_ids=p, **kw) for p in (PROMPT, last)]
        got = run.generate_batch([dict(prompt_ids=p, **kw) for p in (PROMPT, last)], max_batch=2)
    for shared, alone in zip(got, solo):
        assert shared.token_ids == alone.token_ids and shared.logits[0].equal(alone.logits[0])


def test_a_prompt_already_through_its_prefill_leads_no_one(model_dir):
    """A copy is of a prefill still to come: a sequence that joins once the other decodes prefills now, on its own."""
    with load(model_dir) as model, model.open(backend="cpu_ref") as run:
        want = run.generate(prompt_ids=PROMPT, max_new_tokens=3, stop_at_eos=False).token_ids
        with Batch(run.runner, 2, 64) as b:
            first = b.add(run.request(prompt_ids=PROMPT, max_new_tokens=20, stop_at_eos=False))
            b.step()
            assert first.prefilled == len(PROMPT) and not first.done
            later = b.add(run.request(prompt_ids=PROMPT, max_new_tokens=3, stop_at_eos=False))
            b.step()
            assert later.leader is None and later.prefilled == len(PROMPT)
            b.run_until_done()
    assert later.tokens == want and len(first.tokens) == 20


def test_a_follower_lets_go_of_its_leader_once_it_has_its_copy(model_dir):
    with load(model_dir) as model, model.open(backend="cpu_ref") as run:
        with Batch(run.runner, 2, 32) as b:
            lead = b.add(run.request(prompt_ids=PROMPT, max_new_tokens=3, stop_at_eos=False))
            follow = b.add(run.request(prompt_ids=PROMPT, max_new_tokens=3, stop_at_eos=False))
            b.step()
            assert follow.prefilled == len(PROMPT) and follow.leader is None and lead.followers == []
            b.run_until_done()


@pytest.mark.parametrize("chunk", [None, 4])
def test_followers_get_the_prefills_prompt_logprobs_and_its_time(model_dir, chunk):
    with load(model_dir) as model, model.open(backend="cpu_ref") as run:
        reqs = [attrs.evolve(run.request(prompt_ids=PROMPT, max_new_tokens=2, stop_at_eos=False, **g), prompt_logprobs=2)
                for g in SETTINGS[:2]]
        got = run.generate_batch(reqs, max_batch=2, prefill_chunk=chunk)
    assert len(got[0].prompt_logprobs) == len(PROMPT) - 1 and got[1].prompt_logprobs == got[0].prompt_logprobs
    assert got[0].prefill_ms > 0 and got[1].prefill_ms == got[0].prefill_ms  # the same passes, first to last


def test_a_non_finite_prefill_fails_the_followers_that_wait_not_one_that_left(tmp_path):
    from safetensors.torch import load_file, save_file

    d = write_checkpoint(preset_config("tiny"), tmp_path / "tiny")
    tensors = load_file(str(d / "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"].clone()
    embed[PROMPT[0]] = float("nan")
    tensors["model.embed_tokens.weight"] = embed
    save_file(tensors, str(d / "model.safetensors"))
    with load(d) as model, model.open(backend="cpu_ref") as run:
        heard = []
        with Batch(run.runner, 3, 32, prefill_chunk=3) as b:
            lead, waits, leaves = (b.add(run.request(prompt_ids=PROMPT, max_new_tokens=4, stop_at_eos=False,
                                                     on_token=heard.append)) for _ in range(3))
            b.step()
            assert waits.leader is lead and leaves.leader is lead
            leaves.cancel()
            b.run_until_done()
    assert lead.finish_reason == waits.finish_reason == "error" and "NaN" in str(lead.error)
    assert waits.error is lead.error and lead.tokens == waits.tokens == [] and heard == []
    assert leaves.finish_reason == "cancelled" and leaves.error is None
