"""Host copies that outlive one run: what a backend stages in host memory once per opened model.

A sweep opens many runs on one model; the CUDA backend pins each layer once and every run
reuses it. The store is the model's, so closing the model frees it.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable


class HostStore:
    def __init__(self) -> None:
        self._items: dict[Hashable, Any] = {}

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The item under ``key`` (e.g. ("cuda-pinned", dtype)), made on first use."""
        if key not in self._items:
            self._items[key] = make()
        return self._items[key]

    def peek(self, key: Hashable) -> Any:
        """The item under ``key`` if one was made, else None (nothing is made)."""
        return self._items.get(key)

    def discard(self, key: Hashable) -> None:
        """Drop one item, closing it where it can be closed (a pinned staging unpins)."""
        item = self._items.pop(key, None)
        if hasattr(item, "close"):
            item.close()

    def clear(self) -> None:
        for key in list(self._items):
            self.discard(key)


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (empty where there is none): MemTotal, MemAvailable, ..."""
    out = {}
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                key, rest = line.split(":", 1)
                out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out
