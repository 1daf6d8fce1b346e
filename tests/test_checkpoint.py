"""Safetensors reading: sharded sets behave like one file; an index that lies is an error."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from kestrel_core.formats.checkpoint import Checkpoint
from kestrel_core.errors import CheckpointError
from kestrel_core.tools.presets import preset_config, write_checkpoint

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return write_checkpoint(preset_config("demo"), tmp_path_factory.mktemp("sharded") / "demo", shard_mb=1)


def test_the_demo_preset_really_shards(sharded, demo_ckpt):
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) >= 10 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (demo_ckpt / INDEX).exists() and [p.name for p in demo_ckpt.glob("*.safetensors")] == ["model.safetensors"]
    index = json.loads((sharded / INDEX).read_text())
    assert set(index["weight_map"].values()) == set(shards)
    for shard in shards:  # each shard stays within the limit (a single bigger tensor would be alone)
        assert (sharded / shard).stat().st_size <= 2**20 + 64 * 1024


def test_every_tensor_view_matches_safetensors(sharded):
    ckpt = Checkpoint(sharded)
    want = {}
    for p in sharded.glob("*.safetensors"):
        want.update(load_file(str(p)))
    assert sorted(ckpt.names()) == sorted(want)
    for name, t in want.items():
        assert ckpt.view(name).dtype == t.dtype and torch.equal(ckpt.view(name), t), name
    ckpt.close()


def test_dropped_pages_read_back_the_same_bytes(demo_ckpt):
    ckpt = Checkpoint(demo_ckpt)
    names = [n for n in ckpt.names() if n.startswith("model.layers.3.")]
    before = {n: ckpt.view(n).clone() for n in names}
    rss_touched = ckpt.mapping_rss()
    ckpt.drop_pages(names)
    assert ckpt.mapping_rss() < rss_touched
    assert all(torch.equal(ckpt.view(n), before[n]) for n in names)
    ckpt.close()


def test_sharded_gives_the_same_ids_as_one_file(sharded, demo_ckpt, run_model):
    for keep in (1, "off"):
        one, _ = run_model(demo_ckpt, residency__keep=keep, generation__max_new_tokens=4)
        many, _ = run_model(sharded, residency__keep=keep, generation__max_new_tokens=4)
        assert many.token_ids == one.token_ids and len(one.token_ids) == 4
        assert many.counters["bytes_uploaded"] == one.counters["bytes_uploaded"]


@pytest.fixture
def sharded_copy(sharded, tmp_path):
    return shutil.copytree(sharded, tmp_path / "demo")


def test_index_pointing_at_a_missing_tensor(sharded_copy):
    index = json.loads((sharded_copy / INDEX).read_text())
    index["weight_map"]["model.layers.0.mlp.extra.weight"] = next(iter(index["weight_map"].values()))
    (sharded_copy / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model.layers.0.mlp.extra.weight.*incomplete"):
        Checkpoint(sharded_copy)


def test_index_pointing_at_a_missing_shard(sharded_copy):
    victim = sorted(sharded_copy.glob("*.safetensors"))[3]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        Checkpoint(sharded_copy)


@pytest.mark.parametrize("text", ["{", "[]", '{"metadata": {}}', '{"weight_map": [1]}', '{"weight_map": {"a": 1}}'])
def test_an_index_that_is_not_one(sharded_copy, text):
    (sharded_copy / INDEX).write_text(text)
    with pytest.raises(CheckpointError, match="index"):
        Checkpoint(sharded_copy)


def test_span_subtraction():
    from kestrel_core.formats.checkpoint import _subtract

    assert _subtract([(0, 100)], []) == [(0, 100)]
    assert _subtract([(0, 100)], [(10, 20), (50, 60)]) == [(0, 10), (20, 50), (60, 100)]
    assert _subtract([(0, 100)], [(0, 100)]) == []
    assert _subtract([(0, 10), (20, 30)], [(5, 25)]) == [(0, 5), (25, 30)]
    assert _subtract([(10, 20)], [(0, 5), (30, 40)]) == [(10, 20)]


def test_drop_around_keeps_the_kept_tensors_and_drops_their_neighbours(demo_ckpt):
    from kestrel_core.formats.checkpoint import mapping_rss

    ckpt = Checkpoint(demo_ckpt)
    try:
        names = sorted((n for n in ckpt.names() if ".layers." in n), key=lambda n: ckpt.info(n).start)
        f = ckpt.file_of(names[0])
        same = [n for n in names if ckpt.file_of(n) is f][:6]
        paths = [str(f.path.resolve())]
        ckpt.drop_pages(ckpt.names())
        for n in same:
            ckpt.view(n).sum()  # touch all six
        touched = mapping_rss(paths)
        keep = {same[2]}
        ckpt.drop_around(same, keep)
        left = mapping_rss(paths)
        info = ckpt.info(same[2])
        assert left < touched
        assert left <= -(-info.end // 4096) * 4096 - info.start // 4096 * 4096  # only the kept tensor's pages
        assert left >= (info.end - info.start) // 4096 * 4096 - 4096  # and those stay mapped
        assert torch.equal(ckpt.view(same[0]).clone(), ckpt.view(same[0]))  # a dropped tensor reads back
    finally:
        ckpt.close()


def test_the_granule_index_keeps_exactly_the_kept_tensors_that_overlap_the_windows():
    """``drop_around`` finds the tensors to keep through the index; here against a pass over every kept tensor, on
    random layouts: nested spans (a fused tensor and its slices), empty ones, tensors across several granules."""
    import random

    from kestrel_core.formats.checkpoint import GranuleIndex, merge_spans

    rng = random.Random(7)
    for _ in range(200):
        granule = rng.choice([4, 16, 64])
        spans = []
        for i in range(rng.randint(1, 30)):
            start = rng.randint(0, 400)
            spans.append((f"t{i}", start, start + rng.choice([0, 1, 3, granule, 5 * granule + 1, rng.randint(0, 90)])))
        index = GranuleIndex(spans, granule)
        windows = merge_spans([((s // granule) * granule, -(-e // granule) * granule)
                               for _, s, e in rng.sample(spans, rng.randint(1, len(spans)))])
        keep = {n for n, _, _ in spans if rng.random() < 0.5}
        want = merge_spans([(s, e) for n, s, e in spans  # an empty tensor keeps no byte: the index leaves it out
                            if n in keep and s < e and any(s < hi and e > lo for lo, hi in windows)])
        assert index.kept(windows, keep) == want
