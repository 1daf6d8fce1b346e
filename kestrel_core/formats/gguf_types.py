"""Which GGUF type each tensor of a model gets when kestrel writes one: the ``--type`` names, llama.cpp's Q4_K_M mix,
and the fallback for a tensor whose rows do not split into its type's blocks.

A plain type (``q4_0``, ``q4_1``, ``q5_0``, ``q5_1``, ``q8_0``, ``q4_k``, ``q5_k``, ``q6_k``) is every quantizable tensor
in that type, as
``llama-quantize --pure`` writes it. ``q4_k_m`` is llama.cpp's Q4_K_M (``q4_k_m_type``). What is quantizable is what
llama.cpp's ``tensor_allows_quantization`` allows: a weight of two or more dimensions that is not a norm or a MoE
router (``ffn_gate_inp``); norms, biases, routers and rope factors stay F32.

The fallback is llama.cpp's ``tensor_type_fallback`` (src/llama-quant.cpp): a K-quant whose rows do not split into
256-value super-blocks becomes a type of 32-value blocks with more bits a weight (Q4_K by Q5_0, Q5_K by Q5_1, Q6_K by
Q8_0), and a row of no whole 32-value blocks F16.
"""

from __future__ import annotations

import re

import attrs
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from kestrel_core.errors import ConfigError
from kestrel_core.formats.modelconfig import ModelConfig

T = GGMLQuantizationType
PURE = {"q4_0": T.Q4_0, "q4_1": T.Q4_1, "q5_0": T.Q5_0, "q5_1": T.Q5_1, "q8_0": T.Q8_0, "q4_k": T.Q4_K, "q5_k": T.Q5_K,
        "q6_k": T.Q6_K}
Q4_K_M = "q4_k_m"
TYPE_NAMES = (*PURE, Q4_K_M)
# general.file_type: llama.cpp's name for a file mostly of the type (it has no plain "Q4_K" or "Q5_K": their _S)
FILE_TYPES = {"q4_0": LlamaFileType.MOSTLY_Q4_0, "q4_1": LlamaFileType.MOSTLY_Q4_1, "q5_0": LlamaFileType.MOSTLY_Q5_0,
              "q5_1": LlamaFileType.MOSTLY_Q5_1, "q8_0": LlamaFileType.MOSTLY_Q8_0,
              "q4_k": LlamaFileType.MOSTLY_Q4_K_S, "q5_k": LlamaFileType.MOSTLY_Q5_K_S,
              "q6_k": LlamaFileType.MOSTLY_Q6_K, Q4_K_M: LlamaFileType.MOSTLY_Q4_K_M}
FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}  # llama.cpp's tensor_type_fallback
_LAYER = re.compile(r"blk\.(\d+)\.")


def parse_type(value: str) -> str:
    """A ``--type`` as its lower-case name; an unknown one is a ConfigError listing the known."""
    name = str(value).strip().lower()
    if name not in TYPE_NAMES:
        raise ConfigError(f"unknown --type {value!r}; use one of {', '.join(TYPE_NAMES)} (GGUF types kestrel reads and "
                          "writes), or leave --type out for kestrel's own q8 directory")
    return name


def base_type(type_name: str) -> GGMLQuantizationType:
    """The type most tensors get: the plain type, or Q4_K for q4_k_m."""
    return PURE.get(type_name, T.Q4_K)


@attrs.frozen
class TensorType:
    qtype: GGMLQuantizationType  # what the tensor is written as
    wanted: GGMLQuantizationType | None = None  # what the rule chose, where its rows forced a fallback

    @property
    def fell_back(self) -> bool:
        return self.wanted is not None


def quantizable(gguf_name: str, ndim: int) -> bool:
    """llama.cpp's tensor_allows_quantization, for the tensors kestrel writes."""
    return (ndim >= 2 and gguf_name.endswith("weight") and "_norm.weight" not in gguf_name
            and "ffn_gate_inp.weight" not in gguf_name)


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third layer between."""
    eighth = n_layers // 8
    return layer < eighth or layer >= 7 * n_layers // 8 or (layer >= eighth and (layer - eighth) % 3 == 2)


def q4_k_m_type(gguf_name: str, row: int, cfg: ModelConfig) -> GGMLQuantizationType:
    """llama.cpp's Q4_K_M (llama_tensor_get_type_impl in src/llama-quant.cpp, LLAMA_FTYPE_MOSTLY_Q4_K_M, no imatrix,
    no overrides), for the tensors of llama, qwen3 and qwen3moe models. Everything Q4_K except:

    - ``output.weight``, and ``token_embd.weight`` where the model has no output (tied embeddings): Q6_K, or Q8_0
      where its rows (``hidden_size``) are not a multiple of 256; an untied ``token_embd`` stays Q4_K;
    - ``attn_v`` of layer i: Q6_K where ``use_more_bits(i, n_layers)``, that is i < n/8, or i >= 7n/8, or
      (i - n/8) % 3 == 2 (n/8 rounded down: for 28 layers, layers 0-2, 5, 8, 11, 14, 17, 20, 23 and 24-27);
      in a llama model of 80 layers with grouped KV heads (llama.cpp's 70B) the other layers' attn_v are Q5_K;
    - ``ffn_down`` of layer i (a dense layer's, or the expert stack ``ffn_down_exps``): Q6_K where
      ``use_more_bits(i, n_layers)``;
    - models of exactly 8 experts: ``attn_v`` and ``attn_k`` Q8_0 and ``attn_output`` Q5_K (llama.cpp's Mixtral rule).
    """
    n_layers, experts = cfg.num_hidden_layers, cfg.num_experts
    if gguf_name == "output.weight" or (gguf_name == "token_embd.weight" and cfg.tie_word_embeddings):
        return T.Q8_0 if row % GGML_QUANT_SIZES[T.Q4_K][0] else T.Q6_K
    m = _LAYER.match(gguf_name)
    layer = int(m.group(1)) if m else -1
    if "attn_v.weight" in gguf_name:
        qtype = T.Q6_K if use_more_bits(layer, n_layers) else T.Q4_K
        if cfg.model_type == "llama" and n_layers == 80 and cfg.num_key_value_heads != cfg.num_attention_heads \
                and qtype == T.Q4_K:
            qtype = T.Q5_K
        return T.Q8_0 if experts == 8 else qtype
    if "attn_k.weight" in gguf_name:
        return T.Q8_0 if experts == 8 else T.Q4_K
    if "ffn_down" in gguf_name:
        return T.Q6_K if use_more_bits(layer, n_layers) else T.Q4_K
    if "attn_output.weight" in gguf_name:
        return T.Q5_K if experts == 8 else T.Q4_K
    return T.Q4_K


def tensor_type(gguf_name: str, shape: tuple[int, ...], type_name: str, cfg: ModelConfig) -> TensorType:
    """The type ``gguf_name`` (of ``shape``, Hugging Face order: its row is the last dimension) is written as."""
    if not quantizable(gguf_name, len(shape)):
        return TensorType(T.F32)
    row = shape[-1]
    wanted = q4_k_m_type(gguf_name, row, cfg) if type_name == Q4_K_M else PURE[type_name]
    qtype = wanted
    if row % GGML_QUANT_SIZES[qtype][0]:
        qtype = FALLBACK.get(qtype, qtype)
        if row % GGML_QUANT_SIZES[qtype][0]:
            qtype = T.F16
    return TensorType(qtype, wanted if qtype != wanted else None)
