"""A Mixture-of-Experts decode step that reads its experts through the expert table, with the policy a step behind (cpu_ref).

The step reads each routed expert where the table points, its buffer or its host copy, and never waits for the host;
the host hears the step's routing once it reads the step back, and the window's plan on it reaches the table on the
runner's schedule. Results never depend on it.
"""

from __future__ import annotations

import json

import pytest

from backends.cpu_ref.backend import CpuRefBackend
from kestrel_core import load
from kestrel_core.errors import ConfigError
from kestrel_core.hookspecs import hookimpl
from kestrel_core.engine.expert_schedule import ExpertSchedule
from kestrel_core.tools.presets import preset_config, write_checkpoint
from kestrel_core.tools.quantize import quantize_checkpoint
from kestrel_core.formats.units import is_expert
from kestrel_core.tools.traces import TraceRecorder, replay
from plugins.experts import ExpertLFU

PROMPT = [5, 17, 42, 99, 3]
EXPERT = 3 * 32 * 64 * 4  # one tiny-moe expert in cpu_ref's float32 buffers


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return write_checkpoint(preset_config("tiny-moe"), tmp_path_factory.mktemp("table") / "tiny-moe")


@pytest.fixture(scope="module")
def tiny_moe_q8(tiny_moe, tmp_path_factory):
    out = tmp_path_factory.mktemp("table") / "tiny-moe-q8"
    quantize_checkpoint(tiny_moe, out, 32)
    return out


def generate(model_dir, tokens=14, observers=(), **settings):
    with load(model_dir) as model, model.open(observers=observers, **settings) as run:
        table = run.runner.schedule is not None
        result = run.generate(prompt_ids=PROMPT, max_new_tokens=tokens, stop_at_eos=False)
    return result, table


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("checkpoint", ["float", "q8"])
def test_ids_are_the_host_paths_at_every_budget_and_policy(tiny_moe, tiny_moe_q8, dtype, checkpoint):
    path = tiny_moe if checkpoint == "float" else tiny_moe_q8
    ref, table = generate(path, keep="off", expert_decode="host", dtype=dtype)
    assert not table
    expert = EXPERT * (2 if dtype == "float64" else 1)
    for keep in ("off", 2):
        for policy in ("expert_lru", "expert_lfu"):
            for experts in (2, 5, 24):
                got, table = generate(path, keep=keep, expert_policy=policy, expert_budget_mb=experts * expert / 2**20,
                                      dtype=dtype)
                assert table and got.token_ids == ref.token_ids, (keep, policy, experts)
        got, table = generate(path, keep=keep, dtype=dtype)  # no expert policy: an expert goes with its layer
        assert table and got.token_ids == ref.token_ids, keep


def test_a_step_never_routes_on_the_host(tiny_moe, monkeypatch):
    """In a table step the decision point is never reached: the routing comes back with the token."""
    from kestrel_core.engine import runner as runner_mod

    calls = []
    real = runner_mod.host_experts

    def counting(runner, layer, phase, *rest):
        calls.append(phase)
        return real(runner, layer, phase, *rest)

    monkeypatch.setattr(runner_mod, "host_experts", counting)
    result, table = generate(tiny_moe, expert_policy="expert_lru", expert_budget_mb=4 * EXPERT / 2**20)
    assert table and set(calls) == {"prefill"} and len(calls) == 3  # the prefill's three sparse layers, once
    assert sum(p["expert_hits"] + p["expert_misses"] for p in result.per_token) == 13 * 3 * 2  # every step heard


def test_a_prompt_chunk_waits_for_each_expert_as_it_reads_it_and_the_table_follows_after(tiny_moe, monkeypatch):
    """A prefill's sparse layer orders each expert's compute after that expert's upload alone (``before_use`` as the
    layer reads it, in expert order), not after all of them up front; the table points at the admitted slots once the
    layer has read them."""
    events = []
    real_use, real_fetched, real_point = (CpuRefBackend.before_use, CpuRefBackend.fetched_experts,
                                          CpuRefBackend.point_experts)

    def before_use(self, key):
        events.append(("use", key))
        return real_use(self, key)

    def fetched_experts(self, x, weights, chosen, used, weights_of, prompt_from=None):
        events.append(("compute", x.shape[0]))
        out = real_fetched(self, x, weights, chosen, used, weights_of, prompt_from=prompt_from)
        events.append(("computed", sorted(set(chosen.flatten().tolist()))))
        return out

    def point_experts(self, host, slots):
        events.append(("point", sorted(key for key, _ in slots)))
        return real_point(self, host, slots)

    monkeypatch.setattr(CpuRefBackend, "before_use", before_use)
    monkeypatch.setattr(CpuRefBackend, "fetched_experts", fetched_experts)
    monkeypatch.setattr(CpuRefBackend, "point_experts", point_experts)
    _, table = generate(tiny_moe, tokens=1, expert_policy="expert_lru", expert_budget_mb=24 * EXPERT / 2**20)
    assert table
    starts = [i for i, ev in enumerate(events) if ev[0] == "compute"]
    assert len(starts) == 3  # the prompt's three sparse layers
    kinds = [ev[0] for ev in events if ev[0] in ("compute", "point")]
    assert kinds[:6] == ["compute", "point"] * 3  # a layer's table follows its compute, once, never before
    for i in starts:
        assert events[i][1] == len(PROMPT)
        j = next(j for j in range(i, len(events)) if events[j][0] == "computed")
        layer_uses = [ev[1] for ev in events[i + 1:j] if ev[0] == "use"]
        routed = events[j][1]
        assert [e for _, e in layer_uses] == routed and len({k[0] for k in layer_uses}) == 1  # each, as it is read
        assert not any(ev[0] == "point" for ev in events[i:j])
        point = events[j + 1]
        assert point == ("point", [(layer_uses[0][0], e) for e in routed])  # then the table, the chunk's admissions


def test_a_heard_routing_brings_no_expert_of_a_layer_that_left_the_window(tiny_moe):
    """At keep 2 a decode step's layers come and go; the routing a step heard late is for layers that may have left
    since: their experts stay out (an expert goes with its layer), and they are still counted."""
    from kestrel_core.hookspecs import hookimpl

    class Orphans:
        def __init__(self):
            self.seen, self.orphans = 0, []

        @hookimpl
        def on_layer_advance(self, window, layer, phase):
            present = window.resident_units
            self.seen += 1
            self.orphans += [k for k in present if is_expert(k) and (k[0],) not in present]

    watch = Orphans()
    result, table = generate(tiny_moe, tokens=12, observers=[watch], keep=2, expert_policy="expert_lru",
                             expert_budget_mb=24 * EXPERT / 2**20)
    assert table and watch.seen > 0 and watch.orphans == []
    assert sum(p["expert_hits"] + p["expert_misses"] for p in result.per_token) == 11 * 3 * 2  # every step heard


def test_a_miss_is_what_the_step_read_from_the_host_copy(tiny_moe):
    """Everything resident (keep off, no expert policy: every expert preloaded): no step reads a host copy. With a
    budget that holds every expert, the misses stop once each routed expert's admission has reached the table."""
    all_in, _ = generate(tiny_moe)
    assert all_in.counters["expert_misses"] == 0
    roomy, _ = generate(tiny_moe, 24, expert_policy="expert_lru", expert_budget_mb=24 * EXPERT / 2**20)
    misses = [p["expert_misses"] for p in roomy.per_token]
    assert sum(misses) > 0 and misses[-4:] == [0, 0, 0, 0], misses
    assert roomy.counters["layer_evictions"] == 0  # nothing needed to go


def test_what_crosses_the_link_is_counted_apart(tiny_moe):
    """Through the table a decode step reads each miss from its host copy (``bytes_read_host``: one expert's bytes a
    miss) and the admission heard a step later reads it again (``bytes_reread``, within ``bytes_uploaded``). The host
    path reads a miss once, into its buffer, before the step uses it."""
    tight = dict(expert_policy="expert_lru", expert_budget_mb=2 * EXPERT / 2**20)
    table, _ = generate(tiny_moe, **tight)
    host, _ = generate(tiny_moe, expert_decode="host", **tight)
    assert table.token_ids == host.token_ids
    for p in table.per_token:  # decode steps: every miss was a read of the host copy
        assert p["bytes_read_host"] == p["expert_misses"] * EXPERT
    t, h = table.counters, host.counters
    assert t["bytes_read_host"] > 0 and (h["bytes_read_host"], h["bytes_reread"]) == (0, 0)
    assert 0 < t["bytes_reread"] <= min(t["bytes_uploaded"], t["bytes_read_host"])
    assert t["bytes_uploaded"] + t["bytes_read_host"] > h["bytes_uploaded"]  # the table moves more than the host path


def test_the_table_must_follow_an_eviction(tiny_moe, monkeypatch):
    """The test has teeth: a table left pointing at an evicted expert's buffer reads whatever the buffer holds next."""
    ref, _ = generate(tiny_moe, keep="off", expert_decode="host")
    tight = dict(expert_policy="expert_lru", expert_budget_mb=6 * EXPERT / 2**20)  # slots that change hands
    good, _ = generate(tiny_moe, **tight)
    assert good.token_ids == ref.token_ids
    real = CpuRefBackend.point_experts
    monkeypatch.setattr(CpuRefBackend, "point_experts", lambda self, host, slots: real(self, [], slots))
    stale, _ = generate(tiny_moe, **tight)
    assert stale.token_ids != ref.token_ids


def test_an_admission_reads_its_slot_from_the_step_after_next():
    s = ExpertSchedule()
    s.admit_now([(1, 0)], boundary=1)  # a prefill fetched it: every decode step reads its slot
    assert s.begin_step() == [] and s.begin_step() == [] and not s.read_host((1, 0), 0)  # steps 0 and 1 launched
    s.admit_heard((1, 3), payload="bufs")  # step 0's routing, heard after step 1 was launched
    s.evict_heard([(1, 0)])
    assert s.begin_step() == []  # step 2 still reads expert 3's host copy, and expert 0's too
    assert s.begin_step() == [((1, 3), "bufs")]  # step 3 reads expert 3's slot
    assert [s.read_host((1, 3), k) for k in range(4)] == [True, True, True, False]
    assert [s.read_host((1, 0), k) for k in range(4)] == [False, False, True, True]


@pytest.mark.parametrize("landing, staging", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("experts", [2, 4, 5, 8])
def test_replay_counts_what_the_live_run_counted(tiny_moe, temperature, experts, landing, staging):
    """Greedy steps are heard a step late, sampled ones at once: the replay models the same schedule, and where the
    steps land their misses, the same ring (and the same budget held back for the staging slots, or none)."""
    budget_mb = experts * EXPERT / 2**20
    recorder = TraceRecorder()
    with load(tiny_moe) as model:
        with model.open(observers=[recorder], expert_policy="expert_lfu", expert_budget_mb=budget_mb,
                        temperature=temperature, seed=3, expert_landing=landing, expert_staging=staging) as run:
            live = run.generate(prompt_ids=PROMPT, max_new_tokens=16, stop_at_eos=False)
            from kestrel_core.tools.traces import model_info, read_trace
            info = model_info(run)
    assert info["expert_decode"] == "table" and info["lag"] == (1 if temperature == 0 else 0)
    assert info["staging"] == staging
    trace = {"model": info, "sizes": {tuple(map(int, k.split("."))): v for k, v in info["expert_bytes"].items()},
             "events": recorder.events}
    got = replay(trace, ExpertLFU(budget=int(budget_mb * 2**20)))
    c = live.counters
    assert (got["hits"], got["misses"]) == (c["expert_hits"], c["expert_misses"])
    expert_bytes = sum(p["bytes_uploaded"] for p in live.per_token)
    assert got["bytes_per_decoded_token"] * got["decode_tokens"] == expert_bytes  # keep off: only experts move
    # what crossed the link twice: a step's read of a host copy, then the admission heard of that expert
    assert (got["bytes_read_host"], got["bytes_reread"]) == (c["bytes_read_host"], c["bytes_reread"])
    assert info["landing"] == landing
    if landing and experts >= 4:  # every miss crosses once: landed (an upload), or read and not admitted
        assert c["expert_landed"] > 0 and c["bytes_reread"] == 0
    elif landing:  # a budget of two experts leaves no room for a ring: the admissions read again
        assert c["expert_landed"] == 0 and c["bytes_reread"] > 0
    else:
        assert not info["landing"] and c["expert_landed"] == 0
        assert 0 < c["bytes_reread"] <= min(c["bytes_read_host"], c["bytes_uploaded"])
    assert read_trace  # the on-disk form is tested in test_moe_traces.py


def test_expert_decode_is_checked(tiny_moe):
    with load(tiny_moe) as model:
        with pytest.raises(ConfigError, match="expert_decode must be one of auto, table, host, got 'gpu'"):
            model.open(expert_decode="gpu")
        with pytest.raises(ConfigError, match="expert_prefetch guesses .* use expert_decode = 'host'"):
            model.open(expert_decode="table", expert_prefetch=True)
        with model.open(expert_prefetch=True) as run:  # auto: a guess needs the host, so the host routes
            assert run.runner.schedule is None
    with load(tiny_moe) as model, model.open(expert_decode="table", keep=2) as run:
        assert run.runner.schedule is not None


def test_the_expert_decode_flag(tiny_moe, capsys):
    from kestrel_core.cli import main

    argv = ["generate", "--model", str(tiny_moe), "--prompt-ids", "5,17,42", "--max-new-tokens", "6", "--ignore-eos",
            "--expert-policy", "expert_lfu", "--expert-budget-mb", "0.05", "--json"]
    ids = {}
    for mode in ("table", "host"):
        assert main([*argv, "--expert-decode", mode]) == 0
        out = json.loads(capsys.readouterr().out)
        ids[mode] = out["token_ids"]
        assert out["counters"]["expert_misses"] > 0
    assert ids["table"] == ids["host"]
    assert main([*argv, "--expert-decode", "gpu"]) == 2
    assert "expert_decode must be one of auto, table, host, got 'gpu'" in capsys.readouterr().err


def test_waited_weights_wait_for_an_expert_as_it_is_read():
    from kestrel_core.engine.expert_landing import WaitedWeights

    used = []
    weights = {3: {"w": 1}, 5: {"w": 2}}
    ww = WaitedWeights(weights, 7, used.append)
    assert list(ww) == [3, 5] and len(ww) == 2 and used == []  # listing them waits for none
    assert ww[5] == {"w": 2} and used == [(7, 5)]
    with pytest.raises(KeyError):
        ww[4]
    assert used == [(7, 5)]


class PrefetchEverything:
    """An observer that advises, at every decision point, the prefetch of every expert of the layer."""

    def __init__(self, n):
        self.n = n

    @hookimpl
    def on_experts_routed(self, window, layer, experts, phase):
        from kestrel_core.engine.plan import Advice

        return Advice(prefetch=[(layer, e) for e in range(self.n)])


def test_a_landed_step_admits_nothing_at_its_hearing_not_even_prefetch_advice(tiny_moe, monkeypatch):
    """Where steps land their misses, what is resident changes only by landing and eviction while a step is heard: an
    expert admitted then would be pointed at from a later step, while the table may still point at its landed slot."""
    admitted = []
    real = ExpertSchedule.admit_heard
    monkeypatch.setattr(ExpertSchedule, "admit_heard", lambda self, key, payload=None: admitted.append(key) or
                        real(self, key, payload))
    budget_mb = 8 * EXPERT / 2**20
    with load(tiny_moe) as model:
        for landing in (True, False):
            with model.open(observers=[PrefetchEverything(model.config.num_experts)], expert_policy="expert_lru",
                            expert_budget_mb=budget_mb, expert_landing=landing) as run:
                r = run.generate(prompt_ids=PROMPT, max_new_tokens=8, stop_at_eos=False)
            assert (r.counters["expert_landed"] > 0) == landing
            assert bool(admitted) != landing, admitted  # without landing the advice is admitted a step behind
            admitted.clear()


def test_the_ring_and_its_staging_slots_come_out_of_the_expert_budget():
    """(ring, staging, bytes held back) at budgets of tiny-moe's experts (8 a layer, 4 layers, top-2): the policy always
    keeps a token's routed experts; staging takes up to one token's in what is left; no landing where no ring fits,
    and no miss to stage where the budget holds every expert."""
    from kestrel_core.engine.landing import ring_size

    def sizes(n):
        return ring_size(n * EXPERT, EXPERT, 32 * EXPERT, 2, 4)

    assert sizes(2) == (0, 0, 0) and sizes(3) == (0, 0, 0)
    assert sizes(4) == (1, 1, 2 * EXPERT)
    assert sizes(5) == (1, 2, 3 * EXPERT)
    assert sizes(8) == (2, 2, 4 * EXPERT)
    assert sizes(32) == (0, 0, 0) and sizes(40) == (8, 0, 0)


@pytest.mark.parametrize("staging", [True, False])
def test_expert_staging_sets_the_staging_slots_and_changes_no_id(tiny_moe, staging):
    with load(tiny_moe) as model, model.open(expert_policy="expert_lru", expert_budget_mb=8 * EXPERT / 2**20,
                                            expert_staging=staging) as run:
        settings = run.runner.settings
        got = run.generate(prompt_ids=PROMPT, max_new_tokens=10, stop_at_eos=False)
    assert (settings.landing, settings.staged) == ((2, 2) if staging else (2, 0))
    want, _ = generate(tiny_moe, tokens=10)
    assert got.token_ids == want.token_ids


def test_the_expert_staging_flag(tiny_moe, capsys):
    from kestrel_core.cli import main

    argv = ["generate", "--model", str(tiny_moe), "--prompt-ids", "5,17,42", "--max-new-tokens", "6", "--ignore-eos",
            "--expert-policy", "expert_lfu", "--expert-budget-mb", str(8 * EXPERT / 2**20), "--json"]
    ids = {}
    for mode in ("on", "off"):
        assert main([*argv, "--expert-staging", mode]) == 0
        ids[mode] = json.loads(capsys.readouterr().out)["token_ids"]
    assert ids["on"] == ids["off"]
    assert main([*argv, "--expert-staging", "maybe"]) == 2
    assert "--expert-staging: invalid choice: 'maybe'" in capsys.readouterr().err
