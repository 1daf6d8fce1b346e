"""Writing a model as one GGUF file (llama.cpp's format) with quantized weights, for ``kestrel quantize --type`` and
``kestrel make-model --type``.

What is written is what llama.cpp's ``convert_hf_to_gguf.py`` followed by ``llama-quantize`` would write, so that
llama.cpp and kestrel's own reader (``gguf.py``) open it as the model it came from:

- **Names and layouts**: the inverse of the reader's map (``gguf.GLOBAL_NAMES``, ``LAYER_NAMES``, ``EXPERT_STACKS``);
  a qwen3moe layer's experts as one stack ``[experts, out, in]`` a role. A ``llama`` model's ``attn_q`` and
  ``attn_k`` rows (and biases) are permuted into llama.cpp's rotary order (``LlamaModel.permute``, K with the KV
  head count), which the reader undoes; ``qwen3`` and ``qwen3moe`` are stored as they are.
- **Types**: ``gguf_types`` (a plain type, or the Q4_K_M mix; a fallback where a row does not split into blocks,
  said in a note); the blocks are ``gguf_quantize``'s, ggml's reference quantizers. Norms, biases, routers and rope
  factors are F32.
- **Metadata**: ``general.architecture`` (llama, qwen3, qwen3moe), ``general.file_type`` and the quantization
  version; the hyper-parameters the reader maps back to config.json (context length, widths, layer and head counts,
  head size, rope base, RMS epsilon, expert counts); Llama 3 rope scaling as the ``rope_freqs`` tensor llama.cpp
  reads, with ``rope.scaling.original_context_length`` where the model's is not the 8192 llama.cpp's converter
  assumes; the vocabulary (``gguf_vocab``) and ``tokenizer.chat_template``.

The file is written whole to a temporary beside ``out`` and renamed into place, never over a file
(``io.newfile.write_new``); one tensor is quantized at a time, so memory holds about one tensor whatever the model.
"""

from __future__ import annotations

import collections
import warnings
from pathlib import Path
from typing import Callable

import attrs
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.gguf_writer import WriterState

from kestrel_core.errors import ConfigError, KestrelNote
from kestrel_core.formats.gguf import (ARCHITECTURES, EXPERT, EXPERT_STACKS, GLOBAL_NAMES, LAYER_NAMES, LLAMA3_ROPE,
                                       ROPE_FREQS, SUFFIX, _llama3_factors)
from kestrel_core.formats.gguf_quantize import quantize
from kestrel_core.formats.gguf_types import FALLBACK, FILE_TYPES, TensorType, tensor_type
from kestrel_core.formats.gguf_vocab import Vocabulary, gguf_vocabulary
from kestrel_core.formats.modelconfig import ModelConfig
from kestrel_core.formats.tensor_table import all_specs
from kestrel_core.io import progress
from kestrel_core.io.newfile import check_new, write_new

T = GGMLQuantizationType
GGUF_ARCH = {model_type: arch for arch, model_type in ARCHITECTURES.items()}  # kestrel's model_type -> GGUF's
HF_GLOBAL = {hf: g for g, hf in GLOBAL_NAMES.items()}
HF_LAYER = {hf: g for g, hf in LAYER_NAMES.items()}
STACK_OF_ROLE = {role: g for g, role in EXPERT_STACKS.items()}
_ROTARY = {"self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias"}
QUANTIZATION_VERSION = 2  # GGML_QNT_VERSION: the block layouts of today's ggml


@attrs.frozen
class Source:
    """A model to write: its config, its weights by Hugging Face name, and what its directory says besides."""

    config: ModelConfig
    tensor: Callable[[str], torch.Tensor]  # a Hugging Face name -> its weights (any float dtype)
    name: str  # general.name
    where: str  # what messages call it (the directory)
    tokenizer_json: str | None = None  # the text of tokenizer.json
    tokenizer_config: dict = attrs.field(factory=dict)  # tokenizer_config.json (its special tokens)
    chat_template: str | None = None
    end_ids: frozenset[int] = frozenset()  # the ids that end a generation
    done: Callable[[list[str]], None] | None = None  # told the names of each tensor written (a mapping drops their pages)


@attrs.frozen
class Planned:
    """One GGUF tensor: its name, shape (Hugging Face order), the Hugging Face tensors it is made of (several: an
    expert stack), the head count its rows are permuted by (llama's q and k), and its type."""

    name: str
    shape: tuple[int, ...]
    sources: tuple[str, ...]
    kind: TensorType
    heads: int | None = None

    @property
    def nbytes(self) -> int:
        rows = int(np.prod(self.shape[:-1]))
        if self.kind.qtype == T.F32:
            return rows * self.shape[-1] * 4
        if self.kind.qtype == T.F16:
            return rows * self.shape[-1] * 2
        block, size = GGML_QUANT_SIZES[self.kind.qtype]
        return rows * (self.shape[-1] // block) * size


def llama3_scaling(cfg: ModelConfig) -> dict | None:
    """config.json's Llama 3 rope scaling, or None (parse_model_config allows no other kind but "default")."""
    rs = cfg.rope_scaling
    return rs if rs is not None and rs.get("rope_type", rs.get("type")) == "llama3" else None


def check_writable(cfg: ModelConfig) -> None:
    """Refuse, before any work, a model whose GGUF kestrel's reader would not read back as the same model."""
    rs = llama3_scaling(cfg)
    if rs is None:
        return
    if cfg.model_type != "llama":
        raise ConfigError(f"a {cfg.model_type} model with llama3 rope scaling: a GGUF carries Llama 3 rope "
                          "scaling for llama models only (as llama.cpp reads it); quantize it to q8 instead (no --type)")
    for key in ("low_freq_factor", "high_freq_factor"):
        if rs[key] != LLAMA3_ROPE[key]:
            raise ConfigError(f"rope_scaling {key} is {rs[key]:g}; a GGUF carries Llama 3 rope scaling as per-frequency "
                              f"factors that kestrel reads back only for {key} {LLAMA3_ROPE[key]:g} (every Llama 3 "
                              "model's); quantize it to q8 instead (no --type)")


def plan(cfg: ModelConfig, type_name: str) -> list[Planned]:
    """Every tensor of the GGUF, in the order written."""
    check_writable(cfg)
    specs = all_specs(cfg)
    heads = {"q": cfg.num_attention_heads, "k": cfg.num_key_value_heads}
    out: list[Planned] = []

    def add(name: str, shape: tuple[int, ...], sources: tuple[str, ...], permute: int | None = None) -> None:
        out.append(Planned(name, tuple(shape), sources, tensor_type(name, tuple(shape), type_name, cfg), permute))

    if llama3_scaling(cfg) is not None:
        add(ROPE_FREQS, (cfg.head_dim // 2,), ())
    add("token_embd.weight", specs["model.embed_tokens.weight"], ("model.embed_tokens.weight",))
    for layer in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        for hf, g in HF_LAYER.items():
            if prefix + hf in specs:
                permute = heads["q" if "q_proj" in hf else "k"] if cfg.model_type == "llama" and hf in _ROTARY else None
                add(f"blk.{layer}.{g}", specs[prefix + hf], (prefix + hf,), permute)
        if cfg.moe_layer(layer):
            for role, g in STACK_OF_ROLE.items():
                experts = tuple(EXPERT.format(layer=layer, expert=e, role=role) for e in range(cfg.num_experts))
                add(f"blk.{layer}.{g}", (cfg.num_experts, *specs[experts[0]]), experts)
    add("output_norm.weight", specs["model.norm.weight"], ("model.norm.weight",))
    if not cfg.tie_word_embeddings:
        add("output.weight", specs["lm_head.weight"], ("lm_head.weight",))
    covered = {s for p in out for s in p.sources}
    assert covered == set(specs), f"the GGUF plan misses {sorted(set(specs) - covered)[:3]}"
    return out


def _permute(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's two rotary halves interleaved row by row."""
    rows = t.shape[0]
    return t.reshape(n_head, 2, rows // n_head // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def _values(p: Planned, source: Source) -> torch.Tensor:
    """The float weights of one planned tensor, as stored (stacked, permuted), 2-D [rows, row]."""
    if p.name == ROPE_FREQS:
        cfg = source.config
        return torch.from_numpy(_llama3_factors(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling)).reshape(1, -1)
    parts = [source.tensor(name) for name in p.sources]
    t = torch.stack(parts) if len(parts) > 1 else parts[0]
    if p.heads is not None:
        t = _permute(t, p.heads)
    t = t.reshape(-1, p.shape[-1])
    if not bool(torch.isfinite(t).all()):
        raise ConfigError(f"{source.where}: tensor {p.sources[0]} holds NaN or infinite values, which no GGUF block "
                          "encodes; the checkpoint is damaged: re-download it")
    return t


def _encode(p: Planned, t: torch.Tensor) -> np.ndarray:
    qtype = p.kind.qtype
    if qtype == T.F32:
        return t.float().numpy()
    if qtype == T.F16:
        return t.float().numpy().astype(np.float16)
    return quantize(t, qtype)


class _Writer(GGUFWriter):
    """gguf's GGUFWriter, writing into a file it is handed (``write_new``'s temporary) and able to write an empty
    array: gguf refuses one, but a byte-level BPE without merges has a ``tokenizer.ggml.merges`` of length 0, which
    llama.cpp and kestrel read."""

    def attach(self, fh) -> None:
        self.fout, self.state = [fh], WriterState.EMPTY  # what open_output_file sets, for a file already open

    def _pack_val(self, val, vtype, add_vtype, sub_type=None):
        if vtype == GGUFValueType.ARRAY and sub_type is not None and len(val) == 0:
            head = self._pack("I", vtype) if add_vtype else b""
            return head + self._pack("I", sub_type) + self._pack("Q", 0)
        return super()._pack_val(val, vtype, add_vtype, sub_type=sub_type)


def _hparams(w: _Writer, cfg: ModelConfig, arch: str) -> None:
    """The keys the reader turns back into config.json (gguf.GGUFCheckpoint._build_config), typed as llama.cpp's
    converter types them."""
    u32 = {"vocab_size": cfg.vocab_size, "context_length": cfg.max_position_embeddings,
           "embedding_length": cfg.hidden_size, "block_count": cfg.num_hidden_layers,
           "feed_forward_length": cfg.intermediate_size, "attention.head_count": cfg.num_attention_heads,
           "attention.head_count_kv": cfg.num_key_value_heads, "attention.key_length": cfg.head_dim,
           "attention.value_length": cfg.head_dim, "rope.dimension_count": cfg.head_dim}
    if cfg.is_moe:
        u32.update({"expert_count": cfg.num_experts, "expert_used_count": cfg.num_experts_per_tok,
                    "expert_feed_forward_length": cfg.moe_intermediate_size})
    rs = llama3_scaling(cfg)
    if rs is not None and rs["original_max_position_embeddings"] != LLAMA3_ROPE["original_max_position_embeddings"]:
        u32["rope.scaling.original_context_length"] = rs["original_max_position_embeddings"]
    for key, value in u32.items():
        w.add_uint32(f"{arch}.{key}", int(value))
    w.add_float32(f"{arch}.rope.freq_base", float(cfg.rope_theta))
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", float(cfg.rms_norm_eps))
    if cfg.is_moe:
        w.add_bool(f"{arch}.expert_weights_norm", bool(cfg.norm_topk_prob))


def _vocabulary(w: _Writer, vocab: Vocabulary) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    w.add_key_value("tokenizer.ggml.merges", vocab.merges, GGUFValueType.ARRAY, sub_type=GGUFValueType.STRING)
    for key, i in vocab.ids.items():
        w.add_uint32(key, i)
    if vocab.add_bos is not None:
        w.add_add_bos_token(vocab.add_bos)


def _fallback_notes(planned: list[Planned]) -> list[str]:
    """One note for each kind of fallback: how many tensors, from what to what, and why."""
    groups = collections.defaultdict(list)
    for p in planned:
        if p.kind.fell_back:
            groups[(p.kind.wanted, p.kind.qtype)].append(p)
    notes = []
    for (wanted, got), tensors in groups.items():
        rows = ", ".join(map(str, sorted({p.shape[-1] for p in tensors})))
        why = "as llama.cpp does" if wanted in FALLBACK else f"llama.cpp has no fallback for {wanted.name} and stops there"
        notes.append(f"{len(tensors)} tensor(s) written as {got.name} instead of {wanted.name} (e.g. {tensors[0].name}): "
                     f"their rows ({rows} values) do not split into {wanted.name}'s {GGML_QUANT_SIZES[wanted][0]}-value "
                     f"blocks; {why}")
    return notes


def write_gguf(source: Source, out: str | Path, type_name: str, flag: str = "--out",
               blocks: Callable[[Planned], np.ndarray] | None = None) -> dict:
    """Write ``source`` as a new GGUF file ``out`` of ``type_name`` (a ``gguf_types.TYPE_NAMES``); returns a summary.
    ``blocks(planned)``, where given, draws each quantized tensor's stored blocks (uint8 [rows, bytes a row]) in place
    of quantizing its weights (``make-model --random-blocks``).
    Notes (fallbacks, a vocabulary that cannot be carried) are KestrelNote warnings. Under ``progress.shown`` a bar
    counts the tensors written."""
    out = check_new(out, flag, SUFFIX)  # before any work
    cfg = source.config
    planned = plan(cfg, type_name)
    arch = GGUF_ARCH[cfg.model_type]
    notes = _fallback_notes(planned)
    vocab = None
    if source.tokenizer_json is not None:
        vocab, vocab_notes = gguf_vocabulary(source.tokenizer_json, source.tokenizer_config, cfg, source.end_ids,
                                             f"{source.where}'s tokenizer.json")
        notes += vocab_notes
    w = _Writer(None, arch)
    w.add_name(source.name)
    w.add_file_type(int(FILE_TYPES[type_name]))
    w.add_quantization_version(QUANTIZATION_VERSION)
    _hparams(w, cfg, arch)
    if vocab is not None:
        _vocabulary(w, vocab)
    if source.chat_template is not None:
        w.add_chat_template(source.chat_template)
    for p in planned:
        dtype = np.float16 if p.kind.qtype == T.F16 else np.float32
        raw = None if p.kind.qtype in (T.F32, T.F16) else p.kind.qtype
        w.add_tensor_info(p.name, p.shape, np.dtype(dtype), p.nbytes, raw_dtype=raw)

    def write(fh) -> None:
        w.attach(fh)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        with progress.bar(len(planned), "quantize", "tensor") as bar:
            for p in planned:
                quantized = p.kind.qtype not in (T.F32, T.F16)
                w.write_tensor_data(blocks(p) if blocks is not None and quantized else _encode(p, _values(p, source)))
                if source.done is not None and p.sources:
                    source.done(list(p.sources))  # keep the reader's RSS to about one tensor on big models
                bar.update(1)
        fh.flush()

    write_new(out, write, flag, SUFFIX)
    for note in notes:
        warnings.warn(note, KestrelNote, stacklevel=2)
    return {
        "out": str(out),
        "type": type_name,
        "architecture": arch,
        "tensors": len(planned),
        "types": dict(collections.Counter(p.kind.qtype.name for p in planned)),
        "fallbacks": sum(p.kind.fell_back for p in planned),
        "tokenizer": vocab.pre if vocab is not None else None,
        "chat_template": source.chat_template is not None,
        "bytes": out.stat().st_size,
    }
