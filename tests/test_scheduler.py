"""The scheduler's queue bound and its finish callback (the server's 429 and its streams' ends rest on them)."""

from __future__ import annotations

import attrs
import pytest

from kestrel_core.engine.batch import Batch
from kestrel_core.engine.run import load
from kestrel_core.errors import ConfigError
from kestrel_core.engine.sampling import Sampler
from kestrel_core.engine.scheduler import QueueFull, Scheduler

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


@pytest.mark.parametrize("at", [1, 3], ids=["first token", "decode step"])
def test_a_sequence_whose_sampler_fails_ends_alone_and_the_batch_goes_on(run, monkeypatch, at):
    """A sampler's error (temperature 1e-300's NaN softmax was one) ended the batch's thread: every sequence failed
    with it, and a server answered 503 to every later request."""
    real, draws = Sampler.draw, []

    def draw(self, probs):
        if self.gen.seed == 13:
            draws.append(1)
            if len(draws) == at:
                raise RuntimeError("a broken draw")
        return real(self, probs)

    monkeypatch.setattr(Sampler, "draw", draw)
    sched = Scheduler(run, max_batch=2)
    sched.start()
    try:
        bad = sched.submit(request(run, n=5, temperature=1.0, seed=13))
        good = sched.submit(request(run, n=5, temperature=1.0, seed=14))
        assert bad.finished.wait(10) and bad.finish_reason == "error" and "a broken draw" in str(bad.error)
        assert good.finished.wait(10) and good.finish_reason == "length" and len(good.tokens) == 5
        later = sched.submit(request(run, n=2))
        assert later.finished.wait(10) and later.finish_reason == "length"
        assert sched.error is None
    finally:
        sched.stop(cancel=True)


def test_the_error_that_ends_the_batch_is_heard(run, monkeypatch):
    heard = []
    sched = Scheduler(run, max_batch=1, on_error=heard.append)
    monkeypatch.setattr(Batch, "step", lambda self: (_ for _ in ()).throw(RuntimeError("the device fell off")))
    sched.start()
    seq = sched.submit(request(run, n=2))
    assert seq.finished.wait(10) and seq.finish_reason == "error"
    sched.stop()
    assert [str(e) for e in heard] == ["the device fell off"] and sched.error is heard[0]
