"""One run shared by two callers: a run steps one batch at a time (its window holds one token's plans), so a second
caller, from another thread or beside a Scheduler, is refused at once with the fix; before, both got wrong ids and no
error."""

from __future__ import annotations

import threading

import pytest

from kestrel_core import load
from kestrel_core.errors import ConfigError
from kestrel_core.engine.scheduler import Scheduler

PROMPT = [5, 17, 42, 99, 3]


def test_a_second_thread_generating_on_one_run_is_refused_and_the_first_keeps_its_ids(tiny_ckpt):
    with load(tiny_ckpt) as model, model.open(keep=1) as run:
        want = run.generate(prompt_ids=PROMPT, max_new_tokens=12, stop_at_eos=False).token_ids
        started, go_on, errors, got = threading.Event(), threading.Event(), [], []

        def first_token(token):
            started.set()
            go_on.wait(30)  # hold the run mid-generation while the other thread tries

        def first():
            got.append(run.generate(prompt_ids=PROMPT, max_new_tokens=12, stop_at_eos=False,
                                    on_token=first_token).token_ids)

        t = threading.Thread(target=first)
        t.start()
        assert started.wait(30)
        try:
            with pytest.raises(ConfigError, match="this run is generating already .*open a second run with "
                                                  r"model.open\(\.\.\.\), or submit the request to the Scheduler"):
                run.generate(prompt_ids=[1, 2, 3], max_new_tokens=4, stop_at_eos=False)
        except BaseException as exc:
            errors.append(exc)
        finally:
            go_on.set()
            t.join(60)
        assert not errors and got == [want]
        assert run.generate(prompt_ids=PROMPT, max_new_tokens=12, stop_at_eos=False).token_ids == want  # free again


def test_a_direct_generate_beside_a_scheduler_on_its_run_is_refused(tiny_ckpt):
    with load(tiny_ckpt) as model, model.open(keep=2) as run:
        sched = Scheduler(run, max_batch=2, max_queue=2)
        sched.start()
        try:
            with pytest.raises(ConfigError, match="this run is generating already"):
                run.generate(prompt_ids=PROMPT, max_new_tokens=4)
            seq = sched.submit(run.request(prompt_ids=PROMPT, max_new_tokens=6, stop_at_eos=False))
            assert seq.finished.wait(30) and seq.error is None
        finally:
            sched.stop(cancel=True)
        assert run.generate(prompt_ids=PROMPT, max_new_tokens=6, stop_at_eos=False).token_ids == seq.tokens


@pytest.mark.parametrize("stop_ids, needle", [("12", r"stop_ids must be a list of token ids \(ints\), got str"),
                                              ([1, "2"], "stop_ids must hold ints, got a str"),
                                              ([1, 512], r"stop_ids: token id 512 is outside the vocabulary \(0..511\)"),
                                              ([-1], "stop_ids: token id -1 is outside the vocabulary")])
def test_stop_ids_are_checked_as_the_server_checks_its_own(tiny_ckpt, stop_ids, needle):
    """A string (its characters) or an id outside the vocabulary was taken and never matched."""
    with load(tiny_ckpt) as model, model.open() as run:
        with pytest.raises(ConfigError, match=needle):
            run.generate(prompt_ids=PROMPT, max_new_tokens=2, stop_ids=stop_ids)
