"""cpu_ref measures its bound: the weights mapping's RSS (/proc/self/smaps) follows the window.

On the ~320 MB small-300m preset, read the mapping's RSS at every layer boundary through an
on_layer_advance observer. With keep=1 it stays within (keep+1) layers of checkpoint bytes plus
the never-evicted tensors (embeddings, norms) plus slack: two partial pages per tensor that
MADV_DONTNEED cannot drop, and up to 64 KiB of fault-around per tensor. With keep=off it holds
(nearly) every tensor byte of the file.

Observed here (10 layers of 24.0 MiB, 64.04 MiB never evicted, 304.04 MiB of tensors in all):
keep=1 peaks at 112.2 MiB against a bound of 120.0 MiB; keep=off reaches 304.06 MiB.
"""

from __future__ import annotations

import shutil
import sys

import pytest

from kestrel_core.formats.checkpoint import Checkpoint
from kestrel_core.io.mapped import PAGE
from kestrel_core.config import KestrelConfig
from kestrel_core.engine.run import Model
from kestrel_core.hookspecs import hookimpl
from kestrel_core.formats.tensor_table import linear_specs
from kestrel_core.formats.modelconfig import read_model_config
from kestrel_core.tools.presets import preset_config, write_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")]

MiB = 2**20
FAULT_AROUND = 64 * 1024


@pytest.fixture(scope="module")
def small_300m(tmp_path_factory):
    path = write_checkpoint(preset_config("small-300m"), tmp_path_factory.mktemp("rss") / "small-300m")
    yield path
    shutil.rmtree(path, ignore_errors=True)  # 320 MB: don't leave it in pytest's kept temp dirs


@pytest.fixture(scope="module")
def sizes(small_300m):
    """Checkpoint bytes: one streamed layer, the never-evicted tensors, every tensor, the file; the tensor count."""
    cfg = read_model_config(small_300m)
    ckpt = Checkpoint(small_300m)
    per_layer = [[name for name, _ in linear_specs(cfg, layer).values()] for layer in range(cfg.num_hidden_layers)]
    streamed = {name for names in per_layer for name in names}
    layer_bytes = {sum(ckpt.info(n).nbytes for n in names) for names in per_layer}
    assert len(layer_bytes) == 1  # every layer has the same shapes
    out = dict(
        layer=layer_bytes.pop(),
        resident=sum(ckpt.info(n).nbytes for n in ckpt.names() if n not in streamed),
        total=sum(ckpt.info(n).nbytes for n in ckpt.names()),
        file=sum(f.size for f in ckpt.files.values()),
        tensors=len(ckpt.names()),
        n_layers=cfg.num_hidden_layers,
    )
    ckpt.close()
    return out


def rss_at_boundaries(model_dir, keep, tokens=3):
    seen = []

    class RssObserver:
        def __init__(self, ckpt):
            self.ckpt = ckpt

        @hookimpl
        def on_layer_advance(self, window, layer, phase):
            seen.append((window.token, layer, len(window.resident), self.ckpt.mapping_rss()))

    cfg = KestrelConfig().override(residency__keep=keep, generation__max_new_tokens=tokens,
                                   generation__stop_at_eos=False)
    with Model(model_dir) as model, model.open(cfg, observers=[RssObserver(model.checkpoint)]) as run:
        run.generate(prompt_ids=[1, 2, 3, 4])
    return seen


def test_keep_1_mapping_rss_stays_within_the_window(small_300m, sizes):
    seen = rss_at_boundaries(small_300m, keep=1)
    assert len(seen) == 3 * sizes["n_layers"]
    slack = sizes["tensors"] * (2 * PAGE + FAULT_AROUND)
    bound = 2 * sizes["layer"] + sizes["resident"] + slack
    peak = max(rss for *_, rss in seen)
    print(f"\nkeep=1: peak mapping RSS {peak / MiB:.2f} MiB, bound {bound / MiB:.2f} MiB "
          f"(layer {sizes['layer'] / MiB:.2f}, resident {sizes['resident'] / MiB:.2f}, slack {slack / MiB:.2f})")
    assert peak <= bound
    assert slack < sizes["layer"] / 2  # the slack could not hide a whole extra layer
    # The measurement sees the pages that are there: the resident layers and the never-evicted tensors.
    for token, layer, n_resident, rss in seen:
        assert rss >= n_resident * sizes["layer"] + sizes["resident"] - slack, (token, layer, n_resident, rss)
    assert max(n for _, _, n, _ in seen) == 2


def test_keep_off_mapping_rss_holds_the_whole_file(small_300m, sizes):
    seen = rss_at_boundaries(small_300m, keep="off", tokens=2)
    peak = max(rss for *_, rss in seen)
    print(f"\nkeep=off: peak mapping RSS {peak / MiB:.2f} MiB of {sizes['total'] / MiB:.2f} MiB of tensors")
    assert peak >= 0.99 * sizes["total"]
    assert peak <= -(-sizes["file"] // PAGE) * PAGE  # no more than the whole mapping
