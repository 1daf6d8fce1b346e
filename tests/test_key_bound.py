"""A decode step that reads whole KV slots under a mask (the way a captured cuda step attends) reads only the keys in
use: the first ``key_bound`` of them, past every live row's position by the host's own count. Here cpu_ref is put on
that path (its rows otherwise read their own keys, sliced on the host), with the floor lowered so the bound moves
while a short sequence runs: a row that lost even its newest key would change its logits, so a bounded run giving
the whole cache's logits shows the host's count and the rounding are right, through batches, parked slots, chunked
prompts and verify passes."""

from __future__ import annotations

import pytest
import torch

from kestrel_core import load
from kestrel_core.engine import model as model_math
from kestrel_core.engine import runner as runner_mod
from kestrel_core.engine import slots as slots_mod
from kestrel_core.engine.model import Attend, key_bound
from kestrel_core.tools.presets import preset_config, write_checkpoint

PROMPTS = [[5, 17, 42, 99, 3], [1, 2, 3], [7, 8, 9, 10, 11, 12, 13, 14, 15], [100, 200]]


def test_the_bound_is_the_need_rounded_up_to_a_power_of_two_within_the_floor_and_the_cache():
    assert [key_bound(n, 4096) for n in (1, 256, 257, 512, 513, 4000, 4096)] == [256, 256, 512, 512, 1024, 4096, 4096]
    assert key_bound(300, 300) == 300 and key_bound(10, 100) == 100 == key_bound(100, 100)


def test_each_step_reads_exactly_the_keys_its_live_rows_need_rounded_up(tiny_ckpt, monkeypatch):
    """One sequence of a 5-token prompt, floor 1: the steps at positions 5, 6 and 7 read 8 keys, those at 8 to 15 read
    16; each step's mask spans exactly its bound (the prompt's own pass, a span, reads the whole cache)."""
    widths: list[int] = []
    with load(tiny_ckpt) as model, model.open(dtype="float32") as run:
        seen = masked(monkeypatch, 1, widths)
        run.generate(prompt_ids=PROMPTS[0], max_new_tokens=12, stop_at_eos=False)
    assert seen == [None] + [8] * 3 + [16] * 8
    assert widths[1:] == seen[1:] and widths[0] == 5 + 12


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return write_checkpoint(preset_config("tiny-moe"), tmp_path_factory.mktemp("bound") / "tiny-moe")


def masked(monkeypatch, floor: int, widths: list | None = None) -> list[int | None]:
    """cpu_ref's decode steps on the whole-cache path with ``BOUND_FLOOR`` ``floor``: the bounds they read, listed,
    None for a step with spans (and in ``widths``, how many keys each step's mask spans)."""
    seen: list[int | None] = []
    real = Attend.static

    def static(*args, **kwargs):
        spans = args[4] if len(args) > 4 else kwargs.get("spans", ())
        seen.append(None if spans else kwargs.get("bound"))  # a step with spans reads what the cache holds
        at = real(*args, **kwargs)
        if widths is not None:
            widths.append(at.decode_mask.shape[1])
        return at

    monkeypatch.setattr(runner_mod, "_sliced", lambda backend: False)
    monkeypatch.setattr(model_math, "BOUND_FLOOR", floor)
    monkeypatch.setattr(Attend, "static", staticmethod(static))
    return seen


def batch(run, prompts=PROMPTS, **kw):
    """``prompts`` as one batch job, the i-th for 9 + 7i tokens, logits kept: each one's ids and stacked logits."""
    got = run.generate_batch([dict(prompt_ids=p, max_new_tokens=9 + 7 * i, stop_at_eos=False, keep_logits=True)
                              for i, p in enumerate(prompts)], **kw)
    return [r.token_ids for r in got], [torch.stack(r.logits) for r in got]


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_a_bounded_step_gives_the_whole_caches_ids_and_logits(preset, tiny_ckpt, tiny_moe, monkeypatch):
    ckpt = tiny_ckpt if preset == "tiny" else tiny_moe
    with load(ckpt) as model, model.open(dtype="float32", keep=2 if preset == "tiny" else "off") as run:
        for kw in (dict(max_batch=1), dict(max_batch=3, prefill_chunk=4)):
            with monkeypatch.context() as m:
                whole = masked(m, 1 << 20)  # every bound the cache itself
                want_ids, want_logits = batch(run, **kw)
            with monkeypatch.context() as m:
                bounds = masked(m, 1)
                ids, logits = batch(run, **kw)
            assert ids == want_ids, kw
            for a, b in zip(logits, want_logits):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            # step by step (the same steps: the same ids), a bound where the whole cache was read, never more keys
            assert len(bounds) == len(whole) and all((b is None) == (w is None) for b, w in zip(bounds, whole))
            pairs = [(b, w) for b, w in zip(bounds, whole) if b is not None]
            assert all(b <= w for b, w in pairs) and any(b < w for b, w in pairs)
            # the bound moved up as the sequences grew, a power of two or the cache's size
            assert len({b for b, _ in pairs}) >= 2 and all(b & (b - 1) == 0 or b == w for b, w in pairs)


def test_verify_passes_and_parked_slots_keep_the_hosts_count(tiny_ckpt, monkeypatch):
    """Drafted sequences ride verify spans (their decode rows parked), then decode again where the span left them."""
    with load(tiny_ckpt) as model, model.open(dtype="float32", draft="ngram:2", draft_tokens=3) as run:
        reqs = [dict(prompt_ids=p * 3, max_new_tokens=20, stop_at_eos=False, keep_logits=True) for p in PROMPTS]
        with monkeypatch.context() as m:
            masked(m, 1 << 20)
            want = [(r.token_ids, r.logits) for r in run.generate_batch(reqs, max_batch=4)]
        with monkeypatch.context() as m:
            bounds = masked(m, 1)
            results = run.generate_batch(reqs, max_batch=4)
            got = [(r.token_ids, r.logits) for r in results]
        # drafts kept in verify passes, and rows decoded between them where nothing was drafted
        assert any(r.speculative["accepted"] for r in results) and any(1 in r.tokens_per_step for r in results)
        assert [g[0] for g in got] == [w[0] for w in want]
        for (_, a), (_, b) in zip(got, want):
            torch.testing.assert_close(torch.stack(a), torch.stack(b), rtol=1e-5, atol=1e-5)
        # spans unbounded; decode rows bounded, the bound moving as they grow
        assert None in bounds and len(set(bounds) - {None}) >= 2


@pytest.mark.cuda
def test_a_captured_step_is_captured_again_as_its_bound_grows(tiny_ckpt, monkeypatch):
    """On cuda each decode step is captured and replayed: the graph bakes its bound in, so a step of a larger bound is
    not a replay of the smaller one's graph but a step of its own (eager, then captured), and the ids and logits are
    the whole cache's."""
    def generate(floor: int):
        with monkeypatch.context() as m:
            m.setattr(model_math, "BOUND_FLOOR", floor)
            return run.generate(prompt_ids=PROMPTS[0], max_new_tokens=40, stop_at_eos=False, keep_logits=True)

    with load(tiny_ckpt) as model, model.open(backend="cuda", dtype="float32") as run:
        whole, bounded = generate(1 << 20), generate(1)
    assert bounded.token_ids == whole.token_ids
    torch.testing.assert_close(torch.stack(bounded.logits), torch.stack(whole.logits), rtol=1e-5, atol=1e-5)
    # positions 5..44: bounds 8, 16, 32, 64, each one's steps captured once, the rest replayed
    assert bounded.step_modes.count("captured") == 4 > whole.step_modes.count("captured") == 1, bounded.step_modes


@pytest.mark.parametrize("on_a_device", [False, True])
def test_held_positions_is_what_a_slot_holds_as_its_sequences_reach(tiny_ckpt, monkeypatch, on_a_device):
    """``slots.held_positions``, the rule a gate sizes a run's KV cache by (``kvcache.kv_bytes`` of it), against the
    bytes a batch's slots hold at each reach: on the host all ``max_seq`` and the spare row from the start; on a device
    (its first capacity, with the floor lowered so the cache grows) the key bound over the need and the spare row."""
    from kestrel_core.engine.kvcache import kv_bytes

    monkeypatch.setattr(model_math, "BOUND_FLOOR", 4)
    if on_a_device:
        monkeypatch.setattr(slots_mod, "first_capacity", lambda max_seq, device: key_bound(1, max_seq))
    with load(tiny_ckpt) as model, model.open(dtype="float32") as run:
        slots = run.runner.open_slots(2, 40)
        try:
            seen = []
            for need in (1, 4, 5, 9, 17, 33, 40):
                slots.reach(need)
                held = slots_mod.held_positions(need, 40, torch.device("cpu"))
                assert slots.cache_bytes == kv_bytes(model.config, held, torch.float32, slots=2), need
                seen.append(held)
        finally:
            slots.close()
    assert seen == ([5, 5, 9, 17, 33, 41, 41] if on_a_device else [41] * 7)


def test_a_cache_that_grows_under_a_batch_gives_the_whole_caches_ids_and_logits(tiny_ckpt, monkeypatch):
    """A cache that starts at a device's first capacity (floor 4) and grows several times under a batch whose slots are
    parked (chunked prompts, verify spans) and placed again: each sequence's ids and logits are those of a cache that
    held every position from the start (the written keys and values copied over, a parked slot moved to the new park,
    a placed one left where it decodes)."""
    with load(tiny_ckpt) as model, model.open(dtype="float32", draft="ngram:2", draft_tokens=3) as run:
        reqs = [dict(prompt_ids=p * 3, max_new_tokens=20, stop_at_eos=False, keep_logits=True) for p in PROMPTS]
        with monkeypatch.context() as m:
            masked(m, 1 << 20)
            want = run.generate_batch(reqs, max_batch=4, prefill_chunk=8)
        with monkeypatch.context() as m:
            masked(m, 4)
            m.setattr(slots_mod, "first_capacity", lambda max_seq, device: key_bound(1, max_seq))
            sizes, real = [], slots_mod.allocate_cache
            m.setattr(slots_mod, "allocate_cache",
                      lambda cfg, size, *a, **kw: sizes.append(size) or real(cfg, size, *a, **kw))
            got = run.generate_batch(reqs, max_batch=4, prefill_chunk=8)
    assert sizes[:2] == [4, 8] and len(sizes) >= 4  # grown at least three times
    assert any(r.speculative["accepted"] for r in got)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), rtol=1e-5, atol=1e-5)
