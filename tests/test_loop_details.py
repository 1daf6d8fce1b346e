"""What a mutation pass of the runner, the batch and the verify path found untested (each test names the bug it
kills): sampled tokens as the logits say, token id 0, kept logits under drafts, step counts and timings of drafting
sequences, free-slot order, the drafter checks, and a draft model's own cache over several rounds."""

from __future__ import annotations

import itertools

import pytest
import torch

from bench.scenarios.speculative import Oracle, OraclePlugin
from kestrel_core import load
from kestrel_core.config import GenerationConfig
from kestrel_core.engine.batch import Batch, Request
from kestrel_core.engine.sampling import Sampler
from kestrel_core.engine.speculative import begin_drafting, check_draft
from kestrel_core.errors import KestrelError
from kestrel_core.tools.presets import preset_config, write_checkpoint

PROMPT = [5, 17, 42, 99, 3, 5, 17, 42, 99, 3, 5, 17]


def test_a_sampled_sequence_draws_each_token_from_its_own_logits(tiny_ckpt):
    """Replaying the sampler over the kept logits draws exactly the ids (a copy of the step's row taken before the
    drawn token was written would leave argmaxes, in solo and batch alike)."""
    gen = dict(max_new_tokens=10, stop_at_eos=False, temperature=1.3, seed=7)
    with load(tiny_ckpt) as model, model.open(keep=2) as run:
        r = run.generate(prompt_ids=PROMPT, keep_logits=True, **gen)
    sampler = Sampler(GenerationConfig(**gen))
    assert [sampler(row) for row in r.logits] == r.token_ids
    assert r.token_ids != [int(torch.argmax(row)) for row in r.logits]  # sampling changed something


def test_a_first_token_of_id_0_is_the_next_steps_input(tiny_ckpt, monkeypatch):
    """The prefill's token is written into its slot's device state even where it is 0 (a falsy id): the slot's
    previous sequence left another token there."""
    real = Sampler.__call__
    forced = []
    with load(tiny_ckpt) as model, model.open(keep=2) as run:
        want = run.generate(prompt_ids=PROMPT + [0], max_new_tokens=5, stop_at_eos=False).token_ids
        with Batch(run.runner, slots=1, max_seq=64) as b:
            before = b.add(Request([9, 9, 9], GenerationConfig(max_new_tokens=4, stop_at_eos=False)))
            b.run_until_done()
            assert before.tokens[-1] != 0  # the slot's state holds a token other than 0

            def first_is_0(self, logits, *history):
                if not forced:
                    forced.append(1)
                    return 0
                return real(self, logits, *history)

            monkeypatch.setattr(Sampler, "__call__", first_is_0)
            seq = b.add(Request(PROMPT, GenerationConfig(max_new_tokens=6, stop_at_eos=False)))
            b.run_until_done()
    assert seq.tokens == [0] + want


def test_kept_logits_with_drafts_are_the_plain_runs_row_for_row(tiny_ckpt, register_plugin):
    register_plugin(OraclePlugin(), "oracle")
    with load(tiny_ckpt) as model:
        with model.open(keep=1) as run:
            plain = run.generate(prompt_ids=PROMPT, max_new_tokens=12, stop_at_eos=False, keep_logits=True)
        Oracle.answer = plain.token_ids
        with model.open(keep=1, draft="oracle", draft_tokens=4) as run:
            spec = run.generate(prompt_ids=PROMPT, max_new_tokens=12, stop_at_eos=False, keep_logits=True)
    assert spec.speculative["accepted"] > 0 and len(spec.logits) == len(plain.logits) == 12
    assert all(torch.equal(a, b) for a, b in zip(spec.logits, plain.logits))


def test_a_lone_drafting_sequences_steps_count_it_once_and_its_verify_time_is_its_passes(tiny_ckpt, register_plugin,
                                                                                          monkeypatch):
    from backends.cpu_ref.backend import CpuRefBackend

    register_plugin(OraclePlugin(), "oracle")
    with load(tiny_ckpt) as model:
        with model.open(keep=1) as run:
            Oracle.answer = run.generate(prompt_ids=PROMPT, max_new_tokens=12, stop_at_eos=False).token_ids
        ticks = itertools.count()
        monkeypatch.setattr(CpuRefBackend, "mark", lambda self: next(ticks))
        monkeypatch.setattr(CpuRefBackend, "elapsed_ms", lambda self, a, b: float(b - a))
        with model.open(keep=1, draft="oracle", draft_tokens=4) as run:
            r = run.generate(prompt_ids=PROMPT, max_new_tokens=12, stop_at_eos=False)
    assert r.token_ids == Oracle.answer
    assert [p["sequences_in_step"] for p in r.per_token] == [1] * len(r.per_token)
    assert r.speculative["verify_ms"] == sum(r.decode_ms) == len(r.decode_ms)


def test_a_freed_slot_goes_to_the_next_sequence_lowest_first(tiny_ckpt):
    with load(tiny_ckpt) as model, model.open(keep="off") as run, Batch(run.runner, slots=3, max_seq=64) as b:
        seqs = [b.add(Request([1 + i, 2, 3], GenerationConfig(max_new_tokens=n, stop_at_eos=False)))
                for i, n in enumerate((4, 9, 2))]  # slot 2 ends first, then slot 0
        while not (seqs[0].done and seqs[2].done):
            b.step()
        late = b.add(Request([7, 8], GenerationConfig(max_new_tokens=3, stop_at_eos=False)))
        b.run_until_done()
    assert late.slot == 0 and b.free == sorted(b.free)


@pytest.mark.parametrize("draft, probs, needle", [
    ([1, 2, 3, 4, 5], None, r"proposed \[1, 2, 3, 4, 5\]: a draft is at most 4 token ids"),
    ([1, 512], None, r"a draft is at most 4 token ids in 0..511"),
    ([-1], None, "in 0..511"),
    ([True], None, "in 0..511"),
    ([1, 2], [None], "gave 1 distributions for 2 drafts"),
    ([1, 2], [None, None, None], "gave 3 distributions for 2 drafts"),
])
def test_a_drafters_bad_proposal_is_its_sequences_error_naming_it(draft, probs, needle):
    class Named:
        name = "shaky"

    with pytest.raises(KestrelError, match=rf"the drafter 'shaky' {needle}" if "proposed" in needle or "gave" in needle
                       else needle):
        check_draft(Named(), draft, probs, 4, 512)
    assert check_draft(Named(), [1, 2, 3, 4], None, 4, 512) == [1, 2, 3, 4]


def test_a_drafter_whose_begin_returns_no_drafting_is_named():
    class Lazy:
        name = "lazy"

        def begin(self, prompt_ids):
            return "not a drafting"

    with pytest.raises(KestrelError, match="the drafter 'lazy': begin\\(\\) returned str"):
        begin_drafting(Lazy(), [1, 2])


def test_a_drafters_error_ends_its_sequence_alone(tiny_ckpt, register_plugin):
    from kestrel_core.hookspecs import hookimpl

    class TooMany:
        name = "too_many"

        def __init__(self, arg=None, run=None):
            pass

        def begin(self, prompt_ids):
            return self

        def propose(self, context, k):
            return [1] * (k + 1), None

        def accepted(self, context):
            pass

        def close(self):
            pass

    class Plugin:
        @hookimpl
        def register_drafters(self, register):
            register("too_many", TooMany)

    register_plugin(Plugin(), "too-many")
    with load(tiny_ckpt) as model, model.open(keep=2, draft="too_many", draft_tokens=3) as run:
        got = run.generate_batch([dict(prompt_ids=PROMPT, max_new_tokens=6, stop_at_eos=False)], max_batch=2)
    assert isinstance(got[0], KestrelError) and "the drafter 'too_many' proposed" in str(got[0])


def test_ngram_takes_the_latest_of_two_earlier_matches():
    from plugins.drafters import NGram

    assert NGram().propose([1, 2, 5, 1, 2, 6, 1, 2], 1) == ([6], None)


@pytest.fixture(scope="module")
def draft_ckpt(tmp_path_factory):
    return write_checkpoint(preset_config("tiny", layers=2), tmp_path_factory.mktemp("draft") / "tiny-2")


def test_one_sequence_over_rounds_proposes_its_draft_models_own_continuation(tiny_ckpt, draft_ckpt):
    """One sequence, round after round (every draft kept with the bonus; a partial rejection), so the draft model's
    slot is extended and trimmed rather than fed anew: each proposal is the draft model's own greedy continuation."""
    with load(draft_ckpt) as small, small.open(keep="off") as alone:
        def own(context, k):
            return alone.generate(prompt_ids=context, max_new_tokens=k, stop_at_eos=False).token_ids

        with load(tiny_ckpt) as model, model.open(keep=1, draft=str(draft_ckpt), draft_tokens=4) as run:
            context = list(PROMPT)
            seq = run.drafter.begin(context)
            for keep_n in (4, 4, 1, 4, 0, 2):
                proposal, probs = seq.propose(context, 4)
                assert proposal == own(context, 4) and probs is None
                bonus = (proposal[keep_n] + 1) % 256 if keep_n < 4 else 7
                context = context + proposal[:keep_n] + [bonus]
                seq.accepted(context)
                assert context[: len(seq.fed)] == seq.fed  # the slot holds a prefix of the kept sequence


def test_a_sampled_draft_model_gives_each_drafts_distribution(tiny_ckpt, draft_ckpt):
    with load(tiny_ckpt) as model, model.open(keep=1, draft=str(draft_ckpt), draft_tokens=4, temperature=0.9,
                                              seed=3) as run:
        seq = run.drafter.begin(PROMPT)
        tokens, probs = seq.propose(list(PROMPT), 4)
    assert probs is not None and len(probs) == len(tokens) == 4
    assert all(abs(float(p.sum()) - 1) < 1e-5 and float(p[t]) > 0 for p, t in zip(probs, tokens))


def test_a_late_chunked_prompts_prefill_time_spans_its_own_passes(tiny_ckpt, monkeypatch):
    from backends.cpu_ref.backend import CpuRefBackend

    ticks = itertools.count()
    monkeypatch.setattr(CpuRefBackend, "mark", lambda self: next(ticks))  # one tick a mark: a step takes one
    monkeypatch.setattr(CpuRefBackend, "elapsed_ms", lambda self, a, b: float(b - a))
    with load(tiny_ckpt) as model, model.open(keep=2) as run, Batch(run.runner, slots=2, max_seq=64,
                                                                     prefill_chunk=3) as b:
        first = b.add(Request([1, 2], GenerationConfig(max_new_tokens=8, stop_at_eos=False)))
        for _ in range(3):
            b.step()
        late = b.add(Request(list(range(1, 11)), GenerationConfig(max_new_tokens=2, stop_at_eos=False)))
        b.run_until_done()
    assert len(late.prefill_passes) == 4  # ten prompt tokens, three a step
    assert late.result.prefill_ms == 4.0 and first.result.prefill_ms == 1.0


def test_a_non_finite_logit_in_one_row_ends_that_sequence_alone(tiny_ckpt, monkeypatch):
    """One inf in slot 1's row of one decode step: slot 1 ends with the error, slot 0 goes on with its solo ids."""
    from backends.cpu_ref.backend import CpuRefBackend
    from kestrel_core.errors import NonFiniteError

    with load(tiny_ckpt) as model, model.open(keep="off") as run:
        alone = run.generate(prompt_ids=[1, 2, 3], max_new_tokens=8, stop_at_eos=False).token_ids
        real, calls = CpuRefBackend.logits, itertools.count()

        def one_inf(self, h):
            out = real(self, h)
            if out.shape[0] == 2 and next(calls) == 3:  # a later two-row decode step: one logit of row 1
                out[1, 7] = float("inf")
            return out

        monkeypatch.setattr(CpuRefBackend, "logits", one_inf)
        with Batch(run.runner, slots=2, max_seq=64) as b:
            a = b.add(Request([1, 2, 3], GenerationConfig(max_new_tokens=8, stop_at_eos=False)))
            c = b.add(Request([4, 5], GenerationConfig(max_new_tokens=8, stop_at_eos=False)))
            b.run_until_done()
    assert a.tokens == alone and a.error is None
    assert c.finish_reason == "error" and isinstance(c.error, NonFiniteError)


def test_the_layer_loop_runs_the_backends_layer_ops(tiny_ckpt, monkeypatch):
    """A backend's ``layer_ops`` (the cuda backend's fused kernels) are what the loop computes a layer's steps with,
    between its linears, and the final norm too: a backend whose steps are torch's plus a count gives the same ids."""
    from backends.cpu_ref.backend import CpuRefBackend
    from kestrel_core.engine.model import LayerOps

    calls: dict[str, int] = {}

    class Counting(LayerOps):
        def __getattribute__(self, name):
            if not name.startswith("_"):
                calls[name] = calls.get(name, 0) + 1
            return super().__getattribute__(name)

    from tests.conftest import run_once

    plain = run_once(tiny_ckpt)[0].token_ids
    monkeypatch.setattr(CpuRefBackend, "layer_ops", Counting())
    assert run_once(tiny_ckpt)[0].token_ids == plain
    assert set(calls) == {"rms_norm", "qk_norm_rope", "add_rms_norm", "silu_mul"}
    assert calls["qk_norm_rope"] == calls["add_rms_norm"] == calls["silu_mul"] and calls["rms_norm"] > calls["silu_mul"]


def test_layer_ops_setting_picks_the_steps_and_says_what_it_cannot(tiny_ckpt, monkeypatch):
    """``[backend] layer_ops``: torch's steps, the fused kernels, or (where they cannot run) an error naming why;
    cpu_ref computes with torch's and says that a cuda choice has no effect there, as gguf_kernels = "int8"."""
    from backends.cuda import layer_ops
    from kestrel_core.engine.model import TORCH_OPS
    from kestrel_core.errors import ConfigError, KestrelNote
    from tests.conftest import run_once

    assert layer_ops.layer_ops("torch") is TORCH_OPS
    monkeypatch.setattr(layer_ops, "available", lambda: "Triton is not installed")
    assert layer_ops.layer_ops("auto") is TORCH_OPS
    with pytest.raises(ConfigError, match="layer_ops = 'fused' needs the fused kernels.*Triton is not installed"):
        layer_ops.layer_ops("fused")
    monkeypatch.setattr(layer_ops, "available", lambda: None)
    assert isinstance(layer_ops.layer_ops("auto"), layer_ops.FusedOps)
    plain = run_once(tiny_ckpt)[0].token_ids
    for flag, why in (({"backend__layer_ops": "fused"}, "layer_ops = 'fused'"),
                      ({"backend__gguf_kernels": "int8"}, "gguf_kernels = 'int8'")):
        with pytest.warns(KestrelNote, match=f"{why}.*no effect here"):
            assert run_once(tiny_ckpt, **flag)[0].token_ids == plain
    with pytest.raises(ConfigError, match="layer_ops must be one of auto, fused, torch"):
        run_once(tiny_ckpt, backend__layer_ops="fast")
