"""Log-probabilities of the generated tokens, computed in the token loop where each token is chosen: equal to the
log_softmax (float32, the whole vocabulary, before temperature) of the logits the engine computed for that position,
for greedy rows (read back a step late), sampled rows, a prompt's first token and verify passes alike."""

from __future__ import annotations

import attrs
import pytest
import torch

from kestrel_core import load
from kestrel_core.engine.batch import Batch
from kestrel_core.engine.sampling import token_logprobs
from kestrel_core.errors import ConfigError

PROMPTS = [[5, 17, 42, 99, 3], [1, 2, 3], [7, 8, 9, 10, 11, 12, 13]]


def asking(run, prompt, k, **gen):
    """A request for ``prompt`` that asks for each token's log-probability and ``k`` alternatives, its logits kept."""
    request = run.request(prompt_ids=prompt, keep_logits=True, **{"max_new_tokens": 7, "stop_at_eos": False, **gen})
    return attrs.evolve(request, logprobs=k)


def assert_logprobs_of_logits(result, k: int, tol: float = 1e-5) -> None:
    """Each token's log-probability and its top ``k`` equal the log_softmax of the logits kept for its position."""
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids) == len(result.logits)
    for token, lp, logits in zip(result.token_ids, result.logprobs, result.logits):
        want = torch.log_softmax(logits.float(), dim=-1)
        assert lp.token == token
        assert lp.logprob == pytest.approx(float(want[token]), abs=tol)
        values, ids = torch.topk(want, k)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=tol)
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


@pytest.mark.parametrize("keep", ["off", 2])
def test_a_batchs_logprobs_are_the_log_softmax_of_each_rows_logits(tiny_ckpt, keep):
    """Greedy and sampled rows asking (k = 0, 3, 20) beside one that does not, in one continuous batch."""
    with load(tiny_ckpt) as model, model.open(backend="cpu_ref", keep=keep) as run:
        requests = [asking(run, PROMPTS[0], 3), asking(run, PROMPTS[1], 20, temperature=0.9, seed=5),
                    run.request(prompt_ids=PROMPTS[2], max_new_tokens=7, stop_at_eos=False),
                    asking(run, PROMPTS[2], 0, temperature=1.3, top_k=7, seed=1)]
        got = run.generate_batch(requests, max_batch=4, prefill_chunk=4)
        solo = run.generate(prompt_ids=PROMPTS[0], max_new_tokens=7, stop_at_eos=False)
    assert_logprobs_of_logits(got[0], 3)
    assert_logprobs_of_logits(got[1], 20)
    assert got[2].logprobs is None  # it did not ask
    assert_logprobs_of_logits(got[3], 0)
    assert got[0].token_ids == solo.token_ids  # asking changes no token
    # Greedy: the chosen token is the most likely one, first among the alternatives.
    assert all(lp.top[0] == (lp.token, lp.logprob) for lp in got[0].logprobs)


def test_logprobs_are_the_models_before_temperature(tiny_ckpt):
    """vLLM's default (raw_logprobs): the same tokens at another temperature have the same log-probabilities."""
    with load(tiny_ckpt) as model, model.open(backend="cpu_ref") as run:
        greedy = run.generate_batch([asking(run, PROMPTS[0], 2)])[0]
        hot = run.generate_batch([asking(run, PROMPTS[0], 2, temperature=1e-6, seed=3)])[0]  # the argmax, drawn
    assert hot.token_ids == greedy.token_ids
    assert [lp.logprob for lp in hot.logprobs] == pytest.approx([lp.logprob for lp in greedy.logprobs], abs=1e-6)


def test_verify_passes_give_each_kept_token_its_logprobs(tiny_ckpt):
    """Speculative decoding: the tokens a verify pass keeps take theirs from the pass's rows."""
    prompt = [1, 2, 3, 4] * 4  # the n-gram drafter proposes from what repeats
    with load(tiny_ckpt) as model:
        with model.open(backend="cpu_ref", draft="ngram", draft_tokens=3) as run:
            drafted = run.generate_batch([asking(run, prompt, 4, max_new_tokens=12)])[0]
        with model.open(backend="cpu_ref") as run:
            plain = run.generate_batch([asking(run, prompt, 4, max_new_tokens=12)])[0]
    assert drafted.token_ids == plain.token_ids and drafted.speculative["drafted"] > 0
    assert_logprobs_of_logits(drafted, 4)
    assert [lp.logprob for lp in drafted.logprobs] == pytest.approx([lp.logprob for lp in plain.logprobs], abs=1e-5)


def test_token_logprobs_on_a_row():
    logits = torch.tensor([[1.0, 3.0, 2.0, float("-inf")]])
    chosen, values, ids = token_logprobs(logits, torch.tensor([2]), 3)
    want = torch.log_softmax(logits, dim=-1)[0]
    assert float(chosen[0]) == pytest.approx(float(want[2]))
    assert ids[0].tolist() == [1, 2, 0] and values[0].tolist() == pytest.approx(want[[1, 2, 0]].tolist())


@pytest.mark.parametrize("k", [-1, 21, 2.5, True])
def test_a_batch_refuses_logprobs_out_of_range(tiny_ckpt, k):
    with load(tiny_ckpt) as model, model.open(backend="cpu_ref") as run:
        with Batch(run.runner, slots=1, max_seq=32) as b:
            with pytest.raises(ConfigError, match="logprobs must be a whole number in 0..20"):
                b.add(attrs.evolve(run.request(prompt_ids=[1, 2]), logprobs=k))
            assert not b.busy  # nothing was queued


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("keep", ["off", 1])
def test_a_cuda_batchs_logprobs_come_from_its_replayed_steps(tiny_ckpt, keep):
    """On the GPU a greedy row's log-probabilities are gathered on the device in the step (a captured graph's logits)
    and read back with its token a step late: equal to the log_softmax of the logits a solo run keeps."""
    with load(tiny_ckpt) as model, model.open(backend={"name": "cuda", "dtype": "float32"}, keep=keep) as run:
        requests = [attrs.evolve(run.request(prompt_ids=p, max_new_tokens=9, stop_at_eos=False), logprobs=5)
                    for p in PROMPTS]
        requests.append(asking(run, PROMPTS[0], 5, temperature=0.8, seed=2, max_new_tokens=9))
        got = run.generate_batch(requests, max_batch=4)
        solo = [run.generate(prompt_ids=p, max_new_tokens=9, stop_at_eos=False, keep_logits=True) for p in PROMPTS]
    assert any(m == "replayed" for r in got for m in r.step_modes)
    for r, alone in zip(got, solo):
        assert r.token_ids == alone.token_ids
        r = attrs.evolve(r, logits=alone.logits)
        assert_logprobs_of_logits(r, 5, tol=1e-4)
    assert_logprobs_of_logits(got[-1], 5, tol=1e-4)


# --- the prompt's log-probabilities (completions' echo) ----------------------------------------------------------
@pytest.mark.parametrize("chunk", [None, 3])
def test_a_prompts_logprobs_are_those_of_each_prefix_next_token(tiny_ckpt, chunk):
    """Each prompt token after the first: its log-probability given the tokens before it, as a run of that prefix
    gives for its first generated position; in one prompt chunk or several, beside a sequence that does not ask, whose
    ids stay its solo ones."""
    prompt = PROMPTS[2]
    with load(tiny_ckpt) as model, model.open(backend="cpu_ref", keep=2) as run:
        ask = attrs.evolve(run.request(prompt_ids=prompt, max_new_tokens=3, stop_at_eos=False), prompt_logprobs=4)
        other = run.request(prompt_ids=PROMPTS[0], max_new_tokens=5, stop_at_eos=False)
        got, beside = run.generate_batch([ask, other], max_batch=2, prefill_chunk=chunk)
        prefixes = [run.generate(prompt_ids=prompt[:i], max_new_tokens=1, keep_logits=True).logits[0]
                    for i in range(1, len(prompt))]
        solo = run.generate(prompt_ids=PROMPTS[0], max_new_tokens=5, stop_at_eos=False)
        plain = run.generate(prompt_ids=prompt, max_new_tokens=3, stop_at_eos=False)
    assert beside.prompt_logprobs is None and beside.token_ids == solo.token_ids
    assert got.token_ids == plain.token_ids  # asking changes no token
    assert len(got.prompt_logprobs) == len(prompt) - 1
    for token, lp, logits in zip(prompt[1:], got.prompt_logprobs, prefixes):
        want = torch.log_softmax(logits.float(), dim=-1)
        assert lp.token == token and lp.logprob == pytest.approx(float(want[token]), abs=1e-5)
        assert [t for t, _ in lp.top] == torch.topk(want, 4).indices.tolist()


def test_prompt_logprobs_out_of_range_are_refused(tiny_ckpt):
    with load(tiny_ckpt) as model, model.open(backend="cpu_ref") as run:
        bad = attrs.evolve(run.request(prompt_ids=PROMPTS[0], max_new_tokens=2), prompt_logprobs=21)
        with pytest.raises(ConfigError, match="logprobs must be a whole number in 0..20"):
            run.generate_batch([bad])


def test_the_scheduler_refuses_prompt_logprobs_out_of_range_at_submit(tiny_ckpt):
    """Checked where the request is submitted, as the batch checks it: not on the scheduler's thread, later."""
    from kestrel_core.engine.scheduler import Scheduler

    with load(tiny_ckpt) as model, model.open(backend="cpu_ref") as run:
        sched = Scheduler(run, max_batch=1, max_queue=1)
        sched.start()
        try:
            bad = attrs.evolve(run.request(prompt_ids=PROMPTS[0], max_new_tokens=2), prompt_logprobs=21)
            with pytest.raises(ConfigError, match="logprobs must be a whole number in 0..20"):
                sched.submit(bad)
        finally:
            sched.stop(cancel=True)
