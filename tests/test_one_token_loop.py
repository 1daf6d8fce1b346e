"""One token loop: a drafting sequence's verify span rides the batch's step beside every other row, so drafts work in
a batch, a scheduler, a batch job and the server with plain greedy ids; and what ids alone cannot show (an end inside a
verify pass, the residual and the bonus row of sampled acceptance, the window's token, read-back lag, step timing,
buckets, the counters of a dropped step) is tested here (cpu_ref)."""

from __future__ import annotations

import json
import itertools

import pytest
import torch

from bench.scenarios.speculative import Oracle, OraclePlugin
from bench.serve_process import ServeProcess
from kestrel_core import load
from kestrel_core.engine.batch import BUCKETS, Batch, Request, bucket
from kestrel_core.config import GenerationConfig
from kestrel_core.hookspecs import hookimpl
from kestrel_core.engine.sampling import Sampler
from kestrel_core.engine.scheduler import Scheduler
from kestrel_core.engine.speculative import accept

REPEATING = [[5, 17, 42, 99, 3, 5, 17, 42, 99, 3, 5, 17], [9, 8, 7, 9, 8, 7, 9, 8], [1, 2, 3], [4, 4, 4, 4, 4]]
LENGTHS = [14, 9, 6, 11]


def plain(model, **settings) -> list[list[int]]:
    with model.open(**settings) as run:
        return [run.generate(prompt_ids=p, max_new_tokens=n, stop_at_eos=False).token_ids
                for p, n in zip(REPEATING, LENGTHS)]


def asks() -> list[dict]:
    return [dict(prompt_ids=p, max_new_tokens=n, stop_at_eos=False) for p, n in zip(REPEATING, LENGTHS)]


# --- drafts wherever sequences are batched ------------------------------------------------------------------------

@pytest.mark.parametrize("settings", [dict(keep="off"), dict(keep=1), dict(keep=2, policy="pinned_set")])
@pytest.mark.parametrize("draft", ["ngram", "ngram:1"])
def test_drafting_sequences_in_a_batch_keep_their_plain_greedy_ids(tiny_ckpt, settings, draft):
    with load(tiny_ckpt) as model:
        want = plain(model, **settings)
        with model.open(draft=draft, draft_tokens=4, **settings) as run:
            for max_batch, chunk in ((4, None), (2, 3)):
                got = run.generate_batch(asks(), max_batch=max_batch, prefill_chunk=chunk)
                assert [r.token_ids for r in got] == want, (max_batch, chunk)
                assert sum(r.speculative["drafted"] for r in got) > 0
                for r in got:
                    s = r.speculative
                    assert s["kept"] == len(r.token_ids) - 1 == sum(r.tokens_per_step)
                    assert s["passes"] == len(r.decode_ms) == len(r.tokens_per_step)


def test_a_draft_model_drafts_for_a_batch_of_sequences(tiny_ckpt, tmp_path):
    from kestrel_core.tools.presets import preset_config, write_checkpoint

    small = write_checkpoint(preset_config("tiny", layers=2), tmp_path / "tiny-2")
    with load(tiny_ckpt) as model:
        want = plain(model, keep=1)
        with model.open(keep=1, draft=str(small), draft_tokens=3) as run:
            got = run.generate_batch(asks(), max_batch=4)
    assert [r.token_ids for r in got] == want and all(r.speculative["drafted"] > 0 for r in got)


def test_the_scheduler_runs_drafting_sequences(tiny_ckpt):
    with load(tiny_ckpt) as model:
        want = plain(model, keep=2)
        with model.open(keep=2, draft="ngram", draft_tokens=4) as run:
            sched = Scheduler(run, max_batch=3, max_queue=8)
            sched.start()
            try:
                seqs = [sched.submit(run.request(**a)) for a in asks()]
                assert all(s.finished.wait(60) for s in seqs)
            finally:
                sched.stop(cancel=True)
    assert [s.tokens for s in seqs] == want and all(s.error is None for s in seqs)


def test_a_batch_job_with_a_draft_writes_plain_greedy_ids(tiny_ckpt, tmp_path, capsys):
    from kestrel_core.cli import main

    with load(tiny_ckpt) as model:
        want = plain(model)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(a) + "\n" for a in asks()))
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--model", str(tiny_ckpt), "--prompts", str(src), "--out", str(out), "--draft", "ngram",
                 "--draft-tokens", "4", "--max-batch", "3"]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["token_ids"] for line in lines] == want


def test_kestrel_serve_with_a_draft_answers_plain_greedy_ids(tiny_ckpt, tmp_path):
    import concurrent.futures
    import shutil

    with load(tiny_ckpt) as model:
        want = plain(model, backend="cpu_ref")
    d = shutil.copytree(tiny_ckpt, tmp_path / "tiny")
    server = ServeProcess(d, "--backend", "cpu_ref", "--draft", "ngram", "--draft-tokens", "4")
    try:
        client = server.client()

        def ask(i):
            got = client.completions.create(model=server.name, prompt=REPEATING[i], max_tokens=LENGTHS[i],
                                            temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
            return got.choices[0].token_ids

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert list(pool.map(ask, range(4))) == want
    finally:
        server.stop(30)


# --- what ids cannot see ------------------------------------------------------------------------------------------

def test_an_end_inside_a_verify_pass_stops_the_sequence_there(tiny_ckpt, register_plugin):
    """The oracle drafts past an end id: the sequence stops at it, as plain decoding does, and hears nothing after."""
    register_plugin(OraclePlugin(), "oracle")
    prompt = REPEATING[0]
    with load(tiny_ckpt) as model:
        with model.open(keep=1) as run:
            answer = run.generate(prompt_ids=prompt, max_new_tokens=16, stop_at_eos=False).token_ids
            end = answer[6]
            stop_at = answer.index(end)
            stopped = run.generate(prompt_ids=prompt, max_new_tokens=16, stop_ids=[end])
        Oracle.answer = answer
        with model.open(keep=1, draft="oracle", draft_tokens=8) as run:
            heard = []
            spec = run.generate(prompt_ids=prompt, max_new_tokens=16, stop_ids=[end], on_token=heard.append)
    assert spec.token_ids == stopped.token_ids == answer[:stop_at + 1] == heard
    assert spec.speculative["accepted"] > stop_at > 0  # drafts past the end were verified in its pass, and dropped
    assert sum(spec.tokens_per_step) == len(spec.token_ids) - 1


def test_a_rejected_one_hot_draft_has_no_share_in_the_residual():
    """A deterministic drafter's draft d is kept with probability p(d); rejected, the token is drawn from p without d,
    so d comes out exactly as often as p(d) says (a d left in the residual would come out far more often)."""
    vocab, draws, d = 5, 4000, 1
    logits = torch.tensor([[0.0, -1.5, 0.5, 1.0, -0.5], [0.0] * 5])
    sampler = Sampler(GenerationConfig(temperature=1.0, seed=3))
    p = sampler.probs(logits[0])
    counts = torch.zeros(vocab)
    for _ in range(draws):
        n, own = accept(logits, [d], None, sampler, greedy=False)
        counts[d if n else own] += 1
    share = float(counts[d]) / draws
    sd = (float(p[d]) * (1 - float(p[d])) / draws) ** 0.5
    assert abs(share - float(p[d])) < 5 * sd, (share, float(p[d]))
    chi2 = float(((counts - p * draws) ** 2 / (p * draws)).sum())
    assert chi2 < 18.5  # 4 degrees of freedom, p = 0.001


def test_the_bonus_token_after_every_draft_kept_is_drawn_from_the_row_after_the_last_draft():
    vocab, draws = 4, 3000
    logits = torch.tensor([[30.0, 0.0, 0.0, 0.0], [0.0, 30.0, 0.0, 0.0], [2.0, -1.0, 0.5, 1.0]])  # drafts 0, 1 certain
    sampler = Sampler(GenerationConfig(temperature=1.0, seed=4))
    p = sampler.probs(logits[2])
    counts = torch.zeros(vocab)
    for _ in range(draws):
        n, own = accept(logits, [0, 1], [None, None], sampler, greedy=False)
        assert n == 2
        counts[own] += 1
    chi2 = float(((counts - p * draws) ** 2 / (p * draws)).sum())
    assert chi2 < 16.3, (counts, p * draws)  # 3 degrees of freedom, p = 0.001


def test_each_verify_pass_is_one_token_of_the_window(tiny_ckpt, register_plugin):
    """The policy hears the prefill as token 0, then each pass (a verify pass as a decode step) as the next token."""
    seen = []

    class Observer:
        @hookimpl
        def on_layer_advance(self, window, layer, phase):
            seen.append((window.token, layer))

    register_plugin(Observer(), "token-observer")
    with load(tiny_ckpt) as model, model.open(keep=2, draft="ngram", draft_tokens=4) as run:
        r = run.generate(prompt_ids=REPEATING[0], max_new_tokens=12, stop_at_eos=False)
    layers = model.config.num_hidden_layers
    tokens = [t for t, _ in seen]
    assert sorted(set(tokens)) == list(range(1 + len(r.decode_ms)))  # one token a pass, in order
    assert [tokens.count(t) for t in set(tokens)] == [layers] * len(set(tokens))


def test_sampled_rows_are_read_back_in_their_step_and_greedy_ones_a_step_late(tiny_ckpt):
    with load(tiny_ckpt) as model, model.open(keep="off") as run, Batch(run.runner, slots=2, max_seq=64) as b:
        greedy = b.add(Request([1, 2, 3], GenerationConfig(max_new_tokens=6, stop_at_eos=False)))
        b.step()  # the prompt's pass: its first token is on the host at once
        heard = [len(greedy.tokens)]
        b.step()
        heard.append(len(greedy.tokens))
        assert heard == [1, 1] and len(b.unread) == 1  # greedy: its step is read behind the next
        sampled = b.add(Request([4, 5], GenerationConfig(max_new_tokens=6, stop_at_eos=False, temperature=0.7, seed=2)))
        b.step()  # sampled's prompt
        while b.busy:
            before = len(sampled.tokens)
            b.step()
            if not sampled.done and before:
                assert len(sampled.tokens) == before + 1 and not b.unread  # read in the step that made it


def test_decode_times_run_from_one_steps_mark_to_the_next(tiny_ckpt, monkeypatch):
    """With a clock that ticks once a mark, each decode step takes exactly one tick and the prefill one too."""
    from backends.cpu_ref.backend import CpuRefBackend

    ticks = itertools.count()
    monkeypatch.setattr(CpuRefBackend, "mark", lambda self: next(ticks))
    monkeypatch.setattr(CpuRefBackend, "elapsed_ms", lambda self, a, b: float(b - a))
    with load(tiny_ckpt) as model, model.open(keep=1) as run:
        got = run.generate_batch(asks()[:2], max_batch=2)
    for r, n in zip(got, LENGTHS):
        assert r.decode_ms == [1.0] * (n - 1) and r.prefill_ms == 1.0


def test_a_step_is_made_for_the_smallest_bucket_that_holds_its_rows(tiny_ckpt):
    assert [bucket(r, 256) for r in (1, 2, 3, 5, 9, 17, 33, 65, 129)] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert bucket(3, 3) == 3 and bucket(5, 6) == 6  # never past the slots
    with load(tiny_ckpt) as model, model.open(keep="off") as run, Batch(run.runner, slots=6, max_seq=64) as b:
        for p, n in zip(REPEATING, (3, 5, 7, 9)):
            b.add(Request(p, GenerationConfig(max_new_tokens=n, stop_at_eos=False)))
        b.run_until_done()
        assert set(b.dev.graphs) <= set(BUCKETS) | {6} and 4 in b.dev.graphs  # 4 rows decoding: the bucket of 4


def test_a_step_launched_past_a_greedy_end_leaves_the_sequences_counters(tiny_ckpt):
    """Greedy rows are read a step late, so the step after an end id is launched before the end is seen: it is
    dropped, with its uploads, from the sequence's counters."""
    def fresh(**gen):
        with model.open(keep=1) as run:
            return run.generate(prompt_ids=REPEATING[1], **gen)

    with load(tiny_ckpt) as model:
        ref = fresh(max_new_tokens=10, stop_at_eos=False)
        end = ref.token_ids[4]
        n = ref.token_ids.index(end) + 1
        capped = fresh(max_new_tokens=n, stop_at_eos=False)  # no step launched past its end
        stopped = fresh(max_new_tokens=10, stop_ids=[end])  # one launched past it, then dropped
    assert stopped.token_ids == capped.token_ids
    for key in ("bytes_uploaded", "layer_uploads", "evictions"):
        assert stopped.counters[key] == capped.counters[key] > 0, key
    assert len(stopped.per_token) == len(capped.per_token) == n - 1
