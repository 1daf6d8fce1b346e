"""Building kestrel's C++ and CUDA extensions (this folder's sources) with torch.utils.cpp_extension: one rule for all.

An ``Extension`` is built on first use, once a process (torch caches the build in its extensions directory), for
this GPU's compute capability where it has CUDA sources (``KESTREL_CUDA_ARCH=9.0`` overrides it). A reason it cannot
run here (a precondition's, or a failed build of any kind: no nvcc, no host compiler, a compile error) is cached as
one line that names what is missing, and ``KESTREL_BUILD_VERBOSE=1`` shows the build's log.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

from csrc import SOURCE_DIR


def cuda_arch() -> str:
    env = os.environ.get("KESTREL_CUDA_ARCH")
    if env:
        return env
    import torch

    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor}"


class Extension:
    """``name``'s module from ``sources``: ``load()`` builds it (or raises RuntimeError with the one-line reason it
    cannot run here), ``usable()`` is that reason or None. ``check`` gives a reason not to try before any build."""

    def __init__(self, name: str, sources: list[str], label: str, *, cuda: bool, cflags: tuple[str, ...] = ("-O3",),
                 check: Callable[[], str | None] | None = None, loaded: Callable[[object], None] | None = None):
        self.name, self.sources, self.label, self.cuda = name, sources, label, cuda
        self.cflags, self.check, self.loaded = list(cflags), check, loaded
        self._lock = threading.Lock()
        self._module = None
        self._error: str | None = None

    def build(self):
        """Compile (or find torch's cached build) and load; RuntimeError with one line where that fails."""
        from torch.utils.cpp_extension import load

        kw: dict = {}
        name = self.name
        if self.cuda:
            import torch

            arch = cuda_arch()
            name = f"{name}_sm{arch.replace('.', '')}"
            kw = dict(extra_include_paths=[str(SOURCE_DIR)], extra_cuda_cflags=["-O3", "-lineinfo"])
        saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
        if self.cuda:
            os.environ["TORCH_CUDA_ARCH_LIST"] = arch
        try:
            t0 = time.perf_counter()
            module = load(name=name, sources=[str(SOURCE_DIR / s) for s in self.sources], extra_cflags=self.cflags,
                          verbose=os.environ.get("KESTREL_BUILD_VERBOSE") == "1", **kw)
            took = time.perf_counter() - t0
            if took > 5:  # a compile, not torch's cached build: say where the pause went
                print(f"kestrel: built {self.label} in {took:.0f} s (torch caches it for later runs)", file=sys.stderr)
            return module
        except Exception as exc:  # a compiler or loader failure of any kind
            lines = str(exc).strip().splitlines()
            detail = lines[-1] if lines else type(exc).__name__
            needs = (f"nvcc matching torch's CUDA {torch.version.cuda} (CUDA_HOME) and a host C++ compiler" if self.cuda
                     else "a C++ compiler (c++ or CXX) and torch's headers")
            raise RuntimeError(f"{self.label} did not build ({type(exc).__name__}: {detail[:300]}); it needs {needs}; "
                               "KESTREL_BUILD_VERBOSE=1 shows the log") from exc
        finally:
            if self.cuda:
                if saved is None:
                    os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
                else:
                    os.environ["TORCH_CUDA_ARCH_LIST"] = saved

    def load(self):
        if self._module is not None:
            return self._module
        with self._lock:
            if self._module is None and self._error is None:
                why = self.check() if self.check else None
                if why:
                    self._error = why
                else:
                    try:
                        module = self.build()
                        if self.loaded:
                            self.loaded(module)
                        self._module = module
                    except RuntimeError as exc:
                        self._error = str(exc)
            if self._module is None:
                raise RuntimeError(self._error)
            return self._module

    @property
    def built(self):
        """The module where it is built already, else None (never builds)."""
        return self._module

    def usable(self) -> str | None:
        """None where the extension runs here, else why not, in one line (builds it on the first call)."""
        try:
            self.load()
        except RuntimeError as exc:
            return str(exc)
        return None

    def forget(self) -> None:
        """Drop what is cached (built module or reason), so the next ``load`` decides again (for tests)."""
        with self._lock:
            self._module, self._error = None, None
