"""How a run is put together from its config: the factories ``Run.__init__`` calls, one step each.

In the order a run opens: ``join_pipeline`` (this rank's part, where torchrun started several), ``fit_keep`` (keep =
"auto" against the backend's budget), ``make_policy``, ``check_prefetch``, ``make_allocator``, ``make_backend``,
``make_expert_policy``, ``make_window``, ``expert_table``, ``lands`` and ``landing_slots``, ``make_runner``, then
``make_drafter`` (which opens a draft model's run through ``open_draft_run``). Each takes the narrow inputs it needs
and checks what it is given: a plugin's object against its protocol (``checked``), a setting against the model.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any

import attrs
import torch

from kestrel_core import plugins
from kestrel_core.config import OFF, KestrelConfig
from kestrel_core.engine import landing
from kestrel_core.engine.backend import BackendContext
from kestrel_core.engine.contracts import Allocator, Backend, Drafter, ExpertPolicy, Policy, member, missing_members
from kestrel_core.engine.draft_run import DraftRun, check_draft_model
from kestrel_core.engine.expert_cache import budget_bytes
from kestrel_core.engine.fit import EXPERT_POLICY, KeepChoice, KVRoom, choose_keep
from kestrel_core.engine.pipeline import Pipeline, kestrel_version, launched_rank
from kestrel_core.engine.plan import Counters, Observers
from kestrel_core.engine.residency import Window
from kestrel_core.engine.runner import Runner
from kestrel_core.engine.step import StepSettings
from kestrel_core.errors import BudgetError, ConfigError, KestrelError, KestrelNote, PluginError
from kestrel_core.formats.hub import NotCachedError
from kestrel_core.formats.units import UnitTable

def checked(kind: str, name: str, obj: Any, protocol: type) -> Any:
    """``obj``, a plugin's ``kind`` named ``name``, once it has every member of ``protocol``; else a PluginError."""
    missing = missing_members(protocol, obj)
    if missing:
        raise PluginError(f"{kind} {name!r} ({type(obj).__name__}) lacks {', '.join(missing)}; "
                          f"see the {protocol.__name__} protocol in kestrel_core/engine/contracts.py")
    return obj


def make_policy(name: str, keep, n_layers: int) -> Policy:
    """The policy object for one run; ``keep='off'`` means no window whatever the policy (whose name must exist all the same)."""
    reg = plugins.lookup("policies", name)
    if keep == OFF or name == OFF:
        return checked("policy", OFF, plugins.lookup("policies", OFF).factory(n_layers=n_layers, keep=OFF), Policy)
    if not 1 <= keep <= n_layers:
        raise ConfigError(f"keep={keep} is out of range for a {n_layers}-layer model: use 1..{n_layers} or 'off'")
    return checked("policy", name, reg.factory(n_layers=n_layers, keep=keep), Policy)


def fit_keep(model, config: KestrelConfig, factory, counters: Counters, kv: KVRoom) -> tuple[KestrelConfig, KeepChoice]:
    """``keep = "auto"`` resolved against the backend's budget beside ``kv``'s KV cache (``engine.fit``): the config
    with the chosen keep (and no prefetch where every layer is resident), and the choice, whose budget the run hands
    its backend (``KeepChoice.fitted_budget``; the config's ``budget_mb`` stays the user's). A window chosen is said
    on stderr as a note."""
    res, n = config.residency, model.n_layers
    if res.policy != OFF:
        make_policy(res.policy, 1, n)  # an unknown policy is named before any budget is read
    ctx = BackendContext(model.checkpoint, model.config, config.backend, res, counters, n, model.host, model.units,
                         model.quant)
    facts = getattr(factory, "fit_facts", lambda ctx: None)(ctx)
    if facts is None or res.policy == OFF:
        why = "the policy is off" if res.policy == OFF else f"the {config.backend.name} backend states no budget"
        choice = KeepChoice(OFF, n, 0, 0, f"keep = auto: every layer resident ({why})")
    else:
        choice = choose_keep(facts, lambda k: make_policy(res.policy, k, n).peak_layers(), config.backend.prefetch,
                             res.policy, kv.resolve(model.config.max_position_embeddings))
    backend = config.backend if choice.keep != OFF else attrs.evolve(config.backend, prefetch=0)
    residency = attrs.evolve(res, keep=choice.keep)
    if choice.expert_budget:
        residency = attrs.evolve(residency, expert_policy=EXPERT_POLICY, expert_budget_mb=choice.expert_budget / 2**20)
    if choice.keep == OFF and config.backend.prefetch:  # the user's prefetch is not dropped without a word
        warnings.warn(f"{choice.line}, so prefetch = {config.backend.prefetch} has nothing to fetch ahead and is off",
                      KestrelNote, stacklevel=4)
    elif choice.keep != OFF or choice.expert_budget:
        warnings.warn(choice.line, KestrelNote, stacklevel=4)
    return attrs.evolve(config, residency=residency, backend=backend), choice


def join_pipeline(model, config: KestrelConfig, factory) -> tuple[KestrelConfig, Pipeline | None]:
    """This process's rank where torchrun started several (else None), and the config it runs: on a GPU, the device
    torchrun's LOCAL_RANK names unless the config names one."""
    if launched_rank()[1] == 1:
        return config, None
    device_type = getattr(factory, "device_type", "cpu")
    if device_type != "cpu" and not config.backend.device and os.environ.get("LOCAL_RANK"):
        config = attrs.evolve(config, backend=attrs.evolve(config.backend,
                                                           device=f"{device_type}:{os.environ['LOCAL_RANK']}"))
    device = torch.device(config.backend.device or device_type)
    cfg = model.config
    sizes = [0] * cfg.num_hidden_layers  # each layer's weight elements: what the split balances
    for spec in model.units:
        sizes[spec.layer] += sum(math.prod(shape) for _, shape in spec.tensors.values())
    fingerprint = {"kestrel": kestrel_version(), "model": str(model.dir), "model config": attrs.asdict(cfg),
                   "settings": {k: v for k, v in attrs.asdict(config).items() if k != "backend"},
                   "backend": {k: v for k, v in attrs.asdict(config.backend).items() if k != "device"}}
    return config, Pipeline.join(sizes, device, fingerprint)


def micro_batched(setting: str, backend: Backend) -> bool:
    """Whether a pipeline's decode steps go through the ranks in micro-batches (``[backend] micro_batches``): "auto" is
    on where each rank computes on a device of its own (cuda), and off where the ranks share one host's cores and
    memory bandwidth (cpu_ref: there a batch ran slower in micro-batches than without, docs/multi-gpu.md). Every rank
    runs the same backend (the ranks' settings are checked alike), so they agree."""
    return backend.device_per_rank if setting == "auto" else setting == "on"


def make_allocator(name: str, counters: Counters, slots: int) -> Allocator:
    if slots < 0:
        raise ConfigError(f"pool_slots must be >= 0, got {slots}")
    return checked("allocator", name, plugins.lookup("allocators", name).factory(counters=counters, slots=slots), Allocator)


def check_prefetch(config: KestrelConfig) -> None:
    """A prefetch needs a window to fetch ahead in."""
    if config.backend.prefetch and not config.residency.windowed:
        raise ConfigError(f"prefetch = {config.backend.prefetch} needs a window, but keep is off (every layer stays "
                          "resident); set keep to a layer count, or prefetch = 0")


def make_backend(factory, model, config: KestrelConfig, counters: Counters, policy: Policy,
                 choice: KeepChoice | None) -> Backend:
    """The run's backend over ``model``'s layers, sized by the policy's peak (and its peak at any keep, to name one
    that fits) and held to the budget keep = "auto" chose (``choice``; None: a keep given, the backend's own)."""
    res = config.residency
    ctx = BackendContext(model.checkpoint, model.config, config.backend, res, counters, policy.peak_layers(),
                         model.host, model.units, model.quant,
                         keep_peak=lambda k: make_policy(res.policy, k, model.n_layers).peak_layers(),
                         fitted_budget=choice.fitted_budget if choice is not None else None)
    try:
        backend = factory(ctx)
    except MemoryError:
        raise KestrelError(f"out of host memory while loading {model.dir}; free memory or use a smaller model") from None
    return checked("backend", config.backend.name, backend, Backend)


def make_expert_policy(res, model, units: UnitTable) -> ExpertPolicy | None:
    """The run's expert policy, or None; its budget must hold one token's routed experts (in the backend's layout)."""
    if res.expert_prefetch and not model.config.is_moe:
        raise ConfigError(f"expert_prefetch is for Mixture-of-Experts models; {model.dir} ({model.config.model_type}) "
                          "has no experts: leave --expert-prefetch off")
    if res.expert_fetch == "layer" and not model.config.is_moe:
        raise ConfigError(f"expert_fetch = 'layer' is for Mixture-of-Experts models; {model.dir} "
                          f"({model.config.model_type}) has no experts: leave --expert-fetch out")
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
    largest = max(u.nbytes for u in units.experts())
    budget = budget_bytes(res.expert_budget_mb, cfg.num_experts_per_tok, largest)
    return checked("expert policy", res.expert_policy, factory(budget=budget), ExpertPolicy)


def make_drafter(spec, run) -> tuple[Drafter | None, DraftRun | None]:
    """The run's drafter for speculative decoding and, where it drafts with a model, the draft run this opened for it;
    (None, None) without ``spec.draft``. ``spec.draft`` names a registered drafter (``ngram`` or ``ngram:N``, a
    plugin's ``NAME:ARG``), or else a draft model (the ``model`` drafter's). A factory that says
    ``drafts_with_a_model`` gets ``draft_run=``: the model its ``arg`` names, loaded, checked and opened here."""
    if not spec.draft:
        return None, None
    name, _, arg = spec.draft.partition(":")
    drafters = plugins.registry("drafters")
    named = name in drafters
    if named:
        factory, arg = drafters[name].factory, arg or None
    else:
        factory, name, arg = plugins.lookup("drafters", "model").factory, "model", spec.draft
    if not getattr(factory, "drafts_with_a_model", False):
        return checked("drafter", name, factory(arg=arg, run=run), Drafter), None
    try:
        draft_run = open_draft_run(arg, run, name)
    except NotCachedError as exc:
        if named:
            raise
        names = ", ".join(sorted(n for n in drafters if n != "model"))
        raise ConfigError(f"draft {spec.draft!r} names no registered drafter ({names}) and no model: {exc}") from None
    try:
        return checked("drafter", name, factory(arg=arg, run=run, draft_run=draft_run), Drafter), draft_run
    except BaseException:
        draft_run.close()
        raise


def open_draft_run(arg: str | None, run, name: str = "model") -> DraftRun:
    """The draft model ``arg`` names, loaded, checked against the run's model (``draft_run.check_draft_model``) and
    opened whole and resident on the run's device, beside it: a ``DraftRun``."""
    if not arg:
        raise ConfigError(f"--draft {name} needs the draft model: --draft DIR (or a name in the Hugging Face cache)")
    draft = type(run.model)(arg)  # load(arg): the target's class, so this module needs no import of run.py
    try:
        check_draft_model(draft, run.model)
        backend = run.config.backend
        try:
            opened = draft.open(backend={"name": backend.name, "dtype": backend.dtype, "device": backend.device,
                                         "graphs": backend.graphs}, keep="off",
                                alone=True)  # beside a pipeline's rank 0: whole, on its device
        except BudgetError as exc:
            raise BudgetError(f"the draft model {draft.dir} does not fit on the device beside the target: {exc}") from None
        try:
            return DraftRun(opened, run.model, run.config.generation)
        except BaseException:
            opened.close()
            raise
    except BaseException:
        draft.close()
        raise


def make_window(backend: Backend, policy: Policy, allocator: Allocator, counters: Counters, model, res,
                watchers: Observers, expert_policy: ExpertPolicy | None) -> Window:
    """The run's window over the backend's units: the policy's and the expert policy's advice at each boundary, the
    observers hearing it."""
    routers = [p.on_experts_routed for p in (expert_policy,) if p is not None]
    routers.append(member(Policy, policy, "on_experts_routed"))
    return Window(backend.units, backend, policy, allocator, counters, model.n_layers, watchers, routers,
                  expert_policy, res.expert_prefetch, res.expert_fetch == "layer", backend.prefetch_depth)


def expert_table(res, model, backend: Backend) -> bool:
    """Whether a decode step reads its routed experts through the backend's expert table (``expert_decode``)."""
    if not model.config.is_moe or res.expert_decode == "host":
        return False
    if res.expert_decode == "auto":
        return backend.expert_table and not res.expert_prefetch  # a guess needs the host at each sparse layer
    if not backend.expert_table:
        why = backend.expert_table_refusal
        raise ConfigError(f"expert_decode = 'table' needs the backend's expert table, and {backend.name}'s cannot serve "
                          f"this run: {why}; use expert_decode = 'host' (or 'auto')")
    if res.expert_prefetch:
        raise ConfigError("expert_prefetch guesses the next layer's experts on the host at each sparse layer, and "
                          "expert_decode = 'table' keeps the host out of the step: use expert_decode = 'host' to guess")
    return True


def lands(res, backend: Backend, table: bool, pipeline) -> bool:
    """Whether a table-read decode step lands its misses (``engine.landing``) under an expert policy that can
    (``lands``): not with expert_landing off, without the table, where the backend cannot, under a window over the
    layers (an expert goes with its layer), in a pipeline, or with experts of several sizes (a slot holds any one)."""
    if not (res.expert_landing and table and backend.lands and pipeline is None and not res.windowed):
        return False
    return len({tuple(e.geometry for e in u.entries) for u in backend.units.experts()}) == 1


def landing_slots(lands: bool, policy: ExpertPolicy | None, backend: Backend, cfg, staging: bool) -> tuple[int, int]:
    """The landing ring's slots and its staging slots under the expert policy's budget (``landing.ring_size``), held
    back from it; (0, 0) where the step does not land (``lands``) or the policy cannot."""
    if not (lands and policy is not None and member(ExpertPolicy, policy, "lands")):
        return 0, 0
    experts = backend.units.experts()
    size, staged, hold = landing.ring_size(policy.budget, experts[0].nbytes, sum(u.nbytes for u in experts),
                                           cfg.num_experts_per_tok,
                                           sum(map(cfg.moe_layer, range(cfg.num_hidden_layers))), staging)
    if hold:
        policy.hold_back(hold)
    return size, staged


def make_runner(window: Window, backend: Backend, model, config: KestrelConfig, pipeline: Pipeline | None,
                table: bool, landing: tuple[int, int]) -> Runner:
    """The run's runner: CUDA graphs where asked and no pipeline, the expert table where read, the landing ring's
    slots (``landing_slots``), micro-batches (``micro_batched``)."""
    settings = StepSettings(graphs=config.backend.graphs == "auto" and pipeline is None,
                            compile=config.backend.compile, expert_table=table, landing=landing[0], staged=landing[1],
                            micro_batches=micro_batched(config.backend.micro_batches, backend))
    return Runner(window, backend, model.config, settings,
                  guard=getattr(model.checkpoint, "check_unchanged", lambda: None), pipeline=pipeline)
