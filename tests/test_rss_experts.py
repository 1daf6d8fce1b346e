"""cpu_ref measures its expert bound: under an expert budget the weights mapping's RSS follows the resident experts.

A tiny-moe shape widened so that an expert is 3 MiB in float32 (hidden 512, moe_intermediate 512,
16 experts, top-2, layers 1..3 sparse; a 148 MB file), run with keep=off (every layer's own unit
resident) and expert_lru under a budget of 4 experts. The mapping's RSS (/proc/self/smaps) is read at
every decision point (an on_experts_routed observer, before that point's fetch: so it sees what the
previous point left) and every layer boundary, and once after the run, and compared with the bytes
the window's record holds at that moment:

    resident = the page-rounded runs of the file that are resident: the header, the never-evicted
               tensors (embeddings, norms) and the tensors of every resident unit, merged where they touch.

A fault maps more than the faulting page: 64 KiB of fault-around, or (Linux 6.18 on ext4, with large
folios in the page cache) the whole folio, up to 2 MiB. ``granule`` is that span, measured here by
touching one page of a fresh file. So a fill maps up to a granule of its neighbours' pages beside it.

- the bound: RSS <= resident + 2 granules per resident run, and far below the no-policy run's RSS,
  where every expert is preloaded and stays (its layer never goes).
- the tight bound, RSS <= resident (the design's "MADV_DONTNEED takes them out again"): cpu_ref drops
  the non-resident pages of the 2 MiB stretches around each unit it fills or retires
  (Checkpoint.drop_around), so pages a neighbour's fill faulted in do not stay mapped.

Observed here (Linux 6.18, ext4, granule 2 MiB) before cpu_ref dropped the stretches: at most
1.2 MiB above the resident runs; 147.6 MiB with no expert policy. With them: nothing above.
"""

from __future__ import annotations

import shutil
import statistics
import sys

import attrs
import pytest

from kestrel_core import load, plugins
from bench.rss import ResidentRuns, fault_granule
from kestrel_core.io.mapped import PAGE
from kestrel_core.hookspecs import hookimpl
from kestrel_core.formats.tensor_table import all_specs
from kestrel_core.tools.presets import preset_config, write_checkpoint


def _smaps_readable() -> bool:
    try:
        with open("/proc/self/smaps") as fh:
            fh.readline()
        return True
    except OSError:
        return False


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux") or not _smaps_readable(), reason="reads /proc/self/smaps"),
]

MiB = 2**20
PROMPT = [5, 17, 42, 99, 3]
TOKENS = 24
BUDGET_EXPERTS = 4


def widened_moe():
    """tiny-moe, float32, with 3 MiB experts: 16 experts of 3 x [512, 512] in each of layers 1..3."""
    cfg = attrs.evolve(preset_config("tiny-moe", "float32"), hidden_size=512, moe_intermediate_size=512, num_experts=16)
    specs = all_specs(cfg)  # the shapes follow from the config: check the widening took
    assert specs["model.layers.1.mlp.experts.15.down_proj.weight"] == (512, 512)
    return cfg


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = write_checkpoint(widened_moe(), tmp_path_factory.mktemp("rss-experts") / "moe")
    yield path
    shutil.rmtree(path, ignore_errors=True)  # 148 MB: don't leave it in pytest's kept temp dirs


@pytest.fixture(scope="module")
def granule(moe_dir):
    """The bytes one read fault maps, on the checkpoint's file system."""
    return fault_granule(moe_dir.parent)


class RssSampler:
    """The mapping's RSS and the window's resident runs at every decision point and layer boundary."""

    def __init__(self, ckpt, unit_names):
        self.ckpt = ckpt
        self.runs = ResidentRuns(ckpt, unit_names)  # header, never-evicted tensors, and the resident units'
        self.samples: list[dict] = []

    def sample(self, window, where, layer, phase):
        runs, paged, tensor_bytes = self.runs.of(e.source for key in window.resident_units
                                                 for e in window.units[key].entries)
        self.samples.append(dict(
            where=where, phase=phase, token=window.token, layer=layer, rss=self.ckpt.mapping_rss(),
            resident=paged, runs=len(runs), unit_bytes=tensor_bytes, window_bytes=window.resident_bytes,
            experts=sum(len(k) == 2 for k in window.resident_units)))

    @hookimpl
    def on_experts_routed(self, window, layer, experts, phase):
        self.sample(window, "routed", layer, phase)

    @hookimpl
    def on_layer_advance(self, window, layer, phase):
        self.sample(window, "boundary", layer, phase)


def sampled_run(model_dir, register_plugin, **settings):
    with load(model_dir) as model:
        unit_names = {name for spec in model.units for name, _ in spec.tensors.values()}
        expert = sum(model.checkpoint.info(n).nbytes for n, _ in
                     next(s for s in model.units if s.key == (1, 0)).tensors.values())
        sampler = register_plugin(RssSampler(model.checkpoint, unit_names), "rss-experts-sampler")
        try:
            with model.open(keep="off", **settings) as run:
                res = run.generate(prompt_ids=PROMPT, max_new_tokens=TOKENS, stop_at_eos=False)
                sampler.sample(run.window, "end", -1, "end")  # the last decision point's fetch too
        finally:
            plugins.pm.unregister(name="rss-experts-sampler")  # one run's sampler sees that run only
        total = sum(f.size for f in model.checkpoint.files.values())
        tensors = sum(model.checkpoint.info(n).nbytes for n in model.checkpoint.names())
    return sampler.samples, res, dict(expert=expert, file=total, tensors=tensors)


@pytest.fixture(scope="module")
def expert_bytes():
    return 3 * 512 * 512 * 4


@pytest.fixture
def budgeted(moe_dir, register_plugin, expert_bytes):
    # expert_landing off: a step that lands a miss maps its pages as any upload does, but the window counts it only
    # when it hears the step, a step later, and these bounds are page-exact at each decision point
    return sampled_run(moe_dir, register_plugin, expert_policy="expert_lru", expert_landing=False,
                       expert_budget_mb=BUDGET_EXPERTS * expert_bytes / MiB)


def test_expert_budget_bounds_the_mapping_rss(moe_dir, register_plugin, budgeted, granule, expert_bytes):
    samples, res, sizes = budgeted
    assert sizes["expert"] == expert_bytes  # a float32 checkpoint: mapping bytes = buffer bytes
    decode = [s for s in samples if s["phase"] == "decode"]
    assert len([s for s in decode if s["where"] == "routed"]) == (TOKENS - 1) * 3  # three sparse layers a token
    for s in samples:
        assert s["unit_bytes"] == s["window_bytes"], s  # the window's record is the checkpoint's bytes
        bound = s["resident"] + s["runs"] * 2 * granule
        assert s["rss"] <= bound, s
        # The measurement sees the pages that are there: every resident unit's and the never-evicted ones.
        assert s["rss"] >= s["resident"] - s["runs"] * 2 * PAGE, s
    # Under the budget from the third decoded token on: a prefill may overshoot it, and the next decision point trims
    # it, which a decode step reading the expert table hears once the step after it is on its way.
    assert max(s["experts"] for s in decode if s["token"] >= 3) <= BUDGET_EXPERTS
    slack = max(s["runs"] for s in samples) * 2 * granule
    hits, misses = res.counters["expert_hits"], res.counters["expert_misses"]
    peak = max(s["rss"] for s in samples)
    print(f"\nexpert_lru, {BUDGET_EXPERTS} x {expert_bytes / MiB:.0f} MiB experts: peak mapping RSS {peak / MiB:.1f} MiB, "
          f"median (decode) {statistics.median(s['rss'] for s in decode) / MiB:.1f} MiB; most above the resident runs "
          f"{max(s['rss'] - s['resident'] for s in samples) / MiB:.2f} MiB (slack up to {slack / MiB:.1f} MiB, "
          f"granule {granule / 1024:.0f} KiB); hit rate {hits / (hits + misses):.2f}")

    none, _, _ = sampled_run(moe_dir, register_plugin)  # no expert policy: every expert preloaded, and it stays
    everything = max(s["rss"] for s in none)
    print(f"no expert policy: peak mapping RSS {everything / MiB:.1f} MiB of {sizes['tensors'] / MiB:.1f} MiB of tensors")
    assert everything >= 0.99 * sizes["tensors"]
    assert everything <= -(-sizes["file"] // PAGE) * PAGE
    assert peak < everything / 4  # far below: 4 experts (and the prefill's overshoot) of 48
    assert max(s["resident"] + s["runs"] * 2 * granule for s in samples) < everything / 2  # the bound is no cover


def test_evicted_experts_leave_no_pages_behind(budgeted):
    """The tight bound: nothing mapped beyond the resident runs (their partial pages are in ``resident``)."""
    samples, _, _ = budgeted
    worst = max(samples, key=lambda s: s["rss"] - s["resident"])
    print(f"\nmost mapped beyond the resident runs: {(worst['rss'] - worst['resident']) / MiB:.2f} MiB at {worst}")
    assert worst["rss"] <= worst["resident"], worst
