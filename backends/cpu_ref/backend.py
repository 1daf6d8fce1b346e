"""cpu_ref: a fetch copies a unit from the mapping into compute-dtype buffers; retiring it drops the pages.

While a unit is resident its mapped pages stay touched, so the mapping's RSS in
/proc/self/smaps follows the window; ``MADV_DONTNEED`` takes them out again.

A q8 checkpoint is dequantized on upload (W[n, k] = qweight[k, n] * scales[k // g, n])
into the same [N, K] compute-dtype buffers, so the math after upload is the float path's.
"""

from __future__ import annotations

import os
import warnings

import torch

from kestrel_core import quant
from kestrel_core.backend import Backend, BackendContext
from kestrel_core.devices import compute_device
from kestrel_core.dtypes import compute_dtype, itemsize
from kestrel_core.errors import ConfigError, KestrelNote
from kestrel_core.config import HOST_ENV, WCACHE_ENV, check_environment
from kestrel_core.units import EntrySpec, Geometry

DTYPES = ("float32", "float64")


class CpuRefBackend(Backend):
    name = "cpu_ref"

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
        if ctx.residency.budget_mb or os.environ.get(WCACHE_ENV):  # as silent as the host budget was, before
            warnings.warn("the weight-cache budget bounds the cuda backend's device cache; cpu_ref's resident layers "
                          "are bounded by keep, so the budget has no effect here", KestrelNote, stacklevel=2)
        self.quant = ctx.quant  # read and checked once, when the Model opened
        self._q8 = self.quant.tensors if self.quant else {}
        self.lay_out_units()
        self._live: set[str] = set()  # the tensors whose mapped pages stay touched: resident units, and the globals
        self.load_globals()

    def layout(self, spec):
        item = itemsize(self.dtype)
        for role, (name, shape) in spec.tensors.items():
            nbytes = shape[0] * shape[1] * item  # the resident buffer: [N, K] in compute dtype
            q8 = self._q8.get(name)
            if q8 is None:
                yield EntrySpec(role, Geometry(tuple(shape), str(self.dtype), nbytes, "cpu"), name)
            else:
                yield EntrySpec(role, Geometry(tuple(shape), str(self.dtype), nbytes, "cpu", q8.layout), q8)

    def fill(self, buffer, source):
        if isinstance(source, quant.Q8Tensor):
            self._dequantize(buffer, source)
        else:
            buffer.copy_(self.ckpt.view(source))  # touches the mapped pages

    def _dequantize(self, out, q8):
        return quant.dequantize_into(out, self.ckpt.view(q8.qweight), self.ckpt.view(q8.scales), q8.group)

    def _resident(self, name):
        q8 = self._q8.get(name)  # a q8 lm_head: dequantized once, resident for the run
        if q8 is None:
            self._live.add(name)
            return super()._resident(name)
        t = self._dequantize(torch.empty((q8.n, q8.k), dtype=self.dtype), q8)
        self.counters.add_resident(t.numel() * t.element_size())
        self.ckpt.drop_pages(list(q8.stored))
        return t

    def new_buffer(self, geometry, raw=False):
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


def _names(unit) -> list[str]:
    """The checkpoint tensors behind a unit's entries."""
    return [n for e in unit.entries for n in (e.source.stored if isinstance(e.source, quant.Q8Tensor) else (e.source,))]
