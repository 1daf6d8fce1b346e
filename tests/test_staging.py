"""Staging units into the host ring (kestrel_core/staging.py), on the CPU with unpinned slots.

The hot path (pages cached: read with pread, or copied from the mapping) and the cold path (pages
dropped: O_DIRECT) give the same bytes, and count where they came from, piece by piece. The stager hands out each unit's slot with
exactly the unit's fused, converted tensors, stages along the last pass ahead of the uploads, and
stays correct when the forecast is wrong or the ring is too small to stage anything ahead.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from kestrel_core.formats.checkpoint import Checkpoint
from backends.cuda.host.diskread import direct_io_supported
from backends.cuda.host.pagecache import cached_fraction, drop_checkpoint, resident_fraction
from backends.cuda.host.tier import PendingFill, PinnedRing, SlotEntry, slot_bytes
from kestrel_core.formats.tensor_table import unit_specs
from kestrel_core.formats.modelconfig import read_model_config
from kestrel_core.formats.units import is_expert
from kestrel_core.tools.presets import preset_config, write_checkpoint
from backends.cuda.host.staging import Filler, PartRead, Stager
from backends.cuda.layout import slot_entries

DTYPE = torch.bfloat16


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory) -> Path:
    out = write_checkpoint(preset_config("tiny", "float32"), tmp_path_factory.mktemp("staging") / "tiny")
    if not direct_io_supported(out):
        pytest.skip(f"the filesystem of {out} refuses O_DIRECT")
    return out


def entries_of(cfg) -> dict:
    return {spec.key: slot_entries(spec.tensors) for spec in unit_specs(cfg)}


def want(ckpt: Checkpoint, entry: SlotEntry) -> torch.Tensor:
    return torch.cat([ckpt.view(n) for n in entry.parts]).to(DTYPE)


def _drops(ckpt_dir: Path) -> bool:
    ckpt = Checkpoint(ckpt_dir)
    try:
        drop_checkpoint(ckpt, sync=True)
        return cached_fraction(ckpt.view(ckpt.names()[-1])) < 1.0
    finally:
        ckpt.close()


def test_cold_and_hot_parts_give_the_same_bytes_and_are_counted_apart(ckpt_dir):
    ckpt = Checkpoint(ckpt_dir)
    cfg = read_model_config(ckpt_dir)
    entries = entries_of(cfg)[(0,)]
    parts = [n for e in entries for n in e.parts]
    nbytes = sum(ckpt.info(n).nbytes for n in parts)
    filler = Filler(ckpt, threads=3)
    try:
        drop_checkpoint(ckpt, sync=True)
        if max(cached_fraction(ckpt.view(n)) for n in parts) == 1.0:
            pytest.skip("this filesystem keeps the file's pages cached after POSIX_FADV_DONTNEED")
        cold = {n: t.clone() for n, t in filler.sources(entries).items()}
        assert filler.cold_bytes == nbytes and filler.hot_bytes == 0
        assert filler.disk_bytes_read >= nbytes  # aligned supersets
        for n in parts:  # now read the mapping (faulting the pages in): the same bytes
            assert torch.equal(cold[n], ckpt.view(n)), n
            assert cached_fraction(ckpt.view(n)) == 1.0
        hot = filler.sources(entries)
        assert filler.hot_bytes == nbytes and filler.cold_bytes == nbytes  # this time from the cache
        assert all(torch.equal(hot[n], cold[n]) for n in parts)
    finally:
        filler.close()
        ckpt.close()


def test_a_filler_without_o_direct_reads_everything_through_the_mapping(ckpt_dir):
    if not _drops(ckpt_dir):
        pytest.skip("this filesystem keeps the file's pages cached after POSIX_FADV_DONTNEED")
    ckpt = Checkpoint(ckpt_dir)
    filler = Filler(ckpt, direct=False)
    try:
        drop_checkpoint(ckpt, sync=True)
        entries = entries_of(read_model_config(ckpt_dir))[(1,)]
        got = filler.sources(entries)
        total = sum(ckpt.info(n).nbytes for e in entries for n in e.parts)
        # the pages were dropped: read through the mapping, from disk, so counted cold; no O_DIRECT read was made
        assert filler.cold_bytes == total and filler.hot_bytes == 0 and filler.disk_bytes_read == 0
        assert all(torch.equal(got[n], ckpt.view(n)) for e in entries for n in e.parts)
    finally:
        filler.close()
        ckpt.close()


class Done:
    """What an upload leaves on a slot: the stager's worker waits on it before refilling the slot."""

    def __init__(self):
        self.waited = threading.Event()

    def synchronize(self):
        self.waited.set()


def run_passes(ckpt_dir, slots: int, orders: list[list[tuple]], drop_pages: bool = False):
    ckpt = Checkpoint(ckpt_dir)
    cfg = read_model_config(ckpt_dir)
    entries = entries_of(cfg)
    ring = PinnedRing(slots, slot_bytes(entries.values(), DTYPE), DTYPE, threads=2, pin=False)
    stager = Stager(ring, Filler(ckpt), entries.__getitem__, lookahead=slots - 1)
    taken = []
    try:
        for order in orders:
            if drop_pages:
                drop_checkpoint(ckpt, sync=True)
            for key in order:
                slot, views = stager.take(key)
                for e in entries[key]:
                    assert torch.equal(views[e.name], want(ckpt, e)), (key, e.name)
                    assert views[e.name].dtype == DTYPE and views[e.name].shape == e.shape
                taken.append(slot.index)
                stager.give_back(slot, Done())
        return stager, taken
    finally:
        stager.close()
        ring.close()
        ckpt.close()


def test_the_stager_stages_ahead_along_the_last_pass(ckpt_dir):
    layers = [(i,) for i in range(read_model_config(ckpt_dir).num_hidden_layers)]
    stager, taken = run_passes(ckpt_dir, 3, [layers] * 3)
    assert stager.staged_ahead > 0
    # the first pass has no forecast; from the second on, every layer but the first was staged ahead
    assert stager.ahead_hits >= 2 * (len(layers) - 1) - 1
    assert set(taken) == {0, 1, 2}  # every slot was used, none other


def test_a_wrong_forecast_and_a_one_slot_ring_stay_correct(ckpt_dir):
    n = read_model_config(ckpt_dir).num_hidden_layers
    forward = [(i,) for i in range(n)]
    skipping = [(i,) for i in range(0, n, 2)] + [(i,) for i in range(1, n, 2)]  # not the order the forecast holds
    stager, _ = run_passes(ckpt_dir, 2, [forward, skipping, forward, skipping[::-1]], drop_pages=True)
    assert stager.filler.cold_bytes > 0  # dropped pages came from disk
    one, taken = run_passes(ckpt_dir, 1, [forward, forward])
    assert one.lookahead == 0 and one.staged_ahead == 0 and set(taken) == {0}


def test_hot_parts_in_the_slots_dtype_are_read_with_pread_and_never_mapped(tmp_path):
    out = write_checkpoint(preset_config("tiny"), tmp_path / "tiny-bf16")  # stored in bfloat16, the slot's dtype
    ckpt = Checkpoint(out)
    entries = entries_of(read_model_config(out))
    ring = PinnedRing(2, slot_bytes(entries.values(), DTYPE), DTYPE, threads=2, pin=False)
    stager = Stager(ring, Filler(ckpt), entries.__getitem__, lookahead=1)
    try:
        expect = {(key, e.name): want(ckpt, e).clone() for key, es in entries.items() for e in es}
        ckpt.unmap_all()  # the pages are cached (just written and read) and not mapped
        for key in entries:
            slot, views = stager.take(key)
            for e in entries[key]:
                assert torch.equal(views[e.name], expect[key, e.name]), (key, e.name)
            stager.give_back(slot, Done())
            assert ckpt.mapping_rss() == 0, key  # read through the page cache's copy: nothing faulted in
        assert stager.filler.hot_bytes == sum(ckpt.info(n).nbytes for es in entries.values() for e in es for n in e.parts)
    finally:
        stager.close()
        ring.close()
        ckpt.close()


def test_a_part_in_the_slots_dtype_reads_its_cached_pieces_with_pread_and_the_rest_with_o_direct(tmp_path, monkeypatch):
    """Piece by piece: the pieces whose pages are cached are hot, the rest come from disk and leave nothing cached."""
    out = write_checkpoint(preset_config("tiny"), tmp_path / "tiny-bf16")
    if not direct_io_supported(out):
        pytest.skip(f"the filesystem of {out} refuses O_DIRECT")
    monkeypatch.setattr(PartRead, "PIECE", 4096)  # a tiny part in several pieces
    ckpt = Checkpoint(out)
    entries = entries_of(read_model_config(out))[(0,)]
    parts = [n for e in entries for n in e.parts]
    gate = next(n for n in parts if n.endswith("gate_proj.weight"))
    up = next(n for n in parts if n.endswith("up_proj.weight"))
    info, path = ckpt.info(gate), ckpt.file_of(gate).path
    ring = PinnedRing(1, slot_bytes([entries], DTYPE), DTYPE, threads=3, pin=False)
    filler = Filler(ckpt)
    try:
        expect = {e.name: want(ckpt, e).clone() for e in entries}
        drop_checkpoint(ckpt, sync=True)
        if max(cached_fraction(ckpt.view(n)) for n in parts) > 0.0:
            pytest.skip("this filesystem keeps the file's pages cached after POSIX_FADV_DONTNEED")
        fd = os.open(path, os.O_RDONLY)
        try:  # the pages under gate's first two pieces back in the cache, and nothing else (no readahead)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            os.pread(fd, 2 * 4096, info.start)
        finally:
            os.close(fd)
        view = ckpt.view(gate)
        page = os.sysconf("SC_PAGE_SIZE")
        if resident_fraction(view.data_ptr(), 2 * 4096) < 1.0 or resident_fraction(
                (view.data_ptr() + 3 * 4096) // page * page, page) > 0.0:
            pytest.skip("the page cache did not take exactly the pages read")
        slot = ring.acquire()
        got = ring.fill(slot, entries, filler.sources(entries, DTYPE).__getitem__)
        filler.done(entries)
        for e in entries:
            assert torch.equal(got[e.name], expect[e.name]), e.name
        total = sum(ckpt.info(n).nbytes for n in parts)
        assert filler.hot_bytes == 2 * 4096 and filler.cold_bytes == total - 2 * 4096
        assert filler.disk_bytes_read >= filler.cold_bytes  # aligned supersets
        assert cached_fraction(ckpt.view(up)) == 0.0  # read with O_DIRECT: the cache did not take it
        assert ckpt.mapping_rss() == 0  # nothing was read through the mapping
    finally:
        filler.close()
        ring.close()
        ckpt.close()


def test_expected_units_are_staged_ahead_in_order_without_taking_each_others_slots(tmp_path):
    out = write_checkpoint(preset_config("tiny-moe"), tmp_path / "tiny-moe")
    ckpt = Checkpoint(out)
    entries = entries_of(read_model_config(out))
    experts = sorted(k for k in entries if is_expert(k) and k[0] == 1)[:6]  # layer 1 is sparse
    ring = PinnedRing(3, slot_bytes(entries.values(), DTYPE), DTYPE, threads=2, pin=False)
    stager = Stager(ring, Filler(ckpt), entries.__getitem__, lookahead=2)
    try:
        stager.expect(experts)
        for _ in range(500):  # the worker stages what it may ahead, then waits for a take
            with stager._cv:
                staged = list(stager._staged.values())
            if staged and all(f.done() for f in staged):
                break
            threading.Event().wait(0.01)
        assert len(staged) == 2  # lookahead: one slot stays free for the upload
        for key in experts:
            slot, views = stager.take(key)
            for e in entries[key]:
                assert torch.equal(views[e.name], want(ckpt, e)), (key, e.name)
            stager.give_back(slot, Done())
        assert stager.ahead_hits == len(experts)  # every one was staged before its upload asked for it
        # each staged exactly once: none lost its slot to a later one before it was taken
        assert ring.bytes_staged == sum(DTYPE.itemsize * e.shape[0] * e.shape[1] for k in experts for e in entries[k])
    finally:
        stager.close()
        ring.close()
        ckpt.close()


def test_small_units_queued_together_are_staged_side_by_side_and_handed_out_in_order(tmp_path, monkeypatch):
    out = write_checkpoint(preset_config("tiny-moe"), tmp_path / "tiny-moe")
    ckpt = Checkpoint(out)
    entries = entries_of(read_model_config(out))
    experts = sorted(k for k in entries if is_expert(k) and k[0] == 1)[:5]
    events = []
    real_start, real_result = PinnedRing.start, PendingFill.result

    def start(ring, slot, es, view):
        pending = real_start(ring, slot, es, view)
        pending.key = next(k for k in experts if entries[k] == es)
        events.append(("start", pending.key))
        return pending

    def result(pending):
        events.append(("result", pending.key))
        return real_result(pending)

    monkeypatch.setattr(PinnedRing, "start", start)
    monkeypatch.setattr(PendingFill, "result", result)
    ring = PinnedRing(6, slot_bytes(entries.values(), DTYPE), DTYPE, threads=2, pin=False)
    stager = Stager(ring, Filler(ckpt), entries.__getitem__, lookahead=5)
    try:
        stager.expect(experts)  # queued under the stager's lock: the worker finds all five at once
        for key in experts:
            slot, views = stager.take(key)
            for e in entries[key]:
                assert torch.equal(views[e.name], want(ckpt, e)), (key, e.name)
            stager.give_back(slot, Done())
    finally:
        stager.close()
        ring.close()
        ckpt.close()
    assert events == [("start", k) for k in experts] + [("result", k) for k in experts]


def test_a_slot_lays_out_one_layout_once_and_every_unit_of_it_fills_it_exactly(tmp_path):
    """Experts share a layout: the slot's views are made once, and each expert staged into them after another
    holds its own bytes (nothing of the one before), and so does a unit of another layout in the same slot."""
    out = write_checkpoint(preset_config("tiny-moe"), tmp_path / "tiny-moe")  # bf16: every 2-D part reads itself
    ckpt = Checkpoint(out)
    entries = entries_of(read_model_config(out))
    experts = sorted(k for k in entries if is_expert(k))[:4]
    ring = PinnedRing(1, slot_bytes(entries.values(), DTYPE), DTYPE, threads=2, pin=False)
    filler = Filler(ckpt)
    try:
        slot = ring.acquire()
        for key in [*experts, (0,), experts[0]]:
            slot.raw.fill_(0xA5)  # whatever the slot held: the fill must cover every byte of the unit's entries
            got = ring.fill(slot, entries[key], filler.sources(entries[key], DTYPE).__getitem__)
            filler.done(entries[key])
            for e in entries[key]:
                assert torch.equal(got[e.name], want(ckpt, e)), (key, e.name)
        assert len(ring._laid_out) == 2  # the experts' layout and the layer's, in the one slot
        parts = {n for k in experts for e in entries[k] for n in e.parts}
        assert parts <= {name for name, _ in filler._parts}  # each expert's parts made once, kept
    finally:
        filler.close()
        ring.close()
        ckpt.close()
