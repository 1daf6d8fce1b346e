"""The window gate: the residency window itself; is streaming needed at all?

It sets the weights the device cache would hold against the weight-cache budget, and
prices the window's cost (the bytes it re-uploads every token) when they fit.
"""

from __future__ import annotations

import math
from collections import Counter

from kestrel_core.formats.tensor_table import global_specs, small_specs, unit_specs
from kestrel_core.formats.modelconfig import ModelConfig
from kestrel_core.formats.units import is_expert
from kestrel_core import plugins

from .context import GateContext
from .figures import ASSUMED, BUILD, COMPUTED, DONT_BUILD, GIVEN, MEASURED, REMEASURE, WEIGHT_BYTES, fmt_mib, fmt_ratio
from .framework import CARD_GB, WEIGHT_DTYPE, Evaluation, Gate, Needs, Quantity
from .shapes import n_moe_layers, param_count, streamed_params

# kestrel's own layouts, counted with the runner's objects: the residency units of kestrel_core.formats.tensor_table.unit_specs
# (a layer's own unit; each expert of a sparse layer), and per unit cpu_ref's one entry a role, cuda's fused entries.
KESTREL_LAYOUTS = {
    "cpu_ref": "cpu_ref layout: one entry a role (UnitSpec.tensors)",
    "cuda": "cuda layout: its fused entries (the backend's entries_of)",
}


def entries_of(backend: str):
    """A registered backend's entries a unit (its class's ``entries_of``): no backend is imported by name."""
    return plugins.lookup("backends", backend).factory.entries_of
# The seed engine's layout (DESIGN.md, "Device weight cache"): dense 7 single + 2 fused, MoE 5; plus lm_head.
SEED_DENSE_ENTRIES, SEED_MOE_ENTRIES, SEED_GLOBAL_ENTRIES = 9, 5, 1


class WindowGate(Gate):
    name = "window"
    title = "the residency window itself: is streaming needed at all?"
    formula = "weight-cache bytes = parameters x bytes per weight, against the weight-cache budget"
    against = "the weight-cache budget: free device memory less a 2 GiB reserve, or KESTREL_WCACHE_MB / --budget-mb"
    flip_axes = (CARD_GB, WEIGHT_DTYPE)
    needs = (
        Needs("weight bytes", "config or run", "shapes x torch_dtype from config.json; safetensors headers when present"),
        Needs("free device memory", "run or flag", "the budget is it less a 2 GiB reserve"),
        Needs("weight-cache entries", "run", "--measure counts the entries a keep=off run creates"),
    )
    actions = {BUILD: "turn the window on", DONT_BUILD: "don't turn the window on",
               REMEASURE: "re-measure: the weights are within the threshold of the budget"}

    def decide(self, bound, against, threshold=None):
        t = self.threshold if threshold is None else threshold
        ratio = bound / against
        if ratio >= 1:
            return ratio, BUILD
        return ratio, (REMEASURE if ratio >= 1 - t else DONT_BUILD)

    def _checkpoint(self, ctx: GateContext) -> tuple[int, int, str | None] | None:
        """(elements, bytes, quantization) read from the safetensors headers, where weights exist."""
        from kestrel_core.formats.checkpoint import Checkpoint
        from kestrel_core.errors import CheckpointError
        from kestrel_core.formats.quant import META_GROUP, META_QUANT

        if not any(ctx.model_dir.glob("*.safetensors")):
            return None
        try:
            ckpt = Checkpoint(ctx.model_dir)
        except CheckpointError as exc:
            ctx.notes.append(f"weights present but unreadable, using config.json: {exc}")
            return None
        try:
            infos = [ckpt.info(n) for n in ckpt.names()]
            quant = ckpt.metadata.get(META_QUANT)
            if quant:
                quant = f"{quant}, group {ckpt.metadata.get(META_GROUP, '?')}"
            return sum(math.prod(i.shape) for i in infos), sum(i.nbytes for i in infos), quant
        finally:
            ckpt.close()

    def _entries(self, ctx: GateContext) -> dict:
        """Expected resident entries at keep=off: the seed's formula, and kestrel's layouts over every unit
        (keep=off with no expert policy preloads every unit, experts included) plus the resident entries;
        "terms" holds each layout's sum as text."""
        c = ctx.config
        L, moe = c.num_hidden_layers, n_moe_layers(c)
        out = {"seed": (L - moe) * SEED_DENSE_ENTRIES + moe * SEED_MOE_ENTRIES + SEED_GLOBAL_ENTRIES,
               "resident": resident_entries(c), "terms": {}}
        for backend, (streamed, terms) in kestrel_entries(c).items():
            out[backend] = streamed + out["resident"]
            out["terms"][backend] = terms
        return out

    def collect(self, ctx: GateContext) -> list[Quantity]:
        o, f = ctx.options, ctx.config
        off = win = None
        if o.measure:
            off = ctx.run_workload("off")
            win = ctx.run_workload(1, "asymmetric")
        q: list[Quantity] = []
        from_ckpt = self._checkpoint(ctx)
        computed_params = param_count(f)
        self._measured_cache = None  # bytes of a kestrel q8 checkpoint: stored in device layout, cached as is
        if from_ckpt and from_ckpt[2]:
            params, (_, nbytes, quant) = computed_params, from_ckpt
            q.append(Quantity("params", "parameters", params, "count", COMPUTED, "shapes in config.json"))
            q.append(Quantity("checkpoint", f"checkpoint weight bytes ({quant})", nbytes, "B", MEASURED, "safetensors headers"))
        elif from_ckpt:
            params, nbytes, _ = from_ckpt
            q.append(Quantity("params", "parameters", params, "count", MEASURED, "safetensors headers"))
            q.append(Quantity("checkpoint", "checkpoint weight bytes", nbytes, "B", MEASURED, "safetensors headers"))
            if params != computed_params:
                ctx.notes.append(f"config.json implies {computed_params:,} parameters, the checkpoint holds {params:,}")
        else:
            params = computed_params
            item = WEIGHT_BYTES.get(f.torch_dtype, 2.0)
            q.append(Quantity("params", "parameters", params, "count", COMPUTED, "shapes in config.json"))
            q.append(Quantity("checkpoint", "checkpoint weight bytes", params * item, "B", COMPUTED,
                              f"parameters x {item:g} B ({f.torch_dtype})"))
        self._params = params
        wd, kind, src = ctx.weight_dtype()
        if from_ckpt and from_ckpt[2] and kind == ASSUMED:
            wd, kind, src = "int8", MEASURED, f"the checkpoint is {from_ckpt[2]}"
            self._measured_cache = from_ckpt[1]
        self._current_wd = wd
        q.append(Quantity("weight_dtype", "weight-cache dtype", wd, "", kind, src))
        if self._measured_cache is not None:
            cache = self._measured_cache
            q.append(Quantity("weights", "weight-cache bytes", cache, "B", MEASURED, "the q8 checkpoint, in device layout"))
        else:
            cache = params * WEIGHT_BYTES[wd]
            q.append(Quantity("weights", "weight-cache bytes", cache, "B", COMPUTED, f"parameters x {WEIGHT_BYTES[wd]:g} B"))
        q.append(ctx.total_memory())
        free = ctx.free_memory()
        q.append(free)
        budget, bsrc = ctx.weight_cache_budget(free.value)
        q.append(Quantity("budget", "weight-cache budget", budget, "B", COMPUTED, bsrc))
        if off is not None and off.budget_bytes is not None:
            q.append(Quantity("budget_run", "weight-cache budget, the run's", off.budget_bytes, "B", MEASURED, f"{off.backend} backend"))
        ratio = cache / budget
        q.append(Quantity("ratio", "weights / budget", ratio, "ratio", COMPUTED,
                          f"re-measure from {1 - self.threshold:.0%}, window needed from 100%"))
        # The cost the window adds: keep=1 re-uploads every layer but one, every token.
        L = f.num_hidden_layers
        streamed = sum(streamed_params(f, i) for i in range(L)) * WEIGHT_BYTES[wd]  # q8: its group-32 size
        per_token = streamed * (L - 1) / L
        q.append(Quantity("window_bytes_per_token", "window cost: uploaded per token at keep=1", per_token, "B",
                          COMPUTED, f"{L - 1} of {L} layers' matrices"))
        q.append(Quantity("h2d", "host->device bandwidth", o.h2d_gbps, "GB/s",
                          ASSUMED if o.h2d_gbps == 55.0 else GIVEN,
                          "pinned copy on the H200 machine (DESIGN.md)" if o.h2d_gbps == 55.0 else "--h2d-gbps"))
        q.append(Quantity("window_ms_per_token", "window cost: ms per token at least", per_token / (o.h2d_gbps * 1e9) * 1e3,
                          "ms", COMPUTED, "uploaded per token / bandwidth"))
        if f.is_moe:
            ctx.notes.append("MoE: kestrel's window streams whole layers, every expert included; one that streamed "
                             "only the routed experts would move less than this cost")
        entries = self._entries(ctx)
        q.append(Quantity("entries_seed", "entries expected, seed formula", entries["seed"], "count", COMPUTED,
                          f"dense {SEED_DENSE_ENTRIES}/layer, MoE {SEED_MOE_ENTRIES}/layer, + lm_head"))
        for backend, terms in entries["terms"].items():
            src = (f"{terms} + {entries['resident']} resident (embed, norms, lm_head); units from "
                   f"kestrel_core.formats.tensor_table.unit_specs, {KESTREL_LAYOUTS[backend]}")
            q.append(Quantity(f"entries_{backend}", f"entries expected, kestrel {backend}", entries[backend], "count",
                              COMPUTED, src))
        if off is not None:
            q += self._measured(ctx, off, win, entries)
        return q

    def _measured(self, ctx, off, win, entries) -> list[Quantity]:
        q = []
        if off.error:
            q.append(Quantity("run_off", "keep=off run", "refused", "", MEASURED, off.error))
        else:
            got = off.result.counters["peak_resident_entries"]
            want = entries.get(off.backend)
            q.append(Quantity("entries_run", f"entries created, keep=off on {off.backend}", got, "count", MEASURED,
                              "peak_resident_entries"))
            check = "no expectation for this backend" if want is None else ("matches" if got == want else f"MISMATCH: expected {want}")
            q.append(Quantity("entries_check", "entries check", check, "", MEASURED, f"against kestrel {off.backend}"))
            if want is not None and got != want:
                ctx.notes.append(f"the keep=off run created {got} entries, kestrel's {off.backend} layout predicts {want}")
            q.append(Quantity("ms_off", "ms/token, keep=off", off.result.ms_per_token, "ms", MEASURED, off.backend))
            m = off.memory
            q.append(Quantity("peak_off", "peak used, keep=off", m.peak_used_bytes, "B", MEASURED, m.used_source))
        if win.error:
            q.append(Quantity("run_window", "keep=1 run", "refused", "", MEASURED, win.error))
        else:
            per = win.result.per_token[-1] if win.result.per_token else {"bytes_uploaded": 0}
            q.append(Quantity("ms_window", "ms/token, keep=1", win.result.ms_per_token, "ms", MEASURED, win.backend))
            q.append(Quantity("bytes_window", "uploaded per token, keep=1", per["bytes_uploaded"], "B", MEASURED,
                              f"counters, last decode step ({win.compute_dtype})"))
        return q

    def current_point(self, ctx):
        return {**super().current_point(ctx), "weight_dtype": self._current_wd}

    def evaluate(self, ctx, point):
        if self._measured_cache is not None and point["weight_dtype"] == self._current_wd:
            cache = self._measured_cache
        else:
            cache = self._params * WEIGHT_BYTES[point["weight_dtype"]]
        budget = ctx.weight_cache_budget(point["free_bytes"])[0]
        ratio, verdict = self.decide(cache, budget)
        return Evaluation(cache, budget, ratio, verdict)

    def summary(self, ctx, ev, q) -> str:
        w, b = fmt_mib(ev.bound), fmt_mib(ev.against)
        if ev.verdict == BUILD:
            return (f"turn the window on: the weights ({w}) exceed the weight-cache budget ({b}) by "
                    f"{fmt_mib(ev.bound - ev.against)}; with keep=off the cuda backend refuses to load.")
        if ev.verdict == REMEASURE:
            return (f"re-measure: the weights ({w}) are {fmt_ratio(ev.ratio)} of the budget ({b}), within "
                    f"{self.threshold:.0%} of it; activations and the KV cache decide, so run it (--measure).")
        cost = (f"at keep=1 it re-uploads {fmt_mib(q['window_bytes_per_token'].value)} per token, at least "
                f"{q['window_ms_per_token'].value:.2f} ms/token at {q['h2d'].value:g} GB/s")
        if "ms_window" in q and "ms_off" in q:
            cost += (f"; measured on {ctx.workloads[0].backend}: {q['ms_off'].value:.2f} ms/token with keep=off, "
                     f"{q['ms_window'].value:.2f} with keep=1")
        return (f"don't turn the window on: the weights ({w}) fit the weight-cache budget ({b}) at "
                f"{fmt_ratio(ev.ratio)}; the window would only add cost: {cost}.")


def resident_entries(cfg: ModelConfig) -> int:
    """Never-evicted entries a kestrel run counts (Backend.load_globals): embed, final norm, lm_head (untied), and
    every layer's norms/biases."""
    return len(global_specs(cfg)) + sum(len(small_specs(cfg, layer)) for layer in range(cfg.num_hidden_layers))


def kestrel_entries(cfg: ModelConfig) -> dict[str, tuple[int, str]]:
    """backend -> (streamed entries over every residency unit, the sum as text: 'N layer units x E + ...')."""
    units = unit_specs(cfg)
    out = {}
    for backend in KESTREL_LAYOUTS:
        per_unit = entries_of(backend)
        # (kind, entries a unit) -> units: a layer's own unit (layer,) or an expert (layer, e)
        groups = Counter(("expert" if is_expert(u.key) else "layer", per_unit(u.tensors)) for u in units)
        terms = " + ".join(f"{n} {kind} unit{'s' if n != 1 else ''} x {k}"
                           for (kind, k), n in sorted(groups.items(), key=lambda g: (g[0][0] == "expert", -g[0][1])))
        out[backend] = (sum(k * n for (_, k), n in groups.items()), terms)
    return out
