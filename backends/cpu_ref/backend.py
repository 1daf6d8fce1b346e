"""cpu_ref: upload copies a layer from the mapping into float32 buffers; evict releases them and drops the pages.

While a layer is resident its mapped pages stay touched, so the mapping's RSS in
/proc/self/smaps follows the window; ``MADV_DONTNEED`` takes them out again.
"""

from __future__ import annotations

import torch

from kestrel_core.backend import Backend, BackendContext
from kestrel_core.errors import ConfigError
from kestrel_core.model import linear_specs
from kestrel_core.residency import Geometry

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


class CpuRefBackend(Backend):
    name = "cpu_ref"

    def __init__(self, ctx: BackendContext):
        super().__init__(ctx)
        want = ctx.backend.dtype or "float32"
        if want not in _DTYPES:
            raise ConfigError(f"cpu_ref computes in {' or '.join(_DTYPES)}, not {want!r}; set [backend] dtype")
        if ctx.backend.prefetch:
            raise ConfigError("cpu_ref has no side stream to prefetch on; set prefetch = 0 for this backend")
        self.dtype = _DTYPES[want]
        self.device = torch.device("cpu")
        self._specs = [linear_specs(self.cfg, layer) for layer in range(self.cfg.num_hidden_layers)]
        self.load_globals()

    def layer_sources(self, layer):
        item = torch.empty((), dtype=self.dtype).element_size()
        for role, (name, shape) in self._specs[layer].items():
            nbytes = shape[0] * shape[1] * item
            yield role, name, Geometry(tuple(shape), str(self.dtype), nbytes, "cpu")

    def fill(self, buffer, source):
        buffer.copy_(self.ckpt.view(source))  # touches the mapped pages

    def new_buffer(self, geometry):
        return torch.empty(geometry.shape, dtype=self.dtype)

    def free_buffer(self, buffer):
        # Dropping the last reference frees it for real (large blocks go back to the OS).
        del buffer

    def load_resident(self, host):
        return host.to(self.dtype, copy=True)

    def after_evict(self, layer):
        self.ckpt.drop_pages([name for name, _ in self._specs[layer].values()])

    def memory_stats(self):
        return {"mapping_rss_bytes": self.ckpt.mapping_rss()}
