"""The peers alone beside kestrel's `off` on the same weights: transformers (resident with its DynamicCache, or a
StaticCache under torch.compile), accelerate's CPU offload (every decoder layer, or every experts module, in host
memory), accelerate's disk offload and AirLLM.

    python -m bench peers --preset qwen3-8b --models /tmp/m --peers transformers,transformers-static,accelerate
    python -m bench peers --preset qwen3-30b-a3b --layers 8 --peers airllm --fuse-experts --tokens 18
    python -m bench peers --backend cpu_ref --preset tiny --peers transformers --tokens 6     # on the CPU

Each peer row keeps every decode step's time (CUDA events; perf_counter on the CPU) and its summary over the steps
after its warm-up ones; kestrel's `off` row runs first on the same checkpoint and prompt, and each peer's ids are
compared with it. A peer that is not installed is a row that says so.
"""

from __future__ import annotations

from bench import models, peers
from bench.errors import cuda_backend_missing
from bench.log import log
from bench.prompt import prompt_for
from bench.rows import compare_ids, row


def add_arguments(p) -> None:
    models.add_arguments(p)
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--router-skew", type=float, default=0.0)
    p.add_argument("--backend", default="cuda", choices=("cuda", "cpu_ref"),
                   help="kestrel's backend; the peers run on the GPU with cuda, on the CPU with cpu_ref")
    p.add_argument("--peers", default="transformers,transformers-static,accelerate",
                   help=f"comma-separated, of {', '.join(peers.NAMES)}")
    p.add_argument("--tokens", type=int, default=34, help="new tokens of kestrel and the fast peers")
    p.add_argument("--slow-tokens", type=int, default=4, help="new tokens of the offloading peers and AirLLM")
    p.add_argument("--fuse-experts", action="store_true", help="AirLLM: rewrite its split to transformers' fused experts")
    p.add_argument("--drop-cache", action="store_true", help="AirLLM: drop its split's pages before every step")


def needs_gpu(args) -> str | None:
    return cuda_backend_missing(args)


def run(args, record) -> dict:
    from kestrel_core import load

    names = peers.parse_names(args.peers)
    path = models.ensure_preset(args.models, args.preset, layers=args.layers, router_skew=args.router_skew)
    device = "cuda" if args.backend == "cuda" else "cpu"
    with load(path) as model:
        prompt = prompt_for(model.config.vocab_size)
        off = row(model, {"backend": args.backend, "keep": "off"}, prompt, args.tokens, label="kestrel off")
    result: dict = {"preset": args.preset, "layers": args.layers, "path": str(path), "prompt_ids": prompt,
                    "kestrel_off": off, "versions": peers.versions(), "peers": {}}
    log(f"kestrel off: p50 {off['summary']['p50']:.2f} ms")
    for name in names:
        slow = name not in ("transformers", "transformers-static")
        r = peers.peer(name, path, prompt, args.slow_tokens if slow else args.tokens, device=device,
                       scratch_root=args.models, fuse_experts=args.fuse_experts, drop_cache_each_step=args.drop_cache)
        if "token_ids" in r:
            r.update(compare_ids(r, off))
        log(f"{name}: p50 {(r.get('summary') or {}).get('p50')} ms {r.get('error', '')}")
        result["peers"][name] = r
        record.save_partial(result)
    return result
