"""One token's routed experts in two launches, each expert read wherever the expert table points: its device buffer, or
its page-locked host copy (a mapped pinned address: the kernel reads it over the link, and no step waits for the host).

The table holds, for every expert of every sparse layer, two addresses: its ``gate_up`` entry ([2I, H] float, or q8
[H, 2I padded] with its scales after) and its ``down`` entry ([H, I], or q8 [I, H padded]). ``gate_up_kernel`` runs
the k routed experts' gate and up rows and their SwiGLU, ``down_kernel`` each expert's down rows, weighted and summed
in routing order. The same kernel on the same bytes gives bitwise the same result whichever memory it read.

Triton compiles them on first use; where Triton is missing, ``available()`` says so and the backend routes on the host.
"""

from __future__ import annotations

import functools

import torch

GATE_UP, DOWN = 0, 1  # the two addresses of an expert in the table


@functools.cache
def available() -> str | None:
    """None where the kernels can run here, else why not (one line)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    return None


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def gate_up_float(x, ids, table, h, H: tl.constexpr, I: tl.constexpr, DTYPE: tl.constexpr,  # noqa: E741
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        slot = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        e = tl.load(ids + slot)
        w = tl.load(table + e * 2 + 0).to(tl.pointer_type(DTYPE))  # [2I, H]: gate rows, then up rows
        acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x + cols, mask=cols < H, other=0.0).to(tl.float32)
            m = (rows[:, None] < I) & (cols[None, :] < H)
            wg = tl.load(w + rows[:, None] * H + cols[None, :], mask=m, other=0.0).to(tl.float32)
            wu = tl.load(w + (rows[:, None] + I) * H + cols[None, :], mask=m, other=0.0).to(tl.float32)
            acc_g += tl.sum(wg * xk[None, :], axis=1)
            acc_u += tl.sum(wu * xk[None, :], axis=1)
        g = acc_g.to(DTYPE).to(tl.float32)  # as F.linear rounds its output to the compute dtype
        u = acc_u.to(DTYPE).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(DTYPE).to(tl.float32)
        tl.store(h + slot * I + rows, (act * u).to(DTYPE), mask=rows < I)

    @triton.jit
    def down_float(h, ids, weights, table, out, H: tl.constexpr, I: tl.constexpr, K_ROUTED: tl.constexpr,  # noqa: E741
                   DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for slot in range(0, K_ROUTED):
            e = tl.load(ids + slot)
            w = tl.load(table + e * 2 + 1).to(tl.pointer_type(DTYPE))  # [H, I]
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for k0 in range(0, I, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                hk = tl.load(h + slot * I + cols, mask=cols < I, other=0.0).to(tl.float32)
                m = (rows[:, None] < H) & (cols[None, :] < I)
                wd = tl.load(w + rows[:, None] * I + cols[None, :], mask=m, other=0.0).to(tl.float32)
                acc += tl.sum(wd * hk[None, :], axis=1)
            total += acc.to(DTYPE).to(tl.float32) * tl.load(weights + slot).to(tl.float32)
        tl.store(out + rows, total.to(DTYPE), mask=rows < H)

    @triton.jit
    def gate_up_q8(x, ids, table, h, H: tl.constexpr, I: tl.constexpr, NPAD: tl.constexpr,  # noqa: E741
                   GROUP: tl.constexpr, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
        slot = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns: gate at c, up at c + I
        e = tl.load(ids + slot)
        base = tl.load(table + e * 2 + 0)
        q = base.to(tl.pointer_type(tl.int8))  # qweight [H, NPAD]
        s = (base + H * NPAD).to(tl.pointer_type(tl.float32))  # scales [H / GROUP, NPAD]
        acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
        mc = cols < I
        for k0 in range(0, H, GROUP):
            ks = k0 + tl.arange(0, GROUP)
            xk = tl.load(x + ks).to(tl.float32)
            qg = tl.load(q + ks[:, None] * NPAD + cols[None, :], mask=mc[None, :], other=0).to(tl.float32)
            qu = tl.load(q + ks[:, None] * NPAD + (cols[None, :] + I), mask=mc[None, :], other=0).to(tl.float32)
            sg = tl.load(s + (k0 // GROUP) * NPAD + cols, mask=mc, other=0.0)
            su = tl.load(s + (k0 // GROUP) * NPAD + cols + I, mask=mc, other=0.0)
            acc_g += tl.sum(qg * xk[:, None], axis=0) * sg
            acc_u += tl.sum(qu * xk[:, None], axis=0) * su
        g = acc_g.to(DTYPE).to(tl.float32)
        u = acc_u.to(DTYPE).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(DTYPE).to(tl.float32)
        tl.store(h + slot * I + cols, (act * u).to(DTYPE), mask=mc)

    @triton.jit
    def down_q8(h, ids, weights, table, out, H: tl.constexpr, I: tl.constexpr, NPAD: tl.constexpr,  # noqa: E741
                GROUP: tl.constexpr, K_ROUTED: tl.constexpr, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns (H of them)
        mc = cols < H
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for slot in range(0, K_ROUTED):
            e = tl.load(ids + slot)
            base = tl.load(table + e * 2 + 1)
            q = base.to(tl.pointer_type(tl.int8))  # qweight [I, NPAD]
            s = (base + I * NPAD).to(tl.pointer_type(tl.float32))  # scales [I / GROUP, NPAD]
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for k0 in range(0, I, GROUP):
                ks = k0 + tl.arange(0, GROUP)
                hk = tl.load(h + slot * I + ks).to(tl.float32)
                qd = tl.load(q + ks[:, None] * NPAD + cols[None, :], mask=mc[None, :], other=0).to(tl.float32)
                sd = tl.load(s + (k0 // GROUP) * NPAD + cols, mask=mc, other=0.0)
                acc += tl.sum(qd * hk[:, None], axis=0) * sd
            total += acc.to(DTYPE).to(tl.float32) * tl.load(weights + slot).to(tl.float32)
        tl.store(out + cols, total.to(DTYPE), mask=mc)

    return gate_up_float, down_float, gate_up_q8, down_q8


def _tl_dtype(dtype: torch.dtype):
    import triton.language as tl

    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


class GroupedExperts:
    """The launcher for one model's experts: ``H`` hidden, ``I`` an expert's intermediate size, ``k`` routed a token."""

    def __init__(self, hidden: int, inter: int, k: int, dtype: torch.dtype, device: torch.device,
                 q8: tuple[int, int, int] | None = None):
        self.H, self.I, self.k, self.dtype = hidden, inter, k, dtype
        self.q8 = q8  # (group, gate_up n_pad, down n_pad) for a q8 checkpoint
        self.h = torch.empty((k, inter), dtype=dtype, device=device)  # the SwiGLU outputs: a fixed buffer, graph-safe
        self.slots = torch.arange(k, device=device).view(1, k)  # ids for a table of the k routed experts, in order

    def fetched(self, x: torch.Tensor, weights: torch.Tensor, buffers: list) -> torch.Tensor:
        """The k routed experts (in routing order) from the buffers the host fetched them into: the same kernels on a
        table of their addresses."""
        addrs = [b.data_ptr() for pair in buffers for b in pair]
        table = torch.tensor(addrs, dtype=torch.int64).pin_memory().to(x.device, non_blocking=True).view(self.k, 2)
        return self(x, weights, self.slots, table)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """x [1, H], weights [1, k], ids [1, k] (int64), table [E, 2] int64 addresses -> [1, H]."""
        gate_up_float, down_float, gate_up_q8, down_q8 = _kernels()
        H, I, k, dt = self.H, self.I, self.k, _tl_dtype(self.dtype)  # noqa: E741
        out = torch.empty((1, H), dtype=self.dtype, device=x.device)
        x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()
        if self.q8 is None:
            gate_up_float[(k, -(-I // 32))](x, ids, table, self.h, H=H, I=I, DTYPE=dt, BLOCK_N=32, BLOCK_K=128)
            down_float[(-(-H // 16),)](self.h, ids, weights, table, out, H=H, I=I, K_ROUTED=k, DTYPE=dt,
                                       BLOCK_N=16, BLOCK_K=128)
        else:
            group, npad_gu, npad_d = self.q8
            gate_up_q8[(k, -(-I // 64))](x, ids, table, self.h, H=H, I=I, NPAD=npad_gu, GROUP=group, DTYPE=dt,
                                         BLOCK_N=64)
            down_q8[(-(-H // 64),)](self.h, ids, weights, table, out, H=H, I=I, NPAD=npad_d, GROUP=group,
                                    K_ROUTED=k, DTYPE=dt, BLOCK_N=64)
        return out
