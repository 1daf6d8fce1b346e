"""The architecture read from a Hugging Face ``config.json``: Qwen3 and Llama dense decoders, and
Qwen3's Mixture-of-Experts (``qwen3_moe``)."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any, Callable

import attrs

from kestrel_core.errors import ConfigError
from kestrel_core.io.json_keys import TOO_MANY_DIGITS, past_int_limit
from kestrel_core.io.readfile import read_bounded

SUPPORTED = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}  # dense decoders
MOE = {"qwen3_moe": "Qwen3MoeForCausalLM"}  # Mixture-of-Experts: experts are residency units of their own
ARCHITECTURES = {**SUPPORTED, **MOE}


@attrs.frozen
class ModelConfig:
    model_type: str  # "qwen3", "llama" or "qwen3_moe"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: dict | None = None
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # Mixture-of-Experts (qwen3_moe, as Hugging Face's Qwen3MoeConfig); a dense model has no experts.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = False
    # A part of the model (``layers``): its layer 0 is the checkpoint's layer ``first_layer``. Tensor names and the
    # sparse-layer rule read the checkpoint's index; everything else counts from 0.
    first_layer: int = 0
    head: bool = True  # the part holds the model's last layer: it computes the logits (the final norm, lm_head)

    @property
    def qk_norm(self) -> bool:
        return self.model_type in ("qwen3", "qwen3_moe")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def moe_layer(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is sparse: Hugging Face's rule, every ``decoder_sparse_step`` layers but ``mlp_only_layers``."""
        layer += self.first_layer
        return self.is_moe and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    def layers(self, first: int, count: int) -> "ModelConfig":
        """The config of ``count`` of this model's layers from ``first`` (a pipeline rank's part)."""
        if not (0 <= first and count >= 1 and first + count <= self.num_hidden_layers):
            raise ValueError(f"layers {first}..{first + count - 1} are not within the model's "
                             f"{self.num_hidden_layers}")
        return attrs.evolve(self, num_hidden_layers=count, first_layer=self.first_layer + first,
                            head=self.head and first + count == self.num_hidden_layers)

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def to_hf_dict(self) -> dict:
        if self.first_layer or not self.head:
            raise ValueError("a part of a model has no config.json of its own")
        d = attrs.asdict(self)
        del d["first_layer"], d["head"]
        if not self.is_moe:  # a dense config.json carries no expert fields
            for key in _MOE_FIELDS:
                del d[key]
        d["architectures"] = [ARCHITECTURES[self.model_type]]
        d["hidden_act"] = "silu"
        d["attention_dropout"] = 0.0
        d["use_cache"] = True
        return d

    def inv_freq(self):
        """RoPE inverse frequencies, with Llama 3 scaling where config.json asks for it."""
        import torch

        inv = 1.0 / (self.rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim))
        rs = self.rope_scaling  # checked by parse_model_config
        if rs is None or _rope_type(rs) == "default":
            return inv
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old / low, old / high
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(is_mid, mid, scaled)


# --- config.json fields: one typed reader, a (check, description) pair per kind --------------

def is_int(v: Any) -> bool:
    """A JSON integer: bool is an int subclass in Python, but true is not a layer count."""
    return isinstance(v, int) and not isinstance(v, bool)


def shown(v: Any) -> str:
    """A value as the JSON file spells it (true, null, "16"), cut short."""
    text = json.dumps(v, default=repr)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_number(v: Any) -> bool:
    return (is_int(v) or isinstance(v, float)) and math.isfinite(v)


Kind = tuple[Callable[[Any], bool], str]
POSITIVE_INT: Kind = (lambda v: is_int(v) and v > 0, "a positive integer")
POSITIVE_NUMBER: Kind = (lambda v: _is_number(v) and v > 0, "a finite number > 0")
BOOL: Kind = (lambda v: isinstance(v, bool), "true or false")
STRING: Kind = (lambda v: isinstance(v, str), "a string")
LAYER_LIST: Kind = (lambda v: isinstance(v, list) and all(is_int(i) and i >= 0 for i in v), "a list of layer numbers")
TOKEN_IDS: Kind = (
    lambda v: v is None or (is_int(v) and v >= 0) or (isinstance(v, list) and all(is_int(i) and i >= 0 for i in v)),
    "a token id, a list of token ids, or null",
)
_REQUIRED = object()

# Bounds on the fields that size a table or an allocation: far above any published model (Qwen3-Next: 48 layers of
# 512 experts; Gemma: a 262,144-token vocabulary), low enough that what is built from config.json before the weights
# are read stays small (num_hidden_layers 1e9 ground for minutes into a MemoryError). max_position_embeddings sizes
# nothing by itself (the KV cache is sized by the run, and checked); its bound only keeps the arithmetic sane.
LIMITS = {"vocab_size": 2**24, "hidden_size": 2**17, "intermediate_size": 2**20, "num_hidden_layers": 2**12,
          "num_attention_heads": 2**12, "num_key_value_heads": 2**12, "head_dim": 2**12,
          "max_position_embeddings": 2**40, "num_experts": 2**14, "num_experts_per_tok": 2**14,
          "moe_intermediate_size": 2**20, "decoder_sparse_step": 2**12}
MAX_EXPERT_UNITS = 2**17  # num_hidden_layers x num_experts: one table entry (and its tensors' specs) each


def _fix(where: str) -> str:
    """What to do about a wrong field: config.json is the user's to fix; a GGUF's metadata is its converter's."""
    if "GGUF metadata" in where:
        return "the GGUF's metadata is wrong"  # the reader adds which key, and to re-convert
    return "fix config.json"


def _add(where: str) -> str:
    return "the GGUF's metadata lacks it" if "GGUF metadata" in where else "add it to config.json"


def _size(raw: dict, key: str, default: Any = _REQUIRED, where: str = "config.json", null_is_default: bool = False):
    """A positive integer field, at most its LIMITS bound."""
    value = _field(raw, key, POSITIVE_INT, default, where, null_is_default)
    if value is not None and value > LIMITS[key]:
        raise ConfigError(f"{where}: field {key!r} is {value:,}, over the {LIMITS[key]:,} kestrel allows (no model has "
                          f"that many); {_fix(where)}")
    return value


def _field(raw: dict, key: str, kind: Kind, default: Any = _REQUIRED, where: str = "config.json", null_is_default: bool = False):
    """raw[key] checked against kind; absent (or null where HF treats null as unset) gives default."""
    value = raw.get(key)
    if key not in raw or (value is None and null_is_default):
        if default is _REQUIRED:
            raise ConfigError(f"{where}: missing field {key!r}; {_add(where)}")
        return default
    check, want = kind
    if not check(value):
        raise ConfigError(f"{where}: field {key!r} must be {want}, got {shown(value)}; {_fix(where)}")
    return value


ROPE_TYPES = ("default", "llama3")
_LLAMA3: dict[str, Kind] = {"factor": POSITIVE_NUMBER, "low_freq_factor": POSITIVE_NUMBER,
                            "high_freq_factor": POSITIVE_NUMBER,
                            "original_max_position_embeddings": POSITIVE_INT}


def _rope_type(rs: dict):
    return rs.get("rope_type", rs.get("type"))


def _check_rope_scaling(rs: Any, where: str) -> None:
    """rope_scaling is null or a known kind with every parameter inv_freq needs (as HF requires)."""
    if rs is None:
        return
    name = f"{where}: rope_scaling"
    if not isinstance(rs, dict):
        raise ConfigError(f"{name} must be an object or null, got {shown(rs)}; {_fix(where)}")
    kind = _rope_type(rs)
    if kind not in ROPE_TYPES:  # also a missing, non-string or unhashable one
        raise ConfigError(f"{name}: rope_type {shown(kind)} is not supported; supported: {', '.join(ROPE_TYPES)}")
    if kind == "llama3":
        for key, kind_of in _LLAMA3.items():
            _field(rs, key, kind_of, where=f"{name} (llama3)")
        if not rs["low_freq_factor"] < rs["high_freq_factor"]:
            raise ConfigError(
                f"{name}: low_freq_factor must be below high_freq_factor, got {rs['low_freq_factor']} and {rs['high_freq_factor']}; {_fix(where)}"
            )


_DIMS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
               "mlp_only_layers", "norm_topk_prob")


def _moe_fields(raw: dict, where: str, n_layers: int) -> dict:
    """The expert fields of a qwen3_moe config.json: the shapes are required, the layer pattern defaults as in HF."""
    experts = _size(raw, "num_experts", where=where)
    per_token = _size(raw, "num_experts_per_tok", where=where)
    if per_token > experts:
        raise ConfigError(f"{where}: num_experts_per_tok={per_token} exceeds num_experts={experts}; {_fix(where)}")
    if n_layers * experts > MAX_EXPERT_UNITS:
        raise ConfigError(f"{where}: num_hidden_layers x num_experts = {n_layers:,} x {experts:,} expert units, over the "
                          f"{MAX_EXPERT_UNITS:,} kestrel plans for; {_fix(where)}")
    dense = _field(raw, "mlp_only_layers", LAYER_LIST, [], where, null_is_default=True)
    outside = [layer for layer in dense if layer >= n_layers]
    if outside:
        raise ConfigError(f"{where}: mlp_only_layers names layer {outside[0]}, but the model has "
                          f"num_hidden_layers={n_layers} (0..{n_layers - 1}); {_fix(where)}")
    return dict(
        num_experts=experts,
        num_experts_per_tok=per_token,
        moe_intermediate_size=_size(raw, "moe_intermediate_size", where=where),
        decoder_sparse_step=_size(raw, "decoder_sparse_step", 1, where),
        mlp_only_layers=tuple(dense),
        norm_topk_prob=_field(raw, "norm_topk_prob", BOOL, False, where),
    )


def _newer_spellings(raw: dict, where: str) -> dict:
    """config.json as transformers 5 may write it, in the older spelling this parser reads: ``rope_parameters``
    (rope_theta and any scaling) for ``rope_theta`` / ``rope_scaling``, ``num_local_experts`` for ``num_experts``.
    Where both spellings are present they must agree."""
    out = dict(raw)
    params = raw.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise ConfigError(f"{where}: rope_parameters must be an object, got {shown(params)}; {_fix(where)}")
        if "rope_theta" in params:
            if "rope_theta" in raw and raw["rope_theta"] != params["rope_theta"]:
                raise ConfigError(f"{where}: rope_theta {shown(raw['rope_theta'])} and rope_parameters.rope_theta "
                                  f"{shown(params['rope_theta'])} disagree; keep one")
            out["rope_theta"] = params["rope_theta"]
        if _rope_type(params) not in (None, "default") and raw.get("rope_scaling") is None:
            out["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    if "num_local_experts" in raw:
        if "num_experts" in raw and raw["num_experts"] != raw["num_local_experts"]:
            raise ConfigError(f"{where}: num_experts {shown(raw['num_experts'])} and num_local_experts "
                              f"{shown(raw['num_local_experts'])} disagree; keep one")
        out["num_experts"] = raw["num_local_experts"]
    return out


def parse_model_config(raw: dict, where: str = "config.json") -> ModelConfig:
    """Validate a config.json dict; a missing or wrong field is an error naming it."""
    raw = _newer_spellings(raw, where) if isinstance(raw, dict) else raw
    model_type = raw.get("model_type")
    if not (isinstance(model_type, str) and model_type in ARCHITECTURES):
        raise ConfigError(
            f"{where}: model_type {shown(model_type)} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    dims = {key: _size(raw, key, where=where) for key in _DIMS}
    heads = dims["num_attention_heads"]
    # HF treats null like absent for these two.
    kv_heads = _size(raw, "num_key_value_heads", heads, where, null_is_default=True)
    if heads % kv_heads:
        raise ConfigError(f"{where}: num_key_value_heads={kv_heads} must divide num_attention_heads={heads}")
    head_dim = _size(raw, "head_dim", None, where, null_is_default=True)
    if head_dim is None:
        head_dim = dims["hidden_size"] // heads
        if not head_dim:
            raise ConfigError(f"{where}: hidden_size // num_attention_heads is 0; set head_dim or fix the sizes")
    if head_dim % 2:
        raise ConfigError(f"{where}: head_dim={head_dim} must be even for RoPE")
    act = _field(raw, "hidden_act", STRING, "silu", where)
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act {act!r} is not supported; only silu (SwiGLU)")
    rope_scaling = raw.get("rope_scaling")
    _check_rope_scaling(rope_scaling, where)
    # Newer HF writes "dtype"; null (an unset PretrainedConfig field) means the default.
    dtype_key = "torch_dtype" if "torch_dtype" in raw else "dtype"
    return ModelConfig(
        model_type=model_type,
        **dims,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=_size(raw, "max_position_embeddings", 2048, where),
        rms_norm_eps=float(_field(raw, "rms_norm_eps", POSITIVE_NUMBER, 1e-6, where)),
        rope_theta=float(_field(raw, "rope_theta", POSITIVE_NUMBER, 10000.0, where)),
        tie_word_embeddings=_field(raw, "tie_word_embeddings", BOOL, False, where),
        attention_bias=_field(raw, "attention_bias", BOOL, False, where),
        rope_scaling=rope_scaling,
        torch_dtype=_field(raw, dtype_key, STRING, "bfloat16", where, null_is_default=True),
        bos_token_id=_field(raw, "bos_token_id", TOKEN_IDS, None, where),
        eos_token_id=_field(raw, "eos_token_id", TOKEN_IDS, None, where),
        **(_moe_fields(raw, where, dims["num_hidden_layers"]) if model_type in MOE else {}),
    )


JSON_LIMIT = 64 * 2**20  # config.json, tokenizer_config.json, an index: kilobytes to a few MiB in every real model


def read_json(path: Path, error: type[Exception] = ConfigError, limit: int = JSON_LIMIT) -> Any:
    """A JSON file's value; unreadable, too large or invalid JSON is ``error`` naming the path."""
    text = read_bounded(path, limit, str(path), "this is not the small JSON file a model directory holds", error)
    return loads(text, str(path), error)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def loads(text: str | bytes, where: str, error: type[Exception] = ConfigError, finite: bool = False) -> Any:
    """JSON whose nesting past Python's stack is an error, as is NaN or Infinity (which Python's json accepts) where
    ``finite``; config.json keeps them, for its field checks to name the field."""
    try:
        return json.loads(text, parse_constant=_no_constant) if finite else json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{where}: not valid JSON ({exc})") from None  # one line, with the position
    except ValueError as exc:  # from _no_constant, or an integer past Python's 4300 digits
        raise error(f"{where}: not valid JSON ({TOO_MANY_DIGITS if past_int_limit(exc) else exc})") from None
    except RecursionError:
        raise error(f"{where}: not valid JSON (nested too deeply)") from None


def _gguf_hint(model_dir: Path) -> str:
    """Where a directory without config.json holds .gguf files (a GGUF repository as downloaded), what to pass instead."""
    try:
        found = sorted(p.name for p in Path(model_dir).glob("*.gguf"))
    except OSError:
        return ""
    if not found:
        return ""
    shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
    return f"; it holds {shown}: pass a .gguf file itself (--model {Path(model_dir) / found[0]})"


def read_model_config(model_dir: Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    try:
        mode = os.stat(model_dir).st_mode
    except FileNotFoundError:
        raise ConfigError(f"model directory {str(model_dir)!r} does not exist (make one with: kestrel make-model --preset tiny --out DIR)") from None
    except OSError as exc:
        raise ConfigError(f"cannot access model directory {str(model_dir)!r} ({exc.strerror})") from None
    if not stat.S_ISDIR(mode):
        raise ConfigError(f"model directory {str(model_dir)!r} is a file, not a directory; pass the directory that holds config.json and the weights")
    if not os.path.lexists(path):
        raise ConfigError(f"{path}: missing; a Hugging Face model directory needs config.json{_gguf_hint(model_dir)}")
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must hold a JSON object")
    return parse_model_config(raw, str(path))
