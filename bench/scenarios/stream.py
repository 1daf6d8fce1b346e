"""Dense decode: kestrel's rows beside their baselines, measured in one run.

    python -m bench stream --preset qwen3-8b --models /tmp/m --compile --q8-group 64 --tokens 34
    python -m bench stream --preset qwen3-8b --models /tmp/m --rows sweep          # the cost curve (plot)
    python -m bench stream --backend cpu_ref --preset tiny --tokens 6 --peers ""   # on the CPU

On cuda, first the pinned, pageable and device copy rates and the GEMV floor (every linear weight of the shape
in kestrel's fused layout, plus lm_head, read once by F.linear at batch 1, replayed as one CUDA graph), each with
every repetition. Then kestrel's rows, each in every ``--graphs`` mode (auto: the captured step replayed; off:
eager), one after the other:

- ``--rows headline``: off; asymmetric keep=1 with prefetch 1 (every layer streams); pinned_set keep=4 with
  prefetch 1;
- ``--rows sweep``: off; asymmetric and pinned_set at keep L, L-1, L/2, 4 and 1, with prefetch 0 and 1;
  future_evicting at the same keeps; asymmetric at keep 4 and 1 with the free allocator;
- ``--compile``: off and asymmetric keep=1 prefetch 1 again with torch.compile'd layers;
- ``--q8-group G``: the q8 GEMV kernel on the two target shapes, then off (and --compile's off) on a q8 copy, and
  with ``--rows sweep`` asymmetric keep 4 and 1 with prefetch 0 and 1;
- ``--interleave R``: off against asymmetric keep=L, run after run for R rounds, so drift hits both alike;
- ``--peers``: transformers and accelerate on the same weights (``bench.peers``);
- ``--llama-cpp BIN_DIR`` (with ``--gguf``): kestrel's GGUF off at B = 1, 8 and 64 and its 512-token prefill, then
  llama.cpp's llama-bench (tg128, pp512) and llama-batched-bench on the same file (``bench.llama_cpp``); the pairs go
  in ``vs_llama_cpp``. ``--rows none`` leaves the bf16 rows out.

Every row keeps every decode step's time and mode. Its figure is the p50 (with p10, p90, n) over its replayed steps,
or over its eager steps after the first where it replayed none; the captured and eager steps are listed apart. Each
row's ids are compared with off's (a q8 row's with q8 off's, and its leading ids with bf16 off's; a --compile row's
also with the compiled off's), and its bytes uploaded a token and effective GB/s are set against the pinned copy
rate of the same run. On cpu_ref there is no copy rate, floor or capture, and prefetch is 0.
"""

from __future__ import annotations

import gc

from bench import llama_cpp, models, peers
from bench.errors import BenchError
from bench.errors import cuda_backend_missing
from bench.log import log
from bench.prompt import prompt_for
from bench.rows import compare_ids, row
from bench.stats import summary
from bench.timing import copy_rates, graph_times


def add_arguments(p) -> None:
    models.add_arguments(p)
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N layers of the preset")
    p.add_argument("--backend", default="cuda", choices=("cuda", "cpu_ref"))
    p.add_argument("--dtype", default="", help="the backend's compute dtype (kestrel.toml's [backend] dtype)")
    p.add_argument("--tokens", type=int, default=34, help="new tokens a row generates (decode steps: one fewer)")
    p.add_argument("--rows", choices=("headline", "sweep", "none"), default="headline",
                   help="none: no bf16 rows (nor its checkpoint): --gguf's section alone")
    p.add_argument("--graphs", default=None, help="graphs modes, each row in each: auto,off (default on cuda), auto")
    p.add_argument("--compile", action="store_true", help="also off and keep=1 with torch.compile'd layers")
    p.add_argument("--q8-group", type=int, default=0, help="also the q8 rows, on a copy quantized with this group")
    p.add_argument("--gguf", default="", metavar="TYPE",
                   help="also the GGUF rows: the preset as a GGUF of TYPE (e.g. q4_k_m) with random valid blocks")
    p.add_argument("--layer-ops", default="", metavar="CHOICES",
                   help="also --gguf's off row with each of these [backend] layer_ops (comma-separated: fused, auto, "
                        "torch; e.g. fused beside the default's torch steps, in the same run)")
    p.add_argument("--host-kernels", default="", metavar="CHOICES",
                   help="cpu_ref: --gguf's off and keep=1 rows with each of these [backend] host_kernels "
                        "(comma-separated: off, auto; e.g. off,auto: the float32 dequantization beside the host "
                        "GGUF kernel, in the same run)")
    p.add_argument("--interleave", type=int, default=None, help="rounds of off against keep=L (default 3 on cuda, 0)")
    p.add_argument("--peers", default=None,
                   help=f"comma-separated, of {', '.join(peers.NAMES)} (default on cuda: "
                        "transformers,transformers-static,accelerate; on cpu_ref none)")
    p.add_argument("--peer-tokens", type=int, default=4, help="new tokens of the slow peers (accelerate, airllm)")
    llama_cpp.add_argument(p)


def needs_gpu(args) -> str | None:
    return cuda_backend_missing(args)


def keeps(n_layers: int) -> list[int]:
    return sorted({k for k in (n_layers, n_layers - 1, n_layers // 2, 4, 1) if 1 <= k <= n_layers}, reverse=True)


def settings_for(rows: str, n_layers: int, cuda: bool) -> list[dict]:
    """The rows' settings (without backend or graphs), in the order they run."""
    pfs = (0, 1) if cuda else (0,)
    pf1 = 1 if cuda else 0
    out = [{"keep": "off"}]
    if rows == "headline":
        out += [{"policy": "asymmetric", "keep": 1, "prefetch": pf1},
                {"policy": "pinned_set", "keep": min(4, n_layers), "prefetch": pf1}]
        return out
    for policy in ("asymmetric", "pinned_set"):
        out += [{"policy": policy, "keep": k, "prefetch": pf} for k in keeps(n_layers) for pf in pfs]
    out += [{"policy": "future_evicting", "keep": k, "prefetch": 0} for k in keeps(n_layers)]
    out += [{"policy": "asymmetric", "keep": k, "allocator": "free", "prefetch": 0} for k in keeps(n_layers) if k in (4, 1)]
    return out


def label_of(s: dict) -> str:
    if s.get("keep") == "off":
        head = "off"
    else:
        head = f"{s['policy']} keep={s['keep']}" + (f", prefetch {s['prefetch']}" if s.get("prefetch") else "")
    if s.get("allocator"):
        head += f", {s['allocator']}"
    return head + (", --compile" if s.get("compile") else "") + (f", layer_ops {s['layer_ops']}" if s.get("layer_ops")
                                                                  else "") + (
        f", host_kernels {s['host_kernels']}" if s.get("host_kernels") else "")


def host_kernels_of(args) -> list[str]:
    """``--host-kernels``: the [backend] host_kernels of the GGUF section's off and keep=1 rows (checked before any
    row runs); empty: the default's rows alone."""
    from kestrel_core.config import HOST_KERNELS

    chosen = [v.strip() for v in args.host_kernels.split(",") if v.strip()]
    bad = [v for v in chosen if v not in HOST_KERNELS]
    if bad:
        raise BenchError(f"--host-kernels: {', '.join(bad)}: each one of {', '.join(HOST_KERNELS)}")
    if chosen and (not args.gguf or args.backend != "cpu_ref"):
        raise BenchError("--host-kernels sets cpu_ref's rows of --gguf's section: give --gguf TYPE and --backend cpu_ref")
    return chosen


def layer_ops_of(args) -> list[str]:
    """``--layer-ops``: the [backend] layer_ops of the extra off rows (checked before any row runs)."""
    from kestrel_core.config import LAYER_OPS

    chosen = [v.strip() for v in args.layer_ops.split(",") if v.strip()]
    bad = [v for v in chosen if v not in LAYER_OPS]
    if bad:
        raise BenchError(f"--layer-ops: {', '.join(bad)}: each one of {', '.join(LAYER_OPS)}")
    if chosen and not args.gguf:
        raise BenchError("--layer-ops adds rows to --gguf's section: give --gguf TYPE too")
    return chosen


def settle() -> None:
    """Between rows: what the last run left goes, so the next starts alike."""
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def gemv_floor(config) -> dict:
    """Every linear weight of the shape (fused QKV, o, gate-up and down of each layer, and lm_head) read once with
    F.linear at batch 1, replayed as one CUDA graph: the device time a decode step cannot beat; every replay's time."""
    import torch
    import torch.nn.functional as F

    h, i = config.hidden_size, config.intermediate_size
    shapes = [(config.q_dim + 2 * config.kv_dim, h), (h, config.q_dim), (2 * i, h), (h, i)] * config.num_hidden_layers
    shapes.append((config.vocab_size, h))
    weights = [torch.randn(s, dtype=torch.bfloat16, device="cuda") for s in shapes]
    x = {k: torch.randn((1, k), dtype=torch.bfloat16, device="cuda") for k in {s[1] for s in shapes}}

    def all_linears():
        for w in weights:
            F.linear(x[w.shape[1]], w)

    times = graph_times(all_linears, calls=1, warmup=3, reps=30)
    nbytes = sum(w.numel() * 2 for w in weights)
    weights.clear()
    settle()
    s = summary(times)
    log(f"GEMV floor: {s['p50']:.3f} ms for {nbytes / 1e9:.2f} GB ({nbytes / s['p50'] / 1e9:.2f} TB/s)")
    return {"ms": times, "summary": s, "bytes": nbytes, "TBps": nbytes / s["p50"] / 1e9}


class Rows:
    """Runs the rows of one model, each in every graphs mode. Every row's ids are compared with the first off row's
    (graph or eager alike: residency and capture change no id); a --compile row's with the first compiled off's, and
    also with the uncompiled off's."""

    def __init__(self, model, args, pinned_GBps: float | None, prefix: str = ""):
        self.model, self.args, self.pinned, self.prefix = model, args, pinned_GBps, prefix
        self.rows: list[dict] = []
        self.baselines: dict[str, dict] = {}  # "plain" / "compiled": the first off row of each
        self.offs: dict[str, dict] = {}  # graphs mode: the plain off row run in it

    def base(self) -> dict:
        out = {"backend": self.args.backend}
        if self.args.dtype:
            out["dtype"] = self.args.dtype
        return out

    def one(self, s: dict, graphs: str) -> dict:
        settings = {**self.base(), **s, "graphs": graphs}
        label = self.prefix + label_of(s)
        key = "compiled" if s.get("compile") else "plain"
        baseline = self.baselines.get(key) or self.baselines.get("plain")
        r = row(self.model, settings, prompt_for(self.model.config.vocab_size), self.args.tokens, label=label,
                baseline=baseline, pinned_GBps=self.pinned)
        r["graphs"] = graphs
        if s.get("keep") == "off":
            self.baselines.setdefault(key, r)
            if key == "plain":
                self.offs.setdefault(graphs, r)
        if s.get("compile") and "plain" in self.baselines:
            r["vs_uncompiled_off"] = compare_ids(r, self.baselines["plain"])
        sm = r["summary"]
        log(f"{label:40} {graphs:4} p50 {sm['p50']:9.2f} ms (p10 {sm['p10']:.2f}, p90 {sm['p90']:.2f}, n={sm['n']} "
            f"{r['steady_mode']}) {r['bytes_uploaded_per_token'] / 1e9:6.2f} GB/tok ids={r.get('ids_match_baseline')}")
        self.rows.append(r)
        settle()
        return r

    def run(self, settings: list[dict], graphs_modes: list[str]) -> None:
        for s in settings:
            for g in graphs_modes:
                try:
                    self.one(s, g)
                except Exception as exc:  # noqa: BLE001 - recorded with the rows: a setting may not run on this stack
                    if not s.get("compile"):
                        raise
                    log(f"{label_of(s)} failed: {type(exc).__name__}: {exc}")
                    self.rows.append({"label": self.prefix + label_of(s), "graphs": g, "settings": s,
                                      "error": f"{type(exc).__name__}: {str(exc)[:500]}"})
                    settle()


def warm_up(model, args, compile_: bool = False) -> None:
    """A short off run, not recorded: the process's first forwards load kernels (and, with compile, compile)."""
    settings = {"backend": args.backend, "keep": "off", **({"compile": True} if compile_ else {})}
    if args.dtype:
        settings["dtype"] = args.dtype
    try:
        row(model, settings, prompt_for(model.config.vocab_size), min(8, args.tokens))
    except Exception as exc:  # noqa: BLE001 - the compiled rows will record why
        log(f"warm-up failed: {type(exc).__name__}: {exc}")
    settle()


def interleaved(model, args, rounds: int) -> dict:
    """off against asymmetric keep=L (graphs auto), run after run in turn; each setting's steady steps pooled."""
    L = model.config.num_hidden_layers
    runs: dict[str, list[dict]] = {"off": [], "keep_all": []}
    for _ in range(rounds):
        for key, keep in (("off", "off"), ("keep_all", L)):
            r = row(model, {"backend": args.backend, "keep": keep, "graphs": "auto"}, prompt_for(model.config.vocab_size),
                    args.tokens)
            runs[key].append({"decode_ms": r["decode_ms"], "step_modes": r["step_modes"],
                              "steady_steps": r["steady_steps"], "summary": r["summary"]})
            settle()
    out = {"rounds": rounds, "keep": L}
    for key, rs in runs.items():
        pooled = [r["decode_ms"][i] for r in rs for i in r["steady_steps"]]
        out[key] = {"runs": rs, "summary": summary(pooled)}
    out["ratio_p50"] = out["keep_all"]["summary"]["p50"] / out["off"]["summary"]["p50"]
    log(f"interleaved: off {out['off']['summary']['p50']:.3f} ms, keep={L} {out['keep_all']['summary']['p50']:.3f} "
        f"(x{out['ratio_p50']:.3f})")
    return out


def run(args, record) -> dict:
    from kestrel_core import load

    cuda = args.backend == "cuda"
    graphs_modes = (args.graphs or ("auto,off" if cuda else "auto")).split(",")
    bins = llama_cpp.check(args)
    layer_ops_of(args)  # a bad --layer-ops is refused before any row
    host_kernels_of(args)
    if args.rows == "none":
        if not args.gguf:
            raise BenchError("--rows none leaves only --gguf's section: give --gguf TYPE")
        if args.q8_group or args.compile or args.peers:
            raise BenchError("--rows none runs no bf16 model: leave out --q8-group, --compile and --peers")
    peer_names = peers.parse_names(args.peers if args.peers is not None else
                                   ("transformers,transformers-static,accelerate" if cuda and args.rows != "none"
                                    else ""))
    rounds = args.interleave if args.interleave is not None else (3 if cuda and args.rows != "none" else 0)
    result: dict = {"preset": args.preset, "layers": args.layers, "backend": args.backend,
                    "tokens": args.tokens, "graphs_modes": graphs_modes, "row_set": args.rows}
    if cuda:
        result["ceilings"] = copy_rates()
        log(f"pinned h2d {result['ceilings']['pinned_h2d']['GBps']:.1f} GB/s")
    pinned = result["ceilings"]["pinned_h2d"]["GBps"] if cuda else None
    if args.rows == "none":
        result["gguf"] = gguf_section(args, pinned, {}, bins)
        result["vs_llama_cpp"] = result["gguf"].get("llama_cpp", {}).get("rows")
        return result
    path = models.ensure_preset(args.models, args.preset, layers=args.layers)
    result["model"] = {"path": str(path), "weight_bytes": models.weight_bytes(path)}
    with load(path) as model:
        cfg = model.config
        result["model"].update(dtype=cfg.torch_dtype, layers=cfg.num_hidden_layers)
        result["prompt_ids"] = prompt = prompt_for(cfg.vocab_size)
        if cuda:
            result["floor"] = gemv_floor(cfg)
            record.save_partial(result)
        warm_up(model, args)
        rows = Rows(model, args, pinned)
        result["rows"] = rows.rows
        rows.run(settings_for(args.rows, cfg.num_hidden_layers, cuda), graphs_modes)
        record.save_partial(result)
        if args.compile:
            warm_up(model, args, compile_=True)
            pf1 = 1 if cuda else 0
            rows.run([{"keep": "off", "compile": True},
                      {"policy": "asymmetric", "keep": 1, "prefetch": pf1, "compile": True}], graphs_modes)
            record.save_partial(result)
        if rounds:
            result["interleaved"] = interleaved(model, args, rounds)
            record.save_partial(result)
        bf16_off = dict(rows.offs)
    if args.q8_group:
        result["q8"] = q8_section(path, args, pinned, bf16_off, result.get("ceilings"))
        record.save_partial(result)
    if args.gguf:
        result["gguf"] = gguf_section(args, pinned, bf16_off, bins)
        result["vs_llama_cpp"] = result["gguf"].get("llama_cpp", {}).get("rows")
        record.save_partial(result)
    if peer_names:
        result["peers"] = peers.beside(peer_names, path, prompt, args.tokens, args.peer_tokens,
                                       rows.baselines.get("plain"), device="cuda" if args.backend == "cuda" else "cpu",
                                       scratch_root=args.models)
    return result


def q8_section(path, args, pinned, bf16_off: dict, ceilings: dict | None) -> dict:
    from kestrel_core import load

    cuda = args.backend == "cuda"
    qpath = models.ensure_q8(path, args.q8_group)
    out: dict = {"group": args.q8_group, "path": str(qpath), "weight_bytes": models.weight_bytes(qpath)}
    if cuda:
        from bench.scenarios.q8_gemv import TARGET_SHAPES, gemv_rows

        out["gemv"] = gemv_rows(TARGET_SHAPES, args.q8_group, ceilings["d2d_read_plus_write"]["GBps"], ("auto", "torch"))
    with load(qpath) as qmodel:
        warm_up(qmodel, args)
        rows = Rows(qmodel, args, pinned, prefix="q8 ")
        out["rows"] = rows.rows
        settings = [{"keep": "off"}]
        if args.rows == "sweep":
            pfs = (0, 1) if cuda else (0,)
            settings += [{"policy": "asymmetric", "keep": k, "prefetch": pf} for k in (4, 1) for pf in pfs
                         if k <= qmodel.config.num_hidden_layers]
        rows.run(settings, (args.graphs or ("auto,off" if cuda else "auto")).split(","))
        if args.compile:
            warm_up(qmodel, args, compile_=True)
            rows.run([{"keep": "off", "compile": True}], (args.graphs or ("auto,off" if cuda else "auto")).split(","))
    for r in out["rows"]:
        twin = bf16_off.get(r.get("graphs"))
        if twin is not None and "token_ids" in r:
            r["vs_bf16_off"] = compare_ids(r, twin)
    return out


def gguf_section(args, pinned, bf16_off: dict, bins: llama_cpp.Binaries | None = None) -> dict:
    """The preset as a GGUF of ``--gguf`` (random valid blocks; on cuda held and computed as its blocks): off and
    asymmetric keep=1 with prefetch 1, each against bf16 off of the same run (target: off <= 0.40x) and keep=1 against
    its bytes a token over the pinned copy rate (target <= 1.1x); with ``bins``, off beside llama.cpp on the file."""
    from kestrel_core import load
    from kestrel_core.formats.gguf_types import parse_type

    cuda = args.backend == "cuda"
    type_name = parse_type(args.gguf)
    gpath = models.ensure_gguf(args.models, args.preset, type_name, args.layers)
    out: dict = {"type": type_name, "path": str(gpath), "file_bytes": gpath.stat().st_size}
    modes = (args.graphs or ("auto,off" if cuda else "auto")).split(",")
    with load(gpath) as gmodel:
        warm_up(gmodel, args)
        rows = Rows(gmodel, args, pinned, prefix=f"{type_name} ")
        out["rows"] = rows.rows
        kernels = [{"host_kernels": v} for v in host_kernels_of(args)] or [{}]
        rows.run([*({"keep": "off", **k} for k in kernels), *({"keep": "off", "layer_ops": v} for v in layer_ops_of(args)),
                  *({"policy": "asymmetric", "keep": 1, "prefetch": 1 if cuda else 0, **k} for k in kernels)], modes)
        if bins is not None:
            settings = {"backend": args.backend, "keep": "off", **({"dtype": args.dtype} if args.dtype else {})}
            out["llama_cpp"] = llama_cpp.compare(bins, gmodel, gpath, settings, shape=args.preset + (
                f" ({args.layers} layers)" if args.layers else ""), file_type=type_name,
                args=args, log=log)
    targets = []
    for r in out["rows"]:
        if "summary" not in r:
            continue
        p50 = r["summary"]["p50"]
        twin = bf16_off.get(r.get("graphs"))
        if r["settings"].get("keep") == "off" and twin is not None:
            ratio = p50 / twin["summary"]["p50"]
            targets.append({"row": r["label"], "graphs": r["graphs"], "statement": "off <= 0.40x bf16 off",
                            "ratio": ratio, "met": ratio <= 0.40})
        elif pinned and r["bytes_uploaded_per_token"]:
            link_ms = r["bytes_uploaded_per_token"] / (pinned * 1e9) * 1e3
            ratio = p50 / link_ms
            targets.append({"row": r["label"], "graphs": r["graphs"], "link_ms": link_ms,
                            "statement": "keep=1 <= 1.1x its bytes over the pinned copy rate", "ratio": ratio,
                            "met": ratio <= 1.1})
    out["targets"] = targets
    for t in targets:
        log(f"{t['row']:40} {t['graphs']:4} {t['statement']}: x{t['ratio']:.3f} met={t['met']}")
    return out


