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
import os
from pathlib import Path
from typing import Any, Callable, Iterable

import attrs
import torch

from kestrel_core import plugins
from kestrel_core.config import AUTO, KestrelConfig, check_environment, with_settings
from kestrel_core.engine.assemble import (
    check_prefetch,
    expert_table,
    fit_keep,
    join_pipeline,
    landing_slots,
    lands,
    make_allocator,
    make_backend,
    make_drafter,
    make_expert_policy,
    make_policy,
    make_runner,
    make_window,
)
from kestrel_core.engine.batch import Batch, Request, check_batch, generate_one
from kestrel_core.engine.contracts import Backend
from kestrel_core.engine.fit import KeepChoice, KVRoom
from kestrel_core.engine.follower import end_following, follow
from kestrel_core.engine.grammar import Grammars
from kestrel_core.engine.host import HostStore
from kestrel_core.engine.limits import RequestLimits
from kestrel_core.engine.plan import Counters, Observers
from kestrel_core.engine.results import GenerationResult, text_ids
from kestrel_core.engine.sampling import processes
from kestrel_core.errors import BudgetError, ConfigError
from kestrel_core.formats.gguf import GGUFCheckpoint
from kestrel_core.formats.gguf_model import names_gguf, open_gguf
from kestrel_core.formats.gguf_model import no_tokenizer as gguf_no_tokenizer
from kestrel_core.formats.modeldir import read_model_dir
from kestrel_core.formats.tensor_table import unit_specs

__all__ = ["Model", "Run", "load"]


def _ends(req: Request | None) -> frozenset[int]:
    """The ids that end ``req``'s generation (none where it does not stop at one)."""
    return req.eos_ids if req is not None and req.gen.stop_at_eos else frozenset()


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
        """Its steps (``engine.assemble``): this rank's part of the layers, keep = "auto" fitted, then the policy,
        allocator, backend, expert policy, window, expert table and landing ring, runner and drafter."""
        check_environment()
        self.counters = Counters()
        factory = plugins.lookup("backends", config.backend.name).factory
        # Started by torchrun over several ranks: this rank's part of the layers is the model it runs
        config, self.pipeline = (config, None) if alone else join_pipeline(model, config, factory)
        whole, model = model, model if self.pipeline is None else model.part(self.pipeline.first_layer,
                                                                              self.pipeline.n_layers)
        self.keep_choice: KeepChoice | None = None  # what keep = "auto" chose, and why
        if config.residency.keep == AUTO:
            config, self.keep_choice = fit_keep(model, config, factory, self.counters, kv)
        res = config.residency
        self.model, self.config = whole, config
        self.policy = make_policy(res.policy, res.keep, model.n_layers)
        check_prefetch(config)
        self.allocator = make_allocator(res.allocator, self.counters, res.pool_slots)
        watchers = Observers(**plugins.observers(observers))  # resolved once: a plugin registered later sees the next run
        self.backend: Backend = make_backend(factory, model, config, self.counters, self.policy, self.keep_choice)
        try:
            self.expert_policy = make_expert_policy(res, model, self.backend.units)
            self.window = make_window(self.backend, self.policy, self.allocator, self.counters, model, res, watchers,
                                      self.expert_policy)
            table = expert_table(res, model, self.backend)
        except BaseException:
            self.backend.close()
            raise
        self.lands = lands(res, self.backend, table, self.pipeline)  # a trace keeps it: a replay's policy may land
        self.landing_slots, staged = landing_slots(self.lands, self.expert_policy, self.backend, model.config,
                                                   res.expert_staging)
        self.runner = make_runner(self.window, self.backend, model, config, self.pipeline, table,
                                  (self.landing_slots, staged))
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
