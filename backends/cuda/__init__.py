"""The CUDA backend (a device weight cache); registered always, usable where a GPU is present."""

from kestrel_core.hookspecs import hookimpl


@hookimpl
def register_backends(register):
    from .backend import CudaBackend

    register("cuda", CudaBackend)
