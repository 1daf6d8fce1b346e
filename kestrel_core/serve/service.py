"""The model behind the server: loaded once, in the background while the server already answers (503 until then),
with one continuous batch (``Scheduler``) that every request joins; requests in, ``Generation``\\ s out; and the
shutdown that stops admitting, lets what runs go on for a grace period, then cuts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import threading
import time
from typing import Any

import attrs

from kestrel_core.formats.chat_template import ChatTemplate, end_ids
from kestrel_core.config import AUTO, KestrelConfig, model_dir
from kestrel_core.engine.run import Model, Run, load
from kestrel_core.errors import ConfigError, KestrelError
from kestrel_core.engine.fit import DEFAULT_CONTEXT, KVRoom
from kestrel_core.engine.batch import LEFT_OUT_CHUNK, check_batch, default_prefill_chunk
from kestrel_core.engine.kvcache import kv_bytes
from kestrel_core.engine.grammar import GrammarError
from kestrel_core.engine.limits import LimitError, RequestLimits, check_max_seq
from kestrel_core.engine.plan import bytes_streamed
from kestrel_core.engine.scheduler import KV_FIX, QueueFull, Scheduler
from kestrel_core.serve import prompts, tool_calls
from kestrel_core.serve.echo import Echo
from kestrel_core.serve.generation import Generation
from kestrel_core.serve.metrics import ServeMetrics
from kestrel_core.serve.protocol import SEED_RANGE, APIError, ChatRequest, CompletionRequest, bad_request

LOADING, READY, STOPPING, FAILED = "loading", "ready", "stopping", "failed"

log = logging.getLogger("kestrel.serve")


@attrs.frozen
class Limits:
    max_batch: int = 8
    max_seq: int | None = None  # None: min(the model's positions, DEFAULT_CONTEXT)
    prefill_chunk: int | None = None  # None: batch.default_prefill_chunk for the run
    max_queue: int = 64
    max_tokens: int = 4096  # a request's max_tokens, at most



class Service:
    def __init__(self, cfg: KestrelConfig, name: str, limits: Limits, chat_max_tokens: int | None = None,
                 seed: int | None = None, aliases: frozenset[str] = frozenset()):
        """``name``: the model's name in the API (what answers carry and /v1/models lists); ``aliases``: other names a
        request may give for it; ``chat_max_tokens``: a chat reply's length where the request gives none (None: what
        the context leaves, up to the limit); ``seed``: a request's where it gives none (None: a new one each
        request)."""
        self.cfg, self.name, self.limits, self.chat_max_tokens = cfg, name, limits, chat_max_tokens
        self.aliases = frozenset(aliases) | {name}
        self.seed = seed
        self.state = LOADING
        self.created = int(time.time())
        self.load_error: BaseException | None = None
        self.model: Model | None = None
        self.run: Run | None = None
        self.scheduler: Scheduler | None = None
        self.template: ChatTemplate | None = None
        self.no_template: str | None = None  # why chat is refused, where the model has no usable template
        self.chat_ends: frozenset[int] = frozenset()
        self.max_seq = 0
        self.live: set[Generation] = set()
        self.address = ""  # where it listens (the command's socket), for its start lines and kestrel_info
        self.metrics = ServeMetrics(self.figures, self.info)  # its own registry: two servers in one process keep theirs apart
        self._lock = threading.Lock()

    # --- loading (a thread of its own) --------------------------------------------------------------
    def load(self) -> None:
        """Load the model, open the run, start the batch and warm it up; any error lands in ``load_error``."""
        try:
            self._load()
        except BaseException as exc:  # noqa: BLE001 - the server reports it and exits
            self.load_error = exc
            with self._lock:
                self.state = FAILED
            with contextlib.suppress(Exception):  # what did open (the model, the run) is closed; the error stays
                self.close()
            return
        with self._lock:
            if self.state == LOADING:
                self.state = READY

    def follow(self) -> None:
        """A pipeline's rank past the first (torchrun started ``kestrel serve`` on every rank): open the same run as
        rank 0, which serves, and make its steps after it until it shuts down."""
        try:
            self._open()
            self.run.follow()
        finally:
            self.close()

    def _load(self) -> None:
        self._open()
        self.scheduler = Scheduler(self.run, self.limits.max_batch, self.max_seq, self.prefill_chunk,
                                   self.limits.max_queue, on_error=self._batch_failed)
        self.scheduler.start()
        # One short generation: the window preloads and the memory figures printed at start are measured ones.
        warm = self.scheduler.submit(self.run.request(prompt_ids=[0], max_new_tokens=min(2, self.max_seq - 1),
                                                      stop_at_eos=False,
                                                      temperature=0.0))
        warm.finished.wait()
        if warm.error is not None:
            raise warm.error

    def check(self) -> None:
        """The model read (its config, tokenizer and chat template, no weights) and checked against what serving needs:
        a tokenizer, and --max-seq within its positions; a ConfigError, the model closed, where it falls short. The
        command calls it before it announces its address (a model it cannot serve was announced, then exited)."""
        if self.model is not None:
            return
        check_batch(self.limits.max_batch, self.limits.prefill_chunk, left_out=LEFT_OUT_CHUNK)
        model = load(model_dir(self.cfg))
        try:
            if model.tokenizer is None:
                raise ConfigError(f"{model.no_tokenizer()}, and kestrel serve answers in text; "
                                  "use `kestrel generate --prompt-ids` for a model without one")
            positions = model.config.max_position_embeddings
            check_max_seq(self.limits.max_seq, positions, str(model.dir))  # was cut to the model's, unsaid
        except BaseException:
            model.close()
            raise
        self.model = model
        try:
            self.template = model.chat_template()
            self.chat_ends = end_ids(model, self.template)
        except ConfigError as exc:  # completions still work; chat says why it cannot
            self.no_template = str(exc)
        self.max_seq = min(positions, self.limits.max_seq or DEFAULT_CONTEXT)

    def _open(self) -> None:
        """The model loaded and its run opened, with room for the batch's KV cache."""
        self.check()
        model = self.model
        self.run = model.open(self.cfg, kv=KVRoom(self.limits.max_batch, self.max_seq, KV_FIX))
        if self.limits.prefill_chunk is not None:
            self.prefill_chunk, self.chunk_why = self.limits.prefill_chunk, "--prefill-chunk"
        else:
            self.prefill_chunk, why = default_prefill_chunk(model.config.is_moe and self.run.expert_policy is not None)
            self.chunk_why = f"the default: {why}"

    @staticmethod
    def _batch_failed(exc: BaseException) -> None:
        """The batch's thread ended on an error: every later request is a 503 that points here."""
        log.error("the batch stopped on an error; restart the server", exc_info=exc)

    def info(self) -> dict[str, str]:
        """What the server runs, as /metrics' kestrel_info labels and the start's ``serving:`` line: the model, the
        backend and its device, keep (``auto:N``: what auto chose), the draft, the pipeline's ranks, the expert
        budget, the batch's sequences and positions, and the address; empty until the run is open."""
        run = self.run
        if run is None:
            return {}
        res, given = run.config.residency, self.cfg.residency.keep
        spec = self.cfg.speculative
        return {"model": str(self.model.dir), "served_as": self.name, "backend": run.config.backend.name,
                "device": str(run.backend.device),
                "keep": f"auto:{res.keep}" if given == AUTO else str(res.keep),
                "draft": f"{spec.draft} ({spec.draft_tokens} tokens)" if run.drafter is not None else "none",
                "ranks": str(run.pipeline.ranks if run.pipeline is not None else 1),
                "expert_budget": f"{res.expert_budget_mb:g} MiB" if run.expert_policy and res.expert_budget_mb
                else "none",
                "max_batch": str(self.limits.max_batch), "max_positions": str(self.max_seq),
                "address": self.address}

    def describe(self) -> list[str]:
        """What the start prints once loaded: what it serves (``info``), the model, its residency settings and the
        memory measured."""
        cfg, run, model = self.run.config, self.run, self.model  # the run's: keep = "auto" resolved
        res = cfg.residency
        lines = ["serving: " + " ".join(f"{k}={v!r}" if " " in v or not v else f"{k}={v}"
                                        for k, v in self.info().items()),f"model: {model.dir} ({model.config.model_type}, {model.n_layers} layers), served as {self.name!r}",
                 f"residency: backend={cfg.backend.name} policy={run.policy.name} keep={res.keep} "
                 f"allocator={res.allocator} prefetch={cfg.backend.prefetch}"
                 + (f" expert_policy={run.expert_policy.name}" if run.expert_policy else ""),
                 f"batch: {self.limits.max_batch} sequences of up to {self.max_seq:,} positions, "
                 f"{self.limits.max_queue} more may wait; max_tokens at most "
                 f"{min(self.limits.max_tokens, self.max_seq - 1):,}",
                 f"prefill: {self.prefill_chunk:,} prompt tokens a step ({self.chunk_why})"]
        c = run.counters.snapshot()
        kv = kv_bytes(model.config, self.max_seq, run.backend.dtype, self.limits.max_batch)
        # In host memory the KV cache's pages become resident as positions are written (kvcache._zeros); on a device
        # the cache grows in steps as the sequences reach further (slots.Slots.reach)
        kv_what = f"KV cache {_mib(kv)} at most, " + ("resident as written" if run.backend.device.type == "cpu"
                                                      else "grown in steps as the sequences reach further")
        memory = [f"weights resident at peak {_mib(c['peak_resident_bytes'])}", kv_what]
        memory += [f"{k.removesuffix('_bytes').replace('_', ' ')} {_mib(v)}"
                   for k, v in run.backend.memory_stats().items() if v]
        rss = _rss_bytes()
        if rss:
            memory.append(f"process RSS {_mib(rss)}")
        lines.append("memory (measured after a warm-up token): " + ", ".join(memory))
        if self.no_template:
            lines.append(f"chat: off ({self.no_template})")
        return lines

    # --- requests (the event loop) ----------------------------------------------------------------------
    def check_model(self, name: str) -> None:
        if name not in self.aliases:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.name!r}",
                           param="model", code="model_not_found")

    def check_ready(self) -> None:
        if self.state == LOADING:
            raise APIError(503, "the model is loading; try again shortly (GET /health answers 200 once it is ready)",
                           "server_error", code="model_loading", headers={"Retry-After": "5"})
        if self.state != READY:
            raise APIError(503, "the server is shutting down and takes no new request", "server_error",
                           code="shutting_down")

    def check_chat(self) -> None:
        if self.template is None:  # the reason in full is in the server's start lines
            raise APIError(400, "this model cannot chat: it has no usable chat template (chat_template.jinja, or "
                           "chat_template in tokenizer_config.json); send a prompt to /v1/completions instead",
                           param="messages", code="no_chat_template")

    def plan(self, req: CompletionRequest | ChatRequest) -> dict[str, Any]:
        """The request as kestrel's: prompt ids and generation settings, every limit checked (a worker thread's job:
        tokenizing and rendering take time)."""
        model = self.model
        limits = RequestLimits(self.max_seq, "this server", model.config.vocab_size, self.limits.max_tokens,
                               "max_tokens", "--max-seq")
        chat = isinstance(req, ChatRequest)
        room = self.limits.max_batch + self.limits.max_queue
        if req.choices > room:  # no retry could fit them: a 400, where a busy batch's 429 says to try again
            raise bad_request(f"n={req.choices} can never fit: each choice is a sequence, and this server runs "
                              f"{self.limits.max_batch} (--max-batch) and queues {self.limits.max_queue} more "
                              f"(--max-queue); ask for n at most {room}", "n")
        try:
            return self._plan(req, chat, limits)
        except LimitError as exc:  # a limit's one wording, in OpenAI's shape
            raise bad_request(str(exc), exc.param, exc.code) from None

    def _plan(self, req, chat: bool, limits: RequestLimits) -> dict[str, Any]:
        model = self.model
        grammar = None
        if chat:
            self.check_chat()
            grammar = self._forced_call(req)  # a template with no call format: tool_choice's 400, before the tools'
            ids = prompts.chat_ids(model.tokenizer, self.template, req.conversation(), req.chat_template_kwargs, limits,
                                   req.tool_defs)
        else:
            ids = prompts.completion_ids(model.tokenizer, limits, req.prompt)
        default = self.chat_max_tokens if chat else self.cfg.generation.max_new_tokens
        # Scoring a prompt alone: its prefill, and the one token every sequence draws, which the answer leaves out
        n = limits.budget(1 if req.scores_only else req.max_tokens, len(ids), "messages" if chat else "prompt", default)
        # What ends it: the request's stop ids always; the model's end ids (and the template's end of turn) unless
        # the request or the server ignores them.
        ends = set(limits.ids(req.stop_token_ids or (), "stop_token_ids"))
        if self.cfg.generation.stop_at_eos and not req.ignore_eos:
            ends |= model.eos_ids | (self.chat_ends if chat else frozenset())
        generation = req.generation()
        if "seed" not in generation:  # a sampled request without a seed draws differently each time, as OpenAI's
            generation["seed"] = self.seed if self.seed is not None else secrets.randbits(63)
        try:
            request = self.run.request(prompt_ids=ids, max_new_tokens=n, stop_at_eos=bool(ends), stop_ids=ends,
                                       json_schema=req.output_schema, grammar=grammar, **generation)
        except LimitError:
            raise  # a logit_bias id past the vocabulary: a 400 naming the parameter, above
        except GrammarError as exc:  # a forced call's grammar holds the tools' parameters
            param = "tools" if grammar is not None else "response_format"
            raise bad_request(f"{param}: {exc}", param) from None
        except ConfigError as exc:
            raise APIError(400, str(exc)) from None
        echo = not chat and bool(req.echo)
        request = attrs.evolve(request, eos_ids=frozenset(ends), logprobs=req.top_count,
                               prompt_logprobs=req.top_count if echo else None)
        return {"request": request, "stop": req.stop_strings, "n": req.choices,
                "echo": Echo(model.tokenizer, ids) if echo else None}

    def _forced_call(self, req: ChatRequest) -> str | None:
        """The grammar of a reply that is only calls, where tool_choice forces one (in the template's call format)."""
        if not req.forces_call:
            return None
        if req.ignore_eos:
            raise bad_request("a tool_choice that forces a call ends the reply once the call is whole, at an "
                              "end-of-sequence token; leave out ignore_eos", "ignore_eos")
        try:
            return tool_calls.forced(self.template.source, req.tool_defs, req.called_function, req.call_limit == 1)
        except tool_calls.NoCallFormat as exc:
            raise bad_request(str(exc), "tool_choice") from None
        except GrammarError as exc:
            raise bad_request(f"tools: {exc}", "tools") from None

    def start(self, plan: dict[str, Any]) -> list[Generation]:
        """Join the batch, each of the request's ``n`` choices a sequence (all of them, or a 429 where the batch and
        its queue have no room for them now; ``plan`` refused an ``n`` they could never hold). Sampled choices draw with seeds seed, seed + 1, ...; greedy ones are equal."""
        self.check_ready()
        request = plan["request"]
        ends = request.eos_ids if request.gen.stop_at_eos else frozenset()
        loop = asyncio.get_running_loop()
        gens = [Generation(loop, self.model.tokenizer, plan["stop"], ends, len(request.prompt_ids))
                for _ in range(plan["n"])]
        if self.scheduler.error is not None:
            raise APIError(503, "the batch stopped on an error (logged by the server); restart the server",
                           "server_error", code="batch_failed")
        requests = [attrs.evolve(request, gen=attrs.evolve(request.gen, seed=(request.gen.seed + i) % SEED_RANGE),
                                 on_token=gen.on_token, on_finish=gen.on_finish,
                                 on_logprobs=gen.on_logprobs if request.logprobs is not None else None)
                    for i, gen in enumerate(gens)]
        try:
            seqs = self.scheduler.submit_all(requests)
        except QueueFull as exc:
            raise APIError(429, f"the server is busy: {exc}", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except LimitError as exc:  # the context, checked again by the scheduler
            raise bad_request(str(exc), exc.param, exc.code) from None
        for gen, seq in zip(gens, seqs):
            gen.seq = seq
            self.live.add(gen)
        return gens

    def done(self, gen: Generation) -> None:
        self.live.discard(gen)

    def stats(self) -> dict[str, int]:
        s = self.scheduler
        return {"running": s.running, "waiting": s.waiting} if s is not None else {}

    def figures(self) -> dict[str, float]:
        """What /metrics reads at a scrape: the batch's sequences, the bytes the run has streamed, the KV cache's bytes
        and, where the backend reports one, the device memory's peak (none while the model loads)."""
        s, run = self.scheduler, self.run
        if s is None or run is None:
            return {}
        running = s.running
        out = {"running": running, "waiting": s.waiting, "occupancy": running / s.max_batch,
               "bytes_streamed": bytes_streamed(run.runner.snapshot()), "kv_cache_bytes": s.kv_cache_bytes}
        peak = run.backend.memory_stats().get("device_peak_bytes")
        if peak is not None:
            out["device_peak_bytes"] = peak
        return out

    @property
    def health(self) -> str:
        """What /health says: ``ready`` only while requests can be served (a stopped batch cannot)."""
        if self.state == READY and self.scheduler is not None and self.scheduler.error is not None:
            return "batch_failed"
        return self.state

    # --- the end -----------------------------------------------------------------------------------------
    def begin_shutdown(self, grace_s: float) -> None:
        """Admit no more; what runs may go on for ``grace_s`` seconds, then is cut (its stream still ends cleanly)."""
        with self._lock:
            if self.state in (LOADING, READY):
                self.state = STOPPING
        asyncio.get_running_loop().call_later(grace_s, self.cut_all)

    def cut_all(self) -> None:
        for gen in list(self.live):
            gen.cut("the server is shutting down")

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop(cancel=True, timeout=30)
        if self.run is not None:
            self.run.close()
        if self.model is not None:
            self.model.close()


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
