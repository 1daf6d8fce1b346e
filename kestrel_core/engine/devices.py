"""Where tensors are computed: a ``--device`` name checked once, with an error a user can act on."""

from __future__ import annotations

import torch

from kestrel_core.errors import ConfigError


def compute_device(name: str, flag: str = "--device") -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N``, present on this machine."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(f"{flag} {name!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        if device.index not in (None, 0):  # torch takes cpu:N for any N, but the host's CPU is one device, cpu:0
            use = "cpu for each rank (cpu,cpu)" if flag == "--devices" else "cpu"
            raise ConfigError(f"{flag} {name} names no device: the host's CPU is one device, cpu (or cpu:0); use {use}")
        return device
    if device.type != "cuda":
        raise ConfigError(f"{flag} {name!r}: kestrel computes on cpu or cuda, not {device.type}")
    if not torch.cuda.is_available():
        raise ConfigError(f"{flag} {name} needs an NVIDIA GPU and a CUDA build of torch; none is visible here, use {flag} cpu")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ConfigError(f"{flag} {name}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
    return device
