"""Why a scenario cannot run, said in one line."""

from __future__ import annotations


class BenchError(Exception):
    """A reason a scenario cannot run, said in one line (no traceback)."""


def cuda_missing() -> str | None:
    """Why a GPU scenario cannot run here, or None."""
    import torch

    if torch.cuda.is_available():
        return None
    return "needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is False)"
