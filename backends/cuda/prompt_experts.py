"""A prompt's routed experts of a GGUF MoE layer on the tensor cores, every expert in one launch a projection.

Where a prompt's rows take the int8 kernels (``gguf_kernels = "auto"`` or ``"int8"``) and a layer's experts are Q4_K,
Q5_K or Q6_K blocks, the pass's (token, expert) pairs are sorted by expert, each expert's pairs cut into tiles of 16
or 32 rows, and one launch of the tensor-core kernel (``gguf_int8.expert_mmq``) computes gate for every tile, one up,
one down, each tile reading its expert's blocks where its buffer is. Between them: SiLU(gate) · up in the compute
dtype, as ``expert_mlp`` rounds. Each token's k outputs are then added by its routing weights in routing order, in
float32 (the one-row path's epilogue). A pair's row is bitwise that token's row through its expert alone
(``gguf_int8.matmul``), and its sum follows only its own routing, so a prompt row's result never follows the rows
beside it. Before, a prompt's experts ran one by one (index, three linears, scatter), about ten launches an expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import blocks, gguf_int8


def _one_type(w) -> bool:
    return isinstance(w, blocks.BlockWeight) and w.k % 256 == 0 and all(
        s.qtype in gguf_int8.MMQ_TYPES for s in w.segments)


def takes(buffers: list[tuple]) -> bool:
    """Whether these experts' (gate_up, down) buffers run here: GGUF blocks of the tensor-core types, one layout for
    every expert of the layer (a GGUF stores a layer's experts as one tensor of one type)."""
    if not buffers or not all(_one_type(gu) and _one_type(dn) for gu, dn in buffers):
        return False
    return len({(gu.layout, gu.k, dn.layout, dn.k) for gu, dn in buffers}) == 1


def tiles(counts: list[int], addresses: list[int], tile_rows: int, device) -> torch.Tensor:
    """int64 [T, 3]: (first row, end row, address) for each tile of at most ``tile_rows`` rows of each expert's run of
    ``counts`` rows (runs back to back, in the order given), the expert's weight at ``addresses``."""
    out, at = [], 0
    for count, address in zip(counts, addresses):
        out += [(start, min(start + tile_rows, at + count), address) for start in range(at, at + count, tile_rows)]
        at += count
    return torch.tensor(out, dtype=torch.int64).reshape(-1, 3).to(device)


def prompt_experts(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, used: list[int],
                   buffers: list[tuple]) -> torch.Tensor:
    """x [T, H], weights and chosen [T, k] (each token's experts and router weights), ``used`` the distinct experts
    in ascending order and ``buffers`` their (gate_up, down) BlockWeights -> [T, H] in x's dtype."""
    T, kt = chosen.shape
    H, device, dtype = x.shape[1], x.device, x.dtype
    gu0, dn0 = buffers[0]
    inter = dn0.k
    flat = chosen.reshape(-1)
    order = torch.sort(flat, stable=True)[1]  # the pairs (token * k + slot) in expert order
    counts = torch.bincount(flat, minlength=max(used) + 1)[used].tolist()  # the one sync: each expert's rows
    pairs = len(order)
    tile_rows = 32 if pairs >= 32 * len(used) else 16
    xq, xd, xs = gguf_int8.quantize(x)
    halves = []
    for row in (0, inter):  # gate's rows of the gate_up entry, then up's: each a launch over every expert
        qtype, at = blocks.rows_at(gu0.layout, row, inter, H)
        grid = tiles(counts, [gu.raw.data_ptr() + at for gu, _ in buffers], tile_rows, device)
        halves.append(gguf_int8.expert_mmq(xq, xd, xs, order // kt, grid, tile_rows, qtype, inter, H, pairs)
                      .to(dtype))
    h = F.silu(halves[0]) * halves[1]  # [pairs, I], as expert_mlp rounds
    hq, hd, hs = gguf_int8.quantize(h)
    qtype, at = blocks.rows_at(dn0.layout, 0, H, inter)
    grid = tiles(counts, [dn.raw.data_ptr() + at for _, dn in buffers], tile_rows, device)
    y = gguf_int8.expert_mmq(hq, hd, hs, torch.arange(pairs, device=device), grid, tile_rows, qtype, H, inter,
                             pairs).to(dtype)
    y = y[torch.argsort(order)].reshape(T, kt, H)  # back to (token, slot)
    out = (y[:, 0] * weights[:, :1]).float()
    for j in range(1, kt):  # routing order, one add a slot
        out = out + (y[:, j] * weights[:, j:j + 1]).float()
    return out.to(dtype)
