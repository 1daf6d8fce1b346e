"""A batched MoE decode step's experts: the grouped kernels (each routed expert read once for all the rows routed to
it) against the one-row kernels called once a row, on the Qwen3-30B-A3B expert shape.

    python -m bench expert-rows [--rows 1,4,8,32] [--reps 20]

In one run, for bf16 and q8 experts, each held on the device (slots) and in pinned host memory (the table's host
copies, read over the link): for each row count R, R tokens routed uniformly at random to 8 of 128 experts; the
device time of the grouped call (``GroupedExperts.rows``) and of the row loop, each captured in a CUDA graph and
replayed (``graph_times``: launches stay out), whether the two give bitwise the same output, how many distinct
experts the rows routed to, and the bytes each reads (the union's against every row's). The headline: the row loop's
p50 over the grouped call's, per R.
"""

from __future__ import annotations

from bench.errors import cuda_missing
from bench.options import numbers
from bench.stats import summary
from bench.timing import graph_times

H, I, E, K = 2048, 768, 128, 8  # noqa: E741  (Qwen3-30B-A3B: hidden, an expert's intermediate size, experts, routed)


def add_arguments(p) -> None:
    p.add_argument("--rows", type=numbers(int, 1), default=[1, 4, 8, 32])
    p.add_argument("--reps", type=int, default=20)


def needs_gpu(args) -> str | None:
    return cuda_missing()


def _experts(q8: bool, where: str):
    """E experts (bf16 or q8 byte buffers, pinned on the host or on the device), a table of their addresses, the bytes
    of one, and the q8 paddings."""
    import torch

    from kestrel_core.formats import quant

    g = torch.Generator().manual_seed(0)
    held = []
    for _ in range(E):
        pair = []
        for w in (torch.randn(2 * I, H, generator=g) / H**0.5, torch.randn(H, I, generator=g) / I**0.5):
            if q8:
                qweight, scales = quant.quantize(w, 32)
                raw = torch.cat([qweight.view(torch.uint8).reshape(-1), scales.view(torch.uint8).reshape(-1)])
            else:
                raw = w.to(torch.bfloat16).view(torch.uint8).reshape(-1)
            pair.append(raw.pin_memory() if where == "host" else raw.to("cuda"))
        held.append(pair)
    table = torch.tensor([[a.data_ptr(), b.data_ptr()] for a, b in held], dtype=torch.int64, device="cuda")
    n_pad = (quant.pad_n(2 * I), quant.pad_n(H)) if q8 else None
    return held, table, sum(t.numel() for t in held[0]), n_pad


def run(args, record) -> dict:
    import torch

    from backends.cuda.grouped_experts import GroupedExperts

    out: dict = {"shape": {"hidden": H, "intermediate": I, "experts": E, "routed": K}, "rows": args.rows}
    for kind in ("bf16", "q8"):
        for where in ("device", "host"):
            held, table, expert_bytes, n_pad = _experts(kind == "q8", where)
            run_ = GroupedExperts(H, I, K, torch.bfloat16, torch.device("cuda"), (32, *n_pad) if kind == "q8" else None)
            g = torch.Generator().manual_seed(1)
            rows = []
            for r in args.rows:
                ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(r)]).to("cuda")
                x = torch.randn(r, H, generator=g).to("cuda", torch.bfloat16)
                w = torch.softmax(torch.randn(r, K, generator=g), dim=-1).to("cuda", torch.bfloat16)

                def loop():
                    return torch.cat([run_(x[i:i + 1], w[i:i + 1], ids[i:i + 1], table) for i in range(r)])

                def grouped():
                    return run_.rows(x, w, ids, table)

                same = bool(torch.equal(loop(), grouped()))
                t_loop = graph_times(loop, calls=2, reps=args.reps)
                t_grouped = graph_times(grouped, calls=2, reps=args.reps)
                distinct = len(set(ids.reshape(-1).tolist()))
                row = {"rows": r, "distinct_experts": distinct, "bitwise_same": same,
                       "loop_bytes": r * K * expert_bytes, "grouped_bytes": distinct * expert_bytes,
                       "loop_ms": t_loop, "loop": summary(t_loop), "grouped_ms": t_grouped, "grouped": summary(t_grouped)}
                row["loop_over_grouped"] = row["loop"]["p50"] / row["grouped"]["p50"]
                rows.append(row)
                print(f"{kind} {where:6} R={r:3} experts {distinct:3}/{r * K:3} bitwise {same}: loop "
                      f"{row['loop']['p50']:.3f} ms, grouped {row['grouped']['p50']:.3f} ms "
                      f"({row['loop_over_grouped']:.2f}x)", flush=True)
            out[f"{kind} {where}"] = rows
            record.save_partial(out)
            held.clear()
            torch.cuda.empty_cache()
    return out
