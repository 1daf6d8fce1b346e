"""The way in: ``load`` opens a model, ``Model.open`` a run, ``Run.generate`` generates.

A run owns its policy, allocator, backend, window, runner and counters, resolved once when it
opens. Nothing of a run is registered in the plugin manager, so two runs open at once do not
see each other; plugins registered there are observers, resolved when the run opens, that see
every boundary of that run.

    from kestrel_core import load
    model = load("/path/to/model")          # or a name in the Hugging Face cache: load("Qwen/Qwen3-8B"), or a GGUF file
    with model.open(policy="asymmetric", keep=2, backend="cpu_ref") as run:
        res = run.generate(prompt_ids=[1, 2, 3], max_new_tokens=8)
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

import attrs
import torch

from kestrel_core import plugins
from kestrel_core.engine.backend import BackendContext
from kestrel_core.engine.batch import Batch, Request, check_batch, generate_one
from kestrel_core.engine.draft_run import DraftRun, check_draft_model
from kestrel_core.engine.limits import RequestLimits
from kestrel_core.config import AUTO, OFF, KestrelConfig, check_environment, with_settings
from kestrel_core.engine.contracts import (
    Allocator,
    Backend,
    Drafter,
    ExpertPolicy,
    Policy,
    member,
    missing_members,
)
from kestrel_core.errors import BudgetError, ConfigError, KestrelError, KestrelNote, PluginError
from kestrel_core.engine.grammar import Grammars
from kestrel_core.engine.pipeline import Pipeline, kestrel_version, launched_rank
from kestrel_core.formats.tensor_table import unit_specs
from kestrel_core.engine.fit import EXPERT_POLICY, KeepChoice, KVRoom, choose_keep
from kestrel_core.engine.expert_cache import budget_bytes
from kestrel_core.formats.gguf import GGUFCheckpoint
from kestrel_core.formats.gguf_model import names_gguf, open_gguf
from kestrel_core.formats.gguf_model import no_tokenizer as gguf_no_tokenizer
from kestrel_core.engine import landing
from kestrel_core.engine.host import HostStore
from kestrel_core.formats.hub import NotCachedError
from kestrel_core.formats.modeldir import read_model_dir
from kestrel_core.engine.plan import Counters, Observers
from kestrel_core.engine.residency import Window
from kestrel_core.engine.results import GenerationResult, text_ids
from kestrel_core.engine.sampling import processes
from kestrel_core.engine.follower import end_following, follow
from kestrel_core.engine.runner import Runner, StepSettings
from kestrel_core.formats.units import UnitTable

__all__ = ["Model", "Run", "load", "make_allocator", "make_expert_policy", "make_policy"]


def _checked(kind: str, name: str, obj: Any, protocol: type) -> Any:
    missing = missing_members(protocol, obj)
    if missing:
        raise PluginError(f"{kind} {name!r} ({type(obj).__name__}) lacks {', '.join(missing)}; "
                          f"see the {protocol.__name__} protocol in kestrel_core/engine/contracts.py")
    return obj


def make_policy(name: str, keep, n_layers: int) -> Policy:
    """The policy object for one run; ``keep='off'`` means no window whatever the policy (whose name must exist all the same)."""
    reg = plugins.lookup("policies", name)
    if keep == OFF or name == OFF:
        return _checked("policy", OFF, plugins.lookup("policies", OFF).factory(n_layers=n_layers, keep=OFF), Policy)
    if not 1 <= keep <= n_layers:
        raise ConfigError(f"keep={keep} is out of range for a {n_layers}-layer model: use 1..{n_layers} or 'off'")
    return _checked("policy", name, reg.factory(n_layers=n_layers, keep=keep), Policy)


def _ends(req: Request | None) -> frozenset[int]:
    """The ids that end ``req``'s generation (none where it does not stop at one)."""
    return req.eos_ids if req is not None and req.gen.stop_at_eos else frozenset()


def _fit_keep(model: "Model", config: KestrelConfig, factory, counters: Counters,
              kv: KVRoom) -> tuple[KestrelConfig, KeepChoice]:
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


def _join_pipeline(model: "Model", config: KestrelConfig, factory) -> tuple[KestrelConfig, Pipeline | None]:
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
    return _checked("allocator", name, plugins.lookup("allocators", name).factory(counters=counters, slots=slots), Allocator)


def make_expert_policy(res, model: "Model", units: UnitTable) -> ExpertPolicy | None:
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
    return _checked("expert policy", res.expert_policy, factory(budget=budget), ExpertPolicy)


def make_drafter(spec, run: "Run") -> tuple[Drafter | None, DraftRun | None]:
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
        return _checked("drafter", name, factory(arg=arg, run=run), Drafter), None
    try:
        draft_run = open_draft_run(arg, run, name)
    except NotCachedError as exc:
        if named:
            raise
        names = ", ".join(sorted(n for n in drafters if n != "model"))
        raise ConfigError(f"draft {spec.draft!r} names no registered drafter ({names}) and no model: {exc}") from None
    try:
        return _checked("drafter", name, factory(arg=arg, run=run, draft_run=draft_run), Drafter), draft_run
    except BaseException:
        draft_run.close()
        raise


def open_draft_run(arg: str | None, run: "Run", name: str = "model") -> DraftRun:
    """The draft model ``arg`` names, loaded, checked against the run's model (``draft_run.check_draft_model``) and
    opened whole and resident on the run's device, beside it: a ``DraftRun``."""
    if not arg:
        raise ConfigError(f"--draft {name} needs the draft model: --draft DIR (or a name in the Hugging Face cache)")
    draft = load(arg)
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


def expert_table(res, model: "Model", backend: Backend) -> bool:
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


def landing_slots(policy: ExpertPolicy, backend: Backend, cfg, staging: bool) -> tuple[int, int]:
    """The landing ring's slots and its staging slots under the expert policy's budget (``landing.ring_size``), held
    back from it."""
    experts = backend.units.experts()
    size, staged, hold = landing.ring_size(policy.budget, experts[0].nbytes, sum(u.nbytes for u in experts),
                                           cfg.num_experts_per_tok,
                                           sum(map(cfg.moe_layer, range(cfg.num_hidden_layers))), staging)
    if hold:
        policy.hold_back(hold)
    return size, staged


class Model:
    """What every run on one model shares: the parsed config, the mapped checkpoint, host copies. ``with`` closes it."""

    def __init__(self, model_dir: str | os.PathLike):
        if not isinstance(model_dir, (str, os.PathLike)):
            raise ConfigError(f"load() takes a model directory, a .gguf file or a Hugging Face model name (a str or "
                              f"a path), got {type(model_dir).__name__}")
        if "\x00" in os.fsdecode(model_dir):  # no file can be named so; the OS would refuse it with a ValueError
            raise ConfigError(f"model {os.fsdecode(model_dir)!r} holds a NUL character, which no path can; give the model "
                              "directory, .gguf file or Hugging Face name without it")
        files = open_gguf(model_dir) if names_gguf(model_dir) else read_model_dir(model_dir)
        self.dir, self.config, self.checkpoint = files.dir, files.config, files.checkpoint
        self.quant, self.tokenizer, self.eos_ids, self.units = files.quant, files.tokenizer, files.eos_ids, files.units
        self._chat_template = files.chat_template
        self.host = HostStore()  # backend host staging, reused by every run on this model
        self.closed = False
        self._grammars: Grammars | None = None

    def no_tokenizer(self) -> str:
        """Why the model has no tokenizer, as an error's subject: a directory's missing tokenizer.json, or what kept
        kestrel from building a GGUF's."""
        if isinstance(self.checkpoint, GGUFCheckpoint):
            return gguf_no_tokenizer(self.checkpoint)
        return f"{self.dir} has no tokenizer.json"

    @property
    def n_layers(self) -> int:
        return self.config.num_hidden_layers

    def prompt_ids(self, ids: list[int] | None, text: str | None, default: list[int] | None = None) -> list[int]:
        """The prompt as ids: ``ids`` as given, else ``text`` through the tokenizer, else ``default``."""
        if ids:
            return list(ids)
        if text:
            if self.tokenizer is None:
                raise ConfigError(f"--prompt needs a tokenizer: {self.no_tokenizer()}; "
                                  "pass --prompt-ids instead")
            limits = self.limits()
            ids = self.tokenizer.encode_at_most(text, limits.context - 1)  # text far past the context: not whole
            if ids is None:
                raise limits.too_long(None)
            if not ids:
                raise ConfigError("the prompt is empty after tokenization")
            return ids
        if default is not None:
            return list(default)
        raise ConfigError("the prompt is empty: pass --prompt TEXT or --prompt-ids 1,2,3")

    def limits(self) -> RequestLimits:
        """What one request may ask of this model: its vocabulary and positions."""
        return RequestLimits(self.config.max_position_embeddings, "the model", self.config.vocab_size,
                      tokens="max_new_tokens (--max-new-tokens)", source="max_position_embeddings")

    def part(self, first: int, count: int) -> "Model":
        """``count`` of its layers from ``first``, as a model of their own (a pipeline rank's): the same files, the
        config and units of those layers (their tensors keep the checkpoint's names)."""
        part = copy.copy(self)
        part.config = self.config.layers(first, count)
        part.units = unit_specs(part.config)
        return part

    def grammars(self) -> Grammars:
        """Its vocabulary as constrained output reads it (made at the first request that asks)."""
        if self.tokenizer is None:
            raise ConfigError(f"output held to a JSON schema needs the model's tokenizer: {self.no_tokenizer()}")
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.config.vocab_size)
        return self._grammars

    def chat_template(self):
        """The model's chat template (``chat_template.ChatTemplate``): its directory's, or its GGUF metadata's; a
        ConfigError that says what to do where it has none."""
        return self._chat_template()

    def open(self, config: KestrelConfig | None = None, observers: Iterable[object] = (),
             kv: tuple[int, int] | None = None, alone: bool = False, **settings: Any) -> "Run":
        """A run on this model: ``config`` (default: kestrel.toml's defaults), then ``settings`` by their toml
        names, flat (``policy="asymmetric", keep=2, backend="cpu_ref"``) or as tables (``backend={"name": "cuda"}``).
        ``observers``: objects whose hook methods (``on_layer_advance``, ``on_experts_routed``, ``preload``,
        ``alloc``, ``release``) observe this run alone, besides the plugins registered in the manager. ``kv``: the
        KV cache ``keep = "auto"`` leaves room for, (sequences, positions each) (default: one of 4,096 positions, or
        the model's fewer). ``alone``: a run of this process only, where torchrun started several (a draft model beside
        rank 0's run), whose layers are not split over the ranks."""
        if self.closed:
            raise ConfigError(f"this model ({self.dir}) is closed; load it again")
        if config is not None and not isinstance(config, KestrelConfig):
            raise ConfigError(f"open() takes a KestrelConfig or settings by name, got {type(config).__name__}")
        if "model" in settings and not self._names_me(settings["model"]):
            raise ConfigError(f"open(model={settings['model']!r}) names another model than the one loaded ({self.dir}); "
                              "a run runs the model it was opened on: load that one with kestrel_core.load(...)")
        return Run(self, with_settings(config or KestrelConfig(), settings), observers, KVRoom.of(kv), alone)

    def _names_me(self, model: Any) -> bool:
        try:
            return isinstance(model, (str, os.PathLike)) and Path(model).resolve() == Path(self.dir).resolve()
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        self.closed = True
        self.host.clear()
        self.checkpoint.close()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load(model_dir: str | os.PathLike) -> Model:
    """Open a model directory (config.json + *.safetensors), a GGUF file (``x.gguf``: config, tokenizer and chat
    template from its metadata), or a model name such as ``"Qwen/Qwen3-8B"`` from the local Hugging Face cache (never
    downloaded); close it with ``model.close()`` or ``with``."""
    return Model(model_dir)


def _prompt_ids(value: Any, name: str = "prompt_ids", hint: str = "; pass text as prompt=") -> list[int] | None:
    """``value`` (``prompt_ids``, ``stop_ids``) as a list of ints, or a ConfigError naming what it was."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, set, frozenset)):
        raise ConfigError(f"{name} must be a list of token ids (ints), got {type(value).__name__}{hint}")
    for x in value:
        if isinstance(x, bool) or not isinstance(x, int):
            raise ConfigError(f"{name} must hold ints, got a {type(x).__name__} ({str(x)[:40]})")
    return list(value)


class Run:
    """An open run. ``with model.open(...) as run:`` closes it; so does ``run.close()``."""

    def __init__(self, model: Model, config: KestrelConfig, observers: Iterable[object] = (), kv: KVRoom = KVRoom(),
                 alone: bool = False):
        check_environment()
        self.counters = Counters()
        backend_reg = plugins.lookup("backends", config.backend.name)
        # Started by torchrun over several ranks: this rank's part of the layers is the model it runs
        config, self.pipeline = (config, None) if alone else _join_pipeline(model, config, backend_reg.factory)
        whole, model = model, model if self.pipeline is None else model.part(self.pipeline.first_layer,
                                                                              self.pipeline.n_layers)
        self.keep_choice: KeepChoice | None = None  # what keep = "auto" chose, and why
        if config.residency.keep == AUTO:
            config, self.keep_choice = _fit_keep(model, config, backend_reg.factory, self.counters, kv)
        res = config.residency
        self.model, self.config = whole, config
        self.policy = make_policy(res.policy, res.keep, model.n_layers)
        if config.backend.prefetch and not res.windowed:
            raise ConfigError(f"prefetch = {config.backend.prefetch} needs a window, but keep is off (every layer stays "
                              "resident); set keep to a layer count, or prefetch = 0")
        self.allocator = make_allocator(res.allocator, self.counters, res.pool_slots)
        watchers = Observers(**plugins.observers(observers))  # resolved once: a plugin registered later sees the next run
        ctx = BackendContext(model.checkpoint, model.config, config.backend, res, self.counters,
                             self.policy.peak_layers(), model.host, model.units, model.quant,
                             keep_peak=lambda k: make_policy(res.policy, k, model.n_layers).peak_layers(),
                             fitted_budget=self.keep_choice.fitted_budget if self.keep_choice else None)
        try:
            backend = backend_reg.factory(ctx)
        except MemoryError:
            raise KestrelError(f"out of host memory while loading {model.dir}; free memory or use a smaller model") from None
        self.backend: Backend = _checked("backend", config.backend.name, backend, Backend)
        try:
            self.expert_policy = make_expert_policy(res, model, self.backend.units)
        except BaseException:
            self.backend.close()
            raise
        routers = [p.on_experts_routed for p in (self.expert_policy,) if p is not None]
        routers.append(member(Policy, self.policy, "on_experts_routed"))
        self.window = Window(self.backend.units, self.backend, self.policy, self.allocator, self.counters,
                             model.n_layers, watchers, routers, self.expert_policy, res.expert_prefetch,
                             res.expert_fetch == "layer", self.backend.prefetch_depth)
        try:
            table = expert_table(res, model, self.backend)
        except BaseException:
            self.backend.close()
            raise
        self.lands = lands(res, self.backend, table, self.pipeline)  # a trace keeps it: a replay's policy may land
        policy_lands = self.expert_policy is not None and member(ExpertPolicy, self.expert_policy, "lands")
        self.landing_slots, staged = landing_slots(self.expert_policy, self.backend, model.config, res.expert_staging) \
            if self.lands and policy_lands else (0, 0)
        self.runner = Runner(self.window, self.backend, model.config,
                             StepSettings(graphs=config.backend.graphs == "auto" and self.pipeline is None,
                                          compile=config.backend.compile, expert_table=table,
                                          landing=self.landing_slots, staged=staged,
                                          micro_batches=micro_batched(config.backend.micro_batches, self.backend)),
                             guard=getattr(model.checkpoint, "check_unchanged", lambda: None), pipeline=self.pipeline)
        self._open = True
        self.drafter = self.draft_run = None
        try:  # a pipeline's later ranks follow rank 0's steps: the drafts are rank 0's
            if not self.follows:
                self.drafter, self.draft_run = make_drafter(config.speculative, self)
        except BaseException:
            self.close()
            raise

    def request(self, prompt_ids: list[int] | None = None, prompt: str | None = None, keep_logits: bool = False,
                on_token: Callable[[int], None] | None = None, stop_ids: Iterable[int] = (),
                json_schema: dict[str, Any] | None = None, grammar: str | None = None, **generation: Any) -> Request:
        """One sequence to generate, checked: ``prompt_ids`` or ``prompt`` (text, through the model's tokenizer), and
        kestrel.toml's [generation] keys (max_new_tokens, temperature, top_k, top_p, seed, stop_at_eos). ``stop_ids``
        end it as config.json's eos_token_id does (with stop_at_eos). ``json_schema``: the output is a JSON value
        the schema accepts (``{}``: any JSON value), then an end id, by constrained decoding (``engine.grammar``);
        ``grammar``: the same for a grammar in llguidance's Lark."""
        if not self._open or self.model.closed:
            what = "run" if not self._open else f"model ({self.model.dir})"
            raise ConfigError(f"this {what} is closed; open a new run with model.open(...)")
        fields = [f.name for f in attrs.fields(type(self.config.generation))]
        unknown = sorted(set(generation) - set(fields))
        if unknown:
            raise ConfigError(f"unknown generation setting(s) {', '.join(unknown)}; allowed: {', '.join(fields)}")
        ids_given = _prompt_ids(prompt_ids)
        if prompt is not None and not isinstance(prompt, str):
            raise ConfigError(f"prompt must be text (a str), got {type(prompt).__name__}; pass token ids as prompt_ids=")
        gen = with_settings(self.config, generation, "generate").generation
        if ids_given is not None and prompt is not None:
            raise ConfigError("both prompt and prompt_ids are given; pass one (text, or token ids)")
        if ids_given is not None or prompt is not None:  # an argument beats both of the config's
            ids = self.model.prompt_ids(ids_given, prompt)
        else:
            ids = self.model.prompt_ids(list(gen.prompt_ids), gen.prompt)
        check_prompt(self.model, ids, gen)
        stop = self.model.limits().ids(_prompt_ids(stop_ids, "stop_ids", ""), "stop_ids")  # as the server checks its own
        self.model.limits().ids([i for i, _ in gen.logit_bias], "logit_bias")
        eos = self.model.eos_ids | frozenset(stop)  # config.json's and generation_config.json's, and the caller's
        constraint = None
        if json_schema is not None and grammar is not None:
            raise ConfigError("both json_schema and grammar are given; pass one")
        if json_schema is not None or grammar is not None:
            if not gen.stop_at_eos:
                raise ConfigError("output held to a JSON schema or a grammar ends at an end id once it is whole; "
                                  "leave stop_at_eos on")
            grammars = self.model.grammars()
            held = grammars.json(json_schema, eos) if grammar is None else grammars.lark(grammar, eos)
            constraint = held.start
        # A verify pass keeps argmax drafts, which a penalty or a grammar moves.
        drafter = self.drafter if not processes(gen) and constraint is None else None
        draft = self.config.speculative.draft_tokens if drafter is not None else 0
        return Request(ids, gen, eos, keep_logits=keep_logits, on_token=on_token, drafter=drafter, draft_tokens=draft,
                       constraint=constraint)

    def generate(self, prompt_ids: list[int] | None = None, prompt: str | None = None, keep_logits: bool = False,
                 on_token: Callable[[int], None] | None = None, on_text: Callable[[str], None] | None = None,
                 stop_ids: Iterable[int] = (), json_schema: dict[str, Any] | None = None, grammar: str | None = None,
                 **generation: Any) -> GenerationResult:
        """Generate from ``prompt_ids`` or ``prompt`` (see ``request``).

        As it runs, ``on_token(id)`` hears each generated id, and ``on_text(piece)`` (the model's tokenizer
        needed) the text as it grows: the pieces join to the result's ``text``."""
        tok = self.model.tokenizer
        if on_text is not None and tok is None:
            raise ConfigError(f"on_text needs a tokenizer: {self.model.no_tokenizer()}; "
                              "take the ids with on_token instead")
        stream = tok.stream() if on_text is not None else None
        req = None

        def each(token: int) -> None:
            if on_token is not None:
                on_token(token)
            if stream is not None and token not in _ends(req) and (piece := stream.push(token)):
                on_text(piece)

        hear = each if on_token is not None or stream is not None else None
        req = self.request(prompt_ids, prompt, keep_logits, hear, stop_ids, json_schema, grammar, **generation)
        with self._oom_is_a_budget_error():
            result = generate_one(self.runner, req)
        if stream is not None and (rest := stream.finish()):
            on_text(rest)
        return attrs.evolve(result, text=tok.decode(text_ids(result.token_ids, _ends(req))) if tok else None)

    def generate_batch(self, requests: Iterable[dict], max_batch: int = 8, prefill_chunk: int | None = None,
                       on_done: Callable[[int, GenerationResult | Exception], None] | None = None) -> list:
        """Generate every request (each a dict of ``request``'s arguments, or what it returned) as a continuous batch of at most
        ``max_batch`` sequences: one pass over the layers a step serves every decoding sequence, and a sequence joins
        as another leaves. ``prefill_chunk``: prompt tokens a step takes beside the decoding ones (None: a whole
        prompt a step). The results in the order given; ``on_done(i, result or error)`` hears each as it finishes.
        A sequence whose logits went non-finite gets its error in its place; the others go on."""
        check_batch(max_batch, prefill_chunk)
        reqs = []
        for i, r in enumerate(requests):
            if isinstance(r, Request):  # checked by ``request`` already
                reqs.append(r)
                continue
            if not isinstance(r, dict):
                raise ConfigError(f"request {i}: a dict of generate's arguments (prompt= or prompt_ids=, ...), "
                                  f"got {type(r).__name__}")
            reqs.append(self.request(**r))
        if not reqs:
            return []
        max_seq = max(len(r.prompt_ids) + r.gen.max_new_tokens for r in reqs)
        tok = self.model.tokenizer
        out: list = [None] * len(reqs)
        with self._oom_is_a_budget_error(), Batch(self.runner, min(max_batch, len(reqs)), max_seq, prefill_chunk,
                                                  fix="lower max_batch (--max-batch) or max_new_tokens, or shorten "
                                                      "the longest prompt") as b:
            seqs = [b.add(r) for r in reqs]
            while b.busy:
                b.step()
                for i, seq in enumerate(seqs):
                    if seq.done and out[i] is None:
                        ids = text_ids(seq.result.token_ids, _ends(seq.request)) if seq.error is None else []
                        out[i] = seq.error or attrs.evolve(seq.result, text=tok.decode(ids) if tok else None)
                        if on_done is not None:
                            on_done(i, out[i])
        return out

    @contextlib.contextmanager
    def _oom_is_a_budget_error(self):
        try:
            yield
        except torch.cuda.OutOfMemoryError:
            budget = self.backend.budget
            hint = f" (weight-cache budget {budget // 2**20} MiB)" if budget else ""
            raise BudgetError(f"CUDA out of memory during generation{hint}: lower --budget-mb / KESTREL_WCACHE_MB, "
                              "keep, or --max-new-tokens") from None

    @property
    def follows(self) -> bool:
        """Whether this run is a pipeline's rank past the first, which follows rank 0's steps (``follow``)."""
        return self.pipeline is not None and not self.runner.leads

    def follow(self) -> None:
        """On a pipeline's ranks past the first (``torchrun`` started this process as one): make rank 0's steps as it
        takes them, until rank 0 closes its run. Rank 0 generates, serves or runs the batch job; the others call this."""
        if not self.follows:
            what = "one process" if self.pipeline is None else "rank 0 of the pipeline"
            raise ConfigError(f"run.follow() is for a pipeline's ranks past the first, and this is {what}: generate here")
        follow(self.runner)

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        try:
            if self.runner.leads:
                with contextlib.suppress(RuntimeError):  # a rank already gone: nobody is left to tell
                    end_following(self.runner)
            if getattr(self, "drafter", None) is not None:
                self.drafter.close()
            if getattr(self, "draft_run", None) is not None:
                self.draft_run.close()  # opened by this run for its drafter, so closed by it
            self.runner.release_all()
            self.allocator.drain()
        finally:
            self.backend.close()
            if self.pipeline is not None:
                self.pipeline.close()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_prompt(model: Model, prompt_ids: list[int], gen) -> None:
    if not prompt_ids:
        raise ConfigError("the prompt is empty: pass --prompt TEXT or --prompt-ids 1,2,3")
    limits = model.limits()
    limits.ids(prompt_ids)
    limits.budget(gen.max_new_tokens, len(prompt_ids))
