"""A device tensor's elements set by index from the host, in stream order: the table of expert addresses
(``expert_table``) and the landing ring's slots (``landing``) both change this way."""

from __future__ import annotations

import torch


def write_by_index(target: torch.Tensor, index: list[int], values: list[int]) -> None:
    """``target[index] = values`` (int64) in stream order: the pairs cross in one copy from page-locked memory where
    ``target`` is on a GPU, so the host need not wait for the device."""
    both = torch.tensor(index + values, dtype=torch.int64)
    if target.device.type == "cuda":
        both = both.pin_memory()
    both = both.to(target.device, non_blocking=True)
    target.index_copy_(0, both[: len(index)], both[len(index):])
