"""cpu_ref: a fetch copies a unit from the mapping into compute-dtype buffers; retiring it drops the pages.

While a unit is resident its mapped pages stay touched, so the mapping's RSS in
/proc/self/smaps follows the window; ``MADV_DONTNEED`` takes them out again.

A q8 checkpoint is dequantized on upload (W[n, k] = qweight[k, n] * scales[k // g, n])
into the same [N, K] compute-dtype buffers, so the math after upload is the float path's.

With ``[backend] host_kernels = "auto"`` a GGUF's linears of the types the host GGUF kernel computes (Q8_0, Q4_0,
Q4_K, Q6_K; ``host_gguf``) are held as the file's blocks instead: a fetch copies the stored bytes once into the unit's
uint8 buffer (``HostBlocks``), and ``linear`` runs ``host_gguf.matmul`` on them (x quantized to 8 bits a block, as
ggml's ``vec_dot``; each row of x computed alone, so a row's result never depends on its companions). Its pages stay
touched while the unit is resident and go when it retires, as on the float path.
"""

from __future__ import annotations

import math
import os
import warnings

import attrs
import torch
import torch.nn.functional as F

from kestrel_core.formats import quant
from kestrel_core.engine.backend import Backend, BackendContext
from kestrel_core.engine.devices import compute_device
from kestrel_core.engine.fit import FitFacts, given_budget, layers_peak, moe_facts, refuse_over_budget
from kestrel_core.engine.host import meminfo
from kestrel_core.engine.kvcache import kv_bytes
from kestrel_core.engine.landing import landings
from kestrel_core.engine.plan import Fetch
from kestrel_core.engine.pipeline import host_ranks, host_share
from kestrel_core.formats.tensor_table import global_specs, small_specs
from kestrel_core.formats.dtypes import compute_dtype, itemsize
from kestrel_core.errors import ConfigError, KestrelNote
from kestrel_core.config import HOST_ENV, BackendConfig, check_environment
from kestrel_core.engine.model import expert_mlp
from kestrel_core.formats.gguf_model import BlockTensor, block_tensors
from kestrel_core.formats.units import EntrySpec, Geometry, is_expert

from . import host_gguf

DTYPES = ("float32", "float64")
BLOCKS = "gguf-blocks"  # a HostBlocks buffer's Geometry dtype


class HostBlocks:
    """One linear W [n, k] held as the file's ``qtype`` blocks: ``raw`` uint8 [n * row bytes], rows in Hugging Face
    order (``GGUFCheckpoint.blocks``)."""

    __slots__ = ("raw", "qtype", "n", "k")

    def __init__(self, raw: torch.Tensor, qtype, n: int, k: int):
        self.raw, self.qtype, self.n, self.k = raw, qtype, n, k

    @classmethod
    def of(cls, geometry: Geometry) -> "HostBlocks":
        qtype, n, k = geometry.layout
        return cls(torch.empty(geometry.shape, dtype=torch.uint8), qtype, n, k)

    def numel(self) -> int:
        return self.raw.numel()

    def element_size(self) -> int:
        return 1


def block_geometry(t: BlockTensor) -> Geometry:
    return Geometry((t.nbytes,), BLOCKS, t.nbytes, "cpu", (t.qtype, t.n, t.k))


def held_blocks(ctx: BackendContext, note: bool) -> dict[str, BlockTensor]:
    """``host_kernels = "auto"``: the GGUF linears cpu_ref holds as the file's blocks (none where the host kernel cannot
    build: with ``note``, a note says why, and they dequantize as with "off")."""
    if ctx.backend.host_kernels != "auto":
        return {}
    found = block_tensors(ctx.checkpoint, ctx.model, host_gguf.HELD)
    if not found:
        return {}
    why = host_gguf.usable()
    if why is not None:
        if note:
            warnings.warn(f"host_kernels = 'auto': the host GGUF kernel cannot run here ({why}); cpu_ref dequantizes "
                          "this GGUF's blocks to float32 on each fetch instead, as with 'off'", KestrelNote, stacklevel=3)
        return {}
    return found


class CpuRefBackend(Backend):
    name = "cpu_ref"
    expert_table = True  # a dict: an expert's resident buffers, or (absent) its host copy, the checkpoint mapping
    lands = True  # a step's misses land in the ring's slots (``engine.landing``), as cuda's kernel lands them
    row_exact = True  # the reference: a token's result is its own, whoever shares its pass (``linear``, attention)
    device_per_rank = False  # a pipeline's ranks on one host share its cores and memory bandwidth

    def __init__(self, ctx: BackendContext):
        super().__init__(ctx)
        self.dtype = compute_dtype(ctx.backend.dtype or "float32", DTYPES, self.name)
        if ctx.backend.device and compute_device(ctx.backend.device).type != "cpu":
            raise ConfigError(f"cpu_ref computes on the CPU, not on {ctx.backend.device}; use --backend cuda for a GPU")
        self.device = torch.device("cpu")
        check_environment()  # a bad KESTREL_HOST_MB or KESTREL_WCACHE_MB is an error here too, not a note
        if ctx.backend.host_budget_mb or os.environ.get(HOST_ENV):
            warnings.warn("the host budget bounds the cuda backend's pinned staging; cpu_ref pins nothing (it streams "
                          "from the checkpoint mapping, its RSS bounded by keep), so the budget has no effect here",
                          KestrelNote, stacklevel=2)
        if ctx.backend.layer_ops == "fused":
            warnings.warn("layer_ops = 'fused' picks the cuda backend's fused kernels; cpu_ref, the reference, computes "
                          "a layer's steps with torch's ops, so it has no effect here", KestrelNote, stacklevel=2)
        if ctx.backend.gguf_kernels != attrs.fields(BackendConfig).gguf_kernels.default:
            warnings.warn(f"gguf_kernels = {ctx.backend.gguf_kernels!r} picks the cuda backend's GGUF kernels; cpu_ref "
                          "computes a GGUF's blocks with its host kernel or from their float32 dequantization "
                          "(host_kernels), so it has no effect here",
                          KestrelNote, stacklevel=2)
        self.quant = ctx.quant  # read and checked once, when the Model opened
        self._q8 = self.quant.tensors if self.quant else {}
        self._blocks = held_blocks(ctx, note=True)  # a GGUF's linears the host kernel computes, held as their blocks
        self._q8 = {n: t for n, t in self._q8.items() if n not in self._blocks}  # a Q8_0 unit: blocks, not q8
        self.lay_out_units()
        self._check_budget(ctx)
        self._live: set[str] = set()  # the tensors whose mapped pages stay touched: resident units, and the globals
        self._table: dict[tuple, dict] = {}  # expert unit -> the weights its slot holds; absent: read the host copy
        self._ring: list | None = None  # the landing ring's slots (buffers), where the run lands misses
        self._ring_state = torch.zeros(1, dtype=torch.long)  # its head, then each slot's owner
        self._ring_tail = 0
        self.load_globals()
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(ctx.backend.threads or default_threads())  # for this run; close() gives the old count back

    def _check_budget(self, ctx: BackendContext) -> None:
        """A budget the user gave (``--budget-mb`` / KESTREL_WCACHE_MB), or the one keep = "auto" fitted the run to,
        bounds the resident layers as on cuda: ``fit.refuse_over_budget``."""
        given = ctx.fitted_budget or given_budget(ctx.residency.budget_mb)
        if given is None:
            return
        facts = self.fit_facts(ctx)
        refuse_over_budget(*given, facts.what, facts.fixed, facts.peak_bytes, self.cfg.num_hidden_layers,
                           ctx.residency.windowed, ctx.peak_layers, ctx.keep_peak, self.prefetch_depth)

    def close(self):
        super().close()
        torch.set_num_threads(self._threads_before)

    @classmethod
    def fit_facts(cls, ctx: BackendContext) -> FitFacts | None:
        """The host budget for resident layers: the one the user gave (``--budget-mb`` / KESTREL_WCACHE_MB, read as
        cuda reads it: ``fit.given_budget``), else half of the host's available memory (less what the KV cache leaves
        of it); against each unit as this backend holds it (``layout``): the file's blocks where the host kernel
        computes them (``host_kernels = "auto"``), else the compute dtype (a fetch dequantizes). None: no budget
        given and no available memory to read."""
        available = meminfo().get("MemAvailable", 0)
        given = given_budget(ctx.residency.budget_mb)
        if not available and given is None:
            return None
        dtype = compute_dtype(ctx.backend.dtype or "float32", DTYPES, cls.name)
        item = itemsize(dtype)
        blocks = held_blocks(ctx, note=False)  # the run's own note says where the kernel cannot run

        def held(name: str, shape) -> int:
            return blocks[name].nbytes if name in blocks else math.prod(shape) * item

        layers: dict[int, int] = {}
        own, experts = [], []
        for spec in ctx.unit_specs:
            nbytes = sum(held(name, s) for name, s in spec.tensors.values())
            layers[spec.layer] = layers.get(spec.layer, 0) + nbytes
            (experts if is_expert(spec.key) else own).append(nbytes)
        cfg = ctx.model
        fixed = sum(held(name, s) for name, s in global_specs(cfg).values())
        fixed += sum(math.prod(s) for layer in range(cfg.num_hidden_layers) for _, s in small_specs(cfg, layer).values()) * item
        mine, share = host_share(available)  # a pipeline's ranks on this host share its memory
        budget, source = given if given is not None else (mine // 2, f"half of the host's available memory{share}")
        return FitFacts(budget, source, "host budget for resident layers", fixed, cfg.num_hidden_layers,
                        layers_peak(list(layers.values()), own, experts, ctx.residency, cfg),
                        **moe_facts(ctx.residency, cfg, own, experts),
                        room=mine if available else None, room_what=f"of the host's available memory{share}",
                        kv_bytes=lambda slots, positions: kv_bytes(cfg, positions, dtype, slots))

    def layout(self, spec):
        item = itemsize(self.dtype)
        for role, (name, shape) in spec.tensors.items():
            b = self._blocks.get(name)
            if b is not None:  # the file's blocks, as stored
                yield EntrySpec(role, block_geometry(b), name)
                continue
            nbytes = shape[0] * shape[1] * item  # the resident buffer: [N, K] in compute dtype
            q8 = self._q8.get(name)
            if q8 is None:
                yield EntrySpec(role, Geometry(tuple(shape), str(self.dtype), nbytes, "cpu"), name)
            else:
                yield EntrySpec(role, Geometry(tuple(shape), str(self.dtype), nbytes, "cpu", q8.layout), q8)

    def fill(self, buffer, source):
        if isinstance(buffer, HostBlocks):
            buffer.raw.copy_(self.ckpt.blocks(source).reshape(-1))  # touches the mapped pages, as a float copy does
        elif isinstance(source, quant.Q8Tensor):
            self._dequantize(buffer, source)
        else:
            buffer.copy_(self.ckpt.view(source))  # touches the mapped pages

    def _dequantize(self, out, q8):
        return quant.dequantize_into(out, *quant.read_q8(self.ckpt, q8), q8.group)

    def _resident(self, name):
        b = self._blocks.get(name)  # a quantized lm_head: its blocks, copied once, resident for the run
        if b is not None:
            w = HostBlocks(self.ckpt.blocks(name).reshape(-1).clone(), b.qtype, b.n, b.k)
            self.counters.add_resident(w.numel())
            self.ckpt.drop_around([name], self._live)
            return w
        q8 = self._q8.get(name)  # a q8 lm_head: dequantized once, resident for the run
        if q8 is None:
            self._live.add(name)
            return super()._resident(name)
        t = self._dequantize(torch.empty((q8.n, q8.k), dtype=self.dtype), q8)
        self.counters.add_resident(t.numel() * t.element_size())
        self.ckpt.drop_pages(list(q8.stored))
        return t

    def new_buffer(self, geometry, raw=False):
        if geometry.dtype == BLOCKS:
            return HostBlocks.of(geometry)
        return torch.empty(geometry.shape, dtype=self.dtype)  # the CPU allocator has no cache to bypass

    def free_buffer(self, buffer):
        # Dropping the last reference frees it for real (large blocks go back to the OS).
        del buffer

    def load_resident(self, host):
        return host.to(self.dtype, copy=True)

    def fill_unit(self, fetch):
        super().fill_unit(fetch)
        names = _names(fetch.unit)
        self._live.update(names)
        self.ckpt.drop_around(names, self._live)  # a fault maps a whole folio: not the neighbours' pages too

    def retire(self, resident):
        names = _names(resident.unit)
        self._live.difference_update(names)
        self.ckpt.drop_around(names, self._live)  # its pages, and any of its neighbours' that a fill mapped


    def memory_stats(self):
        return {"mapping_rss_bytes": self.ckpt.mapping_rss()}

    @staticmethod
    def linear(x, w):
        """Row by row: a row's result never depends on the rows beside it (a GEMM's blocking changes with its M, and its
        rounding with it), so a sequence's ids in a batch are its ids alone, bitwise. A ``HostBlocks`` weight runs the
        host GGUF kernel on every row at once: it quantizes and reduces each row of x alone, in one order."""
        if isinstance(w, HostBlocks):
            lead = x.shape[:-1]
            y = host_gguf.matmul(x.reshape(-1, w.k), w.raw, w.qtype, w.n, w.k)
            return y.to(x.dtype).reshape(*lead, w.n)
        if x.shape[0] == 1:
            return F.linear(x, w)
        return torch.cat([F.linear(x[i : i + 1], w) for i in range(x.shape[0])])

    def point_experts(self, host, slots):
        for key in host:
            self._table.pop(key, None)
        for key, buffers in slots:
            self._table[key] = {e.name: b for e, b in zip(self.units[key].entries, buffers)}

    def landing_open(self, size, staged=0):  # a step reads its host copies where they are: nothing to stage
        self._ring = [None] * size
        self._ring_state = torch.full((1 + size,), -1, dtype=torch.long)
        self._ring_state[0] = 0
        self._ring_tail = 0

    def landing_fill(self, filled, tail):
        for position, buffers in filled:
            self._ring[position % len(self._ring)] = buffers
        self._ring_tail = tail

    def landing_state(self):
        return self._ring_state

    def _land(self, layer, chosen):
        """``engine.landing``'s rule: each routed miss, in expert order, into the ring's next slot while there is one."""
        state, size, n = self._ring_state, len(self._ring), self.cfg.num_experts
        head = int(state[0])
        for e, position in landings(chosen.flatten().tolist(), lambda e: (layer, e) not in self._table, head,
                                    self._ring_tail):
            key, buffers = (layer, e), self._ring[position % size]
            self.fill_unit(Fetch(self.units[key], buffers, ahead=False))
            self._table[key] = {entry.name: b for entry, b in zip(self.units[key].entries, buffers)}
            state[1 + position % size] = layer * n + e
            head = position + 1
        state[0] = head

    def routed_experts(self, layer, x, weights, chosen):
        """Row by row, each in expert order, as ``model.sparse_mlp`` sums one token's experts: bitwise a row's result
        alone on the same weights, whatever the rows beside it. An expert read from its host copy is read once a
        step, whichever rows it serves. Where the run lands misses, each lands in a ring slot first and is read there."""
        if self._ring is not None:
            self._land(layer, chosen)
        out = torch.zeros_like(x)
        host: dict = {}
        for row in range(x.shape[0]):
            for slot, e in sorted(enumerate(chosen[row].tolist()), key=lambda se: se[1]):
                w = self._table.get((layer, e))
                if w is None:
                    w = host.get(e) or host.setdefault(e, self._host_copy((layer, e)))
                out[row:row + 1] += expert_mlp(x[row:row + 1], w, self.linear) * weights[row:row + 1, slot, None]
        return out

    def _host_copy(self, key) -> dict:
        """An expert read from the mapping for one use, as a fetch would fill it; its pages go again after."""
        unit = self.units[key]
        w = {}
        for e in unit.entries:
            w[e.name] = self.new_buffer(e.geometry)
            self.fill(w[e.name], e.source)
        self.ckpt.drop_around(_names(unit), self._live)
        return w


def _names(unit) -> list[str]:
    """The checkpoint tensors behind a unit's entries."""
    return [n for e in unit.entries for n in (e.source.stored if isinstance(e.source, quant.Q8Tensor) else (e.source,))]


def default_threads() -> int:
    """The torch threads a run computes on where none are given: the cores this process may use, shared among the
    ranks of a pipeline on this host (each rank computing on every core would make the ranks' threads wait on each
    other), at least 1."""
    return max(1, usable_cores() // host_ranks())


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask; a container's CPU set), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)

