"""Reading a Hugging Face model directory once: config.json, the safetensors (mmap'd and checked), the tokenizer,
the ids that end a generation, the chat template (read when asked), and the model's residency units. ``ModelFiles``
is what a model is to the engine, whatever it was read from (a GGUF file: ``gguf_model``)."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Callable

import attrs

from kestrel_core.formats.chat_template import ChatTemplate, load_chat_template
from kestrel_core.formats.checkpoint import Checkpoint
from kestrel_core.errors import ConfigError
from kestrel_core.formats.hub import resolve
from kestrel_core.formats.modelconfig import ModelConfig, read_json, read_model_config
from kestrel_core.formats.quant import QuantInfo, read_quant
from kestrel_core.formats.tensor_table import check_depth, unit_specs, validate_checkpoint
from kestrel_core.formats.tokenizer import Tokenizer, load_tokenizer
from kestrel_core.formats.units import UnitSpec


def _ids(value) -> set[int]:
    return set() if value is None else set(value) if isinstance(value, list) else {value}


def eos_ids(model_dir: Path, config: ModelConfig) -> frozenset[int]:
    """The ids that end a generation: eos_token_id in config.json and in generation_config.json (where a
    checkpoint has one; Qwen3's lists its chat turn's end there too), as transformers' generate reads them."""
    ids = _ids(config.eos_token_id)
    path = Path(model_dir) / "generation_config.json"
    if os.path.lexists(path):  # a directory, a device or a dangling link there is an error read_json names
        raw = read_json(path)
        eos = raw.get("eos_token_id") if isinstance(raw, dict) else None
        is_id = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0  # noqa: E731
        if not (eos is None or is_id(eos) or (isinstance(eos, list) and all(is_id(i) for i in eos))):
            raise ConfigError(f"{path}: eos_token_id must be a token id or a list of them, got {str(eos)[:80]}; "
                              "fix the file or remove the key")
        ids |= _ids(eos)
    return frozenset(ids)


@attrs.frozen
class ModelFiles:
    """A model as read and checked: what every run on it shares."""

    dir: Path  # the model directory, or the .gguf file
    config: ModelConfig
    checkpoint: Checkpoint  # or a gguf.GGUFCheckpoint, which serves the same members
    quant: QuantInfo | None  # None for a float checkpoint
    tokenizer: Tokenizer | None
    eos_ids: frozenset[int]
    units: tuple[UnitSpec, ...]
    chat_template: Callable[[], ChatTemplate]  # the model's chat template, read when asked; a ConfigError where none


def read_model_dir(model_dir: str | Path | Any) -> ModelFiles:
    """Open a model directory, or a model name in the local Hugging Face cache, and check it whole."""
    path = resolve(model_dir)  # a directory, or a model name in the Hugging Face cache
    config = read_model_config(path)
    checkpoint = Checkpoint(path)
    try:
        check_depth(checkpoint, config)  # before anything builds per-layer tables from config.json's depth
        quant = read_quant(checkpoint, config)
        validate_checkpoint(checkpoint, config, quant.stored_names() if quant else {})
        tokenizer = load_tokenizer(path)
        eos = eos_ids(path, config)
    except BaseException:
        checkpoint.close()
        raise
    return ModelFiles(path, config, checkpoint, quant, tokenizer, eos, unit_specs(config),
                      functools.partial(load_chat_template, path))
