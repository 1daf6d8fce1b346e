"""A GGUF file opened as ``ModelFiles``: what ``load("x.gguf")`` (``--model x.gguf``, ``model = "x.gguf"``) reads in
place of a Hugging Face directory.

The config, tokenizer, the ids that end a generation and the chat template come from the file's metadata
(``GGUFCheckpoint``). A unit whose every linear is stored Q8_0 is kestrel's q8 with group 32 (``q8_info``): its
bytes are repacked as they are read, never dequantized, so cuda streams it as q8. Any other tensor is served as
floats (a quantized one dequantized to float32 when a backend reads it), so cuda streams it at its compute
dtype's full width, unless the backend holds the blocks themselves (``block_tensors``: cuda computes on them).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import attrs
from gguf import GGMLQuantizationType

from kestrel_core.errors import CheckpointError, KestrelNote
from kestrel_core.formats.gguf import SUFFIX, GGUFCheckpoint, is_gguf
from kestrel_core.formats.gguf_quants import Q8_0_GROUP
from kestrel_core.formats.modelconfig import ModelConfig
from kestrel_core.formats.modeldir import ModelFiles
from kestrel_core.formats.quant import FLOAT_ROLES, METHOD, N_ALIGN, Q8Tensor, QuantInfo, pad_n, q8_names
from kestrel_core.formats.tensor_table import unit_specs
from kestrel_core.formats.units import is_expert


def names_gguf(model: str | os.PathLike) -> bool:
    """Whether ``model`` names a GGUF: a path ending in ``.gguf`` (whatever is there, so that a directory or a missing
    file of that name gets the GGUF reader's error), or a file that starts with GGUF's magic."""
    path = Path(model)
    if path.suffix.lower() == SUFFIX:
        return True
    try:
        return is_gguf(path)
    except OSError:  # a path that cannot be reached: the directory reader names why
        return False


def open_gguf(path: str | os.PathLike) -> ModelFiles:
    """Open and check a .gguf file whole (a one-line CheckpointError naming what is wrong)."""
    ckpt = GGUFCheckpoint(path)
    try:
        config = ckpt.model_config()  # checked against the tensors when the file opened
        quant = q8_info(ckpt, config)
        tokenizer = _tokenizer(ckpt)
        eos = ckpt.eos_ids()
    except BaseException:
        ckpt.close()
        raise
    return ModelFiles(ckpt.path, config, ckpt, quant, tokenizer, eos, unit_specs(config), ckpt.chat_template)


def _tokenizer(ckpt: GGUFCheckpoint):
    """The tokenizer, or None with a note where kestrel cannot build this one: the weights still run on ids."""
    try:
        return ckpt.tokenizer()
    except CheckpointError as exc:
        warnings.warn(f"{exc}; the model runs on token ids alone", KestrelNote, stacklevel=3)
        return None


def no_tokenizer(ckpt: GGUFCheckpoint) -> str:
    """Why a GGUF has no tokenizer (what ``_tokenizer``'s note said when it opened), as an error's subject."""
    try:
        ckpt.tokenizer()
    except CheckpointError as exc:
        return f"{ckpt.path} has no tokenizer kestrel can build ({str(exc).removeprefix(f'{ckpt.path}: ')})"
    return f"{ckpt.path} holds no vocabulary (no tokenizer.ggml.model in its metadata)"


def q8_info(ckpt: GGUFCheckpoint, cfg: ModelConfig) -> QuantInfo | None:
    """The GGUF's Q8_0 weights as kestrel q8 (group 32, ``packed``): every linear of a layer's unit whose linears are
    all Q8_0 (the router excepted, which stays float as in kestrel's own q8), every expert where all of them are
    Q8_0, and an untied Q8_0 lm_head; None where there is none. Anything else is served as floats: cuda fuses q/k/v
    and gate/up into one entry each, which is q8 or float as a whole, and reads every expert one way."""
    tensors: dict[str, Q8Tensor] = {}
    layers, experts = [], []
    for unit in unit_specs(cfg):
        linears = {name: shape for role, (name, shape) in unit.tensors.items() if role not in FLOAT_ROLES}
        (experts if is_expert(unit.key) else layers).append(linears)
    q8_experts = all(ckpt.info(name).ggml_type == "Q8_0" for linears in experts for name in linears)
    for linears in layers + (experts if q8_experts else []):
        if all(ckpt.info(name).ggml_type == "Q8_0" for name in linears):
            tensors.update({name: _packed(name, shape) for name, shape in linears.items()})
    lm_head = "full"
    if not cfg.tie_word_embeddings and ckpt.info("lm_head.weight").ggml_type == "Q8_0":
        lm_head = "q8"
        tensors["lm_head.weight"] = _packed("lm_head.weight", (cfg.vocab_size, cfg.hidden_size))
    if not tensors:
        return None
    return QuantInfo(METHOD, Q8_0_GROUP, lm_head, N_ALIGN, tensors)


def _packed(name: str, shape: tuple[int, int]) -> Q8Tensor:
    n, k = shape
    qweight, scales = q8_names(name)  # names only: the GGUF stores one tensor, repacked by GGUFCheckpoint.q8
    return Q8Tensor(name, qweight, scales, n, k, Q8_0_GROUP, pad_n(n), packed=True)


@attrs.frozen
class BlockTensor:
    """A 2-D quantized weight W [n, k] held as the file's own blocks (``GGUFCheckpoint.blocks``)."""

    name: str
    qtype: GGMLQuantizationType
    n: int
    k: int
    nbytes: int


def block_tensors(ckpt, cfg: ModelConfig, types, skip=()) -> dict[str, BlockTensor]:
    """Every linear of the model's units (the router excepted, which stays float) and an untied lm_head that the GGUF
    stores as one of ``types`` (the block types a backend computes on), less the names in ``skip`` (those it reads
    another way, as q8); empty for any other checkpoint."""
    if not isinstance(ckpt, GGUFCheckpoint):
        return {}
    names = [name for unit in unit_specs(cfg) for role, (name, _) in unit.tensors.items() if role not in FLOAT_ROLES]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    wanted = {t.name for t in types}
    out = {}
    for name in names:
        info = ckpt.info(name)
        if info.ggml_type in wanted and name not in skip and len(info.shape) == 2:
            out[name] = BlockTensor(name, GGMLQuantizationType[info.ggml_type], *info.shape, info.nbytes)
    return out
