"""Where kestrel's Triton kernels (the grouped experts, the GGUF blocks) can run: one rule for all of them."""

from __future__ import annotations

import functools


@functools.cache
def available() -> str | None:
    """None where the kernels can run here, else why not (one line)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    return None
