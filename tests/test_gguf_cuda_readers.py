"""How the cuda backend reads a GGUF, on the CPU: its host staging of a Q8_0 unit (kestrel q8 from the stored bytes,
no dequantization) and its host ring (a quantized or permuted part staged as its dequantized view, never as its
file bytes); then, on a GPU, a GGUF run on cuda.
"""

from __future__ import annotations

import json

import pytest
import torch

from kestrel_core import load
from kestrel_core.cli import main
from kestrel_core.errors import KestrelNote
from kestrel_core.formats.gguf import GGUFCheckpoint
from kestrel_core.formats.tensor_table import unit_specs
from backends.cuda import q8
from backends.cuda.host.diskread import direct_io_supported
from backends.cuda.host.pagecache import drop_checkpoint
from backends.cuda.host.staging import Filler, PartRead, Stager
from backends.cuda.host.tier import PinnedRing, slot_bytes
from backends.cuda.layout import fusion, slot_entries
from tests.gguf_files import DIMS, LLAMA_TYPES, T, write_model

Q8_ONLY = {k: T.Q8_0 for k in LLAMA_TYPES}
# parts a slot of float32 would have taken as file bytes before: a permuted F32 Q, a Q4_0 K (dequantized to float32)
RING_TYPES = {**LLAMA_TYPES, "attn_q": T.F32, "attn_k": T.Q4_0, "ffn_up": T.F32}


def test_a_q8_0_unit_is_staged_as_q8_from_its_stored_bytes_never_dequantized(tmp_path, monkeypatch):
    path, _ = write_model(tmp_path / "m.gguf", types=Q8_ONLY)
    with load(path) as model:
        ckpt, info = model.checkpoint, model.quant
        views = {n: ckpt.view(n) for spec in model.units for n, _ in spec.tensors.values()}
        monkeypatch.setattr(GGUFCheckpoint, "view", lambda self, name: pytest.fail(f"{name} was dequantized"))
        for spec in model.units:
            for entry, roles in fusion(spec.tensors):
                parts = [info.tensors[spec.tensors[r][0]] for r in roles]
                w = q8.stage_q8(ckpt, parts, pin_memory=False)
                assert w.geometry("cpu") == q8.fused_geometry(parts, "cpu") and w.group == 32
                want = torch.cat([views[spec.tensors[r][0]] for r in roles])
                assert torch.equal(w.dequantize()[: want.shape[0]], want), (spec.key, entry)
            assert q8.unit_page_names(info, spec.tensors) == [n for n, _ in spec.tensors.values()]
        lm_head = q8.load_resident_q8(ckpt, info.tensors["lm_head.weight"], "cpu")
    assert (lm_head.n, lm_head.k, lm_head.group) == (265, DIMS["hidden"], 32)


def _ring_case(tmp_path):
    path, _ = write_model(tmp_path / "m.gguf", types=RING_TYPES)
    ckpt = GGUFCheckpoint(path)
    return ckpt, {spec.key: slot_entries(spec.tensors) for spec in unit_specs(ckpt.model_config())}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("direct", [False, True], ids=["page-cache", "o_direct"])
def test_the_host_ring_stages_a_gguf_as_its_views(tmp_path, dtype, direct):
    if direct and not direct_io_supported(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    ckpt, entries = _ring_case(tmp_path)
    ring = PinnedRing(2, slot_bytes(entries.values(), dtype), dtype, threads=2, pin=False)
    filler = Filler(ckpt, direct=direct)
    stager = Stager(ring, filler, entries.__getitem__, lookahead=1)
    try:
        for key, e, got in staged_cold_then_hot(ckpt, stager, entries):
            want = torch.cat([ckpt.view(n) for n in e.parts]).to(dtype)
            assert torch.equal(got, want), (key, e.name, dtype)
        parts = [n for e in entries[(0,)] for n in e.parts]
        made = [n for n in parts if not ckpt.info(n).raw]
        assert len(made) == 4 and not any(isinstance(filler._parts.get((n, dtype)), PartRead) for n in made)
        fresh = Filler(ckpt, direct=direct)
        try:
            got = fresh.sources(entries[(0,)], dtype)
            mapped = [n for n in parts if not isinstance(got[n], PartRead)]  # a PartRead counts itself as it reads
            assert set(made) <= set(mapped)
            assert fresh.hot_bytes + fresh.cold_bytes == sum(ckpt.info(n).nbytes for n in mapped)  # the file's bytes
        finally:
            fresh.close()
    finally:
        stager.close()
        ring.close()
        filler.close()
        ckpt.close()


class _Done:
    def synchronize(self):
        pass


def staged_cold_then_hot(ckpt, stager, entries):
    """``(key, entry, its staged view)`` of every unit, staged twice through ``stager``: with the file's pages dropped
    (cold), then again (hot); each slot given back once its entries are read."""
    for cold in (True, False):
        if cold:
            drop_checkpoint(ckpt, sync=True)
        for key in entries:
            slot, views = stager.take(key)
            for e in entries[key]:
                yield key, e, views[e.name]
            stager.give_back(slot, _Done())


@pytest.mark.parametrize("direct", [False, True], ids=["page-cache", "o_direct"])
def test_the_host_ring_stages_gguf_blocks_as_stored(tmp_path, direct):
    """A unit of block entries (every part a quantized type: K_TYPES, q and k permuted) is staged as the same bytes the
    all-pinned tier pins (``blocks.stage_blocks``), hot and cold, counted by the file's bytes, never dequantized."""
    from backends.cuda import blocks
    from kestrel_core.formats.gguf_model import block_tensors
    from tests.gguf_files import K_DIMS, K_TYPES

    if direct and not direct_io_supported(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    path, _ = write_model(tmp_path / "k.gguf", dims=K_DIMS, types=K_TYPES)
    ckpt = GGUFCheckpoint(path)
    cfg = ckpt.model_config()
    held = block_tensors(ckpt, cfg, blocks.TYPES)
    entries = {spec.key: slot_entries(spec.tensors, held) for spec in unit_specs(cfg)}
    assert all(e.blocks is not None for es in entries.values() for e in es)
    ring = PinnedRing(2, slot_bytes(entries.values(), torch.bfloat16), torch.bfloat16, threads=2, pin=False)
    filler = Filler(ckpt, direct=direct)
    stager = Stager(ring, filler, entries.__getitem__, lookahead=1)
    real_view = GGUFCheckpoint.view
    try:
        GGUFCheckpoint.view = lambda self, name: pytest.fail(f"{name} was dequantized")
        for key, e, got in staged_cold_then_hot(ckpt, stager, entries):
            want = blocks.stage_blocks(ckpt, [held[n] for n in e.parts], pin_memory=False)
            assert isinstance(got, blocks.BlockWeight) and got.layout == want.layout, (key, e.name)
            assert torch.equal(got.raw, want.raw), (key, e.name)
        assert filler.cold_bytes > 0 and filler.hot_bytes > 0
        fresh = Filler(ckpt, direct=direct)
        try:
            got = fresh.sources(entries[(0,)], torch.bfloat16)
            parts = [n for e in entries[(0,)] for n in e.parts]
            assert all(got[n].dtype == torch.uint8 for n in parts)
            assert fresh.hot_bytes + fresh.cold_bytes == sum(ckpt.info(n).nbytes for n in parts)  # the file's bytes
        finally:
            fresh.close()
    finally:
        GGUFCheckpoint.view = real_view
        stager.close()
        ring.close()
        filler.close()
        ckpt.close()


# --- on a GPU ----------------------------------------------------------------------------------------
@pytest.mark.cuda
def test_a_q8_0_gguf_streams_as_q8_on_cuda_as_its_quantized_copy_does(tmp_path, capsys):
    path, _ = write_model(tmp_path / "m.gguf", types=Q8_ONLY)
    out = tmp_path / "q8"
    assert main(["quantize", "--from", str(path), "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["copied"] == 7 * DIMS["layers"] + 1
    runs = {}
    for name, model_path in (("gguf", path), ("copy", out)):
        with load(model_path) as model, model.open(backend="cuda", keep=1) as run:
            geometries = {e.geometry.dtype for u in run.backend.units.units.values() for e in u.entries}
            assert geometries == {q8.DTYPE}
            res = run.generate(prompt_ids=[5, 40, 77], max_new_tokens=8, stop_at_eos=False)
            runs[name] = (res.token_ids, res.per_token[-1]["bytes_uploaded"])
    assert runs["gguf"] == runs["copy"]  # the same bytes on the device: the same ids, the same traffic


@pytest.mark.cuda
def test_a_gguf_entry_that_mixes_blocks_and_floats_streams_dequantized_and_says_so(tmp_path):
    """LLAMA_TYPES: q Q4_1, k Q4_0 beside a F16 v; gate Q8_0 beside a F32 up; down Q4_1 alone. qkv and gate_up are
    served in bf16 (one note, and a count in memory_stats), down as its blocks."""
    path, _ = write_model(tmp_path / "m.gguf")
    ids = {}
    for keep in (1, "off"):
        with load(path) as model:
            with pytest.warns(KestrelNote, match="only some are stored as quantized blocks"):
                run = model.open(backend="cuda", keep=keep)
            with run:
                by_name = {e.name: e.geometry.dtype for u in run.backend.units.units.values() for e in u.entries}
                assert by_name == {"qkv": str(torch.bfloat16), "o": str(torch.bfloat16),
                                   "gate_up": str(torch.bfloat16), "down": "gguf-blocks"}
                res = run.generate(prompt_ids=[5, 40, 77], max_new_tokens=8, stop_at_eos=False)
                assert res.memory["gguf_dequantized_entries"] == 2 * DIMS["layers"]
                ids[keep] = res.token_ids
    assert ids[1] == ids["off"]


def test_every_type_kestrel_reads_is_held_on_cuda_as_its_blocks(tmp_path):
    """Q2_K, Q3_K, IQ4_NL and IQ4_XS linears too (the types of the large MoE files users offload): the layout holds
    them as the file's blocks, with no note of a dequantization, as every quantized type kestrel reads."""
    import warnings

    from backends.cuda import blocks
    from backends.cuda.layout import DeviceLayout
    from kestrel_core.formats.gguf_quants import QUANT_TYPES
    from tests.gguf_files import K_DIMS, K_TYPES

    assert set(blocks.TYPES) == set(QUANT_TYPES)
    types = {**K_TYPES, "attn_q": T.Q3_K, "attn_k": T.Q2_K, "ffn_up": T.IQ4_XS, "ffn_gate": T.IQ4_NL}
    path, _ = write_model(tmp_path / "low.gguf", dims=K_DIMS, types=types)
    with load(path) as model:
        with warnings.catch_warnings():
            warnings.simplefilter("error", KestrelNote)
            layout = DeviceLayout(model.checkpoint, model.config, None, torch.bfloat16, torch.device("cpu"))
        held = {t.qtype for t in layout.blocks.values()}
        assert {T.Q3_K, T.Q2_K, T.IQ4_XS, T.IQ4_NL} <= held
