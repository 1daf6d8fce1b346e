"""qwen3_moe config.json: read and type-checked like every field (the gates answer for it)."""

from __future__ import annotations

import json

import pytest

from kestrel_core.cli import main
from kestrel_core.errors import ConfigError
from kestrel_core.formats.modelconfig import parse_model_config, read_model_config
from kestrel_core.tools.presets import preset_config

# Qwen3-30B-A3B's config.json as published (the fields that matter, and a few that don't).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "max_position_embeddings": 40960,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "norm_topk_prob": True, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151936, "eos_token_id": 151645,
    "bos_token_id": 151643, "output_router_logits": False, "router_aux_loss_coef": 0.001,
}
@pytest.fixture
def moe_dir(tmp_path):
    d = tmp_path / "qwen3-30b-a3b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    return d


def test_the_expert_fields_are_read(moe_dir):
    cfg = read_model_config(moe_dir)
    assert (cfg.model_type, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == ("qwen3_moe", 128, 8, 768)
    assert (cfg.decoder_sparse_step, cfg.mlp_only_layers, cfg.norm_topk_prob) == (1, (), True)
    assert cfg.is_moe and cfg.qk_norm and all(cfg.moe_layer(i) for i in range(48))
    back = cfg.to_hf_dict()
    assert back["architectures"] == ["Qwen3MoeForCausalLM"] and parse_model_config(json.loads(json.dumps(back))) == cfg


def test_hf_layer_pattern_and_defaults():
    raw = {k: v for k, v in QWEN3_30B_A3B.items() if k not in ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob")}
    cfg = parse_model_config(raw)
    assert (cfg.decoder_sparse_step, cfg.mlp_only_layers, cfg.norm_topk_prob) == (1, (), False)  # HF's defaults
    cfg = parse_model_config(dict(raw, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert [i for i in range(6) if cfg.moe_layer(i)] == [1, 5]  # every second layer, but not layer 3


def test_a_dense_config_has_no_experts_and_writes_none():
    cfg = preset_config("tiny")
    assert not cfg.is_moe and not any(cfg.moe_layer(i) for i in range(cfg.num_hidden_layers))
    assert not {"num_experts", "mlp_only_layers", "norm_topk_prob"} & set(cfg.to_hf_dict())


@pytest.mark.parametrize("key, value, needle", [
    ("num_experts", "128", "field 'num_experts' must be a positive integer, got \"128\""),
    ("num_experts", 0, "field 'num_experts' must be a positive integer, got 0"),
    ("num_experts_per_tok", True, "field 'num_experts_per_tok' must be a positive integer, got true"),
    ("num_experts_per_tok", 129, "num_experts_per_tok=129 exceeds num_experts=128"),
    ("moe_intermediate_size", 768.0, "field 'moe_intermediate_size' must be a positive integer, got 768.0"),
    ("decoder_sparse_step", 0, "field 'decoder_sparse_step' must be a positive integer, got 0"),
    ("mlp_only_layers", "0,1", "field 'mlp_only_layers' must be a list of layer numbers, got \"0,1\""),
    ("mlp_only_layers", [1, -1], "field 'mlp_only_layers' must be a list of layer numbers"),
    ("mlp_only_layers", [48], "mlp_only_layers names layer 48, but the model has num_hidden_layers=48 (0..47)"),
    ("norm_topk_prob", 1, "field 'norm_topk_prob' must be true or false, got 1"),
])
def test_expert_fields_of_the_wrong_type(key, value, needle):
    with pytest.raises(ConfigError, match="^config.json: ") as info:
        parse_model_config(dict(QWEN3_30B_A3B, **{key: value}))
    assert needle in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("key", ["num_experts", "num_experts_per_tok", "moe_intermediate_size"])
def test_the_expert_shapes_are_required(key):
    raw = {k: v for k, v in QWEN3_30B_A3B.items() if k != key}
    with pytest.raises(ConfigError, match=f"missing field '{key}'; add it to config.json"):
        parse_model_config(raw)


def test_generate_on_a_moe_config_without_weights_is_one_line(moe_dir, capsys):
    assert main(["generate", "--model", str(moe_dir), "--prompt-ids", "1,2,3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kestrel: error: ") and err.count("\n") == 1 and "safetensors" in err, err


def _transformers5_spelling(raw: dict) -> dict:
    """The same config as transformers 5 writes it: rope_parameters and num_local_experts."""
    out = {k: v for k, v in raw.items() if k not in ("rope_theta", "num_experts")}
    out["rope_parameters"] = {"rope_type": "default", "rope_theta": raw["rope_theta"]}
    out["num_local_experts"] = raw["num_experts"]
    return out


def test_transformers5_spelling_reads_as_the_published_one():
    assert parse_model_config(_transformers5_spelling(QWEN3_30B_A3B)) == parse_model_config(QWEN3_30B_A3B)


def test_rope_parameters_carry_llama3_scaling():
    from kestrel_core.tools.presets import PRESETS

    raw = dict(PRESETS["tiny-llama"], torch_dtype="float32")
    newer = {k: v for k, v in raw.items() if k not in ("rope_theta", "rope_scaling")}
    newer["rope_parameters"] = {"rope_theta": raw["rope_theta"], **raw["rope_scaling"]}
    a, b = parse_model_config(newer), parse_model_config(raw)
    assert a.rope_theta == b.rope_theta == 500000.0
    assert a.inv_freq().tolist() == b.inv_freq().tolist()


@pytest.mark.parametrize("extra, needle", [
    ({"rope_parameters": {"rope_theta": 10000.0}}, "rope_theta 1000000.0 and rope_parameters.rope_theta 10000.0 disagree"),
    ({"num_local_experts": 64}, "num_experts 128 and num_local_experts 64 disagree"),
    ({"rope_parameters": "big"}, "rope_parameters must be an object"),
])
def test_two_spellings_that_disagree_are_refused(extra, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_model_config({**QWEN3_30B_A3B, **extra})
