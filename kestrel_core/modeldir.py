"""A Hugging Face model directory, opened once: config.json, the safetensors (mmap'd), the tokenizer.

    from kestrel_core import load
    model = load("/path/to/model")          # or a name in the Hugging Face cache: load("Qwen/Qwen3-8B")
    with model.open(policy="asymmetric", keep=2, backend="cpu_ref") as run:
        res = run.generate(prompt_ids=[1, 2, 3], max_new_tokens=8)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .checkpoint import Checkpoint
from .config import KestrelConfig, with_settings
from .errors import ConfigError
from .host import HostStore
from .hub import resolve
from .modelconfig import ModelConfig, read_json, read_model_config
from .quant import read_quant
from .tensor_table import unit_specs, validate_checkpoint
from .tokenizer import Tokenizer, load_tokenizer
from .units import UnitSpec

if TYPE_CHECKING:
    from .engine import Run


def _ids(value) -> set[int]:
    return set() if value is None else set(value) if isinstance(value, list) else {value}


def eos_ids(model_dir: Path, config: ModelConfig) -> frozenset[int]:
    """The ids that end a generation: eos_token_id in config.json and in generation_config.json (where a
    checkpoint has one; Qwen3's lists its chat turn's end there too), as transformers' generate reads them."""
    ids = _ids(config.eos_token_id)
    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        raw = read_json(path)
        eos = raw.get("eos_token_id") if isinstance(raw, dict) else None
        is_id = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0  # noqa: E731
        if not (eos is None or is_id(eos) or (isinstance(eos, list) and all(is_id(i) for i in eos))):
            raise ConfigError(f"{path}: eos_token_id must be a token id or a list of them, got {str(eos)[:80]}; "
                              "fix the file or remove the key")
        ids |= _ids(eos)
    return frozenset(ids)


class Model:
    """What every run on one model shares: the parsed config, the mapped checkpoint, host copies."""

    def __init__(self, model_dir: str | Path):
        self.dir = resolve(model_dir)  # a directory, or a model name in the Hugging Face cache
        self.config: ModelConfig = read_model_config(self.dir)
        self.checkpoint = Checkpoint(self.dir)
        try:
            self.quant = read_quant(self.checkpoint, self.config)  # None for a float checkpoint
            validate_checkpoint(self.checkpoint, self.config, self.quant.stored_names() if self.quant else {})
            self.tokenizer: Tokenizer | None = load_tokenizer(self.dir)
            self.eos_ids: frozenset[int] = eos_ids(self.dir, self.config)
        except BaseException:
            self.checkpoint.close()
            raise
        self.units: tuple[UnitSpec, ...] = unit_specs(self.config)
        self.host = HostStore()  # backend host staging, reused by every run on this model

    @property
    def n_layers(self) -> int:
        return self.config.num_hidden_layers

    def prompt_ids(self, ids: list[int] | None, text: str | None, default: list[int] | None = None) -> list[int]:
        """The prompt as ids: ``ids`` as given, else ``text`` through the tokenizer, else ``default``."""
        if ids:
            return list(ids)
        if text:
            if self.tokenizer is None:
                raise ConfigError(f"--prompt needs a tokenizer: {self.dir} has no usable tokenizer.json; "
                                  "pass --prompt-ids instead")
            ids = self.tokenizer.encode(text)
            if not ids:
                raise ConfigError("the prompt is empty after tokenization")
            return ids
        if default is not None:
            return list(default)
        raise ConfigError("the prompt is empty: pass --prompt TEXT or --prompt-ids 1,2,3")

    def open(self, config: KestrelConfig | None = None, **settings: Any) -> "Run":
        """A run on this model: ``config`` (default: kestrel.toml's defaults), then ``settings`` by their toml
        names, flat (``policy="asymmetric", keep=2, backend="cpu_ref"``) or as tables (``backend={"name": "cuda"}``)."""
        from .engine import open_run  # the run needs the backends' plugin registry; the model does not

        return open_run(self, with_settings(config or KestrelConfig(), settings))

    def close(self) -> None:
        self.host.clear()
        self.checkpoint.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def load(model_dir: str | Path) -> Model:
    """Open a model directory (config.json + *.safetensors), or a model name such as ``"Qwen/Qwen3-8B"`` from the
    local Hugging Face cache (never downloaded); close it with ``model.close()`` or ``with``."""
    return Model(model_dir)
