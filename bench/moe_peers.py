"""The Hugging Face peer rows of the Mixture-of-Experts benchmark, as functions a bench script imports.

    from moe_peers import transformers_resident, accelerate_offload
    row = transformers_resident(path, prompt, n_new)                    # every weight on cuda:0, bfloat16
    row = accelerate_offload(path, prompt, n_new, what="experts")       # every mlp.experts module on the CPU
    row = accelerate_offload(path, prompt, n_new, what="layers")        # every decoder layer on the CPU

Each row: label, ms_per_token (median decode step), prefill_ms, decode_steps, decode_ms, token_ids (greedy,
generated only), peak_device_bytes, the transformers and accelerate versions, and for the offload rows the
modules and bytes left on the CPU. Decode steps are timed with CUDA events by common.hf_decode, after an untimed
warm-up (a prefill and one step; ``warmup=False`` skips it: with the experts offloaded each forward copies them
all); peak_device_bytes is torch.cuda.max_memory_allocated from before the load to the end of the decode. Each
function frees its model and the device memory before it returns.

Module names are read from ``model.named_modules()``, so one map serves transformers 4.5x (``mlp.experts`` a
ModuleList of per-expert MLPs) and 5.x (one fused ``mlp.experts`` module holding ``gate_up_proj``/``down_proj``).

``device="cpu"`` (with ``dtype=torch.float32``) is for smoke tests on a machine without a GPU: the same
loading, device map and greedy loop, timed with ``time.perf_counter`` and no peak device bytes.
"""

from __future__ import annotations

import gc
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import hf_decode  # noqa: E402

_EXPERTS = re.compile(r"(.*\.)?layers\.\d+\.mlp\.experts")
_LAYER = re.compile(r"(.*\.)?layers\.\d+")


def versions() -> dict:
    import transformers

    try:
        import accelerate

        acc = accelerate.__version__
    except ImportError:
        acc = None
    return {"transformers_version": transformers.__version__, "accelerate_version": acc}


def _dtype_kwarg(dtype: torch.dtype) -> dict:
    """transformers >= 4.56 names it ``dtype``; older ones only know ``torch_dtype``."""
    import transformers

    major, minor = (int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def _load(path, dtype: torch.dtype, device_map=None):
    from transformers import AutoModelForCausalLM

    kw = _dtype_kwarg(dtype)
    if device_map is not None:
        kw["device_map"] = device_map
    return AutoModelForCausalLM.from_pretrained(str(path), **kw).eval()


def _cpu_decode(model, prompt: list[int], n_new: int) -> tuple[list[int], list[float], float]:
    """hf_decode's greedy loop with its DynamicCache, on the CPU, timed with perf_counter."""
    times, out = [], []
    with torch.inference_mode():
        t0 = time.perf_counter()
        res = model(input_ids=torch.tensor([prompt]), use_cache=True)
        tok = int(res.logits[0, -1].argmax())
        prefill = (time.perf_counter() - t0) * 1e3
        past = res.past_key_values
        out.append(tok)
        for _ in range(n_new - 1):
            t0 = time.perf_counter()
            res = model(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            tok = int(res.logits[0, -1].argmax())
            times.append((time.perf_counter() - t0) * 1e3)
            past = res.past_key_values
            out.append(tok)
    return out, times, prefill


def _decode(model, prompt, n_new, device: str, warmup: bool = False):
    """Greedy ids, decode-step ms, prefill ms; ``warmup`` first runs a prefill and one step untimed (the
    first forwards of a process load kernels and pick cuBLAS algorithms: a timed first prefill would show it)."""
    if warmup:
        _decode(model, prompt, 2, device)
    if device == "cpu":
        return _cpu_decode(model, list(prompt), n_new)
    if device not in ("cuda", "cuda:0"):
        raise ValueError(f"device must be 'cuda' (cuda:0, as common.hf_decode uses) or 'cpu', got {device!r}")
    return hf_decode(model, list(prompt), n_new)


def _row(label: str, ids, times, prefill, peak, **extra) -> dict:
    return {"label": label, "ms_per_token": statistics.median(times) if times else None,
            "prefill_ms": prefill, "decode_steps": len(times), "decode_ms": times, "token_ids": ids,
            "peak_device_bytes": peak, **versions(), **extra}


def _free(device: str) -> None:
    gc.collect()
    if device != "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()
        if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):  # cuBLAS keeps its workspaces in the caching allocator
            torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()


def _reset_peak(device: str) -> None:
    if device != "cpu":
        _free(device)
        torch.cuda.reset_peak_memory_stats()


def _peak(device: str) -> int | None:
    return None if device == "cpu" else torch.cuda.max_memory_allocated()


def transformers_resident(path, prompt: list[int], n_new: int, device: str = "cuda",
                          dtype: torch.dtype = torch.bfloat16, warmup: bool = True) -> dict:
    """Every weight on the device (``device_map={"": device}``: loaded straight there); greedy decode."""
    _reset_peak(device)
    model = _load(path, dtype, device_map=None if device == "cpu" else {"": device})
    try:
        ids, times, prefill = _decode(model, prompt, n_new, device, warmup)
        peak = _peak(device)
    finally:
        del model
        _free(device)
    return _row("transformers resident", ids, times, prefill, peak, dtype=str(dtype).removeprefix("torch."))


def offload_modules(model, what: str) -> list[str]:
    """Names of the modules ``what`` puts on the CPU: every ``layers.N.mlp.experts`` module, or every decoder layer."""
    if what == "experts":
        names = [n for n, _ in model.named_modules() if _EXPERTS.fullmatch(n)]
    elif what == "layers":
        names = [n for n, m in model.named_modules() if _LAYER.fullmatch(n)]
    else:
        raise ValueError(f"what must be 'experts' or 'layers', got {what!r}")
    if not names:
        raise ValueError(f"no {what} modules in {type(model).__name__}: is it a Mixture-of-Experts decoder?")
    return names


def device_map_for(model, offload: list[str], main) -> dict:
    """A device map covering every parameter and buffer: ``offload`` on "cpu", every other module on ``main``.

    Descends only into modules that hold an offloaded one, so the map stays at the coarsest names
    (a dense layer, the attention, the router, the norms are one entry each).
    """
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


def accelerate_offload(path, prompt: list[int], n_new: int, what: str = "experts", device: str = "cuda",
                       dtype: torch.dtype = torch.bfloat16, warmup: bool = True) -> dict:
    """accelerate's CPU offload: ``what`` ("experts" or "layers") stays in host memory and is copied to the
    device at each forward (accelerate's hooks); every other module lives on ``device``. Greedy decode."""
    import accelerate
    from accelerate.hooks import remove_hook_from_submodules

    _reset_peak(device)
    model = _load(path, dtype)  # on the CPU
    try:
        offload = offload_modules(model, what)
        off_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                        if any(n.startswith(o + ".") for o in offload))
        main = "cpu" if device == "cpu" else torch.device(device).index or 0
        dm = device_map_for(model, offload, main)
        # On the CPU every module is where it runs: force the hooks so the smoke test exercises them too.
        model = accelerate.dispatch_model(model, device_map=dm, main_device=main, force_hooks=device == "cpu")
        ids, times, prefill = _decode(model, prompt, n_new, device, warmup)
        peak = _peak(device)
        remove_hook_from_submodules(model)
    finally:
        del model
        _free(device)
    return _row(f"accelerate offload {what}", ids, times, prefill, peak, what=what,
                offloaded_modules=len(offload), offloaded_bytes=off_bytes, dtype=str(dtype).removeprefix("torch."))
