"""The cuda landing ring's kernels (backends/cuda/landing.py) against the rule both backends share
(kestrel_core.engine.landing.landings). On a GPU they run for real; without one in Triton's interpreter, on CPU tensors
read through their int64 addresses, as the grouped expert kernels' tests run."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported

from backends.cuda import grouped_experts  # noqa: E402
from backends.cuda.landing import BLOCK, GROUP, LandingRing  # noqa: E402
from kestrel_core.engine.landing import Landing, landings  # noqa: E402

pytestmark = pytest.mark.skipif(grouped_experts.available() is not None, reason="needs Triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LAYERS, E = 2, 10
WORDS = (BLOCK * GROUP + 1234, 777)  # gate_up past one round of the copy's programs, down short of one block


def model():
    """Host copies of every expert (distinct words), a table pointing at them, and the host addresses."""
    g = torch.Generator().manual_seed(1)
    host = [[tuple(torch.randint(-2**31, 2**31 - 1, (w,), generator=g, dtype=torch.int32).to(DEVICE) for w in WORDS)
             for _ in range(E)] for _ in range(LAYERS)]
    ptrs = torch.tensor([[[t.data_ptr() for t in ex] for ex in layer] for layer in host], dtype=torch.int64)
    return host, ptrs


def slots(n):
    return [tuple(torch.zeros(w, dtype=torch.int32, device=DEVICE) for w in WORDS) for _ in range(n)]


def test_a_layers_misses_land_in_expert_order_until_the_ring_runs_out():
    host, ptrs = model()
    table = ptrs.to(DEVICE).clone()
    resident = slots(1)[0]  # expert (0, 3) is in a slot already: a hit, never landed
    table[0, 3] = torch.tensor([t.data_ptr() for t in resident])
    ring = LandingRing(4, ptrs, E, tuple(4 * w for w in WORDS), DEVICE)
    free = slots(4)
    record = Landing(4, E)
    for position in record.room()[:3]:  # three slots filled: the fourth misses stay on the host
        record.filled(position, free[position])
    ring.fill([(p, free[p]) for p in range(3)], record.tail)
    chosen = torch.tensor([[7, 3, 1], [1, 9, 5]], device=DEVICE)  # 1 twice, 3 resident: misses 1, 5, 7, 9
    ring.land(0, table[0], chosen)
    want = landings(chosen.flatten().tolist(), lambda e: e != 3, 0, 3)
    assert want == [(1, 0), (5, 1), (7, 2)]
    state = ring.state.tolist()
    assert state[0] == 3 and state[1:4] == [1, 5, 7]
    for e, position in want:
        assert table[0, e].tolist() == [b.data_ptr() for b in free[position]]
        assert all(torch.equal(a, b) for a, b in zip(free[position], host[0][e]))
    assert table[0, 9].tolist() == ptrs[0, 9].tolist()  # no room left: read from its host copy
    assert table[0, 3].tolist() == [t.data_ptr() for t in resident]
    assert not free[3][0].any()  # the slot past the tail is untouched
    assert record.consumed(state[0], state[1:]) == [((0, 1), free[0]), ((0, 5), free[1]), ((0, 7), free[2])]

    # the host fills the room the step used; the next layer goes on from the head, its owners numbered by layer
    assert record.room() == [3, 4, 5, 6]
    fresh = slots(4)
    filled = []
    for buffers, position in zip(fresh, record.room()):
        record.filled(position, buffers)
        filled.append((position, buffers))
    ring.fill(filled, record.tail)
    chosen = torch.tensor([[2, 0, 8]], device=DEVICE)
    ring.land(1, table[1], chosen)
    state = ring.state.tolist()
    assert state[0] == 6 and [state[1 + p % 4] for p in (3, 4, 5)] == [E + 0, E + 2, E + 8]
    for e, position in landings([2, 0, 8], lambda e: True, 3, 7):
        buffers = dict(filled)[position]
        assert table[1, e].tolist() == [b.data_ptr() for b in buffers]
        assert all(torch.equal(a, b) for a, b in zip(buffers, host[1][e]))
    assert [key for key, _ in record.consumed(state[0], state[1:])] == [(1, 0), (1, 2), (1, 8)]


def test_a_step_with_no_miss_lands_nothing():
    host, ptrs = model()
    table = ptrs.to(DEVICE).clone()
    held = slots(E)
    for e in range(E):
        table[0, e] = torch.tensor([t.data_ptr() for t in held[e]])
    ring = LandingRing(2, ptrs, E, tuple(4 * w for w in WORDS), DEVICE)
    free = slots(2)
    ring.fill([(0, free[0]), (1, free[1])], 2)
    before = table.clone()
    ring.land(0, table[0], torch.tensor([[4, 6]], device=DEVICE))
    assert ring.state.tolist()[0] == 0 and torch.equal(table, before)
    assert not any(t.any() for s in free for t in s)


def test_the_host_record_refuses_a_head_it_never_filled():
    record = Landing(2, E)
    record.filled(0, ("a",))
    with pytest.raises(RuntimeError, match="head read back as 2, outside 0..1"):
        record.consumed(2, [1, 2])


def test_misses_past_the_rings_room_are_staged_for_the_step_then_read_from_their_host_copies_again():
    """One free slot and two staging slots: miss 1 lands, 5 and 7 are copied into the staging slots and read there
    for the step (their table rows point at them until ``restore``), 9 is read in place; nothing staged is owned."""
    host, ptrs = model()
    table = ptrs.to(DEVICE).clone()
    ring = LandingRing(4, ptrs, E, tuple(4 * w for w in WORDS), DEVICE, staged=2)
    free = slots(1)
    ring.fill([(0, free[0])], 1)
    chosen = torch.tensor([[7, 9, 1], [1, 5, 7]], device=DEVICE)
    landed = ring.land(0, table[0], chosen)
    staging = ring.staging_slots
    assert table[0, 1].tolist() == [b.data_ptr() for b in free[0]]
    assert table[0, 5].tolist() == [b.data_ptr() for b in staging[0]]
    assert table[0, 7].tolist() == [b.data_ptr() for b in staging[1]]
    assert table[0, 9].tolist() == ptrs[0, 9].tolist()  # past the staging slots too: read from its host copy
    for slot, e in ((free[0], 1), (staging[0], 5), (staging[1], 7)):
        assert all(torch.equal(a, b) for a, b in zip(slot, host[0][e]))
    state = ring.state.tolist()
    assert state[0] == 1 and state[1] == 1 and state[2:] == [-1, -1, -1]  # only the landing is owned
    ring.restore(0, table[0], landed)
    assert table[0, 1].tolist() == [b.data_ptr() for b in free[0]]  # landed: stays in its slot
    assert [table[0, e].tolist() for e in (5, 7, 9)] == [ptrs[0, e].tolist() for e in (5, 7, 9)]
    assert torch.equal(table[1], ptrs[1].to(DEVICE))  # another layer's rows untouched


def test_with_no_room_in_the_ring_every_miss_up_to_the_staging_slots_is_staged():
    host, ptrs = model()
    table = ptrs.to(DEVICE).clone()
    ring = LandingRing(2, ptrs, E, tuple(4 * w for w in WORDS), DEVICE, staged=3)
    landed = ring.land(1, table[1], torch.tensor([[8, 2, 4, 6]], device=DEVICE))  # the ring empty (tail 0)
    staging = ring.staging_slots
    assert [table[1, e].tolist() for e in (2, 4, 6)] == [[b.data_ptr() for b in s] for s in staging]
    assert table[1, 8].tolist() == ptrs[1, 8].tolist()
    for slot, e in zip(staging, (2, 4, 6)):
        assert all(torch.equal(a, b) for a, b in zip(slot, host[1][e]))
    assert ring.state.tolist()[0] == 0
    ring.restore(1, table[1], landed)
    assert torch.equal(table, ptrs.to(DEVICE))
