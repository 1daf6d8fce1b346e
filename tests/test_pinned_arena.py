"""PinnedArena: the full staging's entries as views, at page offsets, of a few power-of-two blocks.

torch's pinned allocator rounds each block up to a power of two, so the arena's blocks are powers
of two and it packs entries into them; ``arena_bytes`` says what it will lock before anything is
allocated. Here the blocks are pageable (``pin=False``); the cuda tests pin them.
"""

from __future__ import annotations

import pytest
import torch

from backends.cuda.host.diskread import ALIGN, round_up
from kestrel_core.errors import ConfigError
from backends.cuda.host.pinned_arena import BLOCK, PinnedArena, arena_bytes

MiB = 2**20
# one Qwen3-8B layer's bf16 entries as the cuda backend stages them: qkv, o, gate_up, down, and the small ones
LAYER_8B = [48 * MiB, 32 * MiB, 192 * MiB, 96 * MiB, 8192, 8192, 256, 256]


def test_the_8b_shape_pins_within_two_percent_of_its_entries_where_one_block_each_pinned_a_third_more():
    sizes = LAYER_8B * 36
    payload = sum(round_up(n) for n in sizes)
    one_block_each = sum(1 << (round_up(n) - 1).bit_length() for n in sizes)  # what pinning each entry alone locks
    pinned = arena_bytes(sizes)
    assert payload <= pinned <= 1.02 * payload
    assert one_block_each > 1.3 * payload  # the waste the arena removes (16.9 GiB for 12.9 here)


def test_views_sit_at_page_offsets_are_disjoint_and_are_counted_by_their_blocks():
    sizes = [5 * MiB + 3, 1 * MiB, 7 * MiB, 300, 2 * MiB, 6 * MiB + 1]
    arena = PinnedArena(sum(round_up(n) for n in sizes), max(sizes), block=8 * MiB, pin=False)
    views = [arena.take(n) for n in sizes]
    assert [v.numel() for v in views] == sizes
    assert all(v.dtype == torch.uint8 and v.data_ptr() % ALIGN == 0 for v in views)
    for i, v in enumerate(views):
        v.fill_(i + 1)
    assert all(bool((v == i + 1).all()) for i, v in enumerate(views))  # no view overwrote another
    assert all(b & (b - 1) == 0 and b <= 8 * MiB for b in arena.blocks)  # powers of two, at most the cap
    assert arena.pinned_bytes == sum(arena.blocks) == arena_bytes(sizes, block=8 * MiB)
    assert len({v.untyped_storage().data_ptr() for v in views}) == len(arena.blocks)


def test_a_later_small_entry_fills_the_gap_an_earlier_block_left():
    arena = PinnedArena(10 * MiB, 6 * MiB, block=8 * MiB, allocate=False)
    for n in (6 * MiB, 3 * MiB, 1 * MiB):  # 3 MiB does not fit beside 6 in 8; the 1 MiB goes back beside the 6
        arena.take(n)
    assert arena.blocks == [8 * MiB, 4 * MiB]


def test_the_last_block_is_no_larger_than_what_is_left_needs():
    sizes = [BLOCK // 2] * 2 + [3 * MiB]
    arena = PinnedArena(sum(sizes), max(sizes), allocate=False)
    for n in sizes:
        arena.take(n)
    assert arena.blocks == [BLOCK, 4 * MiB]


def test_an_entry_larger_than_the_block_gets_a_block_of_its_own_size():
    big = BLOCK + 5 * MiB
    assert arena_bytes([big, MiB]) == 2 * BLOCK  # the cap rises to the power of two over the largest entry


def test_an_entry_the_arena_was_not_sized_for_is_refused():
    arena = PinnedArena(4 * MiB, MiB, block=2 * MiB, allocate=False)
    with pytest.raises(ConfigError, match="larger than the arena's blocks"):
        arena.take(3 * MiB)
    with pytest.raises(ConfigError, match="cannot hold an entry"):
        PinnedArena(MiB, 2 * MiB)
