"""A draft model drafts through the one token loop: the engine opens its run (``engine/draft_run.py``) and hands it to
the drafter, and its proposals go through a Batch of its own, so only batch.py steps and reads its runner."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import attrs
import pytest

from kestrel_core import load
from kestrel_core.config import GenerationConfig
from kestrel_core.engine.batch import Batch, Request
from kestrel_core.engine.draft_run import DraftRun
from kestrel_core.engine.runner import Runner
from kestrel_core.errors import ConfigError, KestrelError, KestrelNote
from kestrel_core.hookspecs import hookimpl
from kestrel_core.tools.presets import preset_config, write_checkpoint

ROOT = Path(__file__).resolve().parent.parent
BATCH = ROOT / "kestrel_core" / "engine" / "batch.py"
REPEATING = [5, 17, 42, 99, 3, 5, 17, 42, 99, 3, 5, 17]


@pytest.fixture(scope="module")
def draft_ckpt(tmp_path_factory):
    return write_checkpoint(preset_config("tiny", layers=2), tmp_path_factory.mktemp("draft") / "tiny-2")


@pytest.fixture
def spied(monkeypatch):
    """Every Runner.step and Runner.read: (the runner, "step" or "read", its caller's file, every file on the stack)."""
    calls = []

    def spy(name):
        real = getattr(Runner, name)

        def wrapped(self, *args, **kwargs):
            frame, files = sys._getframe(1), []
            while frame is not None:
                files.append(Path(frame.f_code.co_filename).resolve())
                frame = frame.f_back
            calls.append((self, name, files[0], files))
            return real(self, *args, **kwargs)

        monkeypatch.setattr(Runner, name, wrapped)

    spy("step")
    spy("read")
    return calls


@pytest.mark.parametrize("generation", [{}, dict(temperature=0.8, seed=3)])
def test_the_draft_models_steps_go_through_the_batch_and_no_plugin(tiny_ckpt, draft_ckpt, spied, generation):
    with load(tiny_ckpt) as model, model.open(keep=1, draft=str(draft_ckpt), draft_tokens=4,
                                              generation=generation) as run:
        res = run.generate(prompt_ids=REPEATING, max_new_tokens=12, stop_at_eos=False)
        drafts = run.draft_run.run.runner
    assert res.speculative["drafted"] > 0
    mine = [c for c in spied if c[0] is drafts]
    assert {name for _, name, _, _ in mine} == {"step", "read"}  # the draft model stepped and was read back
    assert {caller for _, _, caller, _ in spied} == {BATCH}  # by the one token loop, the target's and the draft's alike
    plugins = ROOT / "plugins"
    assert not [f for _, _, _, files in mine for f in files if plugins in f.parents]  # no plugin on the way down


def test_a_greedy_draft_is_read_a_step_late_as_the_batch_reads(tiny_ckpt, draft_ckpt, spied):
    """k greedy drafts: the prompt's step, then k - 1 one-token steps, each read back after the next is launched."""
    with load(tiny_ckpt) as model, model.open(keep=1, draft=str(draft_ckpt), draft_tokens=4) as run:
        seq = run.drafter.begin(REPEATING)
        spied.clear()
        tokens, probs = seq.propose(REPEATING, 4)
        drafts = run.draft_run.run.runner
    assert len(tokens) == 4 and probs is None
    assert [name for runner, name, _, _ in spied if runner is drafts] == \
        ["step", "step", "read", "step", "read", "step", "read", "read"]


def test_the_engine_opens_the_draft_run_hands_it_over_and_closes_it(tiny_ckpt, draft_ckpt, register_plugin):
    got = {}

    class Mine:
        name = "mine"
        drafts_with_a_model = True

        def __init__(self, arg=None, run=None, draft_run=None):
            got.update(arg=arg, draft_run=draft_run)

        def begin(self, prompt_ids):
            return got["draft_run"].sequence()

        def close(self):
            got["closed_first"] = not got["draft_run"].run.model.closed

    class Plugin:
        @hookimpl
        def register_drafters(self, register):
            register("mine", Mine)

    register_plugin(Plugin(), "mine")
    with load(tiny_ckpt) as model:
        with model.open(keep=1) as run:
            plain = run.generate(prompt_ids=REPEATING, max_new_tokens=10, stop_at_eos=False)
        with model.open(keep=1, draft=f"mine:{draft_ckpt}", draft_tokens=3) as run:
            assert isinstance(got["draft_run"], DraftRun) and run.draft_run is got["draft_run"]
            assert got["arg"] == str(draft_ckpt)
            spec = run.generate(prompt_ids=REPEATING, max_new_tokens=10, stop_at_eos=False)
        draft_run = got["draft_run"]
    assert spec.token_ids == plain.token_ids and spec.speculative["drafted"] > 0
    assert got["closed_first"] and draft_run.run.model.closed and draft_run.batch.dev.runner is None


def test_a_drafter_without_a_model_gets_no_draft_run(tiny_ckpt):
    with load(tiny_ckpt) as model, model.open(keep=1, draft="ngram") as run:
        assert run.draft_run is None and run.drafter is not None


def test_a_model_drafter_made_without_its_draft_run_says_so():
    from plugins.drafters import DraftModel

    with pytest.raises(ConfigError, match="drafts through the draft run the engine opens for it"):
        DraftModel(arg="x")


def test_cached_prompt_tokens_need_a_one_slot_batch_and_leave_the_last_to_go_through(tiny_ckpt):
    gen = GenerationConfig(max_new_tokens=2, stop_at_eos=False)
    with load(tiny_ckpt) as model, model.open(keep="off") as run:
        with Batch(run.runner, slots=2, max_seq=64) as batch:
            with pytest.raises(ConfigError, match="needs a batch of one slot"):
                batch.add(Request([1, 2, 3], gen, cached=1))
        with Batch(run.runner, slots=1, max_seq=64) as batch:
            with pytest.raises(ConfigError, match=r"cached must be in 0\.\.2"):
                batch.add(Request([1, 2, 3], gen, cached=3))
            first = batch.add(Request([1, 2, 3], gen))
            batch.step()
            with pytest.raises(KestrelError, match="forgets its steps only when idle"):
                batch.forget()
            batch.run_until_done()
            batch.forget()
            assert batch.passes == []
            # the slot holds [1, 2, 3] and the first token: the next request feeds only what is new
            again = batch.add(Request([1, 2, 3, first.tokens[0]], attrs.evolve(gen, max_new_tokens=1), cached=3))
            batch.run_until_done()
    with load(tiny_ckpt) as model, model.open(keep="off") as run:
        whole = run.generate(prompt_ids=[1, 2, 3], max_new_tokens=2, stop_at_eos=False)
    assert first.result.token_ids == whole.token_ids
    assert again.result.token_ids == whole.token_ids[1:] and again.prefill_passes == [0]


def test_a_sequence_drafting_again_feeds_only_what_is_new_and_proposes_as_if_fed_anew(tiny_ckpt, draft_ckpt,
                                                                                        monkeypatch):
    """Every draft kept and the target's own token after them: the slot holds the context and the drafts but the last,
    so the next proposal's request caches those and feeds two tokens; its drafts are a fresh sequence's."""
    cached = []
    real = Batch.add
    monkeypatch.setattr(Batch, "add",
                        lambda self, request, seq=None: cached.append(request.cached) or real(self, request, seq))
    with load(tiny_ckpt) as model, model.open(keep=1, draft=str(draft_ckpt), draft_tokens=4) as run:
        seq = run.drafter.begin(REPEATING)
        tokens, _ = seq.propose(REPEATING, 4)
        context = REPEATING + tokens + [7]
        again, _ = seq.propose(context, 4)
        fresh, _ = run.drafter.begin(context).propose(context, 4)
    assert cached[:2] == [0, len(REPEATING) + 3] and cached[2] == 0
    assert again == fresh


def test_a_draft_is_the_draft_models_own_greedy_guess_without_the_targets_penalties(tiny_ckpt, draft_ckpt):
    penalties = dict(repetition_penalty=1.8, presence_penalty=1.5, frequency_penalty=1.0)
    with load(tiny_ckpt) as model, model.open(keep=1, draft=str(draft_ckpt), draft_tokens=4,
                                              generation=penalties) as run:
        tokens, _ = run.drafter.begin(REPEATING).propose(REPEATING, 4)
    with load(draft_ckpt) as small, small.open(keep=1) as plain:
        own = plain.generate(prompt_ids=REPEATING, max_new_tokens=4, stop_at_eos=False).token_ids
        penalised = plain.generate(prompt_ids=REPEATING, max_new_tokens=4, stop_at_eos=False, **penalties).token_ids
    assert tokens == own != penalised  # the penalties would change the guess


def test_a_draft_model_of_as_many_positions_as_the_target_opens_without_a_note(tiny_ckpt, draft_ckpt):
    with warnings.catch_warnings():
        warnings.simplefilter("error", KestrelNote)
        with load(tiny_ckpt) as model, model.open(keep=1, draft=str(draft_ckpt), draft_tokens=4) as run:
            assert run.draft_run.max_seq == model.config.max_position_embeddings
