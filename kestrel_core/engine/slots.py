"""A batch's KV slots on the compute device and their growth: the positions a slot holds when a batch opens
(``first_capacity``), what it holds once its sequences reached a need (``held_positions``, the rule a gate sizes a
run's cache by), and ``Slots``: the cache, the decode state, the read-back ring and the captured steps, which the
runner alone reads and writes."""

from __future__ import annotations

import torch

from kestrel_core.engine.kvcache import allocate_cache
from kestrel_core.engine.model import RopeTable, key_bound
from kestrel_core.engine.step_graphs import StepGraphs
from kestrel_core.errors import BudgetError


class DecodeState:
    """What a decode step reads and writes on the compute device, one row a KV slot; a captured graph keeps these
    addresses. ``out`` is the row the host reads back a step late: each slot's next token, whether its logits were
    not finite, then (on a run with an expert table) each sparse layer's routed experts of each slot's row, of a step
    that read it: ``routed`` [sparse layers, slots, k], then (where the step lands its misses) the landing ring's head
    and each of its ``landing`` slots' owner: ``landed`` [1 + landing]."""

    def __init__(self, device: torch.device, rope: RopeTable, slots: int, max_seq: int, vocab: int,
                 routed: tuple[int, int] = (0, 0), landing: int = 0):
        self.slots = slots
        n = routed[0] * slots * routed[1]
        self.out = torch.zeros(2 * slots + n + (1 + landing if landing else 0), dtype=torch.long, device=device)
        self.tokens = self.out[:slots]  # each slot's token: the one its next step reads, then the one it wrote
        self.bad = self.out[slots : 2 * slots]
        self.routed = self.out[2 * slots : 2 * slots + n].view(routed[0], slots, routed[1])
        self.landed = self.out[2 * slots + n :]
        self.allowed = torch.ones((slots, vocab), dtype=torch.bool, device=device)  # the ids each row's argmax may take
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)  # where each slot's token goes
        self.live = torch.zeros(slots, dtype=torch.long, device=device)  # 1 where a slot's sequence decodes: it moves on
        self.slot_ids = torch.arange(slots, device=device)
        self.key_positions = torch.arange(max_seq, device=device)
        self.rope = rope
        self.logits: torch.Tensor | None = None  # the last step's [rows, vocab] float32


def first_capacity(max_seq: int, device: torch.device) -> int:
    """The positions each KV slot holds when a batch opens: in host memory all ``max_seq`` (zero pages the kernel maps
    as they are written: the memory follows the writes by itself), on a device the fewest a bounded step reads
    (``key_bound``), grown as the sequences reach further (``Slots.reach``), so the memory follows the positions in
    use, not ``max_seq``."""
    return max_seq if device.type == "cpu" else key_bound(1, max_seq)


def held_positions(need: int, max_seq: int, device: torch.device) -> int:
    """The positions a KV slot of ``max_seq`` holds once its sequences reached ``need`` (``first_capacity``, then
    ``Slots.reach``'s key bound), and the spare row past them (the park): what a run's cache is sized by, which a
    gate counts with ``kvcache.kv_bytes``."""
    first = first_capacity(max_seq, device)
    return (first if need <= first else key_bound(need, max_seq)) + 1


class Slots:
    """A batch's side on the compute device: ``slots`` KV slots of ``max_seq`` positions, the decode state, the ring
    its steps are read back through and the captured steps, one a row count. Made by ``Runner.open_slots``; only the
    runner reads or writes it."""

    RING = 4  # steps a read may lag behind (greedy reads one late)

    def __init__(self, runner: "Runner", slots: int, max_seq: int, fix: str = ""):
        backend, cfg = runner.backend, runner.cfg
        self.runner = runner
        self.count, self.max_seq, self.fix = slots, max_seq, fix
        self.capacity = first_capacity(max_seq, backend.device)  # the positions a slot's cache holds now (``reach``)
        # one row past them, where a parked slot's decode row writes (``park``)
        self.cache = allocate_cache(cfg, self.capacity, backend.dtype, backend.device, slots, spare=1)
        self.rope = RopeTable(cfg, max_seq + 1, backend.dtype, backend.device)
        self.state = runner.decode_state(self.rope, slots, max_seq)
        self.ring = torch.zeros((self.RING, self.state.out.numel()), dtype=torch.long,
                                pin_memory=backend.device.type == "cuda")
        self.graphs: dict[int, StepGraphs] = {}
        self.graph_logits: dict[int, torch.Tensor] = {}  # by row count: where its captured step's logits go
        self.live: dict[int, int] = {}  # what the device's live flags hold, by slot
        self.masked: set[int] = set()  # the slots whose allowed ids are a grammar's mask, not every id
        self.mask_rows: torch.Tensor | None = None  # host rows the masks go up from (pinned on cuda), made at a first mask
        self.mask_mark = None  # after the last pick's uploads from them
        self.positions = [0] * slots  # the host's copy of each slot's position: placed, then moved on where live
        self.parked: set[int] = set()  # the slots placed at the park (``Runner.park``)
        self.launched = 0
        self.t0 = None  # the mark before its first step
        self.sid = runner.opened  # its number among the run's slots (a pipeline's ranks number them alike)

    def reach(self, need: int) -> None:
        """Hold at least ``need`` positions a slot. A cache that holds fewer grows to the key bound over them (a power
        of two from ``BOUND_FLOOR``, at most ``max_seq``: ``key_bound``), its written keys and values copied over, so
        it grows a few times a run at most; every captured step baked the old buffers' addresses in, so each is
        dropped and captured again; a parked slot moves to the new park. One that cannot be had is a BudgetError
        naming the caller's fix."""
        if need <= self.capacity:
            return
        runner = self.runner
        backend, cfg = runner.backend, runner.cfg
        size = key_bound(need, self.max_seq)
        try:
            grown = allocate_cache(cfg, size, backend.dtype, backend.device, self.count, spare=1)
        except BudgetError as exc:
            raise BudgetError(f"{exc} (the cache grows as its sequences reach further){'; ' + self.fix if self.fix else ''}"
                              ) from None
        for old, new in zip(self.cache, grown):
            new.k[:, :self.capacity].copy_(old.k[:, :self.capacity])
            new.v[:, :self.capacity].copy_(old.v[:, :self.capacity])
        self.drop_graphs()
        self.cache, self.capacity = grown, size
        for slot in self.parked:
            self.state.positions[slot].fill_(self.park)
            self.positions[slot] = self.park

    @property
    def cache_bytes(self) -> int:
        """The bytes the KV cache holds now (every slot's ``capacity`` positions and the spare row, keys and values)."""
        return sum(c.k.nbytes + c.v.nbytes for c in self.cache)

    @property
    def park(self) -> int:
        """Where a parked slot's decode row writes (a prompt in chunks, a verify span, a slot with no sequence yet): the
        cache's row past the positions it holds, which no step reads."""
        return self.capacity

    def drop_graphs(self) -> None:
        for graphs in self.graphs.values():
            graphs.close()
        self.graphs.clear()
        self.graph_logits.clear()

    def close(self) -> None:
        self.drop_graphs()
        if self.runner is not None:  # the run may step another batch now
            self.runner, runner = None, self.runner
            runner.tell("close", self.sid)
            runner._busy.release()
