"""The runner: it owns every step of a run. One layer loop serves prefill, decode and the NaN probe, and the
runner executes every plan the window makes, through the backend.

A decode step reads its token and position from device tensors and writes the next token back
there, so the host never waits for a token before it launches the next step. Greedy decoding
never waits on a token to launch the next step: each step's token (and whether its logits were
finite) is copied to host memory without a wait and read one step later, so a step may run
past an end-of-sequence token. That step is dropped, with its counters, and ``on_token`` hears
of a token only once it is read back: exactly the tokens of the result, in order.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable

import attrs
import torch

from .config import GenerationConfig
from .contracts import Backend
from .errors import BudgetError, NonFiniteError
from .expert_schedule import ExpertSchedule, is_expert
from .kvcache import KVCache, allocate_cache
from .model import Attend, RopeTable, decoder_layer, route
from .modelconfig import ModelConfig
from .plan import Boundary, Plan, delta
from .residency import Window
from .results import MODES, GenerationResult
from .sampling import Sampler
from .step_graphs import StepGraphs

Probe = Callable[[str, torch.Tensor], None]  # (where, hidden state): sees each layer's output on the error path


@attrs.frozen
class StepSettings:
    graphs: bool  # replay a repeating decode step as a captured graph, where the backend can
    compile: bool  # the decode step's layer math through torch.compile
    expert_table: bool = False  # a decode step reads its routed experts through the backend's expert table


@functools.cache
def _compiled_layer():
    return torch.compile(decoder_layer, dynamic=False)


def layer_math(compile: bool):
    """``decoder_layer``, or its torch.compile'd twin (one per process: its kernels are reused across runs)."""
    return _compiled_layer() if compile else decoder_layer


class DecodeState:
    """What a decode step reads and writes on the compute device; a captured graph keeps these addresses."""

    def __init__(self, device: torch.device, rope: RopeTable, max_seq: int, greedy: bool, routed: tuple[int, int] = (0, 0)):
        # [the token, whether this step's logits were not finite, then each sparse layer's routed experts]: one row the
        # host reads back a step late (``routed``: sparse layers x experts a token, where the step reads the table)
        self.out = torch.zeros(2 + routed[0] * routed[1], dtype=torch.long, device=device)
        self.io = self.out[:2]
        self.routed = self.out[2:].view(routed)
        self.position = torch.zeros(1, dtype=torch.long, device=device)  # where the token goes
        self.key_positions = torch.arange(max_seq, device=device)
        self.rope = rope
        self.greedy = greedy  # the step writes its argmax into io[0]; otherwise the host samples from logits
        self.logits: torch.Tensor | None = None  # the last step's [vocab] float32

    def start(self, token: int, position: int) -> None:
        self.io[0].fill_(token)
        self.position.fill_(position)


class Readback:
    """Each step's row (the token, the non-finite flag, the routed experts) copied into (pinned) host memory without a
    wait, read a step or more later."""

    def __init__(self, backend: Backend, state: DecodeState, depth: int = 4):
        self.backend, self.state = backend, state
        self.ring = torch.zeros((depth, state.out.numel()), dtype=torch.long, pin_memory=backend.device.type == "cuda")

    def push(self, k: int):
        self.ring[k % len(self.ring)].copy_(self.state.out, non_blocking=True)
        return self.backend.mark()

    def read(self, k: int, mark) -> tuple[int, bool, list[list[int]]]:
        """Step k's token, whether its logits were not finite, and each sparse layer's routed experts."""
        self.backend.wait(mark)
        row = self.ring[k % len(self.ring)].tolist()
        width = self.state.routed.shape[1]
        return row[0], bool(row[1]), [row[i:i + width] for i in range(2, len(row), width)] if width else []


@attrs.define
class _Step:
    before: dict[str, int]  # counters before its plans
    after: dict[str, int]  # and after (planning is where they move)
    mode: str  # how it ran: eager, captured or replayed
    mark: object  # the backend's marker, recorded once its token was on its way to the host
    logits: torch.Tensor | None  # kept for keep_logits, on the device
    heard: dict[str, int] = attrs.Factory(dict)  # what hearing its routing, a step later, moved in the counters


class Runner:
    """Owns each step of a run on ``window`` and ``backend``: it plans through the window, executes every plan through
    the backend, and runs the layers."""

    def __init__(self, window: Window, backend: Backend, cfg: ModelConfig, settings: StepSettings):
        self.window, self.backend, self.cfg, self.settings = window, backend, cfg, settings
        self.counters = window.counters
        self.sparse = [layer for layer in range(cfg.num_hidden_layers) if window.sparse[layer]]
        self.schedule = ExpertSchedule() if settings.expert_table and self.sparse else None

    # --- plans --------------------------------------------------------------------------------
    def execute(self, plan: Plan | None) -> None:
        """Execute a plan in stream order (the expert table, where there is one, follows it at once)."""
        if plan is None or not (plan.evict or plan.fetch):
            return
        self.backend.execute(plan)
        if self.schedule is not None:
            host = [r.unit.key for r in plan.evict if is_expert(r.unit.key)]
            slots = [(f.unit.key, f.buffers) for f in plan.fetch if is_expert(f.unit.key)]
            if host or slots:
                self.schedule.evict_now(host, plan.layer)
                self.schedule.admit_now((key for key, _ in slots), plan.layer)
                self.backend.point_experts(host, slots)

    def hear(self, step: int, routed: list[list[int]]) -> None:
        """Decode step ``step``'s routing, read back: the window plans on it a step behind (the expert policy hears it,
        and the experts the step read from their host copies are its misses); the plan's uploads start at once on the
        side stream, and the table follows them on the schedule."""
        window, schedule = self.window, self.schedule
        for layer, chosen in zip(self.sparse, routed):
            experts = sorted(set(chosen))
            missed = {e for e in experts if schedule.read_host((layer, e), step)}
            plan = window.hear(layer, experts, "decode", token=step + 1, missed=missed)
            if plan.evict or plan.fetch:
                self.backend.execute(plan)
                host = [r.unit.key for r in plan.evict if is_expert(r.unit.key)]
                schedule.evict_heard(host)
                for f in plan.fetch:
                    if is_expert(f.unit.key):
                        schedule.admit_heard(f.unit.key, f.buffers)
                if host:
                    self.backend.point_experts(host, [])

    def begin_step(self) -> None:
        """Before a decode step is launched: the admissions it reads from their slots."""
        if self.schedule is not None:
            slots = self.schedule.begin_step()
            if slots:
                self.backend.point_experts([], slots)

    def preload(self) -> None:
        self.execute(self.window.preload())

    def release_all(self) -> None:
        self.execute(self.window.release_all())

    # --- the one layer loop ---------------------------------------------------------------------
    def layers(self, h: torch.Tensor, at: Attend, cache: list[KVCache], boundaries: Iterable[Boundary], phase: str,
               layer_fn=decoder_layer, probe: Probe | None = None, state: "DecodeState | None" = None) -> torch.Tensor:
        """Run every layer on ``h``: at each boundary, execute its plan, order the compute after the layer's upload,
        run the layer (a sparse one reads its routed experts: through the table in a decode step that has one, else
        after the host has routed and fetched them)."""
        backend, cfg = self.backend, self.cfg
        for layer, b in enumerate(boundaries):
            self.execute(b.plan)
            backend.before_use(b.key)
            experts = None
            if self.window.sparse[layer]:
                experts = (self._table_experts(layer, state) if state is not None and self.schedule is not None
                           else self._host_experts(layer, phase))
            h = layer_fn(h, b.weights, backend.small[layer], cache[layer], at, cfg, backend.linear, experts)
            if probe:
                probe(f"layer {layer}", h)
            del b  # a buffer its plan freed dies here, not at the end of the token
        return h

    def _table_experts(self, layer: int, state: "DecodeState"):
        """A sparse layer's experts in a decode step that reads them through the expert table: no host in the loop.
        The routed ids go to the step's row, which the host reads back a step late."""
        backend, row = self.backend, state.routed[self.sparse.index(layer)]

        def experts(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
            row.copy_(chosen[0])
            return backend.routed_experts(layer, x, weights, chosen)

        return experts

    def _host_experts(self, layer: int, phase: str):
        """A sparse layer's experts routed on the host: at its decision point the host learns the routed experts (the
        one sync a sparse layer needs), the window plans their fetch, and the layer reads them from their buffers.

        With speculative prefetch, a decode step also applies the next layer's router to this layer's hidden state ``x``
        and learns its guess in the same sync; their fetch runs on the side stream.
        """
        window, backend, cfg = self.window, self.backend, self.cfg
        n = cfg.num_experts

        def decide(chosen: torch.Tensor, x: torch.Tensor) -> tuple[list[int], dict]:
            """``used``: one token's experts in slot order (``sparse_mlp`` reads its weights by slot), else the distinct ones."""
            ids = chosen[0] if chosen.shape[0] == 1 else torch.unique(chosen)  # one token's k experts are distinct
            guess = window.guess_router(layer) if phase == "decode" else None
            if guess is None:
                used = ids.tolist()
                plan, weights = window.route(layer, sorted(used), phase)
            else:
                key, router = guess
                backend.before_use(key)
                guessed = route(x, router, cfg, backend.linear)[1]
                both = torch.cat((ids, torch.unique(guessed) + n)).tolist()
                used = [e for e in both if e < n]
                plan, weights = window.route(layer, sorted(used), phase, guess=[e - n for e in both if e >= n])
            self.execute(plan)
            for e in used:
                backend.before_use((layer, e))
            return used, weights

        def experts(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
            used, routed = decide(chosen, x)
            return backend.fetched_experts(x, weights, chosen, used, routed)

        return experts

    def forward(self, ids: list[int], start: int, cache: list[KVCache], rope: RopeTable, phase: str,
                probe: Probe | None = None) -> torch.Tensor:
        """Logits of the last position of ``ids`` at ``start``, each boundary planned as the loop reaches it (prefill,
        and the NaN probe). ``probe(where, h)`` sees the hidden state after the embedding and after each layer."""
        backend = self.backend
        at = Attend.prefill(rope, start, len(ids), backend.device)
        h = backend.embed(torch.tensor(ids))
        if probe:
            probe("the embedding", h)
        h = self.layers(h, at, cache, self.window.boundaries(phase), phase, probe=probe)
        return backend.logits(h[-1:])[0]

    def decode_step(self, state: DecodeState, cache: list[KVCache], boundaries: Iterable[Boundary]) -> None:
        """One token's layers over ``boundaries``; the next token (greedy) and the position move on on the device."""
        backend = self.backend
        at = Attend.static(state.rope, state.position, state.key_positions)
        h = backend.embed(state.io[:1])
        h = self.layers(h, at, cache, boundaries, "decode", layer_math(self.settings.compile), state=state)
        logits = backend.logits(h)[0]
        if state.greedy:
            state.io[:1].copy_(torch.argmax(logits, dim=-1, keepdim=True))
        state.io[1].copy_(~torch.isfinite(logits).all())
        state.position.add_(1)
        state.logits = logits

    # --- NaN and inf ------------------------------------------------------------------------------
    def check_finite(self, logits: torch.Tensor, ids: list[int], start: int, cache: list[KVCache], rope: RopeTable,
                     phase: str) -> None:
        """Stop at a logit row holding NaN or inf (see ``nonfinite``)."""
        if not bool(torch.isfinite(logits).all()):
            raise self.nonfinite(ids, start, cache, rope, phase)

    def nonfinite(self, ids: list[int], start: int, cache: list[KVCache], rope: RopeTable, phase: str) -> NonFiniteError:
        """The error for non-finite logits at this step, naming the first part of the model whose output went non-finite.

        The search runs the step again through the same layer loop with a probe: on the error path only.
        """
        found: list[str] = []

        def probe(where: str, h: torch.Tensor) -> None:
            if not found and not bool(torch.isfinite(h).all()):
                found.append(where)

        self.forward(ids, start, cache, rope, phase, probe)  # rewrites this step's K/V with the same values
        where = found[0] if found else "the final norm and lm_head"
        dtype = str(self.backend.dtype).replace("torch.", "")
        wider = ", or compute in float32 (--dtype float32)" if self.backend.dtype in (torch.float16, torch.bfloat16) else ""
        return NonFiniteError(
            f"the logits at position {start + len(ids) - 1} hold NaN or inf, first in the output of {where}: "
            f"the weights there hold NaN/inf, or {dtype} overflowed; re-create or re-download the checkpoint{wider}"
        )

    # --- the token loop ---------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], gen: GenerationConfig, eos_ids: frozenset[int], keep_logits: bool = False,
                 on_token: Callable[[int], None] | None = None) -> GenerationResult:
        """Generate from ``prompt_ids`` (checked by the caller). ``on_token(id)`` is called with each token of the result
        as soon as it is read back (the first from the prefill); ``eos_ids`` end the generation where ``gen.stop_at_eos``."""
        try:
            return self._generate(prompt_ids, gen, eos_ids, keep_logits, on_token)
        except torch.cuda.OutOfMemoryError:
            budget = self.backend.budget
            hint = f" (weight-cache budget {budget // 2**20} MiB)" if budget else ""
            raise BudgetError(
                f"CUDA out of memory during generation{hint}: lower --budget-mb / KESTREL_WCACHE_MB, keep, or --max-new-tokens"
            ) from None

    def _generate(self, prompt_ids: list[int], gen: GenerationConfig, eos_ids: frozenset[int], keep_logits: bool,
                  on_token: Callable[[int], None] | None) -> GenerationResult:
        cfg, backend, window, counters = self.cfg, self.backend, self.window, self.counters
        sampler = Sampler(gen)
        max_seq = len(prompt_ids) + gen.max_new_tokens
        cache = allocate_cache(cfg, max_seq, backend.dtype, backend.device)
        fixed = counters.resident_bytes
        greedy = gen.temperature == 0
        with torch.inference_mode():
            rope = RopeTable(cfg, max_seq, backend.dtype, backend.device)
            self.preload()
            backend.synchronize()
            t0 = backend.mark()
            logits = self.forward(prompt_ids, 0, cache, rope, "prefill")
            self.check_finite(logits, prompt_ids, 0, cache, rope, "prefill")
            token = sampler(logits)
            prefill_end = backend.mark()
            prefill_ms = backend.elapsed_ms(t0, prefill_end)
            tokens = [token]
            if on_token:
                on_token(token)
            width = (len(self.sparse), cfg.num_experts_per_tok) if self.schedule is not None else (0, 0)
            state = DecodeState(backend.device, rope, max_seq, greedy, width)
            state.start(token, len(prompt_ids))
            graphs = StepGraphs(window, backend, self.settings.graphs, experts_in_step=self.schedule is not None)
            readback = Readback(backend, state)
            lag = 1 if greedy else 0  # a sampled token is on the host already
            steps: list[_Step] = []
            stop = gen.stop_at_eos and token in eos_ids

            def step(boundaries: Iterable[Boundary]) -> None:
                self.decode_step(state, cache, boundaries)

            def take(k: int) -> bool:
                """Read step k's token (and hear its routing); whether it ends the generation."""
                token, bad, routed = readback.read(k, steps[k].mark)
                if bad:
                    raise self.nonfinite([tokens[k]], len(prompt_ids) + k, cache, rope, "decode")
                if routed:
                    before = counters.snapshot()
                    self.hear(k, routed)
                    steps[k].heard = delta(counters.snapshot(), before)
                tokens.append(token)
                if on_token:
                    on_token(token)
                return gen.stop_at_eos and token in eos_ids

            try:
                while not stop and 1 + len(steps) < gen.max_new_tokens:
                    window.next_token()
                    self.begin_step()
                    before = counters.snapshot()
                    mode = graphs(step)
                    after = counters.snapshot()
                    if not greedy:  # the sampler reads the logits on the host anyway: check them there
                        self.check_finite(state.logits, [tokens[-1]], len(prompt_ids) + len(steps), cache, rope, "decode")
                        state.io[0].fill_(sampler(state.logits))
                    mark = readback.push(len(steps))
                    steps.append(_Step(before, after, mode, mark, state.logits.clone() if keep_logits else None))
                    while len(tokens) - 1 < len(steps) - lag and not stop:
                        stop = take(len(tokens) - 1)
                while len(tokens) - 1 < len(steps) and not stop:
                    stop = take(len(tokens) - 1)
            finally:
                graphs.close()
            kept = steps[: len(tokens) - 1]  # a step launched past the end of sequence is dropped
            final = counters.snapshot()  # with every kept step heard; less what the dropped steps planned
            for s in steps[len(kept):]:
                final = {k: v - s.after[k] + s.before[k] if not k.startswith(("peak_", "resident_")) else v
                         for k, v in final.items()}
            marks = [prefill_end] + [s.mark for s in kept]
            decode_ms = [backend.elapsed_ms(a, b) for a, b in zip(marks, marks[1:])]
            all_logits = [logits.cpu()] + [s.logits.cpu() for s in kept] if keep_logits else None
        return GenerationResult(
            prompt_ids=list(prompt_ids),
            token_ids=tokens,
            prefill_ms=prefill_ms,
            decode_ms=decode_ms,
            counters=final,
            per_token=[_plus(delta(s.after, s.before), s.heard) for s in kept],
            memory=backend.memory_stats(),
            fixed_resident_bytes=fixed,
            logits=all_logits,
            steps={m: sum(s.mode == m for s in kept) for m in MODES},
            step_modes=[s.mode for s in kept],
        )


def _plus(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: v + b.get(k, 0) for k, v in a.items()}
