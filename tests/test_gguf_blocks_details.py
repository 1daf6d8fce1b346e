"""``block_linear``'s row padding and ``BlockWeight.copy_``'s check, without the kernels: the rows each launch is given
(a power of two up to 64, whole launches of 64 past it, so a type compiles at most 7 variants), the rows given back,
and a buffer that refuses an entry of another row width (its own check, not the copy's size error)."""

from __future__ import annotations

import pytest
import torch

from backends.cuda import blocks, gguf_kernels


def test_rows_are_padded_to_a_power_of_two_then_to_whole_launches(monkeypatch):
    seen = []

    def matmul(x, weight, qtype, n, k):
        seen.append(x.shape[0])
        return x[:, :1].float().expand(-1, n) + torch.arange(n)  # each row its own values: padding rows give zeros

    monkeypatch.setattr(gguf_kernels, "matmul", matmul)
    w = blocks.BlockWeight.empty(256, (("Q4_K", 4), ("Q6_K", 2)))
    want = {1: 1, 2: 2, 3: 4, 5: 8, 33: 64, 64: 64, 65: 128, 128: 128, 129: 192, 200: 256}
    for m, rows in want.items():
        seen.clear()
        x = torch.arange(m, dtype=torch.float32)[:, None].expand(m, 256)
        y = blocks.block_linear(x, w)
        assert seen == [rows, rows], m  # one matmul a segment, each given the padded rows
        assert y.shape == (m, 6) and torch.equal(y[:, 0], torch.arange(m, dtype=torch.float32)), m
    assert gguf_kernels.MAX_ROWS == 64


def test_a_buffer_refuses_another_row_width():
    a = blocks.BlockWeight.empty(256, (("Q4_K", 4),))
    for other in (blocks.BlockWeight.empty(512, (("Q4_K", 4),)),  # the same layout, rows twice as wide
                  blocks.BlockWeight.empty(512, (("Q4_K", 2),))):  # the same bytes, half the rows
        with pytest.raises(ValueError, match="block layout mismatch"):
            a.copy_(other)
