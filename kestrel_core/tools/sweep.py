"""``kestrel sweep``: the cost curve over keep x policy x allocator x backend, and the invariance verdict."""

from __future__ import annotations

import statistics

import attrs

from kestrel_core import plugins

from kestrel_core.io import newfile

from kestrel_core.io import progress
from kestrel_core.config import OFF, KestrelConfig
from kestrel_core.engine.assemble import make_policy
from kestrel_core.engine.run import Model
from kestrel_core.errors import ConfigError, KestrelError
from kestrel_core.engine.results import GenerationResult
from kestrel_core.tools.optimum import min_bytes_by_pass


@attrs.frozen
class Row:
    backend: str
    policy: str
    keep: int | str
    allocator: str
    prefetch: int
    result: GenerationResult
    min_by_pass: list[int]  # bytes the offline optimum (belady) moves in each pass at this row's streamed peak

    def steady_mean(self, key: str) -> float:
        """A counter's mean a token from the second decoded token on (after warm-up)."""
        steady = self.result.per_token[1:] or self.result.per_token
        return statistics.fmean(p[key] for p in steady) if steady else 0.0

    @property
    def min_bytes_per_token(self) -> float:
        """The optimum's bytes a token over the same tokens as ``steady_mean`` (pass 0 is the prefill)."""
        decode = self.min_by_pass[1:]
        steady = decode[1:] or decode
        return statistics.fmean(steady) if steady else 0.0

    @property
    def vs_min(self) -> float:
        """Bytes a token over the optimum's at the same peak: 1.0 is optimal."""
        moved = self.steady_mean("bytes_uploaded")
        return moved / self.min_bytes_per_token if self.min_bytes_per_token else (1.0 if not moved else float("inf"))

    def to_json(self) -> dict:
        r = self.result
        mean = self.steady_mean
        return {
            "backend": self.backend,
            "policy": self.policy,
            "keep": self.keep,
            "allocator": self.allocator,
            "prefetch": self.prefetch,
            "ms_per_token": round(r.ms_per_token, 3),
            "prefill_ms": round(r.prefill_ms, 3),
            "layer_uploads_per_token": mean("layer_uploads"),
            "bytes_uploaded_per_token": mean("bytes_uploaded"),
            "min_bytes_per_token": self.min_bytes_per_token,
            "bytes_vs_min": self.vs_min,
            "allocations_after_warmup": sum(p["allocations"] for p in r.per_token[1:]) if len(r.per_token) > 1 else None,
            "peak_resident_bytes": r.counters["peak_resident_bytes"],
            "peak_resident_entries": r.counters["peak_resident_entries"],
            "token_ids": r.token_ids,
            "counters": r.counters,
            "memory": r.memory,
        }


def available_backends(names: list[str] | None) -> list[str]:
    regs = plugins.registry("backends")
    if names:
        for n in names:
            plugins.lookup("backends", n)
        return names
    return [n for n, reg in sorted(regs.items()) if reg.factory.available()]


def run_sweep(
    model: Model,
    base: KestrelConfig,
    prompt_ids: list[int],
    keeps: list,
    policies: list[str],
    allocators: list[str],
    backends: list[str],
    prefetches: list[int] = (0,),
) -> list[Row]:
    """One row a setting, each run on ``model``; under ``progress.shown`` a bar counts the runs."""
    # Check every name, keep and prefetch before the first run, not minutes into the sweep.
    for keep in keeps:
        for policy in policies:
            make_policy(policy, keep, model.n_layers)
    for allocator in allocators:
        plugins.lookup("allocators", allocator)
    for backend in backends:
        for prefetch in prefetches:
            plugins.lookup("backends", backend).factory.check_prefetch(prefetch)
    settings = []
    for backend in backends:
        for keep in keeps:
            for policy in policies if keep != OFF else [OFF]:
                for allocator in allocators:
                    for prefetch in prefetches if keep != OFF else [0]:  # without a window there is nothing to prefetch
                        settings.append((backend, policy, keep, allocator, prefetch))
    rows = []
    for backend in backends:  # warm up (kernel loads, clocks) so the first row is not paying for it
        cfg = base.override(backend__name=backend, residency__keep=OFF, backend__prefetch=0)
        _run(model, cfg, prompt_ids[:2], f"warm-up on {backend}", max_new_tokens=2)
    with progress.bar(len(settings), "sweep", "run") as bar:
        for backend, policy, keep, allocator, prefetch in settings:
            setting = f"{backend} {policy} keep={keep} {allocator} prefetch={prefetch}"
            bar.set_postfix_str(setting)
            cfg = base.override(
                backend__name=backend,
                backend__prefetch=prefetch,
                residency__policy=policy,
                residency__keep=keep,
                residency__allocator=allocator,
            )
            result, bound = _run(model, cfg, prompt_ids, f"run {setting}")
            rows.append(Row(backend, policy, keep, allocator, prefetch, result, bound))
            bar.update(1)
    return rows


def _run(model: Model, cfg: KestrelConfig, prompt_ids: list[int], label: str, max_new_tokens: int | None = None):
    """The run's result, and the optimum's bytes a token at the same streamed peak."""
    settings = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
    try:
        with model.open(cfg) as run:
            result = run.generate(prompt_ids=list(prompt_ids), **settings)
            streamed_peak = result.counters["peak_resident_bytes"] - result.fixed_resident_bytes
            return result, min_bytes_by_pass(run.backend.units.layer_bytes, streamed_peak, 1 + len(result.per_token))
    except KestrelError as exc:  # a failed run ends the sweep: no verdict is drawn over it
        raise type(exc)(f"sweep {label}: {exc}") from None


def invariance(rows: list[Row]) -> dict:
    """Greedy ids must be identical across every setting on one backend."""
    verdict = {"identical": True, "backends": {}}
    for backend in dict.fromkeys(r.backend for r in rows):
        mine = [r for r in rows if r.backend == backend]
        ref = mine[0].result.token_ids
        differing = [f"{r.policy} keep={r.keep} {r.allocator} prefetch={r.prefetch}" for r in mine if r.result.token_ids != ref]
        verdict["backends"][backend] = {"runs": len(mine), "reference": ref, "differing": differing}
        verdict["identical"] &= not differing
    return verdict


def equal_peak_comparison(rows: list[Row]) -> list[dict]:
    """asymmetric against pinned_set at the same keep: same peak resident bytes, bytes moved per token."""
    out = []
    by = {(r.backend, r.policy, r.keep, r.allocator, r.prefetch): r.to_json() for r in rows}
    for (backend, policy, keep, allocator, prefetch), a in by.items():
        p = by.get((backend, "pinned_set", keep, allocator, prefetch))
        if policy != "asymmetric" or p is None:
            continue
        saved = a["bytes_uploaded_per_token"] - p["bytes_uploaded_per_token"]
        out.append({
            "backend": backend, "keep": keep, "allocator": allocator, "prefetch": prefetch,
            "peak_resident_bytes": [a["peak_resident_bytes"], p["peak_resident_bytes"]],
            "bytes_per_token": [a["bytes_uploaded_per_token"], p["bytes_uploaded_per_token"]],
            "saved_fraction": saved / a["bytes_uploaded_per_token"] if a["bytes_uploaded_per_token"] else 0.0,
        })
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def format_table(rows: list[Row]) -> str:
    head = f"{'backend':8} {'policy':16} {'keep':>4} {'alloc':5} {'pf':>2} {'ms/tok':>8} {'prefill':>8} {'layers/tok':>10} {'MiB/tok':>9} {'peak MiB':>9} {'entries':>7} {'allocs*':>7} {'xMIN':>5} ids"
    lines = [head, "-" * len(head)]
    ref: dict[str, list[int]] = {}
    for r in rows:
        j = r.to_json()
        same = ref.setdefault(r.backend, j["token_ids"]) == j["token_ids"]
        allocs = "-" if j["allocations_after_warmup"] is None else str(j["allocations_after_warmup"])
        lines.append(
            f"{r.backend:8} {r.policy:16} {str(r.keep):>4} {r.allocator:5} {r.prefetch:>2} {j['ms_per_token']:8.2f} "
            f"{j['prefill_ms']:8.2f} {j['layer_uploads_per_token']:10.2f} {_mib(j['bytes_uploaded_per_token']):>9} "
            f"{_mib(j['peak_resident_bytes']):>9} {j['peak_resident_entries']:7} {allocs:>7} {r.vs_min:5.2f} {'same' if same else 'DIFF'}"
        )
    lines.append("allocs* = real allocations from the second decoded token on; xMIN = bytes a token over the offline "
                 "optimum's (belady) at the same peak; ids = token ids against the first row of the backend")
    return "\n".join(lines)


def format_verdict(verdict: dict, comparison: list[dict]) -> str:
    lines = []
    for backend, v in verdict["backends"].items():
        if v["differing"]:
            lines.append(f"invariance on {backend}: FAILED - ids differ from the first run in: {'; '.join(v['differing'])}")
        else:
            lines.append(f"invariance on {backend}: token ids identical across all {v['runs']} runs")
    for c in comparison:  # each figure named with its policy: the pair's order is easy to misread
        (a_peak, p_peak), (a_bytes, p_bytes) = c["peak_resident_bytes"], c["bytes_per_token"]
        lines.append(
            f"pinned_set vs asymmetric on {c['backend']} at keep={c['keep']} ({c['allocator']}): peak pinned_set "
            f"{_mib(p_peak)} MiB, asymmetric {_mib(a_peak)} MiB; uploaded pinned_set {_mib(p_bytes)} MiB/token "
            f"({c['saved_fraction']:.0%} fewer bytes), asymmetric {_mib(a_bytes)} MiB/token"
        )
    return "\n".join(lines)


def plotting():
    """matplotlib's pyplot, checked before a sweep starts."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install matplotlib") from None
    return plt


def plot(rows: list[Row], path: str, model: str = "") -> None:
    """The cost curve to a new PNG file (written whole, never over a file: ``newfile``), titled with the model."""
    plt = plotting()
    fig, ax = plt.subplots(figsize=(7, 4))
    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        if r.keep != OFF:
            groups.setdefault((r.backend, r.policy, r.allocator, r.prefetch), []).append(r)
    for (backend, policy, allocator, prefetch), rs in groups.items():
        rs = sorted(rs, key=lambda r: r.keep)
        ax.plot([r.keep for r in rs], [r.result.ms_per_token for r in rs], marker="o",
                label=f"{backend} {policy} {allocator}" + (f" pf{prefetch}" if prefetch else ""))
    for r in rows:
        if r.keep == OFF:
            ax.axhline(r.result.ms_per_token, linestyle="--", linewidth=1, label=f"{r.backend} off")
    ax.set_xlabel("keep (layers)")
    ax.set_ylabel("decode ms/token (median)")
    tokens = len(rows[0].result.token_ids) if rows else 0
    ax.set_title(f"kestrel sweep: {model or 'the model'}, {tokens} tokens a run", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    try:
        newfile.write_new(path, lambda f: fig.savefig(f, format="png", dpi=120), "--plot", ".png")
    except ConfigError as exc:
        raise ConfigError(f"cannot write the plot: {exc}") from None
    finally:
        plt.close(fig)

