"""Open a model directory and assemble one run: policy, allocator and backend resolved once."""

from __future__ import annotations

import contextlib
from pathlib import Path

import attrs

from . import plugins
from .backend import Backend, BackendContext
from .checkpoint import Checkpoint
from .config import OFF, KestrelConfig
from .errors import ConfigError, KestrelError
from .model import validate_checkpoint
from .modelconfig import ModelConfig, read_model_config
from .quant import read_quant
from .residency import Counters, Window
from .tokenizer import Tokenizer, load_tokenizer


class Model:
    """A Hugging Face model directory: config.json, safetensors (mmap'd), optional tokenizer.json."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        self.config: ModelConfig = read_model_config(self.dir)
        self.checkpoint = Checkpoint(self.dir)
        self.quant = read_quant(self.checkpoint, self.config)  # None for a float checkpoint
        validate_checkpoint(self.checkpoint, self.config, self.quant.names if self.quant else frozenset())
        self.tokenizer: Tokenizer | None = load_tokenizer(self.dir)
        self.shared: dict = {}  # backend host staging, reused by every run on this model

    @property
    def n_layers(self) -> int:
        return self.config.num_hidden_layers

    def close(self) -> None:
        self.shared.clear()
        self.checkpoint.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def make_policy(name: str, keep, n_layers: int):
    """The policy object for one run; ``keep='off'`` means no window whatever the policy (whose name must exist all the same)."""
    reg = plugins.lookup("policies", name)
    if keep == OFF or name == OFF:
        return plugins.lookup("policies", OFF).factory(n_layers=n_layers, keep=OFF)
    if not 1 <= keep <= n_layers:
        raise ConfigError(f"keep={keep} is out of range for a {n_layers}-layer model: use 1..{n_layers} or 'off'")
    return reg.factory(n_layers=n_layers, keep=keep)


def make_allocator(name: str, counters: Counters, slots: int):
    if slots < 0:
        raise ConfigError(f"pool_slots must be >= 0, got {slots}")
    return plugins.lookup("allocators", name).factory(counters=counters, slots=slots)


@attrs.define
class Run:
    model: Model
    config: KestrelConfig
    backend: Backend
    window: Window
    policy: object
    allocator: object
    counters: Counters


@contextlib.contextmanager
def open_run(model: Model, config: KestrelConfig):
    """Resolve plugins once, build the backend, and tear everything down afterwards."""
    res = config.residency
    counters = Counters()
    policy = make_policy(res.policy, res.keep, model.n_layers)
    if config.backend.prefetch and not res.windowed:
        raise ConfigError(f"prefetch = {config.backend.prefetch} needs a window, but keep is off (every layer stays "
                          "resident); set keep to a layer count, or prefetch = 0")
    allocator = make_allocator(res.allocator, counters, res.pool_slots)
    backend_reg = plugins.lookup("backends", config.backend.name)
    with plugins.activated(policy, allocator):
        peak = policy.peak_layers() if hasattr(policy, "peak_layers") else model.n_layers
        ctx = BackendContext(model.checkpoint, model.config, config.backend, res, counters, peak, model.shared, model.quant)
        try:
            backend = backend_reg.factory(ctx)
        except MemoryError:
            raise KestrelError(f"out of host memory while loading {model.dir}; free memory or use a smaller model") from None
        window = Window(backend, policy, model.n_layers)
        try:
            yield Run(model, config, backend, window, policy, allocator, counters)
        finally:
            window.release_all()
            drain = getattr(allocator, "drain", None)
            if drain:
                drain()
            backend.close()
