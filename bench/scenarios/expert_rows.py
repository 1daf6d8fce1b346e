"""A batched MoE decode step's experts: the grouped kernels (each routed expert read once for all the rows routed to
it) against the one-row kernels called once a row, on the Qwen3-30B-A3B expert shape; and what reading a miss over
the link costs each kind of expert.

    python -m bench expert-rows [--rows 1,4,8,32] [--reps 20] [--kinds bf16,q8,q4_k] [--where device,host,copied,dma]

In one run, for each kind of expert (bf16, q8, GGUF Q4_K blocks) and each place the experts are read from: for each
row count R, R tokens routed uniformly at random to 8 of 128 experts; the device time of the grouped call
(``GroupedExperts.rows``) and of the row loop, each captured in a CUDA graph and replayed (``graph_times``: launches
stay out), whether the two give bitwise the same output, how many distinct experts the rows routed to, and the bytes
each reads (the union's against every row's). The headline: the row loop's p50 over the grouped call's, per R.

The places: ``device`` (slots), ``host`` (the table's pinned host copies, which the kernels read over the link),
``copied`` (the routed experts first copied from their host copies into device slots by the landing ring's copy
kernel, ``backends.cuda.landing``, then read there: what a landed miss costs) and ``dma`` (the same through the copy
engine, one ``copy_`` an entry). Each of ``host``, ``copied`` and ``dma`` gives its GB/s over the link (the union's
bytes over the grouped call's time, the copy's included), the gate for how a step should read its misses.
"""

from __future__ import annotations

from bench.errors import cuda_missing
from bench.options import names, numbers
from bench.stats import summary
from bench.timing import graph_times

H, I, E, K = 2048, 768, 128, 8  # noqa: E741  (Qwen3-30B-A3B: hidden, an expert's intermediate size, experts, routed)
KINDS = ("bf16", "q8", "q4_k")
WHERE = ("device", "host", "copied", "dma")


def add_arguments(p) -> None:
    p.add_argument("--rows", type=numbers(int, 1), default=[1, 4, 8, 32])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--kinds", type=names(KINDS), default=set(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    p.add_argument("--where", type=names(WHERE), default=set(WHERE), help=f"comma-separated, of {', '.join(WHERE)}")
    p.add_argument("--copy-plans", type=plans, default=[],
                   help="GROUP:BLOCK:WARPS,... the landing ring's copy kernel alone at each (programs an entry, int32 "
                        "words a block, warps), at each row count, for the kinds given (e.g. 16:4096:4,64:2048:4)")


def plans(text: str) -> list[tuple[int, int, int]]:
    """An argparse type: comma-separated GROUP:BLOCK:WARPS, each a whole number >= 1, BLOCK and WARPS powers of two."""
    import argparse

    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            g, b, w = (int(x) for x in part.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r}: give GROUP:BLOCK:WARPS, e.g. 16:4096:4") from None
        if min(g, b, w) < 1 or b & (b - 1) or w & (w - 1):
            raise argparse.ArgumentTypeError(f"{part!r}: each at least 1, BLOCK and WARPS powers of two")
        out.append((g, b, w))
    return out


def needs_gpu(args) -> str | None:
    return cuda_missing()


def _entries(kind: str, g) -> list[tuple]:
    """E experts' two entries as byte tensors on the CPU, and each kernel's extra: q8's paddings, Q4_K's layouts."""
    import numpy as np
    import torch

    from kestrel_core.formats import quant

    held = []
    rng = np.random.default_rng(0)
    for _ in range(E):
        pair = []
        for n, k in ((2 * I, H), (H, I)):
            if kind == "q4_k":
                from gguf import GGMLQuantizationType

                from kestrel_core.tools.presets import random_blocks_of

                pair.append(torch.from_numpy(random_blocks_of(GGMLQuantizationType.Q4_K, n, k, rng)).reshape(-1))
                continue
            w = torch.randn(n, k, generator=g) / k**0.5
            if kind == "q8":
                qweight, scales = quant.quantize(w, 32)
                pair.append(torch.cat([qweight.view(torch.uint8).reshape(-1), scales.view(torch.uint8).reshape(-1)]))
            else:
                pair.append(w.to(torch.bfloat16).view(torch.uint8).reshape(-1))
        held.append(pair)
    return held


def _runner(kind: str):
    """The grouped kernels for ``kind``, and the layouts a call is told (Q4_K blocks)."""
    import torch

    from backends.cuda.grouped_experts import GroupedExperts
    from kestrel_core.formats import quant

    if kind == "q8":
        return GroupedExperts(H, I, K, torch.bfloat16, torch.device("cuda"), (32, quant.pad_n(2 * I), quant.pad_n(H))), None
    if kind == "q4_k":
        layouts = ((("Q4_K", 2 * I),), (("Q4_K", H),))
        return GroupedExperts(H, I, K, torch.bfloat16, torch.device("cuda"), blocks=True), layouts
    return GroupedExperts(H, I, K, torch.bfloat16, torch.device("cuda")), None


def _placed(entries: list, where: str) -> tuple[list, "torch.Tensor"]:
    """The entries where the grouped call reads them: on the device, or pinned on the host (``host``, ``copied``,
    ``dma``: the table points at the host copies); and the table of their addresses."""
    import torch

    held = [[t.to("cuda") if where == "device" else t.pin_memory() for t in pair] for pair in entries]
    table = torch.tensor([[a.data_ptr(), b.data_ptr()] for a, b in held], dtype=torch.int64, device="cuda")
    return held, table


def _landing_list(held: list, ids):
    """The routed experts of ``ids`` (distinct, ascending), a pair of device slots each, and the landing ring's list
    the copy kernel reads (on the device: a row an expert, padded to a power of two with -1: expert, its two slots'
    addresses, staged)."""
    import torch

    from backends.cuda import landing

    routed = sorted(set(ids.reshape(-1).tolist()))
    slots = [[torch.empty_like(t, device="cuda") for t in held[e]] for e in routed]
    out = torch.full((landing._pow2(len(routed)), 4), -1, dtype=torch.int64)
    for j, (e, pair) in enumerate(zip(routed, slots)):
        out[j, :3] = torch.tensor([e, pair[0].data_ptr(), pair[1].data_ptr()])
    return routed, slots, out.to("cuda")


def _staged(held: list, table, ids, where: str):
    """For ``copied`` and ``dma``: a function that copies the routed experts (distinct, ascending) from their host
    copies into device slots (the landing ring's copy kernel, or one ``copy_`` an entry), and the table the grouped
    call then reads, pointing those experts at their slots."""
    import torch

    from backends.cuda import landing

    routed, slots, out = _landing_list(held, ids)
    staged = table.clone()
    for e, pair in zip(routed, slots):
        staged[e, 0], staged[e, 1] = pair[0].data_ptr(), pair[1].data_ptr()
    if where == "dma":
        def copy():
            for e, pair in zip(routed, slots):
                for dst, src in zip(pair, held[e]):
                    dst.copy_(src, non_blocking=True)
        return copy, staged
    if any(t.numel() % 4 for t in held[0]):
        raise ValueError("the ring's copy kernel moves whole 4-byte words")
    words = tuple(t.numel() // 4 for t in held[0])
    kernel = landing._kernels()[1]

    def copy():
        kernel[(out.shape[0], 2, landing.GROUP)](out, table, words[0], words[1], GROUP=landing.GROUP,
                                                 BLOCK=landing.BLOCK)
    copy.slots = slots  # the table points at them: they live as long as the call that writes them
    return copy, staged


def run(args, record) -> dict:
    import torch

    out: dict = {"shape": {"hidden": H, "intermediate": I, "experts": E, "routed": K}, "rows": args.rows}
    for kind in (k for k in KINDS if k in args.kinds):
        entries = _entries(kind, torch.Generator().manual_seed(0))
        expert_bytes = sum(t.numel() for t in entries[0])
        run_, layouts = _runner(kind)
        out[f"{kind} expert_bytes"] = expert_bytes
        for where in (w for w in WHERE if w in args.where):
            held, table = _placed(entries, where)
            g = torch.Generator().manual_seed(1)
            rows = []
            for r in args.rows:
                ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(r)]).to("cuda")
                x = torch.randn(r, H, generator=g).to("cuda", torch.bfloat16)
                w = torch.softmax(torch.randn(r, K, generator=g), dim=-1).to("cuda", torch.bfloat16)
                copy, read = (None, table) if where in ("device", "host") else _staged(held, table, ids, where)

                def loop():
                    if copy is not None:
                        copy()
                    return torch.cat([run_(x[i:i + 1], w[i:i + 1], ids[i:i + 1], read, layouts) for i in range(r)])

                def grouped():
                    if copy is not None:
                        copy()
                    return run_.rows(x, w, ids, read, layouts)

                same = bool(torch.equal(loop(), grouped()))
                t_loop = graph_times(loop, calls=2, reps=args.reps)
                t_grouped = graph_times(grouped, calls=2, reps=args.reps)
                distinct = len(set(ids.reshape(-1).tolist()))
                row = {"rows": r, "distinct_experts": distinct, "bitwise_same": same,
                       "loop_bytes": r * K * expert_bytes, "grouped_bytes": distinct * expert_bytes,
                       "loop_ms": t_loop, "loop": summary(t_loop), "grouped_ms": t_grouped, "grouped": summary(t_grouped)}
                row["loop_over_grouped"] = row["loop"]["p50"] / row["grouped"]["p50"]
                if where != "device":  # the union crossed the link once within the grouped call's time
                    row["link_GBps"] = distinct * expert_bytes / row["grouped"]["p50"] / 1e6
                rows.append(row)
                link = f", {row['link_GBps']:.1f} GB/s over the link" if "link_GBps" in row else ""
                print(f"{kind} {where:6} R={r:3} experts {distinct:3}/{r * K:3} bitwise {same}: loop "
                      f"{row['loop']['p50']:.3f} ms, grouped {row['grouped']['p50']:.3f} ms "
                      f"({row['loop_over_grouped']:.2f}x){link}", flush=True)
            out[f"{kind} {where}"] = rows
            record.save_partial(out)
            held.clear()
            torch.cuda.empty_cache()
        if args.copy_plans:
            out[f"{kind} copy plans"] = copy_plans(entries, args, record, kind)
            record.save_partial(out)
    return out


def copy_plans(entries: list, args, record, kind: str) -> list[dict]:
    """The landing ring's copy kernel alone, moving R rows' routed experts from pinned host copies into device slots,
    at each plan of ``--copy-plans``; every repetition kept, GB/s at the median."""
    import torch

    from backends.cuda import landing

    held, table = _placed(entries, "host")
    kernel = landing._kernels()[1]
    words = tuple(t.numel() // 4 for t in held[0])
    g = torch.Generator().manual_seed(1)
    rows = []
    for r in args.rows:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(r)])
        routed, slots, out = _landing_list(held, ids)
        nout = out.shape[0]
        nbytes = len(routed) * sum(t.numel() for t in held[0])
        for group, block, warps in args.copy_plans:
            def copy():
                kernel[(nout, 2, group)](out, table, words[0], words[1], GROUP=group, BLOCK=block, num_warps=warps)
            copy()
            same = all(torch.equal(d.cpu(), s) for e, pair in zip(routed, slots) for d, s in zip(pair, held[e]))
            t = graph_times(copy, calls=2, reps=args.reps)
            row = {"rows": r, "experts": len(routed), "plan": f"{group}:{block}:{warps}", "bytes": nbytes,
                   "copied_right": same, "ms": t, "summary": summary(t), "GBps": nbytes / summary(t)["p50"] / 1e6}
            rows.append(row)
            print(f"{kind} copy plan {row['plan']:>11} R={r:3} experts {len(routed):3}: {row['summary']['p50']:.3f} ms, "
                  f"{row['GBps']:.1f} GB/s, right {same}", flush=True)
        del slots
    held.clear()
    torch.cuda.empty_cache()
    return rows
