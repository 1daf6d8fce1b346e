"""Batched and speculative decoding on the GPU: the residency of a batch is exact (each streamed layer serves every
row of a step), each bucket's step is captured and replayed, and how far batch companions and drafts move the ids.

On cuda the rows of a step go through GEMMs of another shape than a one-token step's, so ids are not promised bitwise
equal to the solo run's (docs/speculative.md, the batch section of docs/cli.md); in float32 on the tiny preset the
margins are wide enough that they must be, and a difference there is a bug, not rounding."""

from __future__ import annotations

import pytest
import torch

from kestrel_core import load

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[5, 17, 42], [99, 3], [7, 7, 7, 7], [200, 1], [11, 12, 13, 14, 15], [8], [40, 41], [90, 91, 92]]


@pytest.mark.parametrize("keep", [1, "off"])
def test_a_cuda_batch_is_its_solo_runs_and_replays_each_bucket(tiny_ckpt, keep):
    with load(tiny_ckpt) as model, model.open(backend={"name": "cuda", "dtype": "float32"}, keep=keep) as run:
        alone = [run.generate(prompt_ids=p, max_new_tokens=10, stop_at_eos=False).token_ids for p in PROMPTS]
        got = run.generate_batch([dict(prompt_ids=p, max_new_tokens=10, stop_at_eos=False) for p in PROMPTS],
                                 max_batch=4)
    assert [r.token_ids for r in got] == alone
    assert any(m == "replayed" for r in got for m in r.step_modes)


def test_a_cuda_batch_streams_each_layer_once_a_step(tiny_ckpt):
    per_token = {}
    with load(tiny_ckpt) as model, model.open(backend="cuda", keep=1) as run:
        for b in (1, 4):
            got = run.generate_batch([dict(prompt_ids=[3 + i], max_new_tokens=9, stop_at_eos=False) for i in range(b)],
                                     max_batch=b)
            steady = [p for p in got[0].per_token[2:] if p["sequences_in_step"] == b]
            per_token[b] = sum(p["bytes_uploaded"] for p in steady) / (len(steady) * b)
    assert per_token[4] == per_token[1] / 4


@pytest.mark.parametrize("keep", [1, "off"])
def test_cuda_speculative_greedy_is_plain_greedy_in_float32(tiny_ckpt, keep):
    repeating = [5, 17, 42, 99, 3, 5, 17, 42, 99, 3, 5, 17]
    with load(tiny_ckpt) as model:
        with model.open(backend={"name": "cuda", "dtype": "float32"}, keep=keep) as run:
            plain = run.generate(prompt_ids=repeating, max_new_tokens=16, stop_at_eos=False)
        with model.open(backend={"name": "cuda", "dtype": "float32"}, keep=keep, draft="ngram:1",
                        draft_tokens=4) as run:
            spec = run.generate(prompt_ids=repeating, max_new_tokens=16, stop_at_eos=False)
    assert spec.token_ids == plain.token_ids and spec.speculative["drafted"] > 0


def test_a_cuda_draft_models_steps_are_replayed_and_its_own_greedy(tiny_ckpt, tmp_path):
    from kestrel_core.tools.presets import preset_config, write_checkpoint

    draft = write_checkpoint(preset_config("tiny", layers=2), tmp_path / "tiny-2")
    contexts = [[5, 17, 42, 99, 3, 5, 17], [5, 17, 42, 99, 3, 5, 17, 9], [5, 17, 42, 99, 3, 5, 17, 9, 4]]
    with load(draft) as small, small.open(backend="cuda", keep="off", graphs="off") as alone:
        want = [alone.generate(prompt_ids=c, max_new_tokens=6, stop_at_eos=False).token_ids for c in contexts]
    with load(tiny_ckpt) as model, model.open(backend="cuda", keep=1, draft=str(draft), draft_tokens=6) as run:
        seq = run.drafter.begin(contexts[0])
        got = []
        for c in contexts:  # each a token past the last: its drafts rolled back
            seq.accepted(c)
            got.append(seq.propose(c, 6)[0])
        assert run.draft_run.batch.dev.graphs[1].graph is not None  # its batch's one-token step was captured
    # bf16: a captured step may round otherwise than the eager one, so only the lead tokens must agree
    assert [g[:2] for g in got] == [w[:2] for w in want]
