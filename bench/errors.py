"""Why a scenario cannot run, said in one line."""

from __future__ import annotations


class BenchError(Exception):
    """A reason a scenario cannot run, said in one line (no traceback)."""


class Said(BenchError):
    """A reason a scenario stopped that a command it ran has already said on stderr (kestrel's own error line): the
    record holds it, and it is not printed again."""


def cuda_missing() -> str | None:
    """Why a GPU scenario cannot run here, or None."""
    import torch

    if torch.cuda.is_available():
        return None
    return "needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is False)"


def cuda_backend_missing(args, on_cpu: str = "--backend cpu_ref --preset tiny") -> str | None:
    """A scenario with ``--backend``: why its cuda rows cannot run here (with the flags that run it on the CPU), or
    None (a GPU is here, or the backend is cpu_ref)."""
    if args.backend != "cuda":
        return None
    why = cuda_missing()
    return f"{why}; on the CPU: {on_cpu}" if why else None
