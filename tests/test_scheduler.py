"""The scheduler's queue bound and its finish callback (the server's 429 and its streams' ends rest on them)."""

from __future__ import annotations

import attrs
import pytest

from kestrel_core.engine import load
from kestrel_core.errors import ConfigError
from kestrel_core.scheduler import QueueFull, Scheduler

LONG = 400  # tokens: far longer than the few microseconds between two submits


@pytest.fixture(scope="module")
def run(tiny_ckpt):
    with load(tiny_ckpt) as model, model.open(backend="cpu_ref") as r:
        yield r


def request(run, n=LONG, **kw):
    return run.request(prompt_ids=[5, 17, 42], max_new_tokens=n, stop_at_eos=False, **kw)


def test_the_queue_bound_counts_waiting_requests_beyond_the_slots(run):
    sched = Scheduler(run, max_batch=1, max_queue=1)
    sched.start()
    try:
        first, second = sched.submit(request(run)), sched.submit(request(run))
        with pytest.raises(QueueFull, match="the queue holds 1"):
            sched.submit(request(run))
        first.cancel()
        second.cancel()
        assert first.finished.wait(10) and second.finished.wait(10)
        third = sched.submit(request(run, n=3))  # room again once they are done
        assert third.finished.wait(10) and third.finish_reason == "length"
    finally:
        sched.stop(cancel=True)


def test_max_queue_zero_takes_a_request_only_into_a_free_slot(run):
    sched = Scheduler(run, max_batch=1, max_queue=0)
    sched.start()
    try:
        first = sched.submit(request(run))
        with pytest.raises(QueueFull):
            sched.submit(request(run))
        first.cancel()
        assert first.finished.wait(10) and first.finish_reason == "cancelled"
        assert sched.submit(request(run, n=2)).finished.wait(10)
    finally:
        sched.stop(cancel=True)


def test_a_negative_queue_is_refused(run):
    with pytest.raises(ConfigError, match="max_queue"):
        Scheduler(run, max_queue=-1)


def test_on_finish_hears_each_sequence_once_when_it_is_done(run):
    heard = []
    sched = Scheduler(run, max_batch=2)
    sched.start()
    try:
        seqs = [sched.submit(attrs.evolve(request(run, n=n), on_finish=heard.append)) for n in (2, 5, LONG)]
        seqs[2].cancel()
        for seq in seqs:
            assert seq.finished.wait(10)
    finally:
        sched.stop()
    assert sorted(map(id, heard)) == sorted(map(id, seqs))
    assert all(s.done and s.finished.is_set() for s in heard)  # done and woken before the callback ran
    assert [s.finish_reason for s in seqs] == ["length", "length", "cancelled"]
    assert [len(s.tokens) for s in seqs[:2]] == [2, 5]
