"""The CPU reference backend: weights stream from an mmap of the checkpoint; eviction is MADV_DONTNEED."""

from kestrel_core.hookspecs import hookimpl


@hookimpl
def register_backends(register):
    from .backend import CpuRefBackend

    register("cpu_ref", CpuRefBackend)
