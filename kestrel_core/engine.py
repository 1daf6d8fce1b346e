"""One run: its own policy, allocator, backend, window and counters, resolved once and owned by the run.

Nothing of a run is registered in the plugin manager, so two runs open at once do not see
each other; plugins registered there are observers that see every boundary of every run.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import attrs

from . import plugins
from .backend import BackendContext
from .config import OFF, KestrelConfig, with_settings
from .contracts import Allocator, Backend, ExpertPolicy, Policy, missing_members
from .errors import ConfigError, KestrelError, PluginError
from .expert_cache import budget_bytes
from .generate import GenerationResult, generate
from .modeldir import Model, load
from .modelconfig import check_runnable
from .plan import Counters
from .residency import Window

__all__ = ["Model", "Run", "load", "make_allocator", "make_expert_policy", "make_policy", "open_run"]


def _checked(kind: str, name: str, obj: Any, protocol: type) -> Any:
    missing = missing_members(protocol, obj)
    if missing:
        raise PluginError(f"{kind} {name!r} ({type(obj).__name__}) lacks {', '.join(missing)}; "
                          f"see the {protocol.__name__} protocol in kestrel_core/contracts.py")
    return obj


def make_policy(name: str, keep, n_layers: int):
    """The policy object for one run; ``keep='off'`` means no window whatever the policy (whose name must exist all the same)."""
    reg = plugins.lookup("policies", name)
    if keep == OFF or name == OFF:
        return _checked("policy", OFF, plugins.lookup("policies", OFF).factory(n_layers=n_layers, keep=OFF), Policy)
    if not 1 <= keep <= n_layers:
        raise ConfigError(f"keep={keep} is out of range for a {n_layers}-layer model: use 1..{n_layers} or 'off'")
    return _checked("policy", name, reg.factory(n_layers=n_layers, keep=keep), Policy)


def make_allocator(name: str, counters: Counters, slots: int):
    if slots < 0:
        raise ConfigError(f"pool_slots must be >= 0, got {slots}")
    return _checked("allocator", name, plugins.lookup("allocators", name).factory(counters=counters, slots=slots), Allocator)


def make_expert_policy(res, model: Model, units):
    """The run's expert policy, or None; its budget must hold one token's routed experts (in the backend's layout)."""
    if res.expert_prefetch and not model.config.is_moe:
        raise ConfigError(f"expert_prefetch is for Mixture-of-Experts models; {model.dir} ({model.config.model_type}) "
                          "has no experts: leave --expert-prefetch off")
    if res.expert_fetch == "layer" and (res.expert_policy or res.expert_prefetch):
        raise ConfigError("expert_fetch = 'layer' fetches every expert with its layer, so there is nothing for "
                          f"{'an expert policy' if res.expert_policy else 'expert_prefetch'} to choose; "
                          "use expert_fetch = 'routed'")
    if not res.expert_policy:
        if res.expert_budget_mb:
            raise ConfigError("expert_budget_mb needs an expert policy: set --expert-policy (e.g. expert_lru)")
        return None
    cfg = model.config
    if not cfg.is_moe:
        raise ConfigError(f"expert_policy {res.expert_policy!r} is for Mixture-of-Experts models; {model.dir} "
                          f"({cfg.model_type}) has no experts")
    factory = plugins.lookup("expert_policies", res.expert_policy).factory
    if not res.expert_budget_mb > 0:
        raise ConfigError(f"expert_policy {res.expert_policy!r} needs a budget: set --expert-budget-mb to a number above 0")
    largest = max(u.nbytes for key, u in units.units.items() if len(key) == 2)
    budget = budget_bytes(res.expert_budget_mb, cfg.num_experts_per_tok, largest)
    return _checked("expert policy", res.expert_policy, factory(budget=budget), ExpertPolicy)


class Run:
    """An open run. ``with model.open(...) as run:`` closes it; so does ``run.close()``."""

    def __init__(self, model: Model, config: KestrelConfig):
        check_runnable(model.config)  # a checkpoint the runner cannot execute yet was still read and checked
        res = config.residency
        self.model, self.config = model, config
        self.counters = Counters()
        self.policy = make_policy(res.policy, res.keep, model.n_layers)
        if config.backend.prefetch and not res.windowed:
            raise ConfigError(f"prefetch = {config.backend.prefetch} needs a window, but keep is off (every layer stays "
                              "resident); set keep to a layer count, or prefetch = 0")
        self.allocator = make_allocator(res.allocator, self.counters, res.pool_slots)
        backend_reg = plugins.lookup("backends", config.backend.name)
        ctx = BackendContext(model.checkpoint, model.config, config.backend, res, self.counters,
                             self.policy.peak_layers(), model.host, model.units, model.quant)
        try:
            backend = backend_reg.factory(ctx)
        except MemoryError:
            raise KestrelError(f"out of host memory while loading {model.dir}; free memory or use a smaller model") from None
        self.backend = _checked("backend", config.backend.name, backend, Backend)
        try:
            self.expert_policy = make_expert_policy(res, model, self.backend.units)
        except BaseException:
            self.backend.close()
            raise
        self.window = Window(self.backend, self.policy, self.allocator, self.counters, model.n_layers, self.expert_policy,
                             res.expert_prefetch, res.expert_fetch == "layer")
        self._open = True

    def generate(self, prompt_ids: list[int] | None = None, prompt: str | None = None, keep_logits: bool = False,
                 on_token: Callable[[int], None] | None = None, on_text: Callable[[str], None] | None = None,
                 stop_ids: Iterable[int] = (), **generation: Any) -> GenerationResult:
        """Generate from ``prompt_ids`` or ``prompt`` (text, through the model's tokenizer); ``generation`` takes
        kestrel.toml's [generation] keys (max_new_tokens, temperature, top_k, top_p, seed, stop_at_eos).

        As it runs, ``on_token(id)`` hears each generated id, and ``on_text(piece)`` (the model's tokenizer
        needed) the text as it grows: the pieces join to the result's ``text``. ``stop_ids`` end the
        generation as config.json's eos_token_id does (with stop_at_eos)."""
        unknown = sorted(set(generation) - {f.name for f in attrs.fields(type(self.config.generation))})
        if unknown:
            raise ConfigError(f"unknown generation setting(s) {', '.join(unknown)}; "
                              f"allowed: {', '.join(f.name for f in attrs.fields(type(self.config.generation)))}")
        tok = self.model.tokenizer
        if on_text is not None and tok is None:
            raise ConfigError(f"on_text needs a tokenizer: {self.model.dir} has no usable tokenizer.json; "
                              "take the ids with on_token instead")
        gen = with_settings(self.config, generation, "generate").generation
        ids = self.model.prompt_ids(prompt_ids if prompt_ids is not None else list(gen.prompt_ids),
                                    prompt if prompt is not None else gen.prompt)
        stream = tok.stream() if on_text is not None else None

        def each(token: int) -> None:
            if on_token is not None:
                on_token(token)
            if stream is not None and (piece := stream.push(token)):
                on_text(piece)

        hear = each if on_token is not None or stream is not None else None
        result = generate(self, ids, gen, keep_logits=keep_logits, on_token=hear, stop_ids=stop_ids)
        if stream is not None and (rest := stream.finish()):
            on_text(rest)
        return attrs.evolve(result, text=tok.decode(result.token_ids) if tok else None)

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        try:
            self.window.release_all()
            self.allocator.drain()
        finally:
            self.backend.close()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_run(model: Model, config: KestrelConfig) -> Run:
    """A run of ``model`` with ``config``; use it as a context manager, or close it."""
    return Run(model, config)
