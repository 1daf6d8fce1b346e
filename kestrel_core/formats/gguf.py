"""GGUF checkpoints (llama.cpp's single-file format), read through mmap as a ``Checkpoint`` is.

``GGUFCheckpoint(path)`` opens one ``.gguf`` file, reads its header (``gguf_header``: through ``gguf.GGUFReader``,
every count and length bounded before it is read), checks it whole, and serves its tensors under
kestrel's Hugging Face names, so that a backend reads it exactly as it reads ``kestrel_core.formats.checkpoint.Checkpoint``.
Architectures: ``llama``, ``qwen3`` and ``qwen3moe``. Tensor types: F32, F16, BF16 (mapped zero-copy) and Q8_0,
Q4_0, Q4_1, Q4_K, Q5_K, Q6_K (dequantized to float32, one tensor at a time, when it is viewed: ``gguf_quants``).

What it offers (the members of ``Checkpoint`` a backend, ``validate_checkpoint`` or ``read_quant`` use)::

    dir              the .gguf file's path (a GGUF is one file; error messages name it)
    files            {file name: GGUFFile}; a GGUFFile has .path, .size, drop_pages(spans), close()
    metadata         {key: str(value)} of the scalar metadata (arrays such as the vocabulary left out)
    names()          the stored tensors, by kestrel name; a 3-D expert stack (qwen3moe) once, as
                     model.layers.N.mlp.experts.{gate,up,down}_exps
    name in ckpt     a stored name, or a per-expert name model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight
    info(name)       GGUFTensorInfo: name, dtype and shape of what view() gives (F32 for a quantized type;
                     HF order [out, in]), start/end/nbytes: the stored bytes in the file (what drop_pages drops),
                     and gguf_name, ggml_type, permuted, raw (True where start..end are exactly the view's bytes)
    view(name)       a torch tensor: zero-copy and read-only for an F32/F16/BF16 tensor stored as served, else a new
                     float32 (or the stored float dtype) tensor: dequantized from that tensor's bytes alone, and for
                     llama's attn_q / attn_k un-permuted (below)
    source(name)     the stored tensor behind a name: an expert stack for a per-expert name, else the name
    file_of(name)    the GGUFFile that holds it
    drop_pages(names), drop_around(names, keep, granule), unmap_all(), mapping_rss(), close(): as Checkpoint's

and, for the model around it::

    model_config()   the kestrel ModelConfig (the metadata as a config.json dict, through parse_model_config)
    config_dict()    that config.json dict (what a Hugging Face directory of this model would hold)
    tokenizer()      kestrel_core.formats.tokenizer.Tokenizer built from the metadata (gguf_tokenizer), or None where the
                     GGUF holds no vocabulary; a tokenizer kestrel cannot build is a CheckpointError
    hf_tokenizer()   the same as a tokenizers.Tokenizer (tokenizer.json: .save(path))
    chat_template()  kestrel_core.formats.chat_template.ChatTemplate from tokenizer.chat_template (ConfigError without one)
    chat_template_source()  its text, checked (a string, of a template's size) but not compiled; None without one
    eos_ids()        frozenset of the ids that end a generation: eos, and llama.cpp's end-of-turn (eot) and
                     end-of-message (eom) ids where the metadata names them
    q8(name)         a Q8_0 tensor repacked into kestrel's q8 layout (quant.py, group 32), not dequantized:
                     (qweight int8 [K, Npad], scales float32 [K/32, Npad]); quant.dequantize of it equals view(name)

``load("x.gguf")`` opens one through ``gguf_model.open_gguf``: the config, tokenizer, eos ids and chat template of
``model_config()``, ``tokenizer()``, ``eos_ids()`` and ``chat_template()``, and the Q8_0 units as kestrel q8
(``gguf_model.q8_info``: ``packed`` ``quant.Q8Tensor`` entries, read through ``q8(name)``).

Things a backend must know: a quantized or permuted tensor's stored bytes are not its view's (``info(name).raw``
is False; ``nbytes`` is the stored size), so a reader that copies a tensor's file bytes itself must take
``view(name)`` for those, as the cuda host tier's ``Filler.sources`` does.
``drop_pages``/``drop_around`` work on the stored bytes either way. A dequantized view is new memory (float32,
4 bytes a weight), not the mapping, made afresh at each call (nothing is cached: see docs/gguf.md for what that
costs a streamed token). A Q8_0 weight can go to kestrel's q8 path instead, undequantized: ``q8(name)``.

llama.cpp's ``convert_hf_to_gguf.py`` stores a ``llama`` model's Q and K rows in its rotary layout
(``LlamaModel.permute``: ``w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2)``, K with
``n_head_kv`` heads); ``view`` undoes it, giving Hugging Face's rotate-half layout. ``qwen3`` and
``qwen3moe`` are stored unpermuted (their converters, Qwen2Model's subclasses, do not permute).

The checks (each a one-line CheckpointError naming the key or tensor, and the fix): a truncated or
non-GGUF file, an unknown architecture, a tensor type that is unknown or not read here, missing metadata,
a missing, misshapen or unexpected tensor, a vocabulary that disagrees with the embedding, and rope
scaling kestrel does not compute.
"""

from __future__ import annotations

import math
import os
import re
import stat
import warnings
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from kestrel_core.formats import gguf_quants as gq
from kestrel_core.formats.checkpoint import FAULT_GRANULE, GranuleIndex, _subtract, mapping_rss, merge_spans
from kestrel_core.errors import CheckpointError, ConfigError, KestrelNote
from kestrel_core.formats.gguf_header import CORRUPT, HeaderProblem, Stored, read_header
from kestrel_core.formats.modelconfig import ModelConfig, parse_model_config
from kestrel_core.io.mapped import PAGE, MappedFile
from kestrel_core.formats.tensor_table import all_specs

MAGIC = b"GGUF"
SUFFIX = ".gguf"
VERSIONS = (2, 3)  # what gguf reads and llama.cpp writes (3 since 2023)
# general.architecture -> kestrel's model_type
ARCHITECTURES = {"llama": "llama", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}

# GGUF tensor names -> kestrel's (Hugging Face) names
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
}
EXPERT_STACKS = {"ffn_gate_exps.weight": "gate", "ffn_up_exps.weight": "up", "ffn_down_exps.weight": "down"}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3's rope scaling, as per-frequency factors
STACK = "model.layers.{layer}.mlp.experts.{role}_exps"
EXPERT = "model.layers.{layer}.mlp.experts.{expert}.{role}_proj.weight"
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
_PERMUTED = {"attn_q.weight": "q", "attn_k.weight": "k", "attn_q.bias": "q", "attn_k.bias": "k"}
# the ids that end a generation: eos, and llama.cpp's end-of-turn and end-of-message
END_IDS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
# Llama 3 rope scaling as llama.cpp's converter writes rope_freqs (the defaults it assumes where config.json omits them)
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic (or is named ``*.gguf``)."""
    p = Path(path)
    if not p.is_file():
        return False
    if p.suffix.lower() == SUFFIX:
        return True
    try:
        with open(p, "rb") as fh:
            return fh.read(4) == MAGIC
    except OSError:
        return False


@attrs.frozen
class GGUFTensorInfo:
    name: str  # kestrel's (Hugging Face) name
    dtype: str  # of what view() gives: F32, F16 or BF16
    shape: tuple[int, ...]  # of what view() gives, Hugging Face order ([out, in]; GGUF lists ne[0] first)
    start: int  # absolute byte span of the stored bytes in the file
    end: int
    gguf_name: str
    ggml_type: str  # the stored type: "F32", "Q4_1", ...
    permuted: bool = False  # rows in llama.cpp's rotary order: view() un-permutes them

    @property
    def nbytes(self) -> int:
        """Stored bytes (for a quantized type, not the view's)."""
        return self.end - self.start

    @property
    def raw(self) -> bool:
        """The stored bytes are exactly the view's (a float type, unpermuted): a reader may copy them itself."""
        return self.ggml_type == self.dtype and not self.permuted


class GGUFFile(MappedFile):
    """One mmap'd .gguf file: byte views and page drops."""

    def __init__(self, path: Path, size: int):
        self.size = size
        try:
            with open(path, "rb") as fh:
                super().__init__(path, fh.fileno())
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot open ({exc.strerror})") from None

    def bytes(self, start: int, end: int) -> np.ndarray:
        return np.frombuffer(self._mm, dtype=np.uint8, count=end - start, offset=start)


class GGUFCheckpoint:
    """One .gguf file: its tensors under kestrel's names (see the module docstring for every member)."""

    def __init__(self, path: str | os.PathLike):
        self.dir = self.path = Path(path)
        self._where = str(self.path)
        size = self._check_file()
        try:
            meta, stored, size = read_header(self.path)
        except HeaderProblem as exc:
            raise CheckpointError(f"{self.path}: {exc}") from None
        except CheckpointError:
            raise
        except Exception as exc:  # gguf raises ValueError, IndexError, KeyError... on a file it cannot parse
            raise CheckpointError(f"{self.path}: cannot be read as GGUF ({type(exc).__name__}: {_one_line(exc)}); {CORRUPT}") from None
        self._meta = meta
        self._hf = None  # the tokenizers.Tokenizer of hf_tokenizer(), once built
        self.metadata = {k: str(v) for k, v in meta.items() if not isinstance(v, list)}
        self._stored = {t.name: t for t in stored}
        self._check_split()
        self._check_not_adapter()
        self.arch = self._architecture()
        self._check_types()
        self._config_dict = self._build_config()
        try:
            self._config = parse_model_config(self._config_dict, f"{self.path} (GGUF metadata)")
        except ConfigError as exc:
            raise CheckpointError(f"{exc}{_gguf_keys(str(exc), self.arch)}") from None
        self._infos = self._name_tensors()
        self._granule_index: dict[int, GranuleIndex] = {}  # by granule: ``drop_around``'s
        self._validate()
        self.files = {self.path.name: GGUFFile(self.path, size)}
        self._file = self.files[self.path.name]

    # --- opening and checking ----------------------------------------------------------
    def _check_file(self) -> int:
        try:
            st = os.stat(self.path)
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot open ({exc.strerror}); pass the path of a .gguf file") from None
        if stat.S_ISDIR(st.st_mode):
            raise CheckpointError(f"{self.path}: is a directory, and a GGUF model is one file; pass the .gguf file itself "
                                  "(a Hugging Face model directory's name must not end in .gguf)")
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{self.path}: not a regular file; pass the .gguf file")
        if st.st_size < 24:
            raise CheckpointError(f"{self.path}: truncated ({st.st_size} bytes, no GGUF header); re-download or re-create it")
        try:
            with open(self.path, "rb") as fh:
                head = fh.read(8)
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot open ({exc.strerror}); check its permissions, or pass the path "
                                  "of a .gguf file you can read") from None
        magic, version = head[:4], int.from_bytes(head[4:8], "little")
        if magic != MAGIC:
            raise CheckpointError(f"{self.path}: not a GGUF file (it starts with {magic!r}, not b'GGUF'); pass a .gguf "
                                  "file, or a Hugging Face model directory")
        if version & 0xFFFF == 0 and int.from_bytes(head[4:8], "big") in VERSIONS:
            raise CheckpointError(f"{self.path}: a big-endian GGUF; kestrel reads little-endian GGUF files (what llama.cpp "
                                  "writes on x86 and ARM): convert the model on a little-endian machine")
        if version not in VERSIONS:
            raise CheckpointError(f"{self.path}: GGUF version {version}, which kestrel does not read (it reads versions "
                                  f"{' and '.join(map(str, VERSIONS))}, what llama.cpp writes); re-convert the model with a "
                                  "current llama.cpp, or re-download it")
        return st.st_size

    def _fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {what}")

    def _check_split(self) -> None:
        """One part of a GGUF split by llama.cpp's gguf-split (split.count parts; only the first holds the metadata)."""
        count = self._get("split.count", "int", 1)
        if count > 1:
            part = self._get("split.no", "int", 0) + 1
            raise self._fail(f"part {part} of {count} of a split GGUF (split.count={count}); kestrel reads a GGUF of one "
                             "file: merge the parts with `llama-gguf-split --merge FIRST-PART merged.gguf` (FIRST-PART "
                             "the ...-00001-of-... file) and pass merged.gguf")

    def _check_not_adapter(self) -> None:
        """A GGUF of something other than a model (llama.cpp's convert_lora_to_gguf writes general.type 'adapter')."""
        kind = self._get("general.type", "str", "model")
        if kind == "adapter":
            adapter = self._get("adapter.type", "str", "lora")
            adapter = adapter[:40] if adapter.isprintable() else repr(adapter[:40])
            raise self._fail(f"a {adapter} adapter (general.type 'adapter'), not a model; pass the base model's "
                             ".gguf (kestrel does not apply adapters)")

    def _architecture(self) -> str:
        arch = self._meta.get("general.architecture")
        if arch is None:
            raise self._fail("metadata has no general.architecture; the file is not a model GGUF, or is corrupt")
        if not isinstance(arch, str):
            raise self._fail(f"general.architecture is {str(arch)[:60]}, not a string; the file is not a model GGUF, "
                             "or is corrupt")
        if arch not in ARCHITECTURES:
            raise self._fail(f"general.architecture is {arch!r}, which kestrel does not run; supported: "
                             f"{', '.join(ARCHITECTURES)}")
        return arch

    def _check_types(self) -> None:
        for t in self._stored.values():
            if t.qtype not in gq.SUPPORTED:
                raise self._fail(f"tensor {t.name!r} is of type {t.qtype.name}, which kestrel does not read; supported: "
                                 f"{gq.SUPPORTED_NAMES} (re-quantize the model to one of them)")

    def _get(self, key: str, kind: str, default: Any = ...) -> Any:
        """A metadata value of ``kind`` (int, float, bool, str); absent gives ``default`` or an error naming the key."""
        if key not in self._meta:
            if default is ...:
                raise self._fail(f"metadata has no {key}; the GGUF is incomplete or not a {self.arch} model: re-convert it")
            return default
        value = self._meta[key]
        ok = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
              "bool": lambda v: isinstance(v, bool), "str": lambda v: isinstance(v, str)}[kind]
        if not ok(value):
            raise self._fail(f"metadata {key} is {str(value)[:60]!r}, not a{'n' if kind == 'int' else ''} {kind}; "
                             "the GGUF is corrupt: re-convert it")
        return value

    def _build_config(self) -> dict:
        """The metadata as the config.json it came from (checked by parse_model_config afterwards)."""
        a = self.arch
        hidden = self._get(f"{a}.embedding_length", "int")
        heads = self._get(f"{a}.attention.head_count", "int")
        kv = self._meta.get(f"{a}.attention.head_count_kv", heads)
        if isinstance(kv, list):  # per-layer counts: kestrel's layers share one
            if len(set(kv)) != 1:
                raise self._fail(f"metadata {a}.attention.head_count_kv differs between layers ({sorted(set(kv))}); "
                                 "kestrel runs models whose layers share one KV head count")
            kv = kv[0]
        if not (isinstance(kv, int) and not isinstance(kv, bool)):
            raise self._fail(f"metadata {a}.attention.head_count_kv is {str(kv)[:60]!r}, not an int; the GGUF is corrupt: re-convert it")
        head_dim = self._get(f"{a}.attention.key_length", "int", hidden // heads if heads else 0)
        value_dim = self._get(f"{a}.attention.value_length", "int", head_dim)
        if value_dim != head_dim:
            raise self._fail(f"metadata {a}.attention.value_length={value_dim} differs from key_length={head_dim}; "
                             "kestrel runs models whose K and V heads are one size")
        rope_dim = self._get(f"{a}.rope.dimension_count", "int", head_dim)
        if rope_dim != head_dim:
            raise self._fail(f"metadata {a}.rope.dimension_count={rope_dim} is not the head size {head_dim}; kestrel "
                             "rotates whole heads (partial rotary embeddings are not supported)")
        embed = self._stored.get("token_embd.weight")
        if embed is None:
            raise self._fail(f"missing tensor 'token_embd.weight' (model.embed_tokens.weight); {CORRUPT}")
        vocab = self._vocab_size(embed)
        cfg: dict[str, Any] = {
            "model_type": ARCHITECTURES[a],
            "vocab_size": vocab,
            "hidden_size": hidden,
            "num_hidden_layers": self._get(f"{a}.block_count", "int"),
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "head_dim": head_dim,
            "max_position_embeddings": self._get(f"{a}.context_length", "int", 2048),
            "rms_norm_eps": self._get(f"{a}.attention.layer_norm_rms_epsilon", "float"),
            "rope_theta": self._get(f"{a}.rope.freq_base", "float", 10000.0),
            "rope_scaling": self._rope_scaling(head_dim),
            "tie_word_embeddings": "output.weight" not in self._stored,
            "attention_bias": "blk.0.attn_q.bias" in self._stored,
            "torch_dtype": {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[gq.view_dtype(embed.qtype)],
            "hidden_act": "silu",
        }
        for key in END_IDS + ("tokenizer.ggml.bos_token_id",):  # ids kestrel acts on: each one of the vocabulary's
            if key in self._meta and not 0 <= self._get(key, "int") < vocab:
                raise self._fail(f"metadata {key}={self._meta[key]} is not a token id of the {vocab}-token vocabulary; "
                                 "the GGUF is corrupt: re-convert it")
        self._note_template_ids(vocab)
        for key, name in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):
            if name in self._meta:
                cfg[key] = self._get(name, "int")
        experts = self._get(f"{a}.expert_count", "int", 0)
        if a == "qwen3moe":
            ff = self._get(f"{a}.expert_feed_forward_length", "int")
            cfg.update(
                num_experts=self._get(f"{a}.expert_count", "int"),
                num_experts_per_tok=self._get(f"{a}.expert_used_count", "int"),
                moe_intermediate_size=ff,
                norm_topk_prob=self._get(f"{a}.expert_weights_norm", "bool", True),  # llama.cpp's qwen3moe normalizes
                decoder_sparse_step=1,
                mlp_only_layers=[n for n in range(cfg["num_hidden_layers"]) if f"blk.{n}.ffn_gate_inp.weight" not in self._stored],
            )
            cfg["intermediate_size"] = self._get(f"{a}.feed_forward_length", "int", ff)
        else:
            if experts:
                raise self._fail(f"metadata {a}.expert_count={experts}: a Mixture-of-Experts {a} model, which kestrel does "
                                 "not run (its MoE architecture is qwen3moe)")
            cfg["intermediate_size"] = self._get(f"{a}.feed_forward_length", "int")
        return cfg

    def _note_template_ids(self, vocab: int) -> None:
        """unk, pad, sep, cls and mask ids only name a chat template's tokens: one outside the vocabulary is dropped with
        a note (llama.cpp warns and runs on too)."""
        from kestrel_core.formats.gguf_tokenizer import SPECIAL_IDS

        for name, key in SPECIAL_IDS.items():
            value = self._meta.get(key)
            if name in ("bos_token", "eos_token") or value is None or (isinstance(value, int) and 0 <= value < vocab):
                continue
            warnings.warn(f"{self.path}: {key}={str(value)[:40]} is outside the {vocab}-token vocabulary; the chat "
                          f"template gets no {name}", KestrelNote, stacklevel=4)

    def _vocab_size(self, embed: Stored) -> int:
        """The embedding's rows, checked against the vocabulary and the vocab_size key."""
        if len(embed.shape) != 2:
            raise self._fail(f"tensor 'token_embd.weight' has shape {list(embed.shape)}; an embedding is 2-D [vocab, hidden]; "
                             f"{CORRUPT}")
        rows = embed.shape[0]
        tokens = self._meta.get("tokenizer.ggml.tokens")
        if isinstance(tokens, list) and len(tokens) != rows:
            raise self._fail(f"tokenizer.ggml.tokens has {len(tokens)} tokens but token_embd.weight has {rows} rows; the "
                             "vocabulary disagrees with the embedding: re-convert the model")
        declared = self._get(f"{self.arch}.vocab_size", "int", rows)
        if declared != rows:
            raise self._fail(f"metadata {self.arch}.vocab_size={declared} but token_embd.weight has {rows} rows; the "
                             "vocabulary disagrees with the embedding: re-convert the model")
        return rows

    def _rope_scaling(self, head_dim: int) -> dict | None:
        a = self.arch
        kind = self._get(f"{a}.rope.scaling.type", "str", "none")
        if kind not in ("none", ""):
            raise self._fail(f"metadata {a}.rope.scaling.type is {kind!r}; kestrel computes no rope scaling but Llama 3's "
                             "(as a rope_freqs tensor)")
        for key in (f"{a}.rope.scaling.factor", f"{a}.rope.scale_linear"):  # llama.cpp scales by it, as linear scaling
            factor = self._get(key, "float", 0.0)
            if factor not in (0.0, 1.0):
                raise self._fail(f"metadata {key} is {factor:g} (with rope.scaling.type {kind!r}): llama.cpp applies it as "
                                 "linear rope scaling, which kestrel does not compute; run the model's Hugging Face "
                                 "directory, or a GGUF without it")
        freqs = self._stored.get(ROPE_FREQS)
        if freqs is None:
            return None
        if a != "llama" or freqs.qtype.name != "F32" or freqs.ne != (head_dim // 2,):
            raise self._fail(f"tensor {ROPE_FREQS!r} ({freqs.qtype.name} {list(freqs.shape)}) is not Llama 3 rope scaling "
                             f"(F32 [{head_dim // 2}] of a llama model); kestrel cannot compute it")
        with open(self.path, "rb") as fh:
            fh.seek(freqs.start)
            stored = np.frombuffer(fh.read(freqs.end - freqs.start), dtype=np.float32)
        if not (np.isfinite(stored).all() and (stored > 0).all()):
            raise self._fail(f"tensor {ROPE_FREQS!r} holds {float(stored.min()):g} to {float(stored.max()):g}, not the "
                             "finite positive factors of Llama 3 rope scaling; the file is corrupt: re-convert it")
        theta = self._get(f"{a}.rope.freq_base", "float", 10000.0)
        original = self._get(f"{a}.rope.scaling.original_context_length", "int", 8192)  # kestrel's writer sets it
        scaling = {"rope_type": "llama3", "factor": float(stored.max()), **LLAMA3_ROPE,
                   "original_max_position_embeddings": original}
        want = _llama3_factors(theta, head_dim, scaling)
        if not np.allclose(stored, want, rtol=1e-5, atol=0):
            raise self._fail(f"tensor {ROPE_FREQS!r} is not Llama 3 rope scaling with factor {scaling['factor']:g}, "
                             f"low_freq_factor 1, high_freq_factor 4 and {original} original positions; kestrel cannot "
                             "compute it")
        return scaling

    def _name_tensors(self) -> dict[str, GGUFTensorInfo]:
        """kestrel name -> info, for every stored tensor and every expert of a stack."""
        cfg = self._config
        infos: dict[str, GGUFTensorInfo] = {}
        heads = {"q": cfg.num_attention_heads, "k": cfg.num_key_value_heads}
        for t in self._stored.values():
            if t.name == ROPE_FREQS:
                continue  # read into config.rope_scaling
            name, layer, rest = self.kestrel_name(t.name), None, None
            m = _BLOCK.fullmatch(t.name)
            if m:
                layer, rest = int(m.group(1)), m.group(2)
            if name is None:
                raise self._fail(f"tensor {t.name!r} is not one kestrel reads for a {self.arch} model; the GGUF holds "
                                 "another architecture's weights, or was converted by a tool kestrel does not know")
            dtype = gq.view_dtype(t.qtype)
            if rest in EXPERT_STACKS:
                if len(t.shape) != 3:
                    raise self._fail(f"tensor {t.name!r} has shape {list(t.shape)}; an expert stack is 3-D "
                                     f"[experts, out, in]; {CORRUPT}")
                E, rows, cols = t.shape
                span = (t.end - t.start) // E  # expert e: the e-th of E equal runs of whole rows
                for e in range(E):
                    alias = EXPERT.format(layer=layer, expert=e, role=EXPERT_STACKS[rest])
                    infos[alias] = GGUFTensorInfo(alias, dtype, (rows, cols), t.start + e * span, t.start + (e + 1) * span,
                                                  t.name, t.qtype.name)
            permuted = self.arch == "llama" and rest in _PERMUTED
            if permuted:
                n_head = heads[_PERMUTED[rest]]
                if t.shape[0] % (2 * n_head):
                    raise self._fail(f"tensor {t.name!r} has {t.shape[0]} rows, not a whole number of {n_head} heads of "
                                     f"even size; {self.arch}.attention.head_count(_kv) and the weights do not match")
            infos[name] = GGUFTensorInfo(name, dtype, t.shape, t.start, t.end, t.name, t.qtype.name, permuted)
        return infos

    def kestrel_name(self, gguf_name: str) -> str | None:
        """The kestrel name of a GGUF tensor name (an expert stack's is ``STACK``), or None for one kestrel does not read."""
        if gguf_name in GLOBAL_NAMES:
            return GLOBAL_NAMES[gguf_name]
        m = _BLOCK.fullmatch(gguf_name)
        if not m:
            return None
        layer, rest = m.group(1), m.group(2)
        if rest in LAYER_NAMES:
            return f"model.layers.{layer}.{LAYER_NAMES[rest]}"
        if rest in EXPERT_STACKS:
            return STACK.format(layer=layer, role=EXPERT_STACKS[rest])
        return None

    def gguf_name(self, name: str) -> str:
        """The GGUF tensor name that holds kestrel's ``name`` (what a message about the file should say)."""
        for g, k in GLOBAL_NAMES.items():
            if k == name:
                return g
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if m:
            for g, k in LAYER_NAMES.items():
                if k == m.group(2):
                    return f"blk.{m.group(1)}.{g}"
            e = re.fullmatch(r"mlp\.experts\.\d+\.(gate|up|down)_proj\.weight", m.group(2))
            if e:
                return f"blk.{m.group(1)}.ffn_{e.group(1)}_exps.weight"
        return name

    def _validate(self) -> None:
        """Every tensor the config implies is there in its shape (an expert stack [experts, out, in]), and nothing else is."""
        cfg = self._config
        specs = all_specs(cfg)
        for name, shape in specs.items():
            info = self._infos.get(name)
            if info is None:
                raise self._fail(f"missing tensor {self.gguf_name(name)!r} ({name}); the GGUF is incomplete or its "
                                 f"metadata ({self.arch}.block_count, ...) describes another model: re-convert it")
            stored = self._stored[info.gguf_name]
            want = (cfg.num_experts, *shape) if _is_slice(info, self._stored) else tuple(shape)
            if stored.shape != want:
                raise self._fail(f"tensor {info.gguf_name!r} has shape {list(stored.shape)} (GGUF ne {list(stored.ne)}) but "
                                 f"the metadata implies {list(want)} for {self.kestrel_name(info.gguf_name)}; the metadata "
                                 "and the weights do not match: re-convert the model")
        used = {self.source(n) for n in specs}
        extra = sorted(self._infos[n].gguf_name for n in self.names() if n not in used)
        if extra:
            shown = ", ".join(map(repr, extra[:3])) + (", ..." if len(extra) > 3 else "")
            raise self._fail(f"{len(extra)} tensor(s) that a {self.arch} model of this metadata does not use ({shown}); "
                             f"the metadata ({self.arch}.block_count, expert_count, ...) does not describe these weights: "
                             "re-convert the model")

    # --- the Checkpoint interface -------------------------------------------------------
    def names(self) -> list[str]:
        return [n for n, i in self._infos.items() if not _is_slice(i, self._stored)]

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def info(self, name: str) -> GGUFTensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: missing tensor {name!r}; the checkpoint is incomplete or of another "
                                  "architecture") from None

    def source(self, name: str) -> str:
        info = self.info(name)
        if _is_slice(info, self._stored):
            return self.kestrel_name(info.gguf_name)
        return name

    def file_of(self, name: str) -> GGUFFile:
        self.info(name)
        return self._file

    def view(self, name: str) -> torch.Tensor:
        """``name`` as a torch tensor in a float dtype (see the module docstring for when it is zero-copy)."""
        info = self.info(name)
        stored = self._stored[info.gguf_name]
        raw = self._file.bytes(info.start, info.end)
        if stored.qtype in gq.FLOAT_TYPES:
            arr = raw.view(np.uint16 if info.dtype == "BF16" else {"F32": np.float32, "F16": np.float16}[info.dtype])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # a read-only buffer: nothing writes through it
                t = torch.from_numpy(arr)
            if info.dtype == "BF16":
                t = t.view(torch.bfloat16)
            t = t.reshape(info.shape)
        else:
            t = gq.dequantize(raw, stored.qtype, info.shape)
        if info.permuted:
            t = t[torch.from_numpy(self._unpermute(info))]
        return t

    def q8(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A Q8_0 weight [N, K] in kestrel's q8 layout (group 32): (qweight int8 [K, Npad], scales float32 [K/32, Npad])."""
        info = self.info(name)
        if info.ggml_type != "Q8_0" or len(info.shape) != 2:
            raise CheckpointError(f"{self.path}: tensor {info.gguf_name!r} is {info.ggml_type} {list(info.shape)}, not a "
                                  "2-D Q8_0 weight; only Q8_0 repacks into kestrel's q8 layout")
        n, k = info.shape
        rows = self._unpermute(info) if info.permuted else None
        qweight, scales = gq.q8_0_to_kestrel(self._file.bytes(info.start, info.end), n, k, rows)
        return torch.from_numpy(qweight), torch.from_numpy(scales)

    def blocks(self, name: str) -> torch.Tensor:
        """A quantized 2-D weight [N, K] as its stored blocks: uint8 [N, bytes a row], each row K / block-size whole
        blocks as ggml stores them, rows in Hugging Face order (llama's rotary permutation undone by moving whole
        rows, which changes no byte of a block). A view of the mapping where nothing moves, else a copy."""
        info = self.info(name)
        stored = self._stored[info.gguf_name]
        if stored.qtype in gq.FLOAT_TYPES or len(info.shape) != 2:
            raise CheckpointError(f"{self.path}: tensor {info.gguf_name!r} is {info.ggml_type} {list(info.shape)}, "
                                  "not a 2-D weight of quantized blocks")
        n, k = info.shape
        row = gq.row_nbytes(stored.qtype, k)
        if row * n != info.nbytes:
            raise CheckpointError(f"{self.path}: tensor {info.gguf_name!r} holds {info.nbytes} bytes, not the "
                                  f"{row * n} of {n} rows of {k} {info.ggml_type} values; the file is damaged")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only buffer: nothing writes through it
            t = torch.from_numpy(self._file.bytes(info.start, info.end)).view(n, row)
        if info.permuted:
            t = t[torch.from_numpy(self._unpermute(info))]
        return t

    def _unpermute(self, info: GGUFTensorInfo) -> np.ndarray:
        """Row order that undoes llama.cpp's rotary permutation (LlamaModel.permute) of attn_q / attn_k."""
        role = _PERMUTED[info.gguf_name.split(".", 2)[2]]
        n_head = self._config.num_attention_heads if role == "q" else self._config.num_key_value_heads
        rows = info.shape[0]
        return unpermute_rows(rows, n_head)

    def drop_pages(self, names: list[str]) -> None:
        self._file.drop_pages(merge_spans([(self.info(n).start, self.info(n).end) for n in names]))

    def drop_around(self, names: list[str], keep: set[str], granule: int = FAULT_GRANULE) -> None:
        """As Checkpoint.drop_around: the granule-aligned stretches around ``names``, less the ``keep`` tensors' bytes."""
        windows = merge_spans([((self.info(n).start // granule) * granule, -(-self.info(n).end // granule) * granule)
                               for n in names])
        index = self._granule_index.get(granule)
        if index is None:  # every tensor by granule, made on first use (a stored tensor and its slices alike)
            index = self._granule_index[granule] = GranuleIndex(((n, i.start, i.end) for n, i in self._infos.items()),
                                                                granule)
        self._file.drop_pages(_subtract(windows, index.kept(windows, keep)))

    def unmap_all(self) -> None:
        self._file.drop_pages([(0, self._file.size)])

    def mapping_rss(self) -> int:
        return mapping_rss([str(self.path.resolve())])

    def check_unchanged(self) -> None:
        """A CheckpointError where the file changed under the run (``io.mapped``)."""
        self._file.check()

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- the model around it ------------------------------------------------------------
    def model_config(self) -> ModelConfig:
        return self._config

    def config_dict(self) -> dict:
        return dict(self._config_dict)

    def value(self, key: str, default: Any = None) -> Any:
        """A metadata value as the GGUF stores it (arrays as lists)."""
        return self._meta.get(key, default)

    def hf_tokenizer(self):
        """The tokenizers.Tokenizer the metadata describes, or None where the GGUF holds no vocabulary."""
        from kestrel_core.formats.gguf_tokenizer import build_tokenizer

        if "tokenizer.ggml.model" not in self._meta:
            return None
        if self._hf is None:  # built once: its notes (a missing tokenizer.ggml.pre) are said once
            self._hf = build_tokenizer(self._meta, self._where)
        return self._hf

    def tokenizer(self):
        """kestrel's Tokenizer from the metadata, or None where the GGUF holds no vocabulary."""
        from kestrel_core.formats.gguf_tokenizer import GGUFTokenizer

        hf = self.hf_tokenizer()
        return None if hf is None else GGUFTokenizer(hf)

    def special_tokens(self) -> dict[str, str]:
        from kestrel_core.formats.gguf_tokenizer import special_tokens

        return special_tokens(self._meta)

    def chat_template(self):
        from kestrel_core.formats.gguf_tokenizer import chat_template

        return chat_template(self._meta, self._where)

    def chat_template_source(self) -> str | None:
        """tokenizer.chat_template's text (None where there is none), checked as chat_template() checks it, not compiled."""
        from kestrel_core.formats.gguf_tokenizer import template_source

        return template_source(self._meta, self._where)

    def eos_ids(self) -> frozenset[int]:
        return frozenset(self._get(k, "int") for k in END_IDS if k in self._meta)


def unpermute_rows(rows: int, n_head: int) -> np.ndarray:
    """Indices ``idx`` such that ``w_gguf[idx]`` is the Hugging Face weight, for ``w_gguf = LlamaModel.permute(w, n_head)``.

    The converter stores row ``h*hd + 2*j + i`` from Hugging Face's row ``h*hd + i*hd/2 + j`` (i < 2, j < hd/2).
    """
    return np.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(rows)


def _llama3_factors(theta: float, head_dim: int, rs: dict) -> np.ndarray:
    """llama.cpp converter's rope_freqs for Llama 3 scaling ``rs`` (convert_hf_to_gguf.py, LlamaModel)."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high, old = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"], rs["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _is_slice(info: GGUFTensorInfo, stored: dict) -> bool:
    """Whether ``info`` is one expert of a 3-D stack (not the stored tensor itself)."""
    return len(stored[info.gguf_name].ne) == 3 and len(info.shape) == 2


# config.json fields -> the GGUF keys they come from (named in errors parse_model_config raises)
_HF_KEYS = {"num_key_value_heads": "attention.head_count_kv", "num_attention_heads": "attention.head_count",
            "head_dim": "attention.key_length", "hidden_size": "embedding_length", "num_hidden_layers": "block_count",
            "intermediate_size": "feed_forward_length", "num_experts_per_tok": "expert_used_count",
            "num_experts": "expert_count", "moe_intermediate_size": "expert_feed_forward_length",
            "rms_norm_eps": "attention.layer_norm_rms_epsilon", "rope_theta": "rope.freq_base",
            "max_position_embeddings": "context_length"}


def _gguf_keys(message: str, arch: str) -> str:
    named = [f"{hf} is {arch}.{key}" for hf, key in _HF_KEYS.items() if hf in message]
    return f" ({'; '.join(named)}: re-convert the model)" if named else " (re-convert the model)"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:160]

