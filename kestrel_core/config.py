"""Run configuration: attrs classes loaded from ``kestrel.toml``; flags override the file."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any, Callable

import attrs

from kestrel_core.errors import ConfigError
from kestrel_core.io.json_keys import TOO_MANY_DIGITS
from kestrel_core.io.readfile import read_bounded

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

OFF = "off"
AUTO = "auto"  # keep: chosen from the backend's budget when a run opens
# Environment variables that beat a setting of the config file (whole MiB).
WCACHE_ENV = "KESTREL_WCACHE_MB"  # [residency] budget_mb
HOST_ENV = "KESTREL_HOST_MB"  # [backend] host_budget_mb
GRAPHS = ("auto", "off")
MICRO_BATCHES = ("auto", "on", "off")
GGUF_KERNELS = ("auto", "float", "int8")
LAYER_OPS = ("auto", "fused", "torch")
HOST_KERNELS = ("auto", "off")
TOML_LIMIT = 2**20  # kestrel.toml holds a few settings
EXPERT_FETCH = ("routed", "layer")
EXPERT_DECODE = ("auto", "table", "host")


def parse_ids(text: str) -> list[int]:
    """``--prompt-ids 1,2,3`` as ids."""
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise ConfigError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def parse_keep(value: Any) -> int | str:
    """``keep`` is a positive layer count, 'off' (no window: every layer stays resident) or 'auto' (the backend's budget
    picks: every layer resident where the model fits it, else the largest window that does; ``engine.fit``)."""
    if value is None or value == OFF:
        return OFF
    if value == AUTO:
        return AUTO
    if isinstance(value, (bool, float)):  # int(2.5) would quietly give 2
        raise ConfigError(f"keep must be a layer count, 'off' or 'auto', got {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"keep must be a layer count, 'off' or 'auto', got {value!r}") from None


LOGIT_BIAS_MAX = 100.0  # OpenAI's bound on a logit_bias value
LOGIT_BIAS_IDS = 300  # OpenAI's bound on how many ids a logit_bias names


def parse_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """``logit_bias``: token id -> a bias in -100..100 (a dict, its keys ids or their decimal strings as JSON and TOML
    give them; or (id, bias) pairs), as sorted (id, bias) pairs; ids in the vocabulary are checked by the run."""
    if value is None:
        return ()
    items = value.items() if isinstance(value, dict) else value
    try:
        pairs = [(k, v) for k, v in items]
    except (TypeError, ValueError):
        raise ConfigError(f"logit_bias must map token ids to biases, e.g. {{\"50256\": -100}}, got {value!r}"[:200]) from None
    if len(pairs) > LOGIT_BIAS_IDS:
        raise ConfigError(f"logit_bias names {len(pairs)} token ids; at most {LOGIT_BIAS_IDS}")
    out, given = {}, {}
    for k, v in pairs:
        tid = _token_id(k)
        if tid in out:  # "3" and "03" name one token: which bias was meant?
            raise ConfigError(f"logit_bias names token {tid} twice ({_shown(given[tid])} and {_shown(k)}); "
                              "give each id once")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or abs(v) > LOGIT_BIAS_MAX:
            raise ConfigError(f"logit_bias: the bias of token {tid} must be a number in -100..100, got {v!r}")
        out[tid], given[tid] = float(v), k
    return tuple(sorted(out.items()))


_ID_DIGITS = 18  # a token id of more digits is past any vocabulary (and past int()'s 4,300, Python's error)


def _token_id(key: Any) -> int:
    """A logit_bias key as a token id: an int >= 0, or its ASCII decimal digits and nothing else (str.isdigit and int()
    would take " 3 ", "\u0663" or "3_0" as ids too, which OpenAI refuses)."""
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    if isinstance(key, str) and key.isascii() and key.isdigit():
        if len(key) > _ID_DIGITS:
            raise ConfigError(f"logit_bias: the key {_shown(key)} has {len(key):,} digits; a token id has at most "
                              f"{_ID_DIGITS} (no vocabulary is larger)")
        return int(key)
    raise ConfigError(f"logit_bias: the key {_shown(key)} is not a token id; give ids as ASCII decimal digits "
                      "(a whole number >= 0, e.g. \"50256\")")


def _shown(key: Any) -> str:
    """A key as an error quotes it: its repr, cut where it is long."""
    text = repr(key)
    return text if len(text) <= 40 else text[:36] + "...'"


MAX_MIB = 2**40  # MiB: a budget beyond an exabyte is a typo, and would overflow the byte counts built from it


def env_mib(name: str) -> int | None:
    """The bytes an environment variable gives in whole MiB (a budget that beats the config), or None where unset."""
    env = os.environ.get(name)
    if not env:
        return None
    try:
        mb = int(env)
    except ValueError:
        raise ConfigError(f"{name}={env!r} must be a whole number of MiB; fix or unset it") from None
    if mb <= 0:
        raise ConfigError(f"{name}={mb} must be positive; unset it for the default")
    if mb > MAX_MIB:
        raise ConfigError(f"{name}={mb} MiB is beyond any machine (at most 2**40); fix or unset it")
    return mb * 2**20


def check_environment() -> None:
    """Parse every budget the environment sets, whichever backend runs: a bad one is an error on all of them
    (call where a run opens; a backend that uses neither would otherwise never look)."""
    for name in (WCACHE_ENV, HOST_ENV):
        env_mib(name)


# --- field checks: the same rule for kestrel.toml, flags, Model.open and Run.generate ------------

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check(ok: Callable[[Any], bool], rule: str) -> Callable:
    """An attrs validator: ``value`` must satisfy ``ok``; the error names the field (its flag) and the rule.
    A value of the wrong type is left to ``_build``'s type check (toml) or to Python (the API), as before."""
    def validate(instance, attribute, value):
        if isinstance(value, (str, bool)) or value is None:
            return
        if not ok(value):
            flag = attribute.name.replace("_", "-")
            raise ConfigError(f"{attribute.name} (--{flag}) must be {rule}, got {value!r}")
    return validate


def _real_in(lo: float, hi: float = MAX_MIB, lo_open: bool = False) -> Callable[[Any], bool]:
    return lambda v: _is_real(v) and math.isfinite(v) and (lo < v if lo_open else lo <= v) and v <= hi


def _int_in(lo: int, hi: int) -> Callable[[Any], bool]:
    return lambda v: _is_int(v) and lo <= v <= hi


_MIB_OR_DEFAULT = "a finite number of MiB, 0..2**40 (0: the default)"


@attrs.frozen
class BackendConfig:
    name: str = "cpu_ref"
    dtype: str = ""  # compute dtype; empty means the backend's default
    prefetch: int = attrs.field(default=0, validator=_check(_int_in(0, 2**20), "a layer count >= 0"))  # layers uploaded ahead
    device: str = ""  # e.g. "cuda:1"; empty means the backend's default
    graphs: str = attrs.field(default="auto")  # "auto": replay a repeating decode step where the backend can capture; "off": eager

    compile: bool = False  # run the decode step's layer math through torch.compile (fused kernels; the first step compiles)
    # pinned host MiB for streamed weights (cuda; fractions allowed); 0: all where half the RAM holds them, else a ring
    host_budget_mb: float = attrs.field(default=0.0, validator=_check(_real_in(0), _MIB_OR_DEFAULT))
    # cpu_ref: the torch threads a run computes on; 0: the cores this process may use (os.sched_getaffinity), shared
    # among the ranks of a pipeline on this host
    threads: int = attrs.field(default=0, validator=_check(_int_in(0, 4096), "a whole number of threads, 0..4096 (0: the cores this process may use)"))
    # ranks: a decode step of several rows goes through the pipeline in micro-batches, so the ranks work at once; "auto":
    # on for cuda (a device a rank), off for cpu_ref (the ranks of one host share its cores and memory bandwidth)
    micro_batches: str = attrs.field(default="auto")
    # cuda: the kernels a GGUF's blocks run through: "float" (dequantized in the kernel, float32 sums), "int8" (x
    # quantized to two int8 digits a value, int8 dot products; from 16 rows on the tensor cores), or "auto": decode
    # rows and verify spans through the float kernels, a prompt's rows through the int8 ones (each row's bits then
    # follow its kind alone: ``Attend.prompt_from``)
    gguf_kernels: str = attrs.field(default="auto")
    # the steps between a layer's linears (norms, rotary, residual adds, SiLU): "auto" (the backend's fused kernels
    # where it has them: cuda with Triton; 8B Q4_K_M off on an H100, 5.86 -> 3.62 ms a token, stream_20261207T165140Z),
    # "fused" (those, or an error), "torch" (torch's ops)
    layer_ops: str = attrs.field(default="auto")
    # cpu_ref: a GGUF's Q8_0, Q4_0, Q4_K and Q6_K linears: "auto" (held as the file's blocks and computed by the host
    # GGUF kernel, x quantized to 8 bits a value; float32 dequantization where the kernel cannot build), "off" (each
    # fetch dequantizes them to the compute dtype)
    host_kernels: str = attrs.field(default="auto")

    @host_kernels.validator
    def _check_host_kernels(self, _, value: str) -> None:
        if value not in HOST_KERNELS:
            raise ConfigError(f"host_kernels must be one of {', '.join(HOST_KERNELS)}, got {value!r}")

    @layer_ops.validator
    def _check_layer_ops(self, _, value: str) -> None:
        if value not in LAYER_OPS:
            raise ConfigError(f"layer_ops must be one of {', '.join(LAYER_OPS)}, got {value!r}")

    @gguf_kernels.validator
    def _check_gguf_kernels(self, _, value: str) -> None:
        if value not in GGUF_KERNELS:
            raise ConfigError(f"gguf_kernels must be one of {', '.join(GGUF_KERNELS)}, got {value!r}")

    @micro_batches.validator
    def _check_micro_batches(self, _, value: str) -> None:
        if value not in MICRO_BATCHES:
            raise ConfigError(f"micro_batches must be one of {', '.join(MICRO_BATCHES)}, got {value!r}")

    @graphs.validator
    def _check_graphs(self, _, value: str) -> None:
        if value not in GRAPHS:
            raise ConfigError(f"graphs must be one of {', '.join(GRAPHS)}, got {value!r}")


@attrs.frozen
class ResidencyConfig:
    policy: str = "asymmetric"
    keep: int | str = attrs.field(default=AUTO, converter=parse_keep)
    allocator: str = "pool"
    pool_slots: int = attrs.field(default=128, validator=_check(_int_in(0, 2**31), "a whole number >= 0"))
    # device weight-cache budget; 0 means the backend's default
    budget_mb: int = attrs.field(default=0, validator=_check(_int_in(0, MAX_MIB), "whole MiB, 0..2**40 (0: the default)"))
    expert_policy: str = ""  # Mixture-of-Experts: e.g. expert_lru; empty: an expert stays until its layer goes
    # the bytes the expert policy keeps experts in (MiB; fractions allowed)
    expert_budget_mb: float = attrs.field(default=0.0, validator=_check(_real_in(0), "a finite number of MiB, 0..2**40"))
    expert_prefetch: bool = False  # decode: guess layer l+1's experts with its router on layer l's hidden state, upload them ahead
    expert_fetch: str = attrs.field(default="routed")  # "routed": a sparse layer's experts come when routed to; "layer": with the layer
    # A decode step's routed experts: "table", read through the backend's expert table (no host in the step; the expert
    # policy hears the routing a step later); "host", routed on the host at each sparse layer (one sync a layer) and
    # fetched before use; "auto": the table where the backend has one.
    expert_decode: str = attrs.field(default="auto")
    # Where a decode step reads its experts through the table: land each miss in a free slot as the step reads it, so
    # it crosses the link once (``engine.landing``; an expert policy that admits every routed expert); false: the
    # policy's admission uploads it again a step later.
    expert_landing: bool = True
    # With landing: the misses a step cannot land are copied into staging slots beside the ring and read there for the
    # step (cuda: a copy reads the link faster than the expert kernels read in place); false: read in place.
    expert_staging: bool = True

    @expert_fetch.validator
    def _check_expert_fetch(self, _, value: str) -> None:
        if value not in EXPERT_FETCH:
            raise ConfigError(f"expert_fetch must be one of {', '.join(EXPERT_FETCH)}, got {value!r}")

    @expert_decode.validator
    def _check_expert_decode(self, _, value: str) -> None:
        if value not in EXPERT_DECODE:
            raise ConfigError(f"expert_decode must be one of {', '.join(EXPERT_DECODE)}, got {value!r}")

    @property
    def windowed(self) -> bool:
        return self.keep not in (OFF, AUTO) and self.policy != OFF


@attrs.frozen
class GenerationConfig:
    max_new_tokens: int = attrs.field(default=16, validator=_check(_int_in(1, 2**40), "a whole number >= 1"))
    temperature: float = attrs.field(default=0.0, validator=_check(_real_in(0, math.inf), "a finite number >= 0 (0 is greedy)"))
    top_k: int = attrs.field(default=0, validator=_check(_int_in(0, 2**31), "a whole number >= 0 (0 means no cut)"))
    top_p: float = attrs.field(default=1.0, validator=_check(_real_in(0, 1, lo_open=True), "in (0, 1]"))
    seed: int = attrs.field(default=0, validator=_check(_int_in(0, 2**64 - 1), "in 0..2**64-1 (a 64-bit generator seed)"))
    stop_at_eos: bool = True
    prompt: str = ""
    prompt_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    # OpenAI's and vLLM's logit processors (``sampling.Processing``): each token's logit less presence_penalty where it
    # was generated, less frequency_penalty times how often; repetition_penalty (1: off) divides a positive logit of a
    # token seen in the prompt or generated, and multiplies a negative one; logit_bias adds to a token id's logit
    presence_penalty: float = attrs.field(default=0.0, validator=_check(_real_in(-2, 2), "in -2..2 (0: off)"))
    frequency_penalty: float = attrs.field(default=0.0, validator=_check(_real_in(-2, 2), "in -2..2 (0: off)"))
    repetition_penalty: float = attrs.field(default=1.0, validator=_check(_real_in(0, 10, lo_open=True), "in (0, 10] (1: off)"))
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=lambda v: parse_logit_bias(v))

    def __attrs_post_init__(self) -> None:
        if self.prompt and self.prompt_ids:
            raise ConfigError("both prompt and prompt_ids are set; keep one (text, or token ids)")


DRAFT_TOKENS_MAX = 64


@attrs.frozen
class SpeculativeConfig:
    draft: str = ""  # "" (none), "ngram", "ngram:N" (match the last N..2 tokens), any drafter plugin's name, or a model
    draft_tokens: int = attrs.field(default=8, validator=_check(_int_in(1, DRAFT_TOKENS_MAX),
                                                                f"a whole number in 1..{DRAFT_TOKENS_MAX}"))


@attrs.frozen
class KestrelConfig:
    model: str = ""
    backend: BackendConfig = BackendConfig()
    residency: ResidencyConfig = ResidencyConfig()
    generation: GenerationConfig = GenerationConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    # The settings given (kestrel.toml's keys, flags, open()'s arguments) as "section.field": whether one was set is
    # asked here, never whether its value differs from the default (a setting given its default value is given).
    given: frozenset[str] = attrs.field(default=frozenset(), eq=False, repr=False)

    def was_given(self, section: str, field: str) -> bool:
        return f"{section}.{field}" in self.given

    def override(self, **flags: Any) -> "KestrelConfig":
        """Apply flags given as ``section__field=value``, or ``model=...``; None means 'not given'."""
        cfg = self
        for key, value in flags.items():
            if value is None:
                continue
            if "__" not in key:
                cfg = attrs.evolve(cfg, **{key: value}, given=cfg.given | {key})
                continue
            section, field = key.split("__", 1)
            cfg = attrs.evolve(cfg, **{section: attrs.evolve(getattr(cfg, section), **{field: value})},
                               given=cfg.given | {f"{section}.{field}"})
        return cfg


_SECTIONS = {"backend": BackendConfig, "residency": ResidencyConfig, "generation": GenerationConfig,
             "speculative": SpeculativeConfig}


def _build(cls: type, table: dict, where: str):
    fields = {f.name: f for f in attrs.fields(cls)}
    unknown = sorted(set(table) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(fields)}")
    for key, value in table.items():
        default = fields[key].default
        if key in ("keep", "logit_bias"):
            continue  # their converters check them
        if isinstance(default, tuple):
            if not (isinstance(value, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in value)):
                raise ConfigError(f"{where}: {key} must be a list of integers, got {value!r}")
            continue
        want = type(default)
        ok = isinstance(value, want) and (want is bool or not isinstance(value, bool))
        ok = ok or (want is float and isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            raise ConfigError(f"{where}: {key} must be {want.__name__}, got {value!r}")
    try:
        return cls(**table)
    except (TypeError, ValueError, ConfigError) as exc:  # ConfigError: from a converter such as parse_keep
        raise ConfigError(f"{where}: {exc}") from None


def config_from_dict(raw: dict, where: str = "config") -> KestrelConfig:
    unknown = sorted(set(raw) - set(_SECTIONS) - {"model"})
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: model, {', '.join(_SECTIONS)}")
    kwargs: dict[str, Any] = {}
    if "model" in raw:
        if not isinstance(raw["model"], str):
            raise ConfigError(f"{where}: model must be a path string")
        kwargs["model"] = raw["model"]
    for section, cls in _SECTIONS.items():
        table = raw.get(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: [{section}] must be a table")
        kwargs[section] = _build(cls, table, f"{where} [{section}]")
    given = {f"{section}.{key}" for section in _SECTIONS for key in raw.get(section, {})}
    return KestrelConfig(**kwargs, given=frozenset(given | ({"model"} if "model" in raw else set())))


# A setting's flat name (Model.open, Run.generate) -> its (section, field) in kestrel.toml.
FLAT = {"model": (None, "model"), "backend": ("backend", "name"),
        **{f.name: (section, f.name) for section, cls in _SECTIONS.items() for f in attrs.fields(cls) if f.name != "name"}}


def with_settings(base: KestrelConfig, settings: dict[str, Any], where: str = "settings") -> KestrelConfig:
    """``base`` with settings applied, checked as kestrel.toml's are: flat names (``keep=2``, ``backend="cuda"``)
    or whole tables (``backend={"name": "cuda", "dtype": "float32"}``)."""
    tables: dict[str, dict] = {}
    model = base.model
    for key, value in settings.items():
        if key in _SECTIONS and isinstance(value, dict):
            tables.setdefault(key, {}).update(value)
            continue
        if key not in FLAT:
            raise ConfigError(f"{where}: unknown setting {key!r}; allowed: {', '.join(FLAT)}")
        section, field = FLAT[key]
        if section is None:
            model = value
        else:
            tables.setdefault(section, {})[field] = value
    raw = {"model": model, **{section: {**attrs.asdict(getattr(base, section)), **tables.get(section, {})}
                              for section in _SECTIONS}}
    given = {f"{section}.{field}" for section, table in tables.items() for field in table}
    given |= {"model"} if any(FLAT.get(key, ("",))[0] is None for key in settings) else set()
    return attrs.evolve(config_from_dict(raw, where), given=base.given | frozenset(given))


def load_config(path: str | Path | None) -> KestrelConfig:
    if not path:
        return KestrelConfig()
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    data = read_bounded(p, TOML_LIMIT, f"config file {str(p)!r}", "pass a kestrel.toml file")
    try:
        raw = tomllib.loads(data.decode("utf-8-sig"))  # a byte-order mark (Windows editors write one) is not TOML
    except UnicodeDecodeError:
        raise ConfigError(f"config file {str(p)!r} cannot be read (not UTF-8 text); pass a kestrel.toml file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: not valid TOML ({exc})") from None
    except ValueError:  # an integer past Python's 4300 digits: no setting takes one
        raise ConfigError(f"{p}: {TOO_MANY_DIGITS}; no setting takes one") from None
    except RecursionError:
        raise ConfigError(f"{p}: not valid TOML (nested too deeply)") from None
    return config_from_dict(raw, str(p))


def model_dir(cfg: KestrelConfig) -> str:
    """The model the config names (--model, or kestrel.toml's model); a ConfigError that says how to give one."""
    if not cfg.model:
        raise ConfigError("no model given: pass --model DIR, --model FILE.gguf or --model ORG/NAME from the Hugging Face cache "
                          "(or model = \"...\" in kestrel.toml); `kestrel demo` needs none")
    return cfg.model
