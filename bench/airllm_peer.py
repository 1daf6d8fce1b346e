"""AirLLM (pypi ``airllm``) as a peer row of the MoE benchmark.

``airllm_row(model_path, prompt_ids, n_new, scratch_dir)`` runs AirLLM's greedy decode of a Hugging
Face checkpoint folder (config.json + *.safetensors) and returns one row; it never raises: when
AirLLM cannot run the model the row carries ``error`` (the exception's one-line message) and
``stage`` (where it broke), so the bench records why.

What AirLLM 4.0.0 does, read from its source:

* ``airllm.AutoModel`` maps ``config.architectures[0]`` through a small override table (ChatGLM,
  QWen v1, Baichuan, InternLM, Kimi K3, Qwen3.5, Qwen4-Exp); every other architecture, Qwen3-MoE
  (``Qwen3MoeForCausalLM``) included, gets the generic ``AirLLMBaseModel``. That class builds the
  transformers model on ``meta`` and hooks embed, each decoder layer, norm and lm_head: a hook
  loads that module's whole split file to the GPU before it runs and sends it back to ``meta``
  after (next layer prefetched on a thread). Per-expert streaming exists only where a subclass
  names ``expert_prefix`` (Kimi K3); for Qwen3-MoE a token moves every expert of every layer.
* Before the first run it splits the checkpoint into one safetensors file per module, under
  ``<model dir>/splitted_model`` unless ``layer_shards_saving_path`` is given (then
  ``<that>/splitted_model``); a shard holding exactly one module is hard-linked (else symlinked)
  instead of copied. It needs free disk about the model's size there (``NotEnoughSpaceException``).
* Its split keeps the checkpoint's names (``mlp.experts.E.gate_proj.weight``), while transformers 5
  builds fused ``Qwen3MoeExperts`` (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj``
  [E, H, I]) and converts names only in its own ``from_pretrained``: as shipped, AirLLM fails at the
  first MoE layer (``'Qwen3MoeExperts' object has no attribute '0'``). ``fuse_experts=True``
  (``--fuse-experts``) rewrites the scratch split files into the fused layout first (what
  transformers' own conversion does: stack experts, gate then up), then runs AirLLM unchanged; the
  row says so in ``variant`` and ``note``.
* Imports: bitsandbytes is optional (only ``compression=`` needs it, never used here); optimum is
  not imported at all; compressed_tensors only for pre-quantized checkpoints; a model family whose
  module fails to import is skipped with a warning. Needs torch, transformers, accelerate,
  safetensors, huggingface_hub, tqdm.

Here nothing is written into ``model_path``: AirLLM is pointed at ``scratch_dir/model_view`` (links
to the checkpoint's files, plus a shard index written here) and splits into
``scratch_dir/<variant>/splitted_model``; the split is reused by later runs. A ``scratch_dir`` inside
``model_path`` is refused.

    python bench/airllm_peer.py MODEL_DIR --tokens 4 [--scratch DIR] [--fuse-experts] [--device cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

PROMPT = [785, 3974, 13876, 38835, 34208, 916, 279, 15678]  # stream_bench.py's prompt

_EXPERT_KEY = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def _one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:500]


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:  # noqa: BLE001
        return None


def _inside(child: Path, parent: Path) -> bool:
    try:
        child.relative_to(parent)
        return True
    except ValueError:
        return False


def _model_view(model_path: Path, view: Path) -> dict:
    """``view``: symlinks to the checkpoint's files, shards named model-0000k-of-0000n, and an index.

    AirLLM reads shard numbers out of file names (``name.split('-')[1]``) and re-reads a single
    unindexed file once per layer, so the view always has an index and canonical shard names.
    """
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
    """Rewrite split files with per-expert keys into transformers' fused layout; returns files rewritten.

    A file is written beside and moved over the old name (never written in place: a split file may
    be a hard link to the user's checkpoint).
    """
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


def airllm_row(model_path, prompt_ids, n_new: int, scratch_dir, *, device: str = "cuda",
               fuse_experts: bool = False, dtype=None, drop_cache_each_step: bool = False) -> dict:
    """AirLLM greedy decode of ``n_new`` tokens: prefill (token 1), then ``n_new - 1`` decode steps
    of which the first is a warm-up (``drop_cache_each_step``: the split's pages are dropped from the page
    cache before each step, outside its timing). CUDA events time each (``device`` "cpu" uses perf_counter:
    for tests only). Returns the row; on any failure the row has ``error`` and ``stage``."""
    model_path = Path(model_path).resolve()
    scratch = Path(scratch_dir).resolve()
    variant = "fused_split" if fuse_experts else "as_shipped"
    row: dict = {"label": "airllm", "variant": variant, "model": str(model_path), "n_new": n_new,
                 "prompt_len": len(prompt_ids), "airllm_version": _version("airllm"),
                 "transformers_version": _version("transformers"), "device": device}
    notes: list[str] = []
    stage = "setup"
    model = None
    try:
        if _inside(scratch, model_path):
            raise ValueError(f"scratch_dir {scratch} is inside the model folder {model_path}; AirLLM would write there")
        if not (model_path / "config.json").is_file():
            raise FileNotFoundError(f"no config.json in {model_path}")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

        stage = "import"
        with contextlib.redirect_stdout(sys.stderr):  # AirLLM prints progress on stdout
            import importlib

            import airllm
            import torch
            from airllm.utils import split_and_save_layers
            from transformers import AutoConfig
        row["airllm_version"] = getattr(airllm, "__version__", None) or _version("airllm")
        cuda = device.startswith("cuda")
        if cuda and not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available")

        stage = "model_view"
        view = scratch / "model_view"
        weight_map = _model_view(model_path, view)
        config = AutoConfig.from_pretrained(str(view))
        arch = (getattr(config, "architectures", None) or [""])[0]
        row.update(model_type=getattr(config, "model_type", None), architecture=arch)
        vocab = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", None)
        if not prompt_ids or (vocab and not all(0 <= int(t) < vocab for t in prompt_ids)):
            raise ValueError(f"prompt ids must be a non-empty list in 0..{vocab}-1")  # a bad id would kill the CUDA context

        stage = "pick_class"
        with contextlib.redirect_stdout(sys.stderr):
            module_name, cls_name = airllm.AutoModel.get_module_class(str(view))
        base_cls = getattr(importlib.import_module(module_name), cls_name)

        class _Peer(base_cls):  # AirLLM's class, except that a missing tokenizer is no error (ids go in)
            def get_tokenizer(self, hf_token=None):
                try:
                    return super().get_tokenizer(hf_token=hf_token)
                except Exception:  # noqa: BLE001
                    return None

        _Peer.__name__ = base_cls.__name__
        row["airllm_class"] = f"{module_name}.{cls_name}"
        generic = cls_name == "AirLLMBaseModel"
        notes.append(f"airllm.AutoModel mapped architecture {arch or '?'} to {cls_name}"
                     + (" (no dedicated class: the generic path that streams any *ForCausalLM through"
                        " transformers' own forward)" if generic else ""))

        per_expert_ckpt = any(_EXPERT_KEY.match(k) for k in weight_map)
        fused = _fused_expert_params(config) if per_expert_ckpt else set()
        probe = base_cls.__new__(base_cls)  # only for its layer_names_dict, the split's module list
        probe.set_layer_names_dict()
        layer_names = probe.layer_names_dict
        streams_experts = bool(layer_names.get("expert_prefix"))
        row["streams"] = "per_expert" if streams_experts else "whole_layer"
        notes.append("streams " + ("single experts (expert_prefix "
                                   f"{layer_names['expert_prefix']})" if streams_experts else
                                   "whole modules: embed, each decoder layer with all its experts, norm, lm_head"))
        if fused:
            notes.append(f"transformers {row['transformers_version']} builds fused expert tensors "
                         "(experts.gate_up_proj / experts.down_proj); the checkpoint and AirLLM's split name them "
                         "per expert (experts.E.gate_proj.weight)")

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
            notes.append(f"kestrel shim: {n} split files rewritten in {split_dir} to the fused layout "
                         "(stack experts; gate_up = cat(gate, up)); AirLLM's loading and streaming are unchanged")
        elif fused:
            notes.append("as shipped: expected to fail at the first MoE layer (--fuse-experts runs the fused split)")
        row["split_s"] = time.perf_counter() - t0
        row["split_dir"] = str(split_dir)

        stage = "init"
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr):
            model = _Peer(str(view), device="cuda:0" if device == "cuda" else device, dtype=dtype,
                          layer_shards_saving_path=str(split_root), delete_original=False, prefetching=True)
        row["init_s"] = time.perf_counter() - t0
        row["dtype"] = str(model.running_dtype).replace("torch.", "")
        row["prefetching"] = bool(model.prefetching)
        row["tie_word_embeddings"] = bool(getattr(model, "tie_word_embeddings", False))
        hf = model.model
        dev = model.device

        def step(ids, past):
            if drop_cache_each_step:  # the same cold disk kestrel's cold rows read: nothing of the split cached
                from kestrel_cuda.host.pagecache import drop_cache

                for f in split_dir.glob("*.safetensors"):
                    drop_cache(f)
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
            w = time.perf_counter()
            res = hf(input_ids=ids, past_key_values=past, use_cache=True)
            tok = int(res.logits[0, -1].argmax())
            if cuda:
                b.record()
                b.synchronize()
                ms = a.elapsed_time(b)
            else:
                ms = (time.perf_counter() - w) * 1e3
            return tok, res.past_key_values, ms, (time.perf_counter() - w) * 1e3

        tokens: list[int] = []
        row["token_ids"] = tokens
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode(), contextlib.redirect_stdout(sys.stderr):
            stage = "prefill"
            tok, past, row["prefill_ms"], row["prefill_wall_ms"] = step(
                torch.tensor([list(prompt_ids)], device=dev), None)
            tokens.append(tok)
            stage = "decode"
            times, walls = [], []
            for _ in range(n_new - 1):
                tok, past, ms, wall = step(torch.tensor([[tok]], device=dev), past)
                tokens.append(tok)
                times.append(ms)
                walls.append(wall)
        row["warmup_decode_ms"] = times[0] if times else None
        row["decode_ms"] = times[1:]
        row["decode_wall_ms"] = walls[1:]
        row["decode_steps"] = len(times[1:])
        row["ms_per_token"] = statistics.median(times[1:]) if times[1:] else None
        if not times[1:]:
            notes.append("n_new < 3: no decode step after the warm-up, no ms_per_token")
        row["peak_device_bytes"] = torch.cuda.max_memory_allocated() if cuda else None
        row["timer"] = "cuda_events" if cuda else "perf_counter"
    except Exception as e:  # noqa: BLE001 - the row records why AirLLM could not run
        row["error"] = _one_line(e)
        row["stage"] = stage
    finally:
        row["note"] = "; ".join(notes)
        if model is not None:
            ex = getattr(model, "_executor", None)
            if ex is not None:
                ex.shutdown(wait=True)
        del model
        gc.collect()
        if "torch" in sys.modules:
            import torch
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="AirLLM peer row (JSON on stdout)")
    ap.add_argument("model_dir")
    ap.add_argument("--tokens", type=int, default=4, help="new tokens (prefill gives the first; one decode step is warm-up)")
    ap.add_argument("--prompt", default=None, help="comma-separated token ids (default: a fixed 12-token prompt)")
    ap.add_argument("--scratch", default=None, help="where the split goes (default /tmp/airllm_scratch/<model dir name>)")
    ap.add_argument("--fuse-experts", action="store_true", help="rewrite the split to transformers' fused expert layout")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args(argv)
    prompt = [int(x) for x in a.prompt.split(",")] if a.prompt else PROMPT
    if not a.prompt:  # fold the default prompt into a small test model's vocabulary
        try:
            vocab = json.loads((Path(a.model_dir) / "config.json").read_text()).get("vocab_size")
        except (OSError, ValueError):
            vocab = None
        if vocab and max(prompt) >= vocab:
            prompt = [t % vocab for t in prompt]
    scratch = a.scratch or str(Path("/tmp/airllm_scratch") / Path(a.model_dir).resolve().name)
    row = airllm_row(a.model_dir, prompt, a.tokens, scratch, device=a.device, fuse_experts=a.fuse_experts)
    print(json.dumps(row, indent=1))
    return 0  # a failed run is a row with "error", like the function's


if __name__ == "__main__":
    sys.exit(main())
