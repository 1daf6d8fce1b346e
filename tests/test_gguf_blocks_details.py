"""``block_linear``'s row padding and ``BlockWeight.copy_``'s check, without the kernels: the rows each launch is given
(a power of two up to 64, whole launches of 64 past it, so a type compiles at most 7 variants), the rows given back,
and a buffer that refuses an entry of another row width (its own check, not the copy's size error)."""

from __future__ import annotations

import pytest
import torch

from backends.cuda import blocks, gguf_int8, gguf_kernels


def test_rows_are_padded_to_a_power_of_two_then_to_whole_launches(monkeypatch):
    seen = []

    def matmul(x, weight, qtype, n, k):
        seen.append(x.shape[0])
        return x[:, :1].float().expand(-1, n) + torch.arange(n)  # each row its own values: padding rows give zeros

    monkeypatch.setattr(gguf_kernels, "matmul", matmul)
    monkeypatch.setattr(gguf_int8, "matmul", matmul)
    w = blocks.BlockWeight.empty(256, (("Q4_K", 4), ("Q6_K", 2)))
    want = {1: 1, 2: 2, 3: 4, 5: 8, 33: 64, 64: 64, 65: 128, 128: 128, 129: 192, 200: 256}
    for m, rows in want.items():
        seen.clear()
        x = torch.arange(m, dtype=torch.float32)[:, None].expand(m, 256)
        y = blocks.block_linear(x, w)
        assert seen == [rows, rows], m  # one matmul a segment, each given the padded rows
        assert y.shape == (m, 6) and torch.equal(y[:, 0], torch.arange(m, dtype=torch.float32)), m
    assert gguf_kernels.MAX_ROWS == 64


def test_segments_run_the_int8_kernels_where_asked_and_their_address_is_whole_words(monkeypatch):
    """The kernel follows the setting and a segment's type and address, never the rows: a Q4_K segment (read as 4-byte
    words) at an address that is no multiple of 4 runs the float kernel at every row count."""
    calls = []
    for mod in (gguf_kernels, gguf_int8):
        monkeypatch.setattr(mod, "matmul", lambda x, weight, qtype, n, k, mod=mod: calls.append(
            (mod.__name__.rsplit(".", 1)[1], qtype.name, weight.data_ptr() % 4)) or torch.zeros(x.shape[0], n))
    w = blocks.BlockWeight.empty(256, (("Q4_K", 2), ("Q8_0", 2), ("Q6_K", 2)))
    for m in (1, 3, 70):
        calls.clear()
        blocks.block_linear(torch.zeros(m, 256), w, int8=True)
        assert [c[:2] for c in calls] == [("gguf_int8", "Q4_K"), ("gguf_int8", "Q8_0"), ("gguf_int8", "Q6_K")]
        calls.clear()
        blocks.block_linear(torch.zeros(m, 256), w)  # [backend] gguf_kernels = "float" (and "auto"'s decode rows)
        assert [c[:2] for c in calls] == [("gguf_kernels", "Q4_K"), ("gguf_kernels", "Q8_0"), ("gguf_kernels", "Q6_K")]
    odd = blocks.BlockWeight.empty(256, (("Q6_K", 1), ("Q4_K", 2)))  # Q6_K's 210 bytes put Q4_K's at 2 mod 4
    for m in (1, 5):
        calls.clear()
        blocks.block_linear(torch.zeros(m, 256), odd, int8=True)
        assert [c[:2] for c in calls] == [("gguf_int8", "Q6_K"), ("gguf_kernels", "Q4_K")] and calls[1][2] == 2


def test_a_buffer_refuses_another_row_width():
    a = blocks.BlockWeight.empty(256, (("Q4_K", 4),))
    for other in (blocks.BlockWeight.empty(512, (("Q4_K", 4),)),  # the same layout, rows twice as wide
                  blocks.BlockWeight.empty(512, (("Q4_K", 2),))):  # the same bytes, half the rows
        with pytest.raises(ValueError, match="block layout mismatch"):
            a.copy_(other)


def test_gguf_kernels_is_auto_float_or_int8(tiny_ckpt, tmp_path, capsys):
    """[backend] gguf_kernels and --gguf-kernels: a value it does not know is one line naming those it takes."""
    from cli_helpers import fails, gen
    from kestrel_core.config import BackendConfig

    assert BackendConfig().gguf_kernels == "auto" and BackendConfig(gguf_kernels="int8").gguf_kernels == "int8"
    fails(gen(tiny_ckpt, "--gguf-kernels", "fp8"), capsys, "gguf_kernels must be one of auto, float, int8, got 'fp8'")
    toml = tmp_path / "kestrel.toml"
    toml.write_text('[backend]\ngguf_kernels = "int4"\n')
    fails(gen(tiny_ckpt, "--config", str(toml)), capsys, "gguf_kernels must be one of auto, float, int8, got 'int4'")
