"""Built-in benefit gates: kv-paging, l3-residency and window (DESIGN.md, "KV mirror and the gate").

kv-paging and l3-residency share a premise: memory is scarce enough that the KV
mirror matters. Both bound what they could save by the mirror and compare it with
the headroom a real workload leaves. window asks whether streaming is needed at all.
"""

from __future__ import annotations

from kestrel_core.errors import ConfigError
from kestrel_core.gates import (ASSUMED, BUILD, CARD_GB, COMPUTED, DONT_BUILD, GIVEN, MEASURED, REMEASURE,
                                STANDARD_AXES, WEIGHT_BYTES, WEIGHT_DTYPE, Evaluation, Gate, GateContext, MiB,
                                Needs, Quantity, fmt_mib, fmt_ratio)
from kestrel_core.hookspecs import hookimpl

# Streamed weight-cache entries per dense layer in kestrel's own layouts (the window's unit of upload):
# cuda fuses q/k/v and gate/up (qkv, o, gate_up, down); cpu_ref keeps the seven matrices apart.
KESTREL_ENTRIES_PER_LAYER = {"cuda": 4, "cpu_ref": 7}
# The seed engine's layout (DESIGN.md, "Device weight cache"): dense 7 single + 2 fused, MoE 5; plus lm_head.
SEED_DENSE_ENTRIES, SEED_MOE_ENTRIES, SEED_GLOBAL_ENTRIES = 9, 5, 1
_ITEM = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
_FIXED_PEAK_NOTE = ("the flip table holds the peak, less its KV, fixed and adds the mirror of each point; on a card "
                    "smaller than that peak the workload itself would change, so those rows say re-measure")


def _budget(budget_mb: int | None, free_bytes: float) -> tuple[int, str]:
    from kestrel_cuda.budget import resolve_budget  # the one budget rule, shared with the cuda backend

    return resolve_budget(budget_mb or 0, int(free_bytes))


# --- the KV mirror gates -----------------------------------------------------------------------
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
        f, layout = ctx.facts, ctx.options.kv_layout
        if layout == "int8":
            return 2 * f.kv_dim + 8 * f.n_kv_heads, "int8 + f32 scale per kv head"
        if layout == "runner":
            backend, dtype = self._runner(ctx)
            return 2 * f.kv_dim * _ITEM.get(dtype, 4), f"kestrel KVCache ({backend}, {dtype})"
        return 2 * f.kv_dim * _ITEM[layout], f"{layout} K/V"

    def _runner(self, ctx: GateContext) -> tuple[str, str]:
        """(backend, compute dtype) of kestrel's own KV cache: the measured run's, else the device question's (cuda)."""
        if ctx.workloads:
            return ctx.workloads[0].backend, ctx.workloads[0].compute_dtype
        backend = ctx.options.backend or "cuda"
        return backend, ctx.compute_dtype(backend)

    def _slot(self, ctx: GateContext, max_seq: int) -> int:
        return ctx.facts.n_layers * max_seq * self._per_token_bytes

    def collect(self, ctx: GateContext) -> list[Quantity]:
        o, f = ctx.options, ctx.facts
        work = ctx.run_workload("off") if o.measure else None  # first, so total memory is the sampler's
        L, n_kv, hd = f.n_layers, f.n_kv_heads, f.head_dim
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
            backend, dtype = self._runner(ctx)
            runner = L * max_seq.value * 2 * f.kv_dim * _ITEM.get(dtype, 4)
            q.append(Quantity("runner_slot", f"for reference: kestrel KVCache slot ({backend}, {dtype})", runner, "B",
                              COMPUTED, f"{L} x {max_seq.value} x 2*{f.kv_dim}*{_ITEM.get(dtype, 4)}"))
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
            weights = f.param_count() * WEIGHT_BYTES[wd]
            q.append(Quantity("weights", f"weights at {wd}", weights, "B", COMPUTED, f"parameters from {cfg} x {WEIGHT_BYTES[wd]:g} B"))
            budget, bsrc = _budget(o.budget_mb, ctx.free_memory().value)
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
        weights = ctx.facts.param_count() * WEIGHT_BYTES[wd]
        return min(weights, _budget(ctx.options.budget_mb, point["free_bytes"])[0])

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


# --- the window gate ----------------------------------------------------------------------------
class WindowGate(Gate):
    name = "window"
    title = "the residency window itself: is streaming needed at all?"
    formula = "weight-cache bytes = parameters x bytes per weight, against the weight-cache budget"
    against = "the weight-cache budget: half of free device memory, 256 MiB..24 GiB, or KESTREL_WCACHE_MB / --budget-mb"
    flip_axes = (CARD_GB, WEIGHT_DTYPE)
    needs = (
        Needs("weight bytes", "config or run", "shapes x torch_dtype from config.json; safetensors headers when present"),
        Needs("free device memory", "run or flag", "the budget is half of it"),
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
        from kestrel_core.checkpoint import Checkpoint
        from kestrel_core.errors import CheckpointError
        from kestrel_core.quant import META_GROUP, META_QUANT

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
            return sum(i.nbytes // _st_item(i.dtype) for i in infos), sum(i.nbytes for i in infos), quant
        finally:
            ckpt.close()

    def _entries(self, ctx: GateContext) -> dict[str, int | None]:
        """Expected resident entries at keep=off: the seed's formula and kestrel's layouts."""
        f = ctx.facts
        L, moe = f.n_layers, f.n_moe_layers()
        out = {"seed": (L - moe) * SEED_DENSE_ENTRIES + moe * SEED_MOE_ENTRIES + SEED_GLOBAL_ENTRIES}
        resident = _resident_entries(f)
        for backend, per in KESTREL_ENTRIES_PER_LAYER.items():
            out[backend] = None if resident is None else L * per + resident
        out["resident"] = resident
        return out

    def collect(self, ctx: GateContext) -> list[Quantity]:
        o, f = ctx.options, ctx.facts
        off = win = None
        if o.measure:
            off = ctx.run_workload("off")
            win = ctx.run_workload(1, "asymmetric")
        q: list[Quantity] = []
        from_ckpt = self._checkpoint(ctx)
        computed_params = f.param_count()
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
            item = WEIGHT_BYTES.get(f.checkpoint_dtype, 2.0)
            q.append(Quantity("params", "parameters", params, "count", COMPUTED, "shapes in config.json"))
            q.append(Quantity("checkpoint", "checkpoint weight bytes", params * item, "B", COMPUTED,
                              f"parameters x {item:g} B ({f.checkpoint_dtype})"))
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
        budget, bsrc = _budget(o.budget_mb, free.value)
        q.append(Quantity("budget", "weight-cache budget", budget, "B", COMPUTED, bsrc))
        if off is not None and off.budget_bytes is not None:
            q.append(Quantity("budget_run", "weight-cache budget, the run's", off.budget_bytes, "B", MEASURED, f"{off.backend} backend"))
        ratio = cache / budget
        q.append(Quantity("ratio", "weights / budget", ratio, "ratio", COMPUTED,
                          f"re-measure from {1 - self.threshold:.0%}, window needed from 100%"))
        # The cost the window adds: keep=1 re-uploads every layer but one, every token.
        L = f.n_layers
        streamed = sum(f.streamed_params(i) for i in range(L)) * WEIGHT_BYTES[wd]  # q8: its group-32 size
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
        for backend, per in KESTREL_ENTRIES_PER_LAYER.items():
            value = entries[backend]
            src = (f"{per}/layer + {entries['resident']} resident (embed, norms, lm_head)" if value is not None
                   else "n/a: kestrel runs dense qwen3/llama only")
            q.append(Quantity(f"entries_{backend}", f"entries expected, kestrel {backend}", value, "count", COMPUTED, src))
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
        budget = _budget(ctx.options.budget_mb, point["free_bytes"])[0]
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


def _st_item(dtype: str) -> int:
    from kestrel_core.checkpoint import DTYPES

    return DTYPES[dtype][2]


def _resident_entries(facts) -> int | None:
    """Never-evicted entries a kestrel run counts: embed, final norm, lm_head (untied), and every layer's norms/biases."""
    from kestrel_core.model import global_specs, small_specs
    from kestrel_core.modelconfig import parse_model_config

    if facts.is_moe:
        return None
    try:
        cfg = parse_model_config(facts.raw, facts.path)
    except ConfigError:
        return None
    return len(global_specs(cfg)) + sum(len(small_specs(cfg, layer)) for layer in range(cfg.num_hidden_layers))


@hookimpl
def register_gates(register):
    register("kv-paging", KvPagingGate)
    register("l3-residency", L3ResidencyGate)
    register("window", WindowGate)
