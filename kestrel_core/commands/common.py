"""Flags shared by the commands that run a model, and how they override kestrel.toml."""

from __future__ import annotations

import argparse
import os


from kestrel_core.engine.batch import check_batch
from kestrel_core.engine.pipeline import launched_rank
from kestrel_core import plugins
from kestrel_core.config import BackendConfig, KestrelConfig, ResidencyConfig, load_config, parse_ids, parse_keep
from kestrel_core.errors import ConfigError, PluginError


def add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", help="Hugging Face model directory (config.json + *.safetensors), a GGUF file (x.gguf), "
                   "or a name in the local Hugging Face cache such as Qwen/Qwen3-8B (never downloaded)")
    g.add_argument("--config", help="kestrel.toml; flags override it")
    g.add_argument("--json", action="store_true", help="machine-readable output")


def _names(kind: str) -> str:
    """The registered names of one kind of plugin, for a flag's help (the built-ins and any installed plugin's)."""
    try:
        return ", ".join(sorted(plugins.registry(kind)))
    except (PluginError, ImportError) as exc:  # `kestrel plugins` says what is wrong; the help still shows
        return f"see `kestrel plugins` ({exc})"


def add_run_flags(p: argparse.ArgumentParser, sweep: bool = False) -> None:
    add_model_flags(p)
    many = " (comma-separated list)" if sweep else ""
    b, r = BackendConfig(), ResidencyConfig()
    g = p.add_argument_group("residency")
    g.add_argument("--backend", help=f"backend{many}: {_names('backends')} (default {b.name})")
    g.add_argument("--policy", help=f"residency policy{many}: {_names('policies')} (default {r.policy})")
    g.add_argument("--keep", help=f"layers kept resident by the window, 'off' (all resident) or 'auto' (the default: all "
                   f"resident where the model fits the budget, else the largest window that does){many}")
    g.add_argument("--allocator", help=f"weight-buffer allocator{many}: {_names('allocators')} (default {r.allocator})")
    g.add_argument("--prefetch", help=f"layers uploaded ahead on a side stream{many} (default {b.prefetch}; cuda)")
    g.add_argument("--budget-mb", type=int, help="MiB the resident weights may take: cuda's device weight cache, "
                   "cpu_ref's resident layers (also KESTREL_WCACHE_MB; default on cuda: free device memory less "
                   "2 GiB, for any keep, keep auto leaving the KV cache room; on cpu_ref: with keep auto, half the "
                   "host's available memory less the KV cache, with a keep given, none)")
    g.add_argument("--pool-slots", type=int, help=f"buffers the pool may hold (default {r.pool_slots})")
    g = p.add_argument_group("device (every backend)")
    g.add_argument("--dtype", help="compute dtype (cpu_ref: float32 (default) | float64; cuda: bfloat16 (default) | "
                   "float16 | float32)")
    g.add_argument("--device", help="device, e.g. cuda:1 (default: the current one; cpu_ref computes on cpu only)")
    g.add_argument("--devices", help="split the layers over these devices of this host, one rank each, e.g. "
                   "cuda:0,cuda:1, or cpu,cpu on cpu_ref (kestrel starts the ranks; generate, chat and serve; see "
                   "docs/multi-gpu.md)")
    g = p.add_argument_group("cuda")
    g.add_argument("--host-budget-mb", type=float, help="MiB of pinned host memory for streamed weights "
                   "(also KESTREL_HOST_MB); default: every layer where half the available RAM holds them, else a ring")
    g.add_argument("--graphs", help="auto (default): replay a repeating decode step as a captured CUDA graph; off: eager")
    g.add_argument("--gguf-kernels", help="auto (default): a GGUF's blocks through the float kernels for decode rows and "
                   "the int8 ones for a prompt's rows; float: dequantized in the kernel; int8: x quantized to int8, int8 "
                   "dot products (from 16 rows on the tensor cores)")
    g.add_argument("--layer-ops", help="auto (default): a layer's norms, rotary, residual adds and SiLU as fused "
                   "Triton kernels where they run, else torch's ops; fused: those kernels, or an error; torch: torch's ops")
    g.add_argument("--compile", action="store_true", default=None,
                   help="fuse the decode step's layer math with torch.compile (needs Triton on a GPU; the first step compiles)")
    g = p.add_argument_group("cpu_ref")
    g.add_argument("--threads", type=int, help="the torch threads it computes on (default: the cores this process may "
                   "use, shared among the ranks of a pipeline on this host; on a busy machine fewer are faster)")
    g.add_argument("--host-kernels", help="auto (default): a GGUF's Q8_0, Q4_0, Q4_K and Q6_K linears held as their "
                   "blocks and computed by the host GGUF kernel; off: dequantized to float32 on each fetch")
    g = p.add_argument_group("Mixture-of-Experts")
    g.add_argument("--expert-policy", help=f"the expert policy: {_names('expert_policies')} (default: none, an expert "
                   "stays until its layer goes)")
    g.add_argument("--expert-budget-mb", type=float, help="MiB the expert policy keeps experts in")
    g.add_argument("--expert-prefetch", action="store_true", default=None,
                   help="guess the next layer's experts with its router and upload them ahead (decode)")
    g.add_argument("--expert-fetch", help="routed (default): fetch the experts routed to; "
                   "layer: every expert with its layer (whole-layer streaming, the naive baseline)")
    g.add_argument("--expert-decode", help="auto (default): the table where the backend has "
                   "one; table: routed experts read through the device's expert table (the step stays one graph); "
                   "host: routed on the host at each sparse layer")
    g.add_argument("--expert-landing", choices=("on", "off"), help="on (default): a table step lands each miss in a "
                   "free slot as it reads it (one crossing); off: the policy uploads it again a step later")
    g.add_argument("--expert-staging", choices=("on", "off"), help="on (default): with landing, the misses a step "
                   "cannot land are copied to staging slots and read there (cuda); off: read in place over the link")
    g = p.add_argument_group("generation")
    g.add_argument("--prompt", help="prompt text (needs tokenizer.json and the tokenizers package)")
    g.add_argument("--prompt-ids", help="prompt token ids, e.g. 1,2,3")
    g.add_argument("--max-new-tokens", type=int, help="tokens to generate, at least 1 (default 16)")
    g.add_argument("--temperature", type=float, help="0 (the default) is greedy")
    g.add_argument("--top-k", type=int, help="sampling: draw from the k likeliest tokens (0, the default: no cut)")
    g.add_argument("--top-p", type=float, help="sampling: draw from the likeliest tokens whose probabilities reach p, in (0, 1] (default 1)")
    g.add_argument("--seed", type=int, help="seed of the sampling generator, 0..2**64-1 (default 0)")
    g.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-new-tokens")
    g.add_argument("--presence-penalty", type=float, help="subtract this from the logit of every token generated so "
                   "far, -2..2 (default 0)")
    g.add_argument("--frequency-penalty", type=float, help="subtract this times its count from the logit of every "
                   "token generated so far, -2..2 (default 0)")
    g.add_argument("--repetition-penalty", type=float, help="divide the positive logits (multiply the negative ones) "
                   "of tokens in the prompt or generated, in (0, 10] (default 1: off)")
    g.add_argument("--logit-bias", help="add a bias in -100..100 to token ids' logits: ID:BIAS,ID:BIAS (e.g. 50256:-100)")


def add_draft_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--draft", help="ngram, ngram:N (match the last N..2 tokens), a drafter plugin's "
                   "name, or a small model with the same vocabulary (see docs/speculative.md)")
    g.add_argument("--draft-tokens", type=int, help="tokens drafted a pass, 1..64 (default 8)")


def with_draft(cfg: KestrelConfig, args: argparse.Namespace) -> KestrelConfig:
    """``cfg`` with the draft flags (``add_draft_flags``) applied, checked before any model loads."""
    if args.draft is not None and not args.draft.strip():
        raise ConfigError("--draft is empty; give ngram, ngram:N, a drafter plugin's name or a draft model's directory, "
                          "or leave the flag out")
    cfg = cfg.override(speculative__draft=args.draft, speculative__draft_tokens=args.draft_tokens)
    if args.draft_tokens is not None and not cfg.speculative.draft:
        raise ConfigError("--draft-tokens sets how many tokens a drafter proposes, and no draft is set: add --draft "
                          "(or [speculative] draft in kestrel.toml), or drop --draft-tokens")
    return cfg


def _logit_bias(text: str | None) -> list | None:
    """--logit-bias ID:BIAS,ID:BIAS as (id, bias) pairs (their ranges are the config's to check)."""
    if text is None:
        return None
    pairs = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        tid, sep, bias = (x.strip() for x in part.partition(":"))
        bad = ConfigError(f"--logit-bias takes ID:BIAS pairs, comma-separated, each ID in ASCII digits "
                          f"(e.g. 50256:-100), got {part!r}")
        if not sep or not (tid.isascii() and tid.isdigit()) or not bias.isascii() or "_" in bias:
            raise bad  # int() and float() would take "\u0663" or "3_0" as numbers
        try:
            pairs.append((tid, float(bias)))  # the id's digits: the config's to bound
        except ValueError:
            raise bad from None
    return pairs


def _device(args: argparse.Namespace) -> str | None:
    """``--device``, or this rank's of ``--devices``."""
    devices = getattr(args, "devices", None)
    if devices is None:
        return args.device
    if args.device is not None:
        raise ConfigError("pass --device or --devices, not both")
    return rank_device(devices)


def config_from_args(args: argparse.Namespace, sweep: bool = False) -> KestrelConfig:
    """kestrel.toml, then flags. List-valued sweep flags are applied per run, not here."""
    cfg = load_config(args.config)
    single = lambda v: None if sweep else v  # noqa: E731
    prompt_ids = parse_ids(args.prompt_ids) if args.prompt_ids is not None else None
    if args.prompt is not None and not args.prompt.strip():
        raise ConfigError("the prompt is empty: pass some text to --prompt, or --prompt-ids 1,2,3")
    if args.prompt_ids is not None and not prompt_ids:
        raise ConfigError("the prompt is empty: --prompt-ids has no ids")
    if args.prompt is not None and args.prompt_ids is not None:  # the ids would win, and --prompt be ignored
        raise ConfigError("pass --prompt or --prompt-ids, not both")
    # A prompt flag replaces the file's prompt of either kind: the file's ids would otherwise beat a --prompt.
    text_flag, ids_flag = args.prompt is not None, args.prompt_ids is not None
    cfg = cfg.override(generation__prompt_ids=() if text_flag else None, generation__prompt="" if ids_flag else None)
    return cfg.override(
        model=args.model,
        backend__name=single(args.backend),
        backend__dtype=args.dtype,
        backend__device=_device(args),
        backend__graphs=args.graphs,
        backend__gguf_kernels=args.gguf_kernels,
        backend__layer_ops=args.layer_ops,
        backend__compile=args.compile,
        backend__host_budget_mb=args.host_budget_mb,
        backend__threads=args.threads,
        backend__host_kernels=args.host_kernels,
        backend__prefetch=single(_int(args.prefetch, "--prefetch")),
        residency__policy=single(args.policy),
        residency__keep=None if sweep or args.keep is None else parse_keep(args.keep),  # a sweep parses its list
        residency__allocator=single(args.allocator),
        residency__budget_mb=args.budget_mb,
        residency__pool_slots=args.pool_slots,
        residency__expert_policy=args.expert_policy,
        residency__expert_budget_mb=args.expert_budget_mb,
        residency__expert_prefetch=args.expert_prefetch,
        residency__expert_fetch=args.expert_fetch,
        residency__expert_decode=args.expert_decode,
        residency__expert_landing=None if args.expert_landing is None else args.expert_landing == "on",
        residency__expert_staging=None if args.expert_staging is None else args.expert_staging == "on",
        generation__prompt=args.prompt,
        generation__prompt_ids=prompt_ids,
        generation__max_new_tokens=args.max_new_tokens,
        generation__temperature=args.temperature,
        generation__top_k=args.top_k,
        generation__top_p=args.top_p,
        generation__seed=args.seed,
        generation__stop_at_eos=False if args.ignore_eos else None,
        generation__presence_penalty=args.presence_penalty,
        generation__frequency_penalty=args.frequency_penalty,
        generation__repetition_penalty=args.repetition_penalty,
        generation__logit_bias=_logit_bias(args.logit_bias),
    )


def _int(value, flag):
    if value is None or "," in str(value):
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{flag} must be a whole number, got {value!r}") from None


def check_batch_flags(max_batch: int, prefill_chunk: int | None, left_out: str = "") -> None:
    """--max-batch and --prefill-chunk as kestrel serve and a batch job take them: ``batch.check_batch``, worded by
    flag; ``left_out``: what leaving --prefill-chunk out means, where it may be."""
    check_batch(max_batch, prefill_chunk, ("--max-batch", "--prefill-chunk"), left_out)


def prompt_ids_for(cfg: KestrelConfig, model, default: list[int] | None = None) -> list[int]:
    return model.prompt_ids(list(cfg.generation.prompt_ids), cfg.generation.prompt, default)


def mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def parse_devices(text: str) -> list[str]:
    """``cuda:0,cuda:1`` (or ``cpu,cpu``): two or more devices of one kind, no GPU twice, each present here."""
    from kestrel_core.engine.devices import compute_device  # torch: once the flags are read

    names = [d.strip() for d in text.split(",")]
    if len(names) < 2 or not all(names):
        raise ConfigError(f"--devices {text!r}: give two or more devices, comma-separated (cuda:0,cuda:1, or cpu,cpu "
                          "on cpu_ref); for one, use --device")
    kinds = {compute_device(n, "--devices").type for n in names}
    if len(kinds) > 1:
        raise ConfigError(f"--devices {text!r} mixes cpu and cuda; split the layers over GPUs, or over cpu ranks")
    if "cuda" in kinds:
        bare = [n for n in names if ":" not in n]
        if bare:
            raise ConfigError(f"--devices names {bare[0]!r} without an index; name each GPU (cuda:0,cuda:1)")
        twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if twice is not None:
            raise ConfigError(f"--devices names {twice} twice; give each rank a GPU of its own")
    return names


def rank_device(text: str) -> str:
    """This rank's device of ``--devices`` (its LOCAL_RANK's), where the ranks were started."""
    devices = parse_devices(text)
    _, ranks = launched_rank()
    if ranks != len(devices):
        raise ConfigError(f"--devices names {len(devices)} devices but {ranks} ranks were started; give one device a "
                          "rank, or run without torchrun and let --devices start them")
    return devices[int(os.environ.get("LOCAL_RANK", "0"))]
