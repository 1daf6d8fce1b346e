"""The KV mirror gates, kv-paging and l3-residency (DESIGN.md, "KV mirror and the gate").

Both share a premise: memory is scarce enough that the KV mirror matters. Both bound what
they could save by the mirror and compare it with the headroom a real workload leaves.
"""

from __future__ import annotations

from .context import GateContext
from .figures import (ASSUMED, BUILD, COMPUTED, DONT_BUILD, GIVEN, MEASURED, REMEASURE, WEIGHT_BYTES, MiB,
                      fmt_mib, fmt_ratio)
from .framework import STANDARD_AXES, Evaluation, Gate, Needs, Quantity
from .shapes import param_count

_FIXED_PEAK_NOTE = ("the flip table holds the peak, less its KV, fixed and adds the mirror of each point; on a card "
                    "smaller than that peak the workload itself would change, so those rows say re-measure")


class _KvMirrorGate(Gate):
    against = "headroom = total memory - peak used, with the mirror at these settings in the peak"
    flip_axes = STANDARD_AXES
    needs = (
        Needs("num_hidden_layers", "config"),
        Needs("num_key_value_heads", "config"),
        Needs("head_dim", "config", "or hidden_size / num_attention_heads"),
        Needs("max_seq", "flag", "--max-seq; default 8192 capped at max_position_embeddings"),
        Needs("slots", "flag", "--slots: concurrent KV states"),
        Needs("total memory", "run or flag", "--measure or --total-mb"),
        Needs("peak used", "run or flag", "--measure or --peak-mb; else estimated from the weights"),
    )

    # --- what differs between the two gates ---
    def bound_of(self, mirror: float, fill: float) -> float:
        raise NotImplementedError

    def bound_quantity(self, mirror: float, fill: float) -> Quantity:
        raise NotImplementedError

    # --- shared ---
    def _per_token(self, ctx: GateContext) -> tuple[int, str]:
        """(bytes per token per layer, layout label) of the chosen mirror layout."""
        import torch

        from kestrel_core.engine.kvcache import kv_bytes

        c, layout = ctx.config, ctx.options.kv_layout
        if layout == "int8":
            return 2 * c.kv_dim + 8 * c.num_key_value_heads, "int8 + f32 scale per kv head"
        if layout == "runner":
            backend, dtype = self._runner(ctx)
            return kv_bytes(c, 1, getattr(torch, dtype)) // c.num_hidden_layers, f"kestrel KVCache ({backend}, {dtype})"
        return kv_bytes(c, 1, getattr(torch, layout)) // c.num_hidden_layers, f"{layout} K/V"

    def _runner(self, ctx: GateContext) -> tuple[str, str]:
        """(backend, compute dtype) of kestrel's own KV cache: the measured run's, else the device question's (cuda)."""
        if ctx.workloads:
            return ctx.workloads[0].backend, ctx.workloads[0].compute_dtype
        backend = ctx.options.backend or "cuda"
        return backend, ctx.compute_dtype(backend)

    def _slot(self, ctx: GateContext, max_seq: int) -> int:
        return ctx.config.num_hidden_layers * max_seq * self._per_token_bytes

    def collect(self, ctx: GateContext) -> list[Quantity]:
        o, f = ctx.options, ctx.config
        work = ctx.run_workload("off") if o.measure else None  # first, so total memory is the sampler's
        L, n_kv, hd = f.num_hidden_layers, f.num_key_value_heads, f.head_dim
        self._per_token_bytes, layout = self._per_token(ctx)
        max_seq = ctx.max_seq()
        slot = self._slot(ctx, max_seq.value)
        mirror = o.slots * slot
        cfg = "config.json"
        per_token_formula = (f"2*{f.kv_dim} + 8*{n_kv}" if o.kv_layout == "int8"
                             else f"2*{f.kv_dim}*{self._per_token_bytes // (2 * f.kv_dim)}")
        q = [
            Quantity("n_layers", "layers", L, "count", COMPUTED, cfg),
            Quantity("n_kv_heads", "kv heads", n_kv, "count", COMPUTED, cfg),
            Quantity("head_dim", "head_dim", hd, "count", COMPUTED, cfg),
            Quantity("kv_dim", "kv_dim", f.kv_dim, "count", COMPUTED, "kv heads x head_dim"),
            max_seq,
            Quantity("slots", "slots (concurrent KV states)", o.slots, "count", GIVEN if o.slots != 1 else ASSUMED,
                     "--slots" if o.slots != 1 else "default 1"),
            Quantity("mirror_slot", f"KV mirror slot, {layout}", slot, "B", COMPUTED,
                     f"{L} x {max_seq.value} x ({per_token_formula})"),
        ]
        if o.kv_layout != "runner":
            import torch

            from kestrel_core.engine.kvcache import kv_bytes
            from kestrel_core.engine.slots import held_positions

            backend, dtype = self._runner(ctx)
            held = held_positions(max_seq.value, max_seq.value, torch.device("cuda" if backend == "cuda" else "cpu"))
            runner = kv_bytes(f, held, getattr(torch, dtype))
            q.append(Quantity("runner_slot", f"for reference: kestrel KVCache slot ({backend}, {dtype})", runner, "B",
                              COMPUTED, f"kv_bytes: {L} x {held} positions ({max_seq.value} and the spare row) x "
                              f"{runner // (L * held)}"))
        q.append(Quantity("mirror", "KV mirror, all slots", mirror, "B", COMPUTED, f"{o.slots} x slot"))
        if self.uses_fill:
            q.append(Quantity("fill", "context fill", o.fill, "ratio", GIVEN if o.fill else ASSUMED,
                              "--fill" if o.fill else "default 0: nothing written yet, the largest bound"))
        q.append(self.bound_quantity(mirror, o.fill))
        total = ctx.total_memory()
        q.append(total)
        self._base_fixed: float | None = None
        if work is not None:
            m = work.memory
            q += [
                Quantity("peak", "peak used", m.peak_used_bytes, "B", MEASURED,
                         f"sampler every {m.period_s * 1e3:.0f} ms: {m.used_source}"),
                Quantity("run_kv", "of which the run's KV cache", work.kv_bytes, "B", COMPUTED,
                         f"{L} layers x {len(o.prompt_ids) + o.max_new_tokens} tokens x 2*{f.kv_dim} x {work.compute_dtype}"),
                Quantity("process_sampled_peak", "process peak, sampled", m.sampled_peak_bytes, "B", MEASURED,
                         m.sampled_source),
                Quantity("process_exact_peak", "allocator's exact peak", m.exact_peak_bytes, "B", MEASURED,
                         m.exact_source),
                Quantity("sampling_gap", "exact - sampled", m.gap_bytes, "B", MEASURED,
                         "what sampling missed" if m.device == "cpu" else
                         "negative: the CUDA context and non-torch memory that NVML sees"),
            ]
            self._base_fixed = m.peak_used_bytes - work.kv_bytes
            headroom_src = "total - (peak - the run's KV) - mirror"
            ctx.notes.append(_FIXED_PEAK_NOTE)
        elif o.peak_mb is not None:
            peak = int(o.peak_mb * MiB)
            q.append(Quantity("peak", "peak used", peak, "B", GIVEN, "--peak-mb (taken to include the mirror at these settings)"))
            self._base_fixed = peak - mirror
            headroom_src = "total - peak"
            ctx.notes.append(_FIXED_PEAK_NOTE)
        else:
            wd = ctx.weight_dtype()[0]
            weights = param_count(f) * WEIGHT_BYTES[wd]
            q.append(Quantity("weights", f"weights at {wd}", weights, "B", COMPUTED, f"parameters from {cfg} x {WEIGHT_BYTES[wd]:g} B"))
            budget, _ = ctx.weight_cache_budget(ctx.free_memory().value)
            q.append(Quantity("peak", "peak used, estimated", min(weights, budget) + mirror, "B", COMPUTED,
                              "min(weights, weight-cache budget) + mirror; activations and the CUDA context not counted"))
            ctx.notes.append("config-only: the peak is estimated (weights held up to the weight-cache budget, plus the "
                             "mirror), so the headroom is an upper bound; --measure or --peak-mb replace the estimate")
            headroom_src = "total - estimated peak"
        cur = self.evaluate(ctx, self.current_point(ctx))
        q.append(Quantity("headroom", "headroom", cur.against, "B", COMPUTED, headroom_src))
        q.append(Quantity("ratio", "bound / headroom", cur.ratio, "ratio", COMPUTED, f"threshold {self.threshold:.0%}"))
        return q

    def _base(self, ctx: GateContext, point: dict) -> float:
        """Peak used by everything but the mirror."""
        if self._base_fixed is not None:
            return self._base_fixed  # a measured or given peak is held fixed across the grid
        wd = point["weight_dtype"]
        weights = param_count(ctx.config) * WEIGHT_BYTES[wd]
        return min(weights, ctx.weight_cache_budget(point["free_bytes"])[0])

    def evaluate(self, ctx: GateContext, point: dict) -> Evaluation:
        mirror = point["slots"] * self._slot(ctx, point["max_seq"])
        bound = self.bound_of(mirror, ctx.options.fill)
        base, card = self._base(ctx, point), point["card_bytes"]
        if base >= card:
            return Evaluation(bound, 0, None, REMEASURE, "the rest of the workload alone fills this card: measure on it")
        headroom = card - base - mirror
        if headroom <= 0:
            if base + mirror - bound < card:
                return Evaluation(bound, headroom, None, BUILD, "the mirror does not fit, and reclaiming the bound would make it fit")
            return Evaluation(bound, headroom, None, REMEASURE, "the mirror does not fit even with the bound reclaimed")
        ratio, verdict = self.decide(bound, headroom)
        return Evaluation(bound, headroom, ratio, verdict)

    def summary(self, ctx, ev, q) -> str:
        total = q["total"].value
        b = f"{fmt_mib(ev.bound)} ({ev.bound / total:.1%} of memory)"
        if ev.ratio is None:
            return f"{self.actions[ev.verdict]}: {ev.why}; the bound is {b}."
        h = f"{fmt_mib(ev.against)} of headroom ({ev.against / total:.1%})"
        rule = f"the {self.threshold:.0%} rule"
        if ev.verdict == DONT_BUILD:
            return (f"{self.actions[ev.verdict]}: it could {self.verb} at most {b} against {h}; "
                    f"that is {fmt_ratio(ev.ratio)} of the headroom, under {rule}.")
        if ev.verdict == REMEASURE:
            return (f"{self.actions[ev.verdict]}: the bound, {b}, is {fmt_ratio(ev.ratio)} of {h}, past {rule}; "
                    "measure the real workload at these settings before deciding.")
        return f"{self.actions[ev.verdict]}: the bound, {b}, is at least the {h}."


class KvPagingGate(_KvMirrorGate):
    name = "kv-paging"
    title = "page the KV mirror (reclaim the part of each slot not yet written)"
    formula = "slots x n_layers x max_seq x (2*kv_dim + 8*n_kv_heads) x (1 - fill)  [int8 K/V, f32 scale per kv head]"
    verb = "reclaim"
    uses_fill = True
    actions = {BUILD: "build KV paging", DONT_BUILD: "don't build KV paging", REMEASURE: "re-measure"}

    def bound_of(self, mirror, fill):
        return round(mirror * (1.0 - fill))

    def bound_quantity(self, mirror, fill):
        return Quantity("bound", "reclaimable bound (unwritten part)", self.bound_of(mirror, fill), "B", COMPUTED,
                        f"mirror x (1 - {fill:g})")


class L3ResidencyGate(_KvMirrorGate):
    name = "l3-residency"
    title = "device-side L3 residency (a managed device tier for KV states, moving idle ones off and back)"
    formula = "slots x n_layers x max_seq x (2*kv_dim + 8*n_kv_heads)  [the whole mirror could move off the device]"
    verb = "free"
    uses_fill = False
    actions = {BUILD: "build L3 residency", DONT_BUILD: "don't build L3 residency", REMEASURE: "re-measure"}

    def bound_of(self, mirror, fill):
        return mirror

    def bound_quantity(self, mirror, fill):
        return Quantity("bound", "bound: the whole mirror", mirror, "B", COMPUTED, "every slot moved off the device")
