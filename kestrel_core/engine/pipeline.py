"""Layers split over ranks with torch.distributed: a pipeline of processes, each holding a contiguous part of the
model's layers in its own window, on its own device.

Launched by ``torchrun`` (its environment: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), every rank runs
the same command and opens the same run; rank 0 then leads: its token loop (a generation, a batch job, the server's
scheduler) decides every step, and its runner tells the other ranks each call it makes (``tell``), which they make
after it (``follower.follow``). In a step, the first rank embeds the step's tokens, each rank runs its layers on the
hidden state it got and sends the result on, and the last rank computes the logits and sends them to rank 0. Greedy ids
are those of one rank.

    pipe = Pipeline.join(layer_bytes, device)   # None where torchrun did not start this process
    part = model_config.layers(pipe.first_layer, pipe.n_layers)

The split is contiguous and balanced by bytes (``split``). Ranks that disagree on the model, its settings or
kestrel's version are refused at the start, naming the difference; a rank that dies or hangs ends every other's wait
within ``timeout_s`` (``KESTREL_PIPELINE_TIMEOUT_S``, default 300).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import os
import pickle
from typing import TYPE_CHECKING, Any

import attrs

from kestrel_core.errors import ConfigError, KestrelError

if TYPE_CHECKING:
    import torch

DEFAULT_TIMEOUT_S = 300.0
TOLD_BYTES = 4096  # what one broadcast carries of rank 0's calls (a step's fit; a longer prompt takes a second)


def split(layer_bytes: list[int], ranks: int) -> list[tuple[int, int]]:
    """Contiguous parts ``(first, count)`` of the layers, one a rank, whose largest holds the fewest bytes (a streamed
    token costs about the largest part's bytes over one link); of equal splits, the one whose parts end earliest."""
    n = len(layer_bytes)
    if not 1 <= ranks <= n:
        raise ConfigError(f"{ranks} ranks for a model of {n} layers: each rank holds at least one layer; "
                          f"run at most {n} ranks")
    prefix = [0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + b)
    inf = float("inf")
    # best[k][i]: the least largest part of the first i layers in k parts; cut[k][i]: where its last part starts
    best = [[inf] * (n + 1) for _ in range(ranks + 1)]
    cut = [[0] * (n + 1) for _ in range(ranks + 1)]
    best[0][0] = 0
    for k in range(1, ranks + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds, i = [n], n
    for k in range(ranks, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    bounds.reverse()
    return [(a, b - a) for a, b in zip(bounds, bounds[1:])]


@attrs.define(eq=False)
class Pipeline:
    rank: int
    ranks: int
    first_layer: int
    n_layers: int
    parts: list[tuple[int, int]]
    control: Any = None  # the group rank 0 tells its steps over (gloo, no timeout: a server may idle for days)
    # the group the logits go back to rank 0 on: NCCL runs one pair of ranks' sends and receives on a group in order,
    # so rank 0's receive of a micro-batch's logits must not queue behind its send of the next micro-batch
    back: Any = None
    told: list = attrs.Factory(list)  # rank 0's runner calls not yet sent: they go with the next that communicates

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.ranks - 1

    def to_json(self) -> dict:
        return {"rank": self.rank, "ranks": self.ranks, "parts": [list(p) for p in self.parts]}

    # --- a step ------------------------------------------------------------------------------------------------
    def hidden_in(self, rows: int, hidden: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The hidden state of a step's ``rows`` rows, from the rank before."""
        import torch
        import torch.distributed as dist

        h = torch.empty((rows, hidden), dtype=dtype, device=device)
        with self.link():
            dist.recv(h, self.rank - 1)
        return h

    def hidden_out(self, h: torch.Tensor) -> None:
        """This rank's layers' output, to the rank after."""
        import torch.distributed as dist

        h = h.contiguous()
        with self.link():
            dist.send(h, self.rank + 1)

    def logits(self, logits: torch.Tensor | None, rows: int, vocab: int, device: torch.device) -> torch.Tensor:
        """The step's logits, [rows, vocab] float32: the last rank's (``logits``) go to rank 0, which alone chooses
        tokens (it leads); a rank between them gets zeros of that shape (its token loop follows rank 0's and reads
        none), so only one rank's logits cross a link a step."""
        import torch
        import torch.distributed as dist

        if self.last:
            out = logits.float().contiguous()
            if not self.first:
                with self.link():
                    dist.send(out, 0, group=self.back)
            return out
        out = torch.zeros((rows, vocab), dtype=torch.float32, device=device)
        if self.first:
            with self.link():
                dist.recv(out, self.ranks - 1, group=self.back)
        return out

    def send_on(self, h: torch.Tensor) -> Any:
        """A micro-batch's output of this rank's layers, to the rank after, without waiting: the work to wait on (the
        tensor must live until then)."""
        import torch.distributed as dist

        with self.link():
            return dist.isend(h, self.rank + 1)

    def logits_to_first(self, logits: torch.Tensor) -> Any:
        """The last rank: a micro-batch's logits to rank 0, without waiting (the work to wait on)."""
        import torch.distributed as dist

        with self.link():
            return dist.isend(logits, 0, group=self.back)

    def logits_from_last(self, rows: int, vocab: int, device: torch.device) -> torch.Tensor:
        """Rank 0: a micro-batch's logits, [rows, vocab] float32, from the last rank."""
        import torch
        import torch.distributed as dist

        out = torch.empty((rows, vocab), dtype=torch.float32, device=device)
        with self.link():
            dist.recv(out, self.ranks - 1, group=self.back)
        return out

    def sent(self, works: list) -> None:
        """Wait for sends made without waiting (``send_on``, ``logits_to_first``) to complete."""
        with self.link():
            for work in works:
                work.wait()

    @contextlib.contextmanager
    def link(self):
        """A message to or from another rank: where that rank is gone (its connection closed; killed, or ended by its
        own error) or the wait ran past the timeout, a KestrelError in one line, not the backend's traceback."""
        try:
            yield
        except RuntimeError as exc:  # gloo's and NCCL's errors (DistBackendError is one)
            raise KestrelError(f"rank {self.rank} of {self.ranks} lost a rank it exchanges steps with "
                               f"({' '.join(str(exc).split())[:160]}); see that rank's error") from None

    # --- rank 0 leads, the others follow ------------------------------------------------------------------------
    def tell(self, op: tuple, now: bool = False) -> None:
        """Rank 0: a runner call the other ranks make after it (``follower.follow``), sent with the ones before it once a
        call that communicates (``now``: a step, the NaN probe, the end) comes."""
        self.told.append(op)
        if now:
            import torch
            import torch.distributed as dist

            told, self.told = self.told, []
            data = pickle.dumps(told)
            first = torch.zeros(TOLD_BYTES, dtype=torch.uint8)  # one broadcast a step: the length, and the calls
            first[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)
            inline = len(data) <= TOLD_BYTES - 8
            if inline:
                first[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            with self.link():
                dist.broadcast(first, 0, group=self.control)
                if not inline:  # a long prompt's ids: a second broadcast of their size
                    dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=self.control)

    def hear(self) -> list[tuple]:
        """A rank past the first: rank 0's next calls, in order (waits for them, however long rank 0 idles)."""
        import torch
        import torch.distributed as dist

        try:
            first = torch.empty(TOLD_BYTES, dtype=torch.uint8)
            dist.broadcast(first, 0, group=self.control)
            n = int.from_bytes(first[:8].numpy().tobytes(), "little")
            if n <= TOLD_BYTES - 8:
                return pickle.loads(first[8:8 + n].numpy().tobytes())
            rest = torch.empty(n, dtype=torch.uint8)
            dist.broadcast(rest, 0, group=self.control)
            return pickle.loads(rest.numpy().tobytes())
        except RuntimeError as exc:  # rank 0 gone: its connection closed
            raise KestrelError(f"rank {self.rank} of {self.ranks} lost rank 0, whose steps it follows "
                               f"({' '.join(str(exc).split())[:160]}); see rank 0's error") from None

    def first_found(self, where: str | None) -> str | None:
        """Every rank's finding (the NaN probe's first non-finite output in its part, or None), the earliest rank's:
        the ranks hold the layers in order. Every rank calls it."""
        import torch.distributed as dist

        everyone: list = [None] * self.ranks
        with self.link():
            dist.all_gather_object(everyone, where, group=self.control)
        return next((w for w in everyone if w is not None), None)

    def gather(self, mine: Any) -> list:
        """Every rank's ``mine``, in rank order (a summary each rank keeps of its part). Every rank calls it."""
        import torch.distributed as dist

        everyone: list = [None] * self.ranks
        with self.link():
            dist.all_gather_object(everyone, mine, group=self.control)
        return everyone

    # --- the start and the end ---------------------------------------------------------------------------------
    @classmethod
    def join(cls, layer_bytes: list[int], device: torch.device, fingerprint: dict[str, Any]) -> "Pipeline | None":
        """This process's rank of the pipeline torchrun started (None: not started so, or one rank): the process
        group joined, the ranks' fingerprints (the model, its settings, kestrel's version) compared, the part split."""
        rank, ranks = launched_rank()
        if ranks <= 1:
            return None
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            check_master()
            timeout = datetime.timedelta(seconds=timeout_s())  # the rendezvous waits no longer than the other waits
            backend = "gloo" if device.type == "cpu" else "nccl"
            try:
                if device.type == "cuda":
                    torch.cuda.set_device(device)
                dist.init_process_group(backend, timeout=timeout)
            except (ValueError, RuntimeError) as exc:  # torchrun's environment incomplete, or the rendezvous failed
                raise ConfigError(f"rank {rank} of {ranks} could not join the others ({' '.join(str(exc).split())[:200]})"
                                  "; start every rank with torchrun (it sets MASTER_ADDR, MASTER_PORT, RANK and "
                                  "WORLD_SIZE)") from None
        check_alike(rank, ranks, fingerprint)
        parts = split(layer_bytes, ranks)
        first, count = parts[rank]
        control = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))
        back = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s()))  # the world's backend: NCCL on GPUs
        return cls(rank, ranks, first, count, parts, control, back=back)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def micro_batches(rows: int, ranks: int) -> list[tuple[int, int]]:
    """A decode step's ``rows`` cut into contiguous micro-batches, (first row, end) each: one a rank where there are
    rows enough, so that while a rank runs one, the rank before runs the next. Every rank cuts alike."""
    m = max(1, min(rows, ranks))
    base, extra = divmod(rows, m)
    bounds = [0]
    for i in range(m):
        bounds.append(bounds[-1] + base + (i < extra))
    return list(zip(bounds, bounds[1:]))


def check_alike(rank: int, ranks: int, fingerprint: dict[str, Any]) -> None:
    """Every rank runs the same model with the same settings and kestrel: else a ConfigError naming the first
    difference, on every rank."""
    import torch.distributed as dist

    mine = json.dumps(_flat(fingerprint), sort_keys=True, default=str)
    everyone: list[str | None] = [None] * ranks
    dist.all_gather_object(everyone, mine)
    base = json.loads(everyone[0])
    for r, text in enumerate(everyone):
        other = json.loads(text)
        if other != base:
            key = next(k for k in sorted(set(base) | set(other)) if base.get(k) != other.get(k))
            raise ConfigError(f"pipeline rank {r} runs {key} = {str(other.get(key))[:120]} where rank 0 runs "
                              f"{str(base.get(key))[:120]}; start every rank with the same model, settings and "
                              "kestrel")


def _flat(value: Any, at: str = "") -> dict[str, str]:
    """A nested dict as {"a.b.c": value as text}, so that a difference is named by its key."""
    if isinstance(value, dict):
        out: dict[str, str] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{at}.{k}" if at else str(k)))
        return out
    if isinstance(value, (set, frozenset)):  # a set's text follows the process's hash seed: its sorted items do not
        value = sorted(value, key=str)
    return {at: str(value)}


def launched_rank() -> tuple[int, int]:
    """(this process's rank, the ranks) as torchrun's environment gives them; (0, 1) outside a pipeline."""
    ranks = _env_int("WORLD_SIZE", 1)
    if ranks <= 1:
        return 0, 1
    rank = _env_int("RANK", None)
    if rank is None or not 0 <= rank < ranks:
        raise ConfigError(f"WORLD_SIZE is {ranks} but RANK is {os.environ.get('RANK')!r}; start the ranks with "
                          "torchrun, or unset WORLD_SIZE to run one process")
    local, here = _env_int("LOCAL_RANK", None), _env_int("LOCAL_WORLD_SIZE", None)
    if here is not None and not 1 <= here <= ranks:
        raise ConfigError(f"LOCAL_WORLD_SIZE is {here} but WORLD_SIZE is {ranks}: a host runs 1 to WORLD_SIZE of the "
                          "ranks; start the ranks with torchrun, which sets both")
    if local is not None and not 0 <= local < (here if here is not None else ranks):
        raise ConfigError(f"LOCAL_RANK is {local}, past the {here if here is not None else ranks} ranks "
                          f"{'this host runs (LOCAL_WORLD_SIZE)' if here is not None else 'of WORLD_SIZE'}; start the "
                          "ranks with torchrun, which sets both")
    return rank, ranks


def check_master() -> None:
    """MASTER_ADDR and MASTER_PORT, where the ranks meet, as a rank reads them before it joins: set, a port number,
    and a name that resolves (an unknown host is said at once, not after the rendezvous's retries run out)."""
    import socket

    addr, port = os.environ.get("MASTER_ADDR", "").strip(), os.environ.get("MASTER_PORT", "").strip()
    if not addr or not port:
        return  # the rendezvous says what is missing
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"MASTER_PORT={port[:40]!r} is not a port number (1 to 65535); torchrun sets it")
    try:
        socket.getaddrinfo(addr, int(port))
    except (OSError, UnicodeError) as exc:
        raise ConfigError(f"MASTER_ADDR={addr[:80]!r} does not resolve ({exc}); give the address of rank 0's host")


def host_ranks() -> int:
    """The ranks started on this host (torchrun's LOCAL_WORLD_SIZE; 1 outside a pipeline): they share its memory, so
    each takes its share of a budget of host memory."""
    if launched_rank()[1] <= 1:
        return 1
    return max(1, _env_int("LOCAL_WORLD_SIZE", 1))


def host_share(nbytes: int) -> tuple[int, str]:
    """This rank's share of ``nbytes`` of the host's memory, and the words a budget's source adds for it ("" where
    the process is the host's only rank)."""
    ranks = host_ranks()
    return nbytes // ranks, ("" if ranks == 1 else f", shared by the {ranks} ranks of this host")


def _env_int(name: str, default: int | None) -> int | None:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}={text[:40]!r} is not a whole number; torchrun sets it, or unset it") from None


def timeout_s() -> float:
    """How long a rank waits on another (KESTREL_PIPELINE_TIMEOUT_S, default 300 s)."""
    text = os.environ.get("KESTREL_PIPELINE_TIMEOUT_S", "").strip()
    try:
        value = float(text) if text else DEFAULT_TIMEOUT_S
    except ValueError:
        value = -1.0
    if not (0 < value < float("inf")):
        raise ConfigError(f"KESTREL_PIPELINE_TIMEOUT_S={text[:40]!r} must be a number of seconds above 0")
    return value


ACROSS_RANKS = {"generate", "serve", "chat"}  # the commands a pipeline runs (a batch job is generate's)


def check_command(command: str) -> None:
    """A command that cannot run over ranks yet is refused on every rank, before any loads."""
    _, ranks = launched_rank()
    if ranks > 1 and command not in ACROSS_RANKS:
        raise ConfigError(f"kestrel {command} does not run over several ranks yet (torchrun started {ranks}); run it "
                          "as one process, or use kestrel generate or kestrel serve")


def kestrel_version() -> str:
    try:
        return importlib.metadata.version("kestrel")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"
