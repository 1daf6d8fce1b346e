"""The CUDA backend: a bounded device weight cache fed from pinned host staging.

A unit's entries are the layout the device computes from (``layout.fusion``): a dense
layer is fused QKV, o, fused gate-up, down; a sparse layer's own unit QKV, o, router; an
expert fused gate-up, down. Each unit's host copy is pinned once at load, so an upload is
one DMA per entry (no memset, transpose or sync). With ``prefetch = d``, layers
``l+1..l+d`` upload on a side stream while ``l`` computes (as do the guessed experts of
speculative expert prefetch); a unit needed at once uploads on the compute stream. Events
order the two streams, and a released buffer is refilled only after its last reader is done.
A decode step whose plan repeats is captured as one CUDA graph (``capture``) and
replayed (``replay``): uploads, prefetch, events, every layer and the argmax.
"""

from __future__ import annotations

import functools
import warnings

import attrs
import torch
import torch.nn.functional as F

from kestrel_core.io import progress
from kestrel_core.config import BackendConfig
from kestrel_core.engine.backend import Backend, BackendContext
from backends.cuda.budget import RESERVE, fit_room, resolve_budget
from kestrel_core.engine.devices import compute_device
from kestrel_core.formats.dtypes import compute_dtype, itemsize
from kestrel_core.errors import BudgetError, ConfigError, KestrelError, KestrelNote
from kestrel_core.engine.host import meminfo
from backends.cuda.host.diskread import round_up
from backends.cuda.host.tier import PinnedRing, resolve_host_budget, ring_slots, slot_bytes
from backends.cuda.host.pinned_arena import PinnedArena, arena_bytes, release_cached_pinned
from backends.cuda.host.staging import Filler, Stager
from kestrel_core.engine.fit import FitFacts, moe_facts, refuse_over_budget
from kestrel_core.engine.kvcache import kv_bytes
from kestrel_core.formats.units import Unit, UnitTable, is_expert

from . import blocks, grouped_experts, layer_ops, prompt_experts, q8
from .expert_table import DeviceExpertTable
from .layout import DeviceLayout, fusion, slot_entries, streamed_peak
from .rawcuda import RawBlock, raw_empty

DTYPES = ("bfloat16", "float16", "float32")


class CudaBackend(Backend):
    name = "cuda"
    device_type = "cuda"

    @classmethod
    def available(cls) -> bool:
        return torch.cuda.is_available()

    @classmethod
    def check_prefetch(cls, depth: int) -> None:
        if depth < 0:
            raise ConfigError(f"prefetch must be >= 0, got {depth}")

    @classmethod
    def entries_of(cls, tensors: dict) -> int:
        return len(fusion(tensors))

    @classmethod
    def weight_budget(cls, config_mb: int, free_bytes: int) -> tuple[int, str]:
        return resolve_budget(config_mb, free_bytes)

    @classmethod
    def dtype_and_device(cls, ctx: BackendContext) -> tuple[torch.dtype, torch.device]:
        """The run's compute dtype and GPU, checked (a GPU there, a dtype cuda computes in, a cuda device): what a run
        and its fit both read."""
        if not torch.cuda.is_available():
            raise KestrelError("the cuda backend needs an NVIDIA GPU and a CUDA build of torch; use --backend cpu_ref")
        dtype = compute_dtype(ctx.backend.dtype or "bfloat16", DTYPES, cls.name)
        device = compute_device(ctx.backend.device or "cuda")
        if device.type != "cuda":
            raise ConfigError(f"the cuda backend computes on a GPU, not on {device}; use --device cuda:N or --backend cpu_ref")
        return dtype, device

    def __init__(self, ctx: BackendContext):
        self.dtype, self.device = self.dtype_and_device(ctx)
        super().__init__(ctx)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(self.device)
        self.prefetch_depth = ctx.backend.prefetch
        kernels = ctx.backend.gguf_kernels  # [backend] gguf_kernels: which kernels run GGUF blocks, decode and prompt
        self.gguf_int8, self.gguf_prompt_int8 = kernels == "int8", kernels in ("int8", "auto")
        self.layer_ops = layer_ops.layer_ops(ctx.backend.layer_ops)  # between a layer's linears: fused where Triton runs
        if ctx.backend.threads:
            warnings.warn("threads sets cpu_ref's torch threads; the cuda backend computes on the GPU, so it has no "
                          "effect here", KestrelNote, stacklevel=2)
        if ctx.backend.host_kernels != attrs.fields(BackendConfig).host_kernels.default:
            warnings.warn(f"host_kernels = {ctx.backend.host_kernels!r} picks how cpu_ref computes a GGUF's blocks; the "
                          "cuda backend computes them on the GPU (gguf_kernels), so it has no effect here", KestrelNote,
                          stacklevel=2)
        # Compute runs on whatever stream is current (the default one, or a graph's capture stream);
        # prefetched uploads run on a side stream, ordered against it by events
        # (speculative expert prefetch uploads there too, and a prompt chunk's routed experts under an expert policy).
        side = self.prefetch_depth or ctx.residency.expert_prefetch or ctx.residency.expert_policy
        self.copy_stream = torch.cuda.Stream(self.device) if side else None
        self._capture_stream = torch.cuda.Stream(self.device)
        self._said_unpinned = False
        self._ready: dict[tuple, torch.cuda.Event] = {}  # unit key -> its upload's event
        self._last_read: dict[int, torch.cuda.Event] = {}  # buffer data_ptr -> compute event at release
        self._last_write: dict[int, torch.cuda.Event] = {}  # buffer data_ptr -> upload event of a prefetch evicted unused
        self.quant = ctx.quant  # read and checked once, when the Model opened
        self._q8 = self.quant.tensors if self.quant else {}
        if self.quant:
            q8.kernel_available()  # build (or find cached) before any timing; a failure says so once, at first use
        self._layout = DeviceLayout(self.ckpt, self.cfg, self.quant, self.dtype, self.device)
        self._blocks = self._layout.blocks  # a GGUF's quantized linears, held as their blocks
        self._check_block_kernels()
        self.lay_out_units()
        self._check_budget(ctx)
        self._stager: Stager | None = None
        self._host = self._set_up_host(ctx)
        self._grouped = self._set_up_grouped()
        self._experts = self._set_up_expert_table()
        self.expert_table = self._experts is not None
        self.lands = self.expert_table and self._experts.entry_bytes is not None
        torch.cuda.reset_peak_memory_stats(self.device)
        RawBlock.peak_bytes = RawBlock.live_bytes
        try:
            self.load_globals()
        except torch.cuda.OutOfMemoryError:
            raise self._oom("loading embeddings and lm_head") from None

    def _check_block_kernels(self) -> None:
        """A GGUF's quantized weights compute as blocks through Triton: where it cannot run, say so before any upload."""
        if not self._blocks:
            return
        why = blocks.gguf_kernels.available()
        if why is not None:
            types = ", ".join(sorted({t.qtype.name for t in self._blocks.values()}))
            raise ConfigError(f"this GGUF's {types} weights compute on cuda as their own blocks through Triton "
                              f"kernels, which cannot run here ({why}); install triton, or use --backend cpu_ref")

    # --- layout and budget -------------------------------------------------------
    def layout(self, spec):
        """The unit's fused entries (``layout.DeviceLayout``): the layout the host staging holds and the math reads."""
        return self._layout.entries(spec)

    def _global_bytes(self) -> int:
        return self._layout.global_bytes()

    @property
    def dequantized_entries(self) -> list[str]:
        return self._layout.dequantized_entries

    @classmethod
    def fit_facts(cls, ctx: BackendContext) -> FitFacts:
        """The weight-cache budget (``budget.resolve_budget``: ``--budget-mb``, default free device memory less
        ``budget.RESERVE``) and the KV cache beside it, against each layer's bytes as this backend streams them
        (``DeviceLayout``), read before anything loads."""
        dtype, device = cls.dtype_and_device(ctx)
        return cls.fit_facts_at(ctx, dtype, device, torch.cuda.mem_get_info(device)[0])

    @classmethod
    def fit_facts_at(cls, ctx: BackendContext, dtype: torch.dtype, device: torch.device, free: int) -> FitFacts:
        """``fit_facts`` on a device of ``free`` bytes free: arithmetic over the layout, no GPU asked (so the fit can be
        reasoned about, and tested, without one)."""
        lay = DeviceLayout(ctx.checkpoint, ctx.model, ctx.quant, dtype, device, note=False)
        units = UnitTable(Unit.of(spec, lay.entries(spec)) for spec in ctx.unit_specs)
        budget, source = resolve_budget(ctx.residency.budget_mb, free)
        own = [u.nbytes for u in units.own()]
        experts = [u.nbytes for u in units.experts()]
        return FitFacts(budget, source, "device weight-cache budget", lay.global_bytes(), ctx.model.num_hidden_layers,
                        streamed_peak(units, ctx.residency, ctx.model),
                        **moe_facts(ctx.residency, ctx.model, own, experts),
                        room=fit_room(free), room_what=f"free on {device} less the {RESERVE >> 30} GiB reserve",
                        kv_bytes=lambda slots, positions: kv_bytes(ctx.model, positions, dtype, slots))

    def _check_budget(self, ctx: BackendContext) -> None:
        """In bytes over units: the run's peak of resident layers (the largest ones), plus the prefetch, plus the globals."""
        self.budget, self.budget_source = ctx.fitted_budget or resolve_budget(ctx.residency.budget_mb,
                                                                              torch.cuda.mem_get_info(self.device)[0])
        glob, mib, peak_bytes = self._global_bytes(), 2**20, streamed_peak(self.units, ctx.residency, self.cfg)
        largest = peak_bytes(1)
        if self.budget < glob + largest:
            raise BudgetError(
                f"weight-cache budget {self.budget // mib} MiB ({self.budget_source}) is below one layer's working set: "
                f"need at least {-(-(glob + largest) // mib)} MiB ({largest // mib} MiB for the largest layer"
                f"{' and its experts' if self.cfg.is_moe else ''} + {glob // mib} MiB resident); "
                "raise --budget-mb or KESTREL_WCACHE_MB"
            )
        experts = self.cfg.is_moe and not ctx.residency.expert_policy
        refuse_over_budget(self.budget, self.budget_source, "weight-cache budget", glob, peak_bytes,
                           self.cfg.num_hidden_layers, ctx.residency.windowed, ctx.peak_layers, ctx.keep_peak,
                           self.prefetch_depth,
                           ", bound the experts with --expert-policy expert_lru --expert-budget-mb N" if experts else "")

    def _oom(self, what: str) -> BudgetError:
        mib = 2**20
        return BudgetError(
            f"CUDA out of memory while {what} ({self.counters.resident_bytes // mib} MiB of weights resident, "
            f"budget {self.budget // mib} MiB); set --budget-mb / KESTREL_WCACHE_MB below "
            f"{torch.cuda.mem_get_info(self.device)[0] // mib + self.counters.resident_bytes // mib} MiB or lower keep"
        )

    # --- the expert table --------------------------------------------------------------
    def _set_up_expert_table(self) -> DeviceExpertTable | None:
        """The table, where a decode step can read its experts through it: every expert's host copy pinned for the run
        (the all-pinned tier) and the grouped kernels available; else None (why: ``expert_table_refusal``)."""
        if not self.cfg.is_moe:
            self.expert_table_refusal = "the model has no experts"
            return None
        if self._stager is not None:
            self.expert_table_refusal = ("the host ring holds no expert for good, so a step has no host copy to read: "
                                         "give the host budget every layer, or use expert_decode = 'host'")
            return None
        if self._grouped is None:
            self.expert_table_refusal = f"its grouped expert kernels cannot run here ({self._grouped_refusal})"
            return None
        return DeviceExpertTable(self.units, self._host, self.cfg, self.device, self._grouped)

    def _set_up_grouped(self) -> grouped_experts.GroupedExperts | None:
        """The grouped expert kernels of a Mixture-of-Experts model, where Triton is here: a decode step's experts run
        through them on either path (the table, or host-routed), so the path never changes a result. Where they
        cannot, ``_grouped_refusal`` says why and experts run one by one."""
        self._grouped_refusal = "the model has no experts"
        if not self.cfg.is_moe:
            return None
        self._grouped_refusal = grouped_experts.available()
        if self._grouped_refusal is not None:
            return None
        experts = self.units.experts()
        if {tuple(e.name for e in u.entries) for u in experts} != {("gate_up", "down")}:
            self._grouped_refusal = "an expert's entries are not gate_up and down"
            return None
        held = {blocks.is_block_geometry(e.geometry) for u in experts for e in u.entries}
        if held == {True, False}:
            self._grouped_refusal = "some of its expert entries are GGUF blocks and others floats"
            return None
        q8_params = None
        gu, dn = (e.geometry for e in experts[0].entries)
        if q8.is_q8_geometry(gu):  # every expert is (a GGUF's q8 holds its experts whole or not at all: gguf_model)
            q8_params = (gu.shape[0] // gu.layout[2], gu.shape[1], dn.shape[1])  # group, gate_up n_pad, down n_pad
        cfg = self.cfg
        return grouped_experts.GroupedExperts(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok,
                                              self.dtype, self.device, q8_params, blocks=held == {True},
                                              int8=self.gguf_int8)

    def fetched_experts(self, x, weights, chosen, used, weights_of, prompt_from=None):
        rows = x.shape[0]
        at = rows if prompt_from is None or not self.gguf_prompt_int8 else max(0, prompt_from)
        if at < rows and self._grouped is not None and self._grouped.blocks:
            # a prompt's rows: every routed expert at once on the tensor cores, where the experts' types allow
            mine = used if at == 0 and rows > 1 else torch.unique(chosen[at:]).tolist()
            buffers = [(weights_of[e]["gate_up"], weights_of[e]["down"]) for e in mine]
            if prompt_experts.takes(buffers):
                tail = prompt_experts.prompt_experts(x[at:], weights[at:], chosen[at:], mine, buffers)
                if at == 0:
                    return tail
                head = chosen[0].tolist() if at == 1 else torch.unique(chosen[:at]).tolist()
                return torch.cat((self.fetched_experts(x[:at], weights[:at], chosen[:at], head, weights_of), tail))
        if self._grouped is None or rows != 1:
            return super().fetched_experts(x, weights, chosen, used, weights_of)
        return self._grouped.fetched(x, weights, [(weights_of[e]["gate_up"], weights_of[e]["down"]) for e in used])

    def point_experts(self, host, slots):
        self._experts.point(host, slots, torch.cuda.current_stream(self.device), self.before_use)

    def routed_experts(self, layer, x, weights, chosen):
        return self._experts.routed(layer, x, weights, chosen)

    def landing_open(self, size, staged=0):
        self._experts.open_ring(size, staged)

    def landing_fill(self, filled, tail):
        self._experts.ring.fill(filled, tail)

    def landing_state(self):
        return self._experts.ring.state

    # --- host staging --------------------------------------------------------------
    def _set_up_host(self, ctx: BackendContext) -> dict[tuple, torch.Tensor]:
        """The host tier: every unit pinned once where the host budget holds them all, else a ring of slots."""
        self._slot_entries = {spec.key: slot_entries(spec.tensors, self._blocks) for spec in ctx.unit_specs}
        staged = arena_bytes(self._host_sizes())  # what pinning every unit locks (its blocks, not the bare sum)
        key = ("cuda-pinned-staging", "q8" if self.quant else "", "blocks" if self._blocks else "", self.dtype)
        held = ctx.host.peek(key)  # an earlier run's staging of this model: this run reuses or frees it
        available = meminfo().get("MemAvailable", 0)
        if available and held is not None:
            available += held.pinned_bytes
        self.host_budget = resolve_host_budget(ctx.backend.host_budget_mb, available, staged)
        if self.host_budget.mode == "all":
            staging = ctx.host.get(key, self._stage_host)
            self.host_pinned_bytes = staging.pinned_bytes
            return staging.host
        if self.quant:
            raise ConfigError(
                f"the host ring stages float checkpoints; this q8 checkpoint's {staged / 2**20:,.0f} MiB are pinned whole, "
                f"over the host budget of {self.host_budget.bytes // 2**20} MiB ({self.host_budget.source}): raise "
                "--host-budget-mb or KESTREL_HOST_MB, or run a float checkpoint (for a GGUF with Q8_0 weights: "
                "one of other types, or its weights written as safetensors)")
        ctx.host.discard(key)  # an earlier run's full staging would pin more than this run's budget
        size = slot_bytes(self._slot_entries.values(), self.dtype)
        depth = max(self.prefetch_depth, int(ctx.residency.expert_prefetch))
        n = ring_slots(self.host_budget, size, depth)
        ring = PinnedRing(n, size, self.dtype, pin=True)
        self._stager = Stager(ring, Filler(self.ckpt), self._slot_entries.__getitem__, lookahead=n - 1)
        self.host_pinned_bytes = ring.pinned_bytes
        return {}

    def _stage_host(self) -> "Staging":
        """Pin each unit once, already fused and in compute dtype (q8: in device layout): an upload is then a
        plain DMA. Keyed by entry source, (unit key, entry name). Each entry is a view of one of a
        ``PinnedArena``'s blocks of torch's pinned allocator, which torch copies from asynchronously and inside a
        captured graph (memory registered with cudaHostRegister is copied from asynchronously too, but it is not
        one of its blocks, so a graph refuses it).

        The staging lives in the opened model's host store, so a sweep pins the weights once.
        """
        host: dict[tuple, torch.Tensor] = {}
        sizes = self._host_sizes()
        arena = PinnedArena(sum(map(round_up, sizes)), max(sizes, default=0))
        with progress.bar(len(self.ctx.unit_specs), "pinning", unit="unit") as bar:
            for spec in self.ctx.unit_specs:
                host.update(self._stage_unit(spec, arena))
                bar.update(1)
        return Staging(host, arena.pinned_bytes)

    def _host_sizes(self) -> list[int]:
        """Each host entry's bytes, in the order the staging takes them (unit by unit, entry by entry)."""
        return [e.geometry.nbytes for u in self.units.units.values() for e in u.entries]

    def _stage_unit(self, spec, arena: PinnedArena) -> dict[tuple, torch.Tensor]:
        """One unit's host staging, keyed (unit key, entry name), each entry a view of the arena, in ``layout``
        order (the order ``_host_sizes`` gives the arena)."""
        tensors = spec.tensors
        staged = {}
        for name, roles in fusion(tensors):
            parts = [self._q8.get(tensors[r][0]) for r in roles]
            block_parts = self._layout.block_parts(spec, name, roles)
            if parts[0] is not None:
                staged[name] = q8.stage_q8(self.ckpt, parts, alloc=arena.take)
            elif block_parts is not None:
                staged[name] = blocks.stage_blocks(self.ckpt, block_parts, alloc=arena.take)
            else:  # a float checkpoint's entry, or a float entry of a q8 one (a router)
                staged[name] = self._stage_float(roles, tensors, arena)
        if self.quant:
            self.ckpt.drop_pages(q8.unit_page_names(self.quant, tensors))
        else:
            self.ckpt.drop_pages([n for n, _ in tensors.values()])  # the pinned copy is the host staging now
        return {(spec.key, name): t for name, t in staged.items()}

    def _stage_float(self, roles, tensors, arena: PinnedArena) -> torch.Tensor:
        rows = sum(tensors[r][1][0] for r in roles)
        cols = tensors[roles[0]][1][1]
        buf = arena.take(rows * cols * itemsize(self.dtype)).view(self.dtype).view(rows, cols)
        at = 0
        for r in roles:
            src = self.ckpt.view(tensors[r][0])
            buf[at : at + src.shape[0]].copy_(src)
            at += src.shape[0]
        return buf

    # --- Backend contract ----------------------------------------------------------
    def new_buffer(self, geometry, raw=False):
        try:
            if q8.is_q8_geometry(geometry):  # one byte buffer: qweight then scales
                if raw:
                    return q8.new_q8_buffer(geometry, self.device, empty=raw_empty)
                buf = q8.new_q8_buffer(geometry, self.device)
            elif blocks.is_block_geometry(geometry):  # one byte buffer: the segments' blocks
                if raw:
                    return blocks.new_block_buffer(geometry, self.device, empty=raw_empty)
                buf = blocks.new_block_buffer(geometry, self.device)
            elif raw:
                return raw_empty(geometry.shape, self.dtype, self.device)
            else:
                buf = torch.empty(geometry.shape, dtype=self.dtype, device=self.device)
        except torch.cuda.OutOfMemoryError:
            raise self._oom("allocating a weight buffer") from None
        if self.copy_stream is not None:
            buf.record_stream(self.copy_stream)
        if self._experts is not None:
            buf.record_stream(self._experts.stream)
        return buf

    def free_buffer(self, buffer):
        del buffer  # raw: cudaFree runs as the last view dies; pool fallback: back to torch's cache

    def fill(self, buffer, source):
        """A copy from pinned staging on the current stream (in order with the compute)."""
        buffer.copy_(self._host[source], non_blocking=True)

    def execute(self, plan):
        """Evictions, then fetches in order; a prefetch after a demand upload in the same plan starts once that upload
        is done, so the two do not share the link while the compute waits for the first. With a host ring, the plan's
        units are staged into it back to back ahead of their uploads. A prompt chunk's routed experts upload on the side
        stream, back to back, each with its own event: the layer computes each expert after its upload alone
        (``before_use``, as it reads it), so the experts already there and those landed run while the rest cross."""
        for resident in plan.evict:
            self.retire(resident)
        if plan.phase == "heard":  # a step behind, for later steps: on the table's stream, which no replay waits for
            for fetch in plan.fetch:
                self._experts.admit(fetch, self._last_read, self._copy_unit)
            return
        if self._stager is not None and plan.fetch:
            self._stager.expect([fetch.unit.key for fetch in plan.fetch])
        demand = False
        for fetch in plan.fetch:
            if fetch.ahead and demand and self.copy_stream is not None:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(self.device))
                self.copy_stream.wait_event(ev)
                demand = False
            streamed = plan.phase == "prefill" and is_expert(fetch.unit.key)
            self.fill_unit(fetch, side=streamed)
            demand = demand or not (fetch.ahead or streamed)

    def fill_unit(self, fetch, side=False):
        """A prefetch (``fetch.ahead``) uploads on the side stream; a unit needed now uploads on the compute stream,
        so it does not queue behind the side stream's prefetch (``side``: on the side stream all the same, waited for
        by ``before_use``)."""
        try:
            if self.copy_stream is not None and (fetch.ahead or side):
                for buffer in fetch.buffers:
                    ptr = buffer.data_ptr()
                    waits = self._last_read.pop(ptr, None)  # its last reader, on the compute stream
                    if waits is not None:
                        self.copy_stream.wait_event(waits)
                    self._last_write.pop(ptr, None)  # an earlier side-stream write is in this stream's order
                with torch.cuda.stream(self.copy_stream):
                    self._copy_unit(fetch, self.copy_stream)
                ev = torch.cuda.Event()
                ev.record(self.copy_stream)
                self._ready[fetch.unit.key] = ev
                return
            current = torch.cuda.current_stream(self.device)
            for buffer in fetch.buffers:
                ptr = buffer.data_ptr()
                self._last_read.pop(ptr, None)  # its readers are earlier on this stream
                pending = self._last_write.pop(ptr, None)  # a prefetch evicted unused may still be writing it
                if pending is not None:
                    current.wait_event(pending)
            self._copy_unit(fetch, current)
        except torch.cuda.OutOfMemoryError:
            raise self._oom(f"uploading unit {fetch.unit.key}") from None

    def _copy_unit(self, fetch, stream):
        """The unit's entries from host to their buffers on ``stream``: from the full staging, or from a ring slot,
        which goes back to the ring with the event its copies leave."""
        if self._stager is None:
            for entry, buffer in zip(fetch.unit.entries, fetch.buffers):
                self.fill(buffer, entry.source)
            return
        slot, views = self._stager.take(fetch.unit.key)
        try:
            for entry, buffer in zip(fetch.unit.entries, fetch.buffers):
                buffer.copy_(views[entry.name], non_blocking=True)
        finally:
            done = torch.cuda.Event()
            done.record(stream)
            self._stager.give_back(slot, done)

    def retire(self, resident):
        if self._experts is not None:
            self._experts.retired(resident.unit.key, torch.cuda.current_stream(self.device))
        if self.copy_stream is not None or self._experts is not None:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))  # the last reader of these buffers is queued before this point
            pending = self._ready.pop(resident.unit.key, None)  # evicted before any use: its upload may still run
            for buf in resident.buffers:
                self._last_read[buf.data_ptr()] = ev
                if pending is not None:
                    self._last_write[buf.data_ptr()] = pending

    def before_use(self, key):
        ev = self._ready.pop(key, None)
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)

    # --- the captured decode step ----------------------------------------------------
    captures = True

    def capture(self, step, plans):
        """The step as one CUDA graph: its uploads (from pinned staging), the side stream's prefetch and
        events, every layer and the argmax. Activations go to the graph's private memory pool.

        Events recorded while capturing exist only inside the graph, so none is kept for an eager wait.
        """
        if self._stager is not None:  # a slot's contents change every token: a graph would replay stale bytes
            if not self._said_unpinned:
                self._said_unpinned = True
                warnings.warn("the host ring stages each unit into a slot just before its upload, so the decode step "
                              "cannot be captured; it runs eagerly (a host budget that holds every unit lets it be)",
                              KestrelNote, stacklevel=2)
            return None
        unpinned = [e.source for plan in plans for fetch in plan.fetch for e in fetch.unit.entries
                    if not _pinned(self._host[e.source])]
        if unpinned:  # a pageable source cannot be copied inside a graph (an error, or garbage in older torch)
            if not self._said_unpinned:
                self._said_unpinned = True
                warnings.warn(f"the host copy of unit {unpinned[0][0]} ({unpinned[0][1]}) is not pinned, so the decode "
                              "step cannot be captured; it runs eagerly", KestrelNote, stacklevel=2)
            return None
        torch.cuda.synchronize(self.device)  # every eager upload and read is done: no eager event is needed inside
        self._forget_events()
        if self._experts is not None:
            # admissions' uploads are done too; a wait on their events inside the capture would fail it
            self._experts.ready.clear()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=self._capture_stream):
                if self.copy_stream is not None:
                    self.copy_stream.wait_stream(self._capture_stream)  # the side stream joins the capture
                step()
                if self.copy_stream is not None:
                    self._capture_stream.wait_stream(self.copy_stream)  # and rejoins it before the end
        except RuntimeError as exc:  # something in the step cannot be captured: nothing of it ran, so run it eagerly
            warnings.warn(f"the decode step could not be captured ({str(exc).splitlines()[0][:200]}); it runs eagerly",
                          KestrelNote, stacklevel=2)
            graph = None
        finally:
            self._forget_events()
        return graph

    def replay(self, graph):
        """Launch the graph on the current stream, after every eager upload, before any later one."""
        current = torch.cuda.current_stream(self.device)
        if self.copy_stream is not None:
            current.wait_stream(self.copy_stream)
        self._forget_events()  # ordered by the wait above, and by stream order against the compute
        graph.replay()
        if self.copy_stream is not None:
            self.copy_stream.wait_stream(current)  # a later eager refill waits for the graph's last read
        if self._experts is not None:
            self._experts.stream.wait_stream(current)  # and so does a later admission (no retire recorded the graph's)

    def _forget_events(self):
        self._ready.clear()
        self._last_read.clear()
        self._last_write.clear()

    def load_resident(self, host):
        return host.to(device=self.device, dtype=self.dtype)

    def _resident(self, name):
        b = self._blocks.get(name)  # a quantized lm_head stays as its blocks on the device
        if b is not None:
            w = blocks.load_resident_blocks(self.ckpt, b, self.device)
            self.ckpt.drop_pages([name])
            self.counters.add_resident(w.nbytes)
            return w
        t = self._q8.get(name)  # a q8 lm_head stays q8 on the device
        if t is None:
            w = super()._resident(name)
            self.ckpt.drop_pages([name])  # on the device now: its pages leave the mapping (and the RSS)
            return w
        w = q8.load_resident_q8(self.ckpt, t, self.device)
        self.counters.add_resident(w.nbytes)
        return w

    def linear(self, x, w):
        if isinstance(w, q8.Q8Weight):
            return q8.q8_linear(x, w)  # T == 1: the csrc kernel; T > 1: dequantize + matmul
        if isinstance(w, blocks.BlockWeight):
            return blocks.block_linear(x, w, self.gguf_int8)
        return F.linear(x, w)

    def prompt_linear(self, prompt_from):
        if self.gguf_prompt_int8 == self.gguf_int8:
            return self.linear
        return functools.partial(self._linear_by_kind, prompt_from=prompt_from)

    def _linear_by_kind(self, x, w, prompt_from):
        """A pass's rows before ``prompt_from`` through the decode rows' GGUF kernels, the rest (a prompt's) through
        the prompt's (``gguf_kernels = "auto"``: float, then int8 on the tensor cores)."""
        if not isinstance(w, blocks.BlockWeight):
            return self.linear(x, w)
        return blocks.block_linear(x, w, self.gguf_int8, prompt_from=prompt_from, prompt_int8=self.gguf_prompt_int8)

    def synchronize(self):
        torch.cuda.synchronize(self.device)

    def mark(self):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def elapsed_ms(self, start, stop):
        """CUDA events on the compute stream (which waits on every upload it reads)."""
        stop.synchronize()
        return start.elapsed_time(stop)

    def wait(self, mark):
        mark.synchronize()

    def memory_stats(self):
        return {
            "device_peak_bytes": torch.cuda.max_memory_allocated(self.device) + RawBlock.peak_bytes,
            "device_peak_allocated_bytes": torch.cuda.max_memory_allocated(self.device),
            "device_peak_reserved_bytes": torch.cuda.max_memory_reserved(self.device),
            "raw_peak_bytes": RawBlock.peak_bytes,
            "budget_bytes": self.budget,
            "host_pinned_bytes": self.host_pinned_bytes,
            "host_budget_bytes": self.host_budget.bytes,
            "gguf_dequantized_entries": len(self.dequantized_entries),
            **self._ring_stats(),
        }

    def _ring_stats(self) -> dict[str, int]:
        """Where the host ring's staged bytes came from, counted since the run opened (none without a ring)."""
        if self._stager is None:
            return {}
        f = self._stager.filler
        return {"host_ring_hot_bytes": f.hot_bytes, "host_ring_cold_bytes": f.cold_bytes,
                "host_ring_disk_read_bytes": f.disk_bytes_read}

    def close(self):
        super().close()
        self._host = {}
        if self._stager is not None:
            torch.cuda.synchronize(self.device)  # every upload from a slot is done before the ring unpins
            self._stager.close()
            self._stager.ring.close()
            self._stager = None
        self._forget_events()


@attrs.define
class Staging:
    """Every unit's host copy (entry source -> pinned tensor) and the bytes they pin. ``close`` lets go of them
    and hands torch's cached pinned blocks back (torch keeps a freed pinned block for reuse, still locked);
    a block a live run still reads stays."""

    host: dict
    pinned_bytes: int

    def close(self) -> None:
        self.host = {}
        self.pinned_bytes = 0
        release_cached_pinned()



def _pinned(host) -> bool:
    return (host.raw if isinstance(host, (q8.Q8Weight, blocks.BlockWeight)) else host).is_pinned()
