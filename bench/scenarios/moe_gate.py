"""The gate for a MoE decode step's miss path: where does a routed expert that is not in a device slot come from fastest?

    python -m bench moe-gate [--experts 8] [--reps 20]

In one run, for experts of the Qwen3-30B-A3B shape (gate_up [2 x 768, 2048] and down [2048, 768] in bfloat16:
9.4 MB each, and in q8 group 32):

- ``dma``: ``cudaMemcpyAsync`` of the experts from pinned host memory into device slots (``tensor.copy_``);
- ``copy_kernel``: a kernel that reads the pinned host copies through their mapped addresses and writes device slots;
- ``kernel_from_host``: the grouped expert kernels computing one token's ``--experts`` routed experts straight from
  the pinned host copies (the table pointing at them), against ``kernel_from_device``, the same from device slots;
- the pinned copy rate of a 1 GiB buffer, for scale.

Each figure is the median of every repetition kept in the record (device time by CUDA events, the kernels from CUDA
graph replays so that launches stay out). The verdict: the miss path reads host copies in the kernel where that is
at least as fast as uploading them first (by DMA or a copy kernel) and then reading the slots.
"""

from __future__ import annotations

from bench.errors import cuda_missing
from bench.stats import summary
from bench.timing import copy_rates, event_times, graph_times

H, I = 2048, 768  # noqa: E741  (Qwen3-30B-A3B: hidden, an expert's intermediate size)


def add_arguments(p) -> None:
    p.add_argument("--experts", type=int, default=8, help="routed experts a token (Qwen3-30B-A3B: 8)")
    p.add_argument("--reps", type=int, default=20)


def needs_gpu(args) -> str | None:
    return cuda_missing()


def _copy_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy(src_addr, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        src = src_addr.to(tl.pointer_type(tl.int32))
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)

    return copy


def experts(k: int, q8: bool):
    """k experts' host copies (pinned) and device slots, and the two tables pointing at each."""
    import torch

    from kestrel_core.formats import quant

    g = torch.Generator().manual_seed(0)
    host, dev = [], []
    for _ in range(k):
        gu = torch.randn(2 * I, H, generator=g, dtype=torch.float32) / H**0.5
        dn = torch.randn(H, I, generator=g, dtype=torch.float32) / I**0.5
        pair = []
        for w in (gu, dn):
            if q8:
                qweight, scales = quant.quantize(w, 32)
                raw = torch.cat([qweight.view(torch.uint8).reshape(-1), scales.view(torch.uint8).reshape(-1)])
            else:
                raw = w.to(torch.bfloat16).view(torch.uint8).reshape(-1)
            pair.append(raw.pin_memory())
        host.append(pair)
        dev.append([t.to("cuda") for t in pair])
    table = lambda ts: torch.tensor([[a.data_ptr(), b.data_ptr()] for a, b in ts], dtype=torch.int64, device="cuda")  # noqa: E731
    n_pad = (quant.pad_n(2 * I), quant.pad_n(H)) if q8 else None
    return host, dev, table(host), table(dev), n_pad


def run(args, record) -> dict:
    import torch

    from backends.cuda.grouped_experts import GroupedExperts

    k, reps = args.experts, args.reps
    out: dict = {"shape": {"hidden": H, "intermediate": I, "routed": k}, "pinned_copy": copy_rates(reps=reps)}
    copy = _copy_kernel()
    for kind in ("bf16", "q8"):
        host, dev, host_table, dev_table, n_pad = experts(k, kind == "q8")
        nbytes = sum(t.numel() for pair in host for t in pair)
        slots = [torch.empty_like(t) for pair in dev for t in pair]
        sources = [t for pair in host for t in pair]

        def dma():
            for s, h in zip(slots, sources):
                s.copy_(h, non_blocking=True)

        def kernel_copy():
            for s, h in zip(slots, sources):
                n = h.numel() // 4
                copy[(-(-n // 4096),)](h.data_ptr(), s.view(torch.int32), n, BLOCK=4096)

        grouped = GroupedExperts(H, I, k, torch.bfloat16, torch.device("cuda"),
                                 (32, *n_pad) if kind == "q8" else None)
        x = torch.randn(1, H, dtype=torch.bfloat16, device="cuda")
        w = torch.full((1, k), 1.0 / k, dtype=torch.bfloat16, device="cuda")
        ids = torch.arange(k, device="cuda").view(1, k)
        from_host = lambda: grouped(x, w, ids, host_table)  # noqa: E731
        from_device = lambda: grouped(x, w, ids, dev_table)  # noqa: E731
        same = bool(torch.equal(from_host(), from_device()))
        rows = {"dma": event_times(dma, warmup=3, reps=reps), "copy_kernel": event_times(kernel_copy, warmup=3, reps=reps),
                "kernel_from_host": graph_times(from_host, calls=4, reps=reps),
                "kernel_from_device": graph_times(from_device, calls=4, reps=reps)}
        out[kind] = {"bytes": nbytes, "bitwise_same_output": same,
                     **{name: {"ms": t, "summary": summary(t), "GBps": nbytes / summary(t)["p50"] / 1e6}
                        for name, t in rows.items()}}
        upload_then_read = min(out[kind]["dma"]["summary"]["p50"], out[kind]["copy_kernel"]["summary"]["p50"]) + \
            out[kind]["kernel_from_device"]["summary"]["p50"]
        out[kind]["verdict"] = ("read host copies in the kernel" if out[kind]["kernel_from_host"]["summary"]["p50"]
                                <= upload_then_read else "upload misses into scratch slots first, then read them")
        out[kind]["upload_then_read_ms"] = upload_then_read
        variants = {}  # the kernels' block and split choices, from device and host memory alike
        for block_n, split in ((16, (2, 3)), (32, (2, 3)), (32, (4, 6)), (64, (4, 4)), (128, (8, 4)), (256, (8, 4))):
            v = GroupedExperts(H, I, k, torch.bfloat16, torch.device("cuda"), (32, *n_pad) if kind == "q8" else None,
                               block_n=block_n, split=split)
            dev_t = graph_times(lambda: v(x, w, ids, dev_table), calls=4, reps=reps)
            host_t = graph_times(lambda: v(x, w, ids, host_table), calls=4, reps=reps)
            variants[f"block_n={block_n} split={split}"] = {
                "device_ms": dev_t, "device": summary(dev_t), "device_GBps": nbytes / summary(dev_t)["p50"] / 1e6,
                "host_ms": host_t, "host": summary(host_t), "host_GBps": nbytes / summary(host_t)["p50"] / 1e6}
        out[kind]["variants"] = variants
        record.save_partial(out)
        for held in (host, dev, slots, sources):
            held.clear()
        torch.cuda.empty_cache()
    return out
