"""The device weight-cache budget rule: half of free memory, capped at 24 GiB, floor 256 MiB; overridable.

Pure arithmetic, shared by whatever sizes a device cache (the cuda backend) and whatever
reasons about one (a plugin): ``KESTREL_WCACHE_MB`` beats the config's ``budget_mb``, which
beats the default.
"""

from __future__ import annotations

import os

from .errors import ConfigError

CAP = 24 * 2**30
FLOOR = 256 * 2**20
ENV = "KESTREL_WCACHE_MB"


def default_budget(free_bytes: int) -> int:
    return max(FLOOR, min(CAP, free_bytes // 2))


def env_mib(name: str) -> int | None:
    """The bytes an environment variable gives in whole MiB (a budget that beats the config), or None where unset."""
    env = os.environ.get(name)
    if not env:
        return None
    try:
        mb = int(env)
    except ValueError:
        raise ConfigError(f"{name}={env!r} must be a whole number of MiB") from None
    if mb <= 0:
        raise ConfigError(f"{name}={mb} must be positive")
    return mb * 2**20


def resolve_budget(config_mb: int, free_bytes: int) -> tuple[int, str]:
    """(budget bytes, where it came from): KESTREL_WCACHE_MB beats the config, which beats the default."""
    env = env_mib(ENV)
    if env is not None:
        return env, ENV
    if config_mb < 0:
        raise ConfigError(f"budget_mb must be >= 0 (0 means the default), got {config_mb}")
    if config_mb:
        return config_mb * 2**20, "config"
    return default_budget(free_bytes), "default (half of free device memory, 256 MiB..24 GiB)"
