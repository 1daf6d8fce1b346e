"""Building kestrel's CUDA C++ extensions (csrc/) with torch.utils.cpp_extension, for the current device's arch.

One rule for every extension: compiled on first use for this GPU's compute capability (``KESTREL_CUDA_ARCH=9.0``
overrides it), cached by torch in its extensions directory, and a failure of any kind (no nvcc, no host compiler, a
compile error) turns into one line that names what is missing; ``KESTREL_BUILD_VERBOSE=1`` shows the build's log.
"""

from __future__ import annotations

import os

import torch


def arch() -> str:
    env = os.environ.get("KESTREL_CUDA_ARCH")
    if env:
        return env
    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor}"


def build(stem: str, sources: list[str], label: str):
    """The loaded module ``{stem}_sm{arch}`` from csrc's ``sources``; raises RuntimeError with a one-line reason."""
    from torch.utils.cpp_extension import load

    from csrc import SOURCE_DIR

    cc = arch()
    saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = cc
    try:
        return load(
            name=f"{stem}_sm{cc.replace('.', '')}",
            sources=[str(SOURCE_DIR / s) for s in sources],
            extra_include_paths=[str(SOURCE_DIR)],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", "-lineinfo"],
            verbose=os.environ.get("KESTREL_BUILD_VERBOSE") == "1",
        )
    except Exception as exc:  # a compiler or loader failure of any kind
        first = str(exc).strip().splitlines()
        detail = first[-1] if first else type(exc).__name__
        raise RuntimeError(
            f"{label} did not build ({type(exc).__name__}: {detail[:300]}); it needs nvcc matching torch's CUDA "
            f"{torch.version.cuda} (CUDA_HOME) and a host C++ compiler; KESTREL_BUILD_VERBOSE=1 shows the log") from exc
    finally:
        if saved is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = saved
