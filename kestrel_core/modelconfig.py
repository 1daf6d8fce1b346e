"""The architecture read from a Hugging Face ``config.json`` (Qwen3 and Llama dense decoders)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs

from .errors import ConfigError

SUPPORTED = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


@attrs.frozen
class ModelConfig:
    model_type: str  # "qwen3" or "llama"
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

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def to_hf_dict(self) -> dict:
        d = attrs.asdict(self)
        d["architectures"] = [SUPPORTED[self.model_type]]
        d["hidden_act"] = "silu"
        d["attention_dropout"] = 0.0
        d["use_cache"] = True
        return d

    def inv_freq(self):
        """RoPE inverse frequencies, with Llama 3 scaling where config.json asks for it."""
        import torch

        inv = 1.0 / (self.rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim))
        rs = self.rope_scaling
        if not rs:
            return inv
        kind = rs.get("rope_type", rs.get("type"))
        if kind == "default":
            return inv
        if kind != "llama3":
            raise ConfigError(f"rope_scaling type {kind!r} is not supported; supported: llama3, default")
        factor = rs["factor"]
        low, high = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old = rs.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old / low, old / high
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(is_mid, mid, scaled)


_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


def parse_model_config(raw: dict, where: str = "config.json") -> ModelConfig:
    """Validate a config.json dict; a missing or wrong field is an error naming it."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED:
        raise ConfigError(
            f"{where}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}"
        )
    for key in _REQUIRED:
        if key not in raw:
            raise ConfigError(f"{where}: missing field {key!r} (needed for a {model_type} model)")
        if not isinstance(raw[key], int) or raw[key] <= 0:
            raise ConfigError(f"{where}: field {key!r} must be a positive integer, got {raw[key]!r}")
    heads = raw["num_attention_heads"]
    kv_heads = raw.get("num_key_value_heads", heads)
    if not isinstance(kv_heads, int) or kv_heads <= 0 or heads % kv_heads:
        raise ConfigError(f"{where}: num_key_value_heads={kv_heads!r} must divide num_attention_heads={heads}")
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    if head_dim % 2:
        raise ConfigError(f"{where}: head_dim={head_dim} must be even for RoPE")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act {act!r} is not supported; only silu (SwiGLU)")
    max_pos = raw.get("max_position_embeddings", 2048)
    if not isinstance(max_pos, int) or max_pos <= 0:
        raise ConfigError(f"{where}: max_position_embeddings must be a positive integer, got {max_pos!r}")
    return ModelConfig(
        model_type=model_type,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        rope_scaling=raw.get("rope_scaling"),
        torch_dtype=str(raw.get("torch_dtype", raw.get("dtype", "bfloat16"))),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=raw.get("eos_token_id"),
    )


def read_model_config(model_dir: Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ConfigError(f"model directory {str(model_dir)!r} does not exist (make one with: kestrel make-model --preset tiny --out DIR)")
    if not path.is_file():
        raise ConfigError(f"{path}: missing; a Hugging Face model directory needs config.json")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must hold a JSON object")
    return parse_model_config(raw, str(path))
