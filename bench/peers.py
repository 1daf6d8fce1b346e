"""The peers a kestrel row is set beside, on the same checkpoint: Hugging Face transformers (every weight on the
device, with its DynamicCache eagerly or a StaticCache under torch.compile), accelerate's CPU and disk offload,
and AirLLM. Each is imported only when asked for; one that is not installed says so (``PeerUnavailable``).

    row = transformers_dynamic(path, prompt, 34)                 # resident, DynamicCache, eager
    row = transformers_static(path, prompt, 34)                  # resident, StaticCache + torch.compile
    row = accelerate_offload(path, prompt, 4, what="layers")     # every decoder layer in host memory
    row = accelerate_offload(path, prompt, 18, what="experts")   # every mlp.experts module in host memory
    row = accelerate_disk_offload(path, prompt, 4, scratch)      # an offload folder of memmapped weights
    row = airllm(path, prompt, 18, scratch, fuse_experts=True)   # AirLLM's layer-by-layer streaming
    row = peer("transformers", path, prompt, 34, ...)            # by name; a failure is a row with "error"

A row keeps every decode step's time (CUDA events on a GPU; ``time.perf_counter`` with ``device="cpu"``, for a
machine without one) and ``summary`` over the steps after the first ``skip`` ones, the greedy ids (generated only),
the prefill, peak device bytes (``torch.cuda.max_memory_allocated`` from before the load) and the versions.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.errors import BenchError
from bench.stats import summary

NAMES = ("transformers", "transformers-static", "accelerate", "accelerate-experts", "accelerate-disk", "airllm")
_EXPERTS = re.compile(r"(.*\.)?layers\.\d+\.mlp\.experts")
_LAYER = re.compile(r"(.*\.)?layers\.\d+")
_EXPERT_KEY = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class PeerUnavailable(BenchError):
    """A peer's package is not installed here."""


def require(name: str, pip: str | None = None):
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise PeerUnavailable(f"{pip or name} is not installed here (pip install {pip or name}): {exc}") from None


def version(name: str) -> str | None:
    try:
        from importlib.metadata import version as v

        return v(name)
    except Exception:  # noqa: BLE001 - not installed
        return None


def versions() -> dict:
    return {k: version(k) for k in ("transformers", "accelerate", "airllm")}


def _one_line(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0] if msg else ''}"[:500]


# --- loading and the greedy loop ----------------------------------------------------------------------------------

def _dtype(name: str):
    import torch

    return getattr(torch, name)


def _dtype_kwarg(dtype) -> dict:
    """transformers >= 4.56 names it ``dtype``; older ones only know ``torch_dtype``."""
    transformers = require("transformers")
    major, minor = (int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def load(path, dtype: str = "bfloat16", device_map=None):
    transformers = require("transformers")
    kw = _dtype_kwarg(_dtype(dtype))
    if device_map is not None:
        kw["device_map"] = device_map
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), **kw).eval()


class _Timer:
    """CUDA events on a GPU, perf_counter on the CPU; ms of one interval."""

    def __init__(self, device: str):
        self.cuda = device != "cpu"

    def __enter__(self):
        if self.cuda:
            import torch

            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.a.record()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.b.record()
            self.b.synchronize()
            self.ms = self.a.elapsed_time(self.b)
        else:
            self.ms = (time.perf_counter() - self.t0) * 1e3


def greedy(model, prompt: list[int], n_new: int, device: str) -> tuple[list[int], list[float], float]:
    """Greedy decode with the model's DynamicCache: (ids, ms of each decode step, prefill ms)."""
    import torch

    dev = "cpu" if device == "cpu" else "cuda"
    times, out = [], []
    with torch.inference_mode():
        with _Timer(device) as t:
            res = model(input_ids=torch.tensor([list(prompt)], device=dev), use_cache=True)
            tok = int(res.logits[0, -1].argmax())
        prefill, past = t.ms, res.past_key_values
        out.append(tok)
        for _ in range(n_new - 1):
            with _Timer(device) as t:
                res = model(input_ids=torch.tensor([[tok]], device=dev), past_key_values=past, use_cache=True)
                tok = int(res.logits[0, -1].argmax())
            times.append(t.ms)
            past = res.past_key_values
            out.append(tok)
    return out, times, prefill


def _free(device: str) -> None:
    gc.collect()
    if device != "cpu":
        import torch

        torch.cuda.synchronize()
        if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):  # cuBLAS keeps its workspaces in the caching allocator
            torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()


def _reset_peak(device: str) -> None:
    if device != "cpu":
        import torch

        _free(device)
        torch.cuda.reset_peak_memory_stats()


def _peak(device: str) -> int | None:
    if device == "cpu":
        return None
    import torch

    return torch.cuda.max_memory_allocated()


def peer_row(label: str, ids, times, prefill, peak, skip: int, device: str, **extra) -> dict:
    return {"label": label, "token_ids": ids, "prefill_ms": prefill, "decode_ms": times, "skipped_steps": skip,
            "summary": summary(times[skip:]), "peak_device_bytes": peak,
            "timer": "perf_counter" if device == "cpu" else "cuda_events", "device": device, **versions(), **extra}


# --- the peers ----------------------------------------------------------------------------------------------------

def transformers_dynamic(path, prompt: list[int], n_new: int, device: str = "cuda", dtype: str = "bfloat16",
                         skip: int = 1) -> dict:
    """Every weight on the device (loaded straight there), greedy with the DynamicCache, eager. An untimed prefill and
    step first (the first forwards of a process load kernels and pick cuBLAS algorithms)."""
    _reset_peak(device)
    model = load(path, dtype, device_map=None if device == "cpu" else {"": device})
    try:
        greedy(model, prompt, 2, device)
        ids, times, prefill = greedy(model, prompt, n_new, device)
        peak = _peak(device)
    finally:
        del model
        _free(device)
    return peer_row("transformers, DynamicCache, eager", ids, times, prefill, peak, skip, device, dtype=dtype)


def transformers_static(path, prompt: list[int], n_new: int, device: str = "cuda", dtype: str = "bfloat16",
                        skip: int = 3) -> dict:
    """Every weight on the device, a StaticCache of the run's length, and the decode step under
    ``torch.compile(mode="reduce-overhead")``; the first ``skip`` steps (compile and the cudagraph trees' warm-up)
    are left out of the summary."""
    import torch

    transformers = require("transformers")
    _reset_peak(device)
    hf = load(path, dtype, device_map=None if device == "cpu" else {"": device})
    dev = "cpu" if device == "cpu" else "cuda"
    max_len = len(prompt) + n_new
    try:
        try:
            cache = transformers.StaticCache(config=hf.config, max_batch_size=1, max_cache_len=max_len, device=dev,
                                             dtype=_dtype(dtype))
        except TypeError:  # newer transformers take fewer arguments
            cache = transformers.StaticCache(config=hf.config, max_cache_len=max_len)
        step = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
        times, out = [], []
        t0 = time.perf_counter()
        with torch.inference_mode():
            with _Timer(device) as t:
                res = hf(input_ids=torch.tensor([list(prompt)], device=dev), past_key_values=cache,
                         cache_position=torch.arange(len(prompt), device=dev), use_cache=True)
                tok = res.logits[0, -1].argmax().view(1, 1)
            prefill = t.ms
            out.append(int(tok))
            for p in range(len(prompt), max_len - 1):
                with _Timer(device) as t:
                    res = step(input_ids=tok, past_key_values=cache, cache_position=torch.tensor([p], device=dev),
                               use_cache=True)
                    tok = res.logits[0, -1].argmax().view(1, 1).clone()
                times.append(t.ms)
                out.append(int(tok))
        wall = time.perf_counter() - t0
        peak = _peak(device)
    finally:
        del hf
        _free(device)
    return peer_row('transformers, StaticCache + torch.compile(mode="reduce-overhead")', out, times, prefill, peak,
                    skip, device, dtype=dtype, wall_s_with_compile=wall)


def offload_modules(model, what: str) -> list[str]:
    """The modules ``what`` puts on the CPU: every ``layers.N.mlp.experts`` module, or every decoder layer."""
    if what == "experts":
        names = [n for n, _ in model.named_modules() if _EXPERTS.fullmatch(n)]
    elif what == "layers":
        names = [n for n, _ in model.named_modules() if _LAYER.fullmatch(n)]
    else:
        raise ValueError(f"what must be 'experts' or 'layers', got {what!r}")
    if not names:
        raise ValueError(f"no {what} modules in {type(model).__name__}: is it a Mixture-of-Experts decoder?")
    return names


def device_map_for(model, offload: list[str], main) -> dict:
    """A device map covering every parameter and buffer: ``offload`` on "cpu", every other module on ``main``.
    It descends only into modules that hold an offloaded one, so the map stays at the coarsest names."""
    off = set(offload)
    dm: dict = {}

    def holds(name: str) -> bool:
        return any(o.startswith(name + ".") for o in off) if name else bool(off)

    def visit(prefix: str, module) -> None:
        if prefix in off:
            dm[prefix] = "cpu"
            return
        if not holds(prefix):
            dm[prefix] = main
            return
        for name, _ in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            dm[f"{prefix}.{name}" if prefix else name] = main
        for name, child in module.named_children():
            visit(f"{prefix}.{name}" if prefix else name, child)

    visit("", model)
    return dm


def accelerate_offload(path, prompt: list[int], n_new: int, what: str = "layers", device: str = "cuda",
                       dtype: str = "bfloat16", skip: int = 0) -> dict:
    """accelerate's CPU offload: ``what`` ("layers" or "experts") stays in host memory and is copied to the device
    at each forward by accelerate's hooks; every other module lives on the device. An untimed prefill and step first."""
    accelerate = require("accelerate")
    from accelerate.hooks import remove_hook_from_submodules

    _reset_peak(device)
    model = load(path, dtype)  # on the CPU
    try:
        offload = offload_modules(model, what)
        off_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                        if any(n.startswith(o + ".") for o in offload))
        import torch

        main = "cpu" if device == "cpu" else torch.device(device).index or 0
        # On the CPU every module is where it runs: force the hooks so a CPU run exercises them too.
        model = accelerate.dispatch_model(model, device_map=device_map_for(model, offload, main), main_device=main,
                                          force_hooks=device == "cpu")
        greedy(model, prompt, 2, device)
        ids, times, prefill = greedy(model, prompt, n_new, device)
        peak = _peak(device)
        remove_hook_from_submodules(model)
    finally:
        del model
        _free(device)
    return peer_row(f"accelerate {version('accelerate')} offload, {what} on the CPU", ids, times, prefill, peak, skip,
                    device, what=what, offloaded_modules=len(offload), offloaded_bytes=off_bytes, dtype=dtype)


def accelerate_disk_offload(path, prompt: list[int], n_new: int, scratch_root, device: str = "cuda",
                            dtype: str = "bfloat16", skip: int = 1) -> dict:
    """accelerate's ``disk_offload``: an offload folder of memmapped weights (its pages as the run leaves them:
    accelerate keeps them mapped, so they cannot be dropped). The folder is this run's own and goes afterwards."""
    accelerate = require("accelerate")
    folder = Path(tempfile.mkdtemp(prefix="offload-", dir=scratch_root))
    try:
        _reset_peak(device)
        model = load(path, dtype)
        accelerate.disk_offload(model, str(folder), execution_device=0 if device != "cpu" else "cpu")
        ids, times, prefill = greedy(model, prompt, n_new, device)
        row = peer_row("accelerate disk_offload", ids, times, prefill, _peak(device), skip, device, dtype=dtype,
                       offload_folder_bytes=sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()))
        del model
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        _free(device)
    return row


# --- AirLLM -------------------------------------------------------------------------------------------------------
# What AirLLM 4.0.0 does, read from its source:
# * airllm.AutoModel maps config.architectures[0] through a small override table; every other architecture,
#   Qwen3-MoE included, gets the generic AirLLMBaseModel, which builds the transformers model on meta and hooks
#   embed, each decoder layer, norm and lm_head: a hook loads that module's whole split file to the GPU before it
#   runs (next layer prefetched on a thread). For Qwen3-MoE a token moves every expert of every layer.
# * Before the first run it splits the checkpoint into one safetensors file per module under
#   <layer_shards_saving_path>/splitted_model, hard-linking a shard that holds exactly one module.
# * Its split keeps per-expert names (mlp.experts.E.gate_proj.weight) while transformers 5 builds fused experts
#   (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]) and converts names only in its own from_pretrained:
#   as shipped, AirLLM fails at the first MoE layer. fuse_experts=True rewrites the scratch split (never the
#   checkpoint) into the fused layout first; the row says so in "variant" and "note".
# Nothing is written into the model's folder: AirLLM is pointed at scratch/model_view (links to the checkpoint's
# files plus a shard index) and splits into scratch/<variant>/splitted_model.

def _inside(child: Path, parent: Path) -> bool:
    try:
        child.relative_to(parent)
        return True
    except ValueError:
        return False


def _model_view(model_path: Path, view: Path) -> dict:
    """``view``: symlinks to the checkpoint's files, shards named model-0000k-of-0000n, and an index (AirLLM reads
    shard numbers out of file names and re-reads a single unindexed file once per layer)."""
    from safetensors import safe_open

    view.mkdir(parents=True, exist_ok=True)
    for old in view.iterdir():
        if old.is_symlink() or old.is_file():
            old.unlink()
    shards = sorted(p for p in model_path.glob("*.safetensors") if p.is_file())
    if not shards:
        raise FileNotFoundError(f"no *.safetensors in {model_path}")
    for p in model_path.iterdir():
        if p.is_file() and p.suffix != ".safetensors" and p.name != "model.safetensors.index.json":
            (view / p.name).symlink_to(p.resolve())
    names = {p.name: f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k, p in enumerate(shards, 1)}
    weight_map, total = {}, 0
    for p in shards:
        (view / names[p.name]).symlink_to(p.resolve())
        with safe_open(str(p), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has keys(), no iteration
                weight_map[key] = names[p.name]
        total += p.stat().st_size
    (view / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return weight_map


def _fused_expert_params(config) -> set[str]:
    """Names of the 3D expert parameters the transformers model class builds (empty: per-expert modules)."""
    import transformers
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = transformers.AutoModelForCausalLM.from_config(config)
    out = {n for n, p in model.named_parameters() if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))}
    del model
    return out


def _fuse_split(split_dir: Path, fused_params: set[str]) -> int:
    """Rewrite split files with per-expert keys into transformers' fused layout; the files rewritten. Each is written
    beside and moved over the old name (never in place: a split file may be a hard link to the checkpoint)."""
    import torch
    from safetensors.torch import load_file, save_file

    done = 0
    for path in sorted(split_dir.glob("*.safetensors")):
        sd = load_file(str(path))
        groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
        for key in list(sd):
            m = _EXPERT_KEY.match(key)
            if m and f"{m['prefix']}.gate_up_proj" in fused_params:
                groups.setdefault(m["prefix"], {}).setdefault(m["proj"], {})[int(m["e"])] = sd.pop(key)
        if not groups:
            continue
        for prefix, projs in groups.items():
            n = len(projs["gate_proj"])
            if any(sorted(projs[p]) != list(range(n)) for p in ("gate_proj", "up_proj", "down_proj")):
                raise ValueError(f"{path.name}: experts of {prefix} are not 0..{n - 1} for every projection")
            sd[f"{prefix}.gate_up_proj"] = torch.stack(
                [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]], dim=0) for e in range(n)]).contiguous()
            sd[f"{prefix}.down_proj"] = torch.stack([projs["down_proj"][e] for e in range(n)]).contiguous()
        tmp = path.with_name(path.name + ".fused.tmp")
        save_file(sd, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, path)
        done += 1
    return done


def airllm(model_path, prompt_ids, n_new: int, scratch_dir, *, device: str = "cuda", fuse_experts: bool = False,
           drop_cache_each_step: bool = False) -> dict:
    """AirLLM greedy decode of ``n_new`` tokens: the prefill gives the first, then ``n_new - 1`` decode steps of
    which the first is a warm-up (``skipped_steps``). ``drop_cache_each_step`` drops the split's pages from the page
    cache before each step, outside its timing. Never raises: a failure is a row with ``error`` and ``stage``."""
    model_path, scratch = Path(model_path).resolve(), Path(scratch_dir).resolve()
    variant = "fused_split" if fuse_experts else "as_shipped"
    row: dict = {"label": f"AirLLM {version('airllm')}", "variant": variant, "model": str(model_path),
                 "n_new": n_new, "prompt_len": len(prompt_ids), **versions(), "device": device}
    notes: list[str] = []
    stage, model = "setup", None
    try:
        if _inside(scratch, model_path):
            raise ValueError(f"scratch_dir {scratch} is inside the model folder {model_path}; AirLLM would write there")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        stage = "import"
        with contextlib.redirect_stdout(sys.stderr):  # AirLLM prints progress on stdout
            airllm_mod = require("airllm")
            import torch
            from airllm.utils import split_and_save_layers
            from transformers import AutoConfig
        cuda = device.startswith("cuda")
        if cuda and not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available")

        stage = "model_view"
        view = scratch / "model_view"
        weight_map = _model_view(model_path, view)
        config = AutoConfig.from_pretrained(str(view))
        arch = (getattr(config, "architectures", None) or [""])[0]
        row.update(model_type=getattr(config, "model_type", None), architecture=arch)
        vocab = getattr(config, "vocab_size", None)
        if not prompt_ids or (vocab and not all(0 <= int(t) < vocab for t in prompt_ids)):
            raise ValueError(f"prompt ids must be a non-empty list in 0..{vocab}-1")  # a bad id kills the CUDA context

        stage = "pick_class"
        with contextlib.redirect_stdout(sys.stderr):
            module_name, cls_name = airllm_mod.AutoModel.get_module_class(str(view))
        base_cls = getattr(importlib.import_module(module_name), cls_name)

        class _Peer(base_cls):  # AirLLM's class, except that a missing tokenizer is no error (ids go in)
            def get_tokenizer(self, hf_token=None):
                try:
                    return super().get_tokenizer(hf_token=hf_token)
                except Exception:  # noqa: BLE001
                    return None

        _Peer.__name__ = base_cls.__name__
        row["airllm_class"] = f"{module_name}.{cls_name}"
        notes.append(f"airllm.AutoModel mapped architecture {arch or '?'} to {cls_name}")
        per_expert_ckpt = any(_EXPERT_KEY.match(k) for k in weight_map)
        fused = _fused_expert_params(config) if per_expert_ckpt else set()
        probe = base_cls.__new__(base_cls)  # only for its layer_names_dict, the split's module list
        probe.set_layer_names_dict()
        layer_names = probe.layer_names_dict
        row["streams"] = "per_expert" if layer_names.get("expert_prefix") else "whole_layer"

        stage = "split"
        split_root = scratch / variant
        split_root.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr):
            split_dir = Path(split_and_save_layers(str(view), str(split_root), layer_names=layer_names,
                                                   delete_original=False))
        if fused and fuse_experts:
            stage = "fuse_split"
            n = _fuse_split(split_dir, fused)
            notes.append(f"kestrel shim: {n} split files rewritten to transformers' fused expert layout; AirLLM's "
                         "loading and streaming are unchanged")
        elif fused:
            notes.append("as shipped: expected to fail at the first MoE layer (fuse_experts runs the fused split)")
        row["split_s"] = time.perf_counter() - t0

        stage = "init"
        with contextlib.redirect_stdout(sys.stderr):
            model = _Peer(str(view), device="cuda:0" if device == "cuda" else device,
                          layer_shards_saving_path=str(split_root), delete_original=False, prefetching=True)
        row["dtype"] = str(model.running_dtype).replace("torch.", "")
        hf, dev = model.model, model.device

        def step(ids, past):
            if drop_cache_each_step:  # the same cold disk kestrel's cold rows read: nothing of the split cached
                from backends.cuda.host.pagecache import drop_cache

                for f in split_dir.glob("*.safetensors"):
                    drop_cache(f)
            with _Timer("cuda" if cuda else "cpu") as t:
                res = hf(input_ids=ids, past_key_values=past, use_cache=True)
                tok = int(res.logits[0, -1].argmax())
            return tok, res.past_key_values, t.ms

        tokens: list[int] = []
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode(), contextlib.redirect_stdout(sys.stderr):
            stage = "prefill"
            tok, past, prefill = step(torch.tensor([list(prompt_ids)], device=dev), None)
            tokens.append(tok)
            stage = "decode"
            times = []
            for _ in range(n_new - 1):
                tok, past, ms = step(torch.tensor([[tok]], device=dev), past)
                tokens.append(tok)
                times.append(ms)
        row.update(peer_row(row["label"], tokens, times, prefill,
                            torch.cuda.max_memory_allocated() if cuda else None, 1, "cuda" if cuda else "cpu"))
    except PeerUnavailable as exc:
        row.update(error=str(exc), stage=stage)
    except Exception as exc:  # noqa: BLE001 - the row records why AirLLM could not run
        row.update(error=_one_line(exc), stage=stage)
    finally:
        row["note"] = "; ".join(notes)
        if model is not None and getattr(model, "_executor", None) is not None:
            model._executor.shutdown(wait=True)
        del model
        gc.collect()
    return row


def peer(name: str, path, prompt: list[int], n_new: int, *, device: str = "cuda", scratch_root=None,
         fuse_experts: bool = False, drop_cache_each_step: bool = False) -> dict:
    """The peer called ``name`` (one of NAMES); a peer that cannot run is a row with ``error``, not an exception."""
    try:
        if name == "transformers":
            return transformers_dynamic(path, prompt, n_new, device)
        if name == "transformers-static":
            return transformers_static(path, prompt, n_new, device)
        if name == "accelerate":
            return accelerate_offload(path, prompt, n_new, "layers", device)
        if name == "accelerate-experts":
            return accelerate_offload(path, prompt, n_new, "experts", device)
        if name == "accelerate-disk":
            return accelerate_disk_offload(path, prompt, n_new, scratch_root, device)
        if name == "airllm":
            scratch = Path(tempfile.mkdtemp(prefix="airllm-scratch-", dir=scratch_root))
            try:
                return airllm(path, prompt, n_new, scratch, device=device, fuse_experts=fuse_experts,
                              drop_cache_each_step=drop_cache_each_step)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)  # this run's own directory
        raise ValueError(f"unknown peer {name!r}; known: {', '.join(NAMES)}")
    except PeerUnavailable as exc:
        return {"label": name, "error": str(exc)}
    except Exception as exc:  # noqa: BLE001 - a peer that cannot run is recorded, not fatal
        return {"label": name, "error": _one_line(exc)}
    finally:
        _free(device)


FAST = ("transformers", "transformers-static")  # resident: as many tokens as kestrel's rows; the rest are slow


def beside(names: list[str], path, prompt: list[int], tokens: int, slow_tokens: int, off: dict | None, *,
           device: str, scratch_root, fuse_experts: bool = False, done=lambda rows: None) -> dict:
    """The peers ``names`` on ``path``'s weights and ``prompt``, each row's ids compared with kestrel's ``off`` row
    where given: the resident peers (FAST) generate ``tokens``, the others ``slow_tokens``. The rows by name beside
    the peers' versions; ``done(rows)`` after each, for a partial record."""
    from bench.log import log
    from bench.rows import compare_ids

    out: dict = {"versions": versions()}
    for name in names:
        r = peer(name, path, prompt, tokens if name in FAST else slow_tokens, device=device,
                 scratch_root=scratch_root, fuse_experts=fuse_experts)
        if off is not None and "token_ids" in r:
            r.update(compare_ids(r, off))
        log(f"peer {name}: {(r.get('summary') or {}).get('p50')} ms/tok {r.get('error', '')}")
        out[name] = r
        done(out)
    return out


def parse_names(text: str) -> list[str]:
    names = [n for n in (text or "").split(",") if n]
    bad = [n for n in names if n not in NAMES]
    if bad:
        raise BenchError(f"unknown peer {bad[0]!r}; known: {', '.join(NAMES)}")
    return names
