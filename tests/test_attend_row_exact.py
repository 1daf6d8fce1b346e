"""``Attend``'s row-exact path (cpu_ref's) on its own: a decode row attends over keys 0..its position of its own slot
and nothing past it, a parked row attends nothing (its row is zeros), and a span's rows are causal, each over keys
0..start+r; all against the attention written out in float64."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kestrel_core.engine.kvcache import KVCache
from kestrel_core.engine.model import Attend

HEADS, KV_HEADS, HD, SLOTS, MAX_SEQ = 4, 2, 8, 3, 10
CFG = SimpleNamespace(head_dim=HD, q_dim=HEADS * HD)


class _Rope:
    def at(self, positions):
        zeros = torch.zeros((positions.shape[0], HD))
        return zeros, zeros


def _setup(rows: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache(torch.randn(SLOTS, MAX_SEQ, KV_HEADS, HD, generator=gen),
                    torch.randn(SLOTS, MAX_SEQ, KV_HEADS, HD, generator=gen))  # stale keys past every position
    q, k, v = (torch.randn(rows, h, HD, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))
    return cache, q, k, v


def _want(q_row, cache, slot, upto):
    keys = cache.k[slot, :upto].double().repeat_interleave(HEADS // KV_HEADS, dim=1)  # [upto, heads, hd]
    values = cache.v[slot, :upto].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    p = torch.softmax(torch.einsum("hd,thd->ht", q_row.double(), keys) * HD**-0.5, dim=-1)
    return torch.einsum("ht,thd->hd", p, values).reshape(-1)


def test_decode_rows_attend_over_their_own_keys_and_a_parked_row_attends_nothing():
    cache, q, k, v = _setup(3, 0)
    positions = torch.tensor([3, 6, 0])
    at = Attend.static(_Rope(), positions, torch.arange(3), torch.arange(MAX_SEQ), row_exact=True,
                       live=torch.tensor([True, False, True]), sliced=True)
    out = at.attend(q, k, v, cache, CFG)
    assert out.shape == (3, CFG.q_dim)
    for b in (0, 2):
        assert torch.allclose(out[b].double(), _want(q[b], cache, b, int(positions[b]) + 1), atol=1e-5), b
    assert torch.equal(out[1], torch.zeros(CFG.q_dim))  # parked: no attention
    assert torch.equal(cache.k[1, 6], k[1])  # its key is written all the same


def test_a_spans_rows_are_causal_each_over_keys_to_its_own_position():
    cache, q, k, v = _setup(4, 1)
    at = Attend.prefill(_Rope(), 2, 4, "cpu", slot=1, key_positions=torch.arange(MAX_SEQ), sliced=True)
    out = at.attend(q, k, v, cache, CFG)
    for r in range(4):
        assert torch.allclose(out[r].double(), _want(q[r], cache, 1, 2 + r + 1), atol=1e-5), r


def test_a_step_that_may_be_captured_reads_no_position_on_the_host():
    """Unsliced (a row-exact backend that captures): every decode row over the whole cache under the device's mask,
    the same values, and a parked row is not skipped (a replay could not know it)."""
    cache, q, k, v = _setup(3, 0)
    positions = torch.tensor([3, 6, 0])
    at = Attend.static(_Rope(), positions, torch.arange(3), torch.arange(MAX_SEQ), row_exact=True,
                       live=torch.tensor([True, False, True]), sliced=False)
    assert at.live is None and at.decode_mask is not None
    out = at.attend(q, k, v, cache, CFG)
    for b in range(3):
        assert torch.allclose(out[b].double(), _want(q[b], cache, b, int(positions[b]) + 1), atol=1e-5), b



def test_a_nan_key_makes_the_rows_attention_nan():
    """A non-finite weight must reach the logits, where the run stops naming the layer: a row attending alone over a NaN
    key gives NaN (torch's unmasked CPU kernel would give a finite number)."""
    cache, q, k, v = _setup(1, 0)
    cache.k[0, 1, 0, 0] = float("nan")
    at = Attend.static(_Rope(), torch.tensor([3]), torch.arange(1), torch.arange(MAX_SEQ), row_exact=True,
                       live=torch.tensor([True]), sliced=True)
    out = at.attend(q, k, v, cache, CFG)
    assert not bool(torch.isfinite(out).all())


def test_decode_rows_from_a_later_slot_read_their_own_slots_on_either_path():
    """A pipeline's micro-batch of decode rows starts past slot 0 (``first_slot``): row b is slot first_slot + b, on
    the row-exact path and on the masked one (cuda's) alike."""
    cache, q, k, v = _setup(2, 3)
    positions = torch.tensor([4, 6])
    for row_exact, sliced in ((True, True), (False, False)):
        c = KVCache(cache.k.clone(), cache.v.clone())
        at = Attend.static(_Rope(), positions, torch.tensor([1, 2]), torch.arange(MAX_SEQ), row_exact=row_exact,
                           sliced=sliced, first_slot=1)
        out = at.attend(q, k, v, c, CFG)
        for b, slot in enumerate((1, 2)):
            want = _want(q[b], c, slot, int(positions[b]) + 1)
            assert torch.allclose(out[b].double(), want, atol=1e-5), (row_exact, b)
