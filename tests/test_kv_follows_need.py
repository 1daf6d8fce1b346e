"""A KV cache in host memory holds memory for the positions its sequences wrote, not for every slot x max_seq: its
buffers are zero pages the kernel maps as they are first written. Read back, an unwritten position is zero."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.rss import process_memory
from kestrel_core.engine.kvcache import allocate_cache, kv_bytes
from kestrel_core.tools.presets import preset_config


def rss() -> int:
    now = process_memory()["rss_bytes"]
    if now is None:
        pytest.skip("no /proc/self/status: the process's resident memory cannot be read here")
    return now


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_host_kv_cache_is_resident_as_it_is_written(dtype):
    cfg = preset_config("tiny")
    slots, max_seq = 8, 65536
    need = kv_bytes(cfg, max_seq, dtype, slots)
    assert need >= 256 * 2**20  # large enough that the bounds below could not hold by chance
    before = rss()
    kv = allocate_cache(cfg, max_seq, dtype, torch.device("cpu"), slots)
    allocated = rss() - before
    for layer in kv:  # one sequence of 256 positions in slot 3
        layer.k[3, :256] = 1
        layer.v[3, :256] = 1
    written = rss() - before
    assert allocated < need // 16, (allocated, need)  # torch.zeros would have made all of it resident here
    assert written < need // 4, (written, need)  # one slot of eight: at most its own pages (huge pages or not)
    assert all(float(layer.k[3, 256:].abs().sum()) == 0 and float(layer.v[:3].abs().sum()) == 0 for layer in kv)
    assert kv[0].k.dtype == dtype and kv[0].k.is_contiguous() and kv[0].k.data_ptr() % 64 == 0


# --- found by a mutation pass ---------------------------------------------------------------------------
def test_a_small_host_buffer_is_zeroed_too():
    """A block below malloc's mmap threshold may be one just freed, its bytes still there: zeroed all the same."""
    from kestrel_core.engine.kvcache import _zeros

    for _ in range(20):
        junk = np.full(4096 + 64, 0xAB, dtype=np.uint8)
        del junk
        assert float(_zeros((2, 16, 2, 32), torch.float32, "cpu").abs().sum()) == 0


def test_a_cache_with_a_spare_row_is_refused_where_only_its_positions_would_fit(monkeypatch):
    """The park's spare row counts against the memory there is: a cache of 64 positions and a spare where exactly 64
    fit is refused before any is touched, naming the 64 positions asked for; 63 and a spare fit."""
    from kestrel_core.engine import kvcache
    from kestrel_core.errors import BudgetError

    cfg = preset_config("tiny")
    monkeypatch.setattr(kvcache, "meminfo", lambda: {"MemAvailable": kv_bytes(cfg, 64, torch.float32, 2)})
    with pytest.raises(BudgetError, match="the KV cache for 2 x 64 positions needs"):
        allocate_cache(cfg, 64, torch.float32, torch.device("cpu"), 2, spare=1)
    assert allocate_cache(cfg, 63, torch.float32, torch.device("cpu"), 2, spare=1)[0].k.shape[1] == 64
