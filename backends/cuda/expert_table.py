"""The cuda backend's expert table: for every expert of every sparse layer, the device addresses a decode step reads it
from, its device buffer (a slot) or its page-locked host copy, so that no decode step waits for the host.

The table is an int64 tensor [layers, experts, 2] (the ``gate_up`` and ``down`` entries' addresses) that the grouped
expert kernels read (``grouped_experts``); it starts pointing at the host copies, which the all-pinned staging keeps for
the run. Changing it is a device write in stream order. An expert admitted a step behind uploads on a stream of its own,
which no graph replay waits for; the write that points the table at its slot waits for that upload, and the runner's
schedule makes it a step later, so the wait costs nothing. A slot is refilled only after the steps that read it.
"""

from __future__ import annotations

import torch

from .grouped_experts import GroupedExperts
from .index_write import write_by_index
from .landing import LandingRing


class DeviceExpertTable:
    def __init__(self, units, host: dict, cfg, device: torch.device, grouped: GroupedExperts):
        L, E = cfg.num_hidden_layers, cfg.num_experts
        self.E, self.device = E, device
        ptrs = torch.zeros((L, E, 2), dtype=torch.int64)
        for unit in units.experts():
            for j, entry in enumerate(unit.entries):  # gate_up, then down (layout.FUSED's order)
                ptrs[unit.key[0], unit.key[1], j] = host[entry.source].data_ptr()
        self.host_ptrs = ptrs  # what a host copy's address is, kept for pointing back to it
        # GGUF block experts: each layer's (gate_up, down) layouts, which its grouped kernels are told
        self.layouts = {unit.layer: tuple(e.geometry.layout[1] for e in unit.entries)
                        for unit in units.experts() if grouped.blocks}
        self.table = ptrs.to(device)
        self.stream = torch.cuda.Stream(device)  # admissions heard a step behind: no replay waits for them
        self.ready: dict[tuple, torch.cuda.Event] = {}  # expert unit -> its admission's upload event
        self.grouped = grouped
        sizes = {tuple(e.geometry.nbytes for e in unit.entries) for unit in units.experts()}
        # a miss lands in a slot by a word copy: every expert alike, whole words
        self.entry_bytes = next(iter(sizes)) if len(sizes) == 1 and all(b % 4 == 0 for b in next(iter(sizes))) else None
        self.ring: LandingRing | None = None

    def open_ring(self, size: int, staged: int = 0) -> None:
        self.ring = LandingRing(size, self.host_ptrs, self.E, self.entry_bytes, self.device, staged)

    def point(self, host: list, slots: list, current: torch.cuda.Stream, before_use) -> None:
        """In stream order on ``current``: ``host`` experts at their host copies, ``slots`` (key, buffers) at their buffers,
        each after its upload (an admission's event, or the backend's ``before_use``)."""
        flat, vals = [], []
        for key in host:
            self._wait_admission(key, current)  # its buffer may be reused once it is evicted
            for j in (0, 1):
                flat.append((key[0] * self.E + key[1]) * 2 + j)
                vals.append(int(self.host_ptrs[key[0], key[1], j]))
        for key, buffers in slots:
            self._wait_admission(key, current)
            before_use(key)
            for j, b in enumerate(buffers):
                flat.append((key[0] * self.E + key[1]) * 2 + j)
                vals.append(b.data_ptr())
        if not flat:
            return
        table = self.table.view(-1)
        if torch.cuda.is_current_stream_capturing():  # inside a captured step: values baked into the graph
            for i, v in zip(flat, vals):
                table[i].fill_(v)
            return
        write_by_index(table, flat, vals)

    def admit(self, fetch, last_read: dict, copy) -> None:
        """Upload a heard admission on the table's own stream, after the last reader of each of its buffers."""
        for buffer in fetch.buffers:
            waits = last_read.pop(buffer.data_ptr(), None)
            if waits is not None:
                self.stream.wait_event(waits)
        with torch.cuda.stream(self.stream):
            copy(fetch, self.stream)
        ev = torch.cuda.Event()
        ev.record(self.stream)
        self.ready[fetch.unit.key] = ev

    def _wait_admission(self, key, current: torch.cuda.Stream) -> None:
        ev = self.ready.pop(key, None)
        if ev is not None:
            current.wait_event(ev)

    def retired(self, key, current: torch.cuda.Stream) -> None:
        """An expert evicted before its admission's upload was waited for: whatever reuses its buffers comes after."""
        self._wait_admission(key, current)

    def routed(self, layer: int, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Each row's routed experts through the table; a row's result is its result alone (a batched step's ids are
        its sequences' solo ids). Several rows read each expert once for all the rows routed to it (``rows``)."""
        table, layouts = self.table[layer], self.layouts.get(layer)
        landed = self.ring.land(layer, table, chosen) if self.ring is not None else None
        if x.shape[0] == 1:
            y = self.grouped(x, weights, chosen, table, layouts)
        else:
            y = self.grouped.rows(x, weights, chosen, table, layouts)
        if landed is not None:
            self.ring.restore(layer, table, landed)
        return y
