"""The host tier's budget rule and its ring of slots (on the CPU: unpinned slots, the same code path)."""

from __future__ import annotations

import pytest
import torch

from kestrel_core.formats.checkpoint import Checkpoint
from kestrel_core.errors import BudgetError, ConfigError
from backends.cuda.host.tier import (HOST_ENV, HostBudget, PinnedRing, SlotEntry, resolve_host_budget, ring_slots,
                                    slot_bytes)
from kestrel_core.formats.tensor_table import unit_specs
from kestrel_core.formats.modelconfig import read_model_config
from backends.cuda.layout import slot_entries

MiB = 2**20


def test_everything_is_pinned_where_it_fits_half_the_available_memory(monkeypatch):
    monkeypatch.delenv(HOST_ENV, raising=False)
    assert resolve_host_budget(0, 64 * 2**30, 16 * 2**30) == HostBudget(
        32 * 2**30, "default (half of the available host memory)", "all")
    assert resolve_host_budget(0, 64 * 2**30, 40 * 2**30).mode == "ring"  # a 40 GB model on a 64 GB host
    assert resolve_host_budget(1024, 64 * 2**30, 40 * 2**30) == HostBudget(1024 * MiB, "config", "ring")


def test_a_pipelines_ranks_on_one_host_share_the_default(monkeypatch):
    """Four ranks of one host (torchrun's LOCAL_WORLD_SIZE): each pins an eighth of the available memory; a budget
    given is each rank's as given."""
    monkeypatch.delenv(HOST_ENV, raising=False)
    for k, v in {"WORLD_SIZE": "8", "RANK": "5", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(k, v)
    assert resolve_host_budget(0, 64 * 2**30, 16 * 2**30) == HostBudget(
        8 * 2**30, "default (half of the available host memory, shared by the 4 ranks of this host)", "ring")
    assert resolve_host_budget(1024, 64 * 2**30, 40 * 2**30) == HostBudget(1024 * MiB, "config", "ring")


def test_the_environment_beats_the_config(monkeypatch):
    monkeypatch.setenv(HOST_ENV, "512")
    assert resolve_host_budget(4096, 64 * 2**30, 2**30) == HostBudget(512 * MiB, HOST_ENV, "ring")
    monkeypatch.setenv(HOST_ENV, "lots")
    with pytest.raises(ConfigError, match="KESTREL_HOST_MB='lots' must be a whole number of MiB"):
        resolve_host_budget(0, 2**30, 2**30)
    monkeypatch.setenv(HOST_ENV, "0")
    with pytest.raises(ConfigError, match="KESTREL_HOST_MB=0 must be positive"):
        resolve_host_budget(0, 2**30, 2**30)


def test_a_budget_that_would_lock_more_than_the_host_has_is_refused_before_locking(monkeypatch):
    monkeypatch.delenv(HOST_ENV, raising=False)
    avail = 8 * 2**30
    # all pinned: a 10 GiB staging under a 12 GiB budget on a host with 8 GiB available
    with pytest.raises(BudgetError, match=r"host budget 12,288 MiB \(config\) would page-lock 10,240 MiB, more than "
                                          r"the 8,192 MiB of host memory available now .*lower --host-budget-mb"):
        resolve_host_budget(12 * 1024, avail, 10 * 2**30)
    # a ring: it locks its budget
    monkeypatch.setenv(HOST_ENV, str(9 * 1024))
    with pytest.raises(BudgetError, match=r"9,216 MiB \(KESTREL_HOST_MB\) would page-lock 9,216 MiB"):
        resolve_host_budget(0, avail, 40 * 2**30)
    monkeypatch.delenv(HOST_ENV)
    # what fits is taken: a staging of 6 GiB under the same 12 GiB budget, a ring of 7 GiB
    assert resolve_host_budget(12 * 1024, avail, 6 * 2**30).mode == "all"
    assert resolve_host_budget(7 * 1024, avail, 40 * 2**30).mode == "ring"
    # where the available memory cannot be read (0), nothing is refused for it
    assert resolve_host_budget(12 * 1024, 0, 10 * 2**30).mode == "all"


def test_a_negative_config_budget_is_refused(monkeypatch):
    monkeypatch.delenv(HOST_ENV, raising=False)
    with pytest.raises(ConfigError, match="host_budget_mb must be >= 0"):
        resolve_host_budget(-1, 2**30, 2**30)


def test_a_budget_below_one_unit_and_the_prefetch_says_what_it_needs():
    budget = HostBudget(100 * MiB, "config", "ring")
    assert ring_slots(budget, 30 * MiB, 2) == 3
    with pytest.raises(BudgetError, match=r"need at least 120 MiB \(4 slots of 30.0 MiB\); raise --host-budget-mb"):
        ring_slots(budget, 30 * MiB, 3)


def _entries(cfg):
    """Each unit's entries in cuda's fused layout, as the ring stages them."""
    return {spec.key: slot_entries(spec.tensors) for spec in unit_specs(cfg)}


class Event:
    def __init__(self):
        self.waited = 0

    def synchronize(self):
        self.waited += 1


@pytest.mark.parametrize("threads", [1, 3])
def test_a_slot_holds_a_unit_fused_and_converted(tiny_ckpt, threads):
    cfg = read_model_config(tiny_ckpt)
    entries = _entries(cfg)
    size = slot_bytes(entries.values(), torch.bfloat16)
    assert size % 4096 == 0 and size >= max(sum(e.nbytes(torch.bfloat16) for e in es) for es in entries.values())
    ckpt = Checkpoint(tiny_ckpt)
    ring = PinnedRing(2, size, torch.bfloat16, threads=threads, pin=False)
    try:
        for key, es in entries.items():
            slot = ring.acquire()
            got = ring.fill(slot, es, ckpt.view)
            for e in es:
                want = torch.cat([ckpt.view(n) for n in e.parts]).to(torch.bfloat16)
                assert torch.equal(got[e.name], want), (key, e.name)
                assert got[e.name].data_ptr() % 4096 == 0
            ring.release(slot, None)
        assert ring.bytes_staged == sum(e.nbytes(torch.bfloat16) for es in entries.values() for e in es)
    finally:
        ring.close()
        ckpt.close()


def test_slots_come_in_turn_and_wait_for_their_last_reader():
    ring = PinnedRing(2, 4096, torch.float32, threads=1, pin=False)
    a, b = ring.acquire(), ring.acquire()
    assert a is not b
    ev = Event()
    ring.release(a, ev)
    assert ring.acquire() is a and ev.waited == 1  # the oldest slot comes back once its upload is done
    assert ring.acquire() is b
    with pytest.raises(ConfigError, match="does not fit the ring's slot of 4096 bytes"):
        ring.fill(b, [SlotEntry("big", (64, 64), ("x",))], lambda name: torch.zeros(64, 64))
    with pytest.raises(ConfigError, match="its parts have 3 rows, the entry 4"):
        ring.fill(b, [SlotEntry("qkv", (4, 8), ("q",))], lambda name: torch.zeros(3, 8))
    ring.close()


def test_the_flag_and_the_toml_key_set_the_host_budget(tmp_path):
    from kestrel_core.cli import build_parser
    from kestrel_core.commands.common import config_from_args

    args = build_parser().parse_args(["generate", "--host-budget-mb", "1536.5"])
    assert config_from_args(args).backend.host_budget_mb == 1536.5
    toml = tmp_path / "kestrel.toml"
    toml.write_text("[backend]\nhost_budget_mb = 2048\n")
    args = build_parser().parse_args(["generate", "--config", str(toml)])
    assert config_from_args(args).backend.host_budget_mb == 2048
    toml.write_text('[backend]\nhost_budget_mb = "lots"\n')
    with pytest.raises(ConfigError, match="host_budget_mb must be float"):
        config_from_args(build_parser().parse_args(["generate", "--config", str(toml)]))


def test_cpu_ref_says_the_host_budget_does_not_apply(tiny_ckpt, monkeypatch):
    from kestrel_core import load
    from kestrel_core.errors import KestrelNote

    monkeypatch.delenv(HOST_ENV, raising=False)
    with pytest.warns(KestrelNote, match="cpu_ref pins nothing"):
        with load(tiny_ckpt) as model, model.open(backend="cpu_ref", host_budget_mb=512):
            pass
