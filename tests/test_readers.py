"""The readers never guess: exactly the files and tensors the checkpoint declares, every config.json
field of the right type, and any bad input one line on stderr (exit 2), never a traceback."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from cli_helpers import WEIGHTS, fails, gen, header_of
from kestrel_core.cli import main
from kestrel_core.errors import ConfigError
from kestrel_core.formats.modelconfig import parse_model_config
from kestrel_core.tools.quantize import quantize_checkpoint

INDEX = "model.safetensors.index.json"
GATE = "model.layers.2.mlp.gate_proj.weight"
UP = "model.layers.2.mlp.up_proj.weight"  # same shape as GATE
NORM = "model.norm.weight"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


# --- helpers -------------------------------------------------------------------------

def runs(argv: list[str], capsys) -> None:
    rc = main(argv)
    assert rc == 0, capsys.readouterr().err


def write_header(path, header_or_text) -> None:
    """Replace a file's header (a dict, or raw JSON text); the data region stays as it was."""
    raw, n, _ = header_of(path)
    text = header_or_text if isinstance(header_or_text, str) else json.dumps(header_or_text)
    path.write_bytes(struct.pack("<Q", len(text.encode())) + text.encode() + raw[8 + n :])


def edit_header(path, edit) -> None:
    _, _, header = header_of(path)
    edit(header)
    write_header(path, header)


DELETE = object()  # edit_config(..., key=DELETE) removes the key


def edit_config(model_dir, **fields) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in fields.items():
        if value is DELETE:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


def deny(monkeypatch, owner, attr: str, target) -> None:
    """Make ``owner.attr(path, ...)`` raise PermissionError for ``target`` (tests run as root: chmod does not deny)."""
    real = getattr(owner, attr)

    def denied(path, *args, **kwargs):
        if os.path.abspath(os.fspath(path)) == os.path.abspath(os.fspath(target)):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(owner, attr, denied)


@pytest.fixture
def tiny_sharded(tiny_copy):
    """The tiny checkpoint as two shards and an index, like a Hugging Face download."""
    tensors = load_file(str(tiny_copy / WEIGHTS))
    names = sorted(tensors)
    halves = (names[: len(names) // 2], names[len(names) // 2 :])
    weight_map = {}
    for shard, part in zip(SHARDS, halves):
        save_file({n: tensors[n] for n in part}, str(tiny_copy / shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    (tiny_copy / WEIGHTS).unlink()
    (tiny_copy / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tiny_copy


def shard_of(model_dir, name: str) -> str:
    return json.loads((model_dir / INDEX).read_text())["weight_map"][name]


def edit_index(model_dir, edit) -> None:
    index = json.loads((model_dir / INDEX).read_text())
    edit(index["weight_map"])
    (model_dir / INDEX).write_text(json.dumps(index))


def add_tensor(path, name: str, tensor: torch.Tensor) -> None:
    tensors = load_file(str(path))
    tensors[name] = tensor
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_the_sharded_fixture_runs(tiny_sharded, capsys):
    runs(gen(tiny_sharded), capsys)


# --- A. which files and tensors are read ---------------------------------------------------

def test_a_stray_file_without_an_index(tiny_copy, capsys):
    # Today the stray file's (stale) tensors silently replace the real ones.
    save_file({UP: torch.zeros(160, 64, dtype=torch.bfloat16)}, str(tiny_copy / "zz-old.safetensors"))
    fails(gen(tiny_copy), capsys, "2 *.safetensors files", "model.safetensors, zz-old.safetensors", INDEX,
          "remove the stray")


def test_a_stray_file_beside_an_index(tiny_sharded, capsys):
    save_file({UP: torch.zeros(160, 64, dtype=torch.bfloat16)}, str(tiny_sharded / "zz-old.safetensors"))
    fails(gen(tiny_sharded), capsys, f"{INDEX} does not name zz-old.safetensors", "remove the stray")


def test_a_tensor_defined_in_two_shards(tiny_sharded, capsys):
    first, second = SHARDS
    name = next(n for n in load_file(str(tiny_sharded / first)))
    add_tensor(tiny_sharded / second, name, load_file(str(tiny_sharded / first))[name])
    fails(gen(tiny_sharded), capsys, repr(name), f"defined in both {first} and {second}")


def test_a_tensor_in_another_shard_than_the_index_says(tiny_sharded, capsys):
    first, second = SHARDS
    tensors = load_file(str(tiny_sharded / first))
    name = next(iter(tensors))
    add_tensor(tiny_sharded / second, name, tensors.pop(name))
    save_file(tensors, str(tiny_sharded / first), metadata={"format": "pt"})
    fails(gen(tiny_sharded), capsys, repr(name), f"is in {second} but {INDEX} maps it to {first}")


def test_a_tensor_the_index_does_not_list(tiny_sharded, capsys):
    shard = shard_of(tiny_sharded, UP)
    edit_index(tiny_sharded, lambda wm: wm.pop(UP))
    fails(gen(tiny_sharded), capsys, repr(UP), f"is in {shard} but {INDEX} does not list it")


@pytest.mark.parametrize("shift, how", [(0, "alias the same bytes"), (2, "overlap")])
def test_overlapping_data_offsets(tiny_copy, capsys, shift, how):
    # up_proj's offsets pointing into gate_proj's bytes: today it runs with gate's weights as up's.
    def edit(h):
        lo, hi = h[GATE]["data_offsets"]
        h[UP]["data_offsets"] = [lo + shift, hi + shift]

    edit_header(tiny_copy / WEIGHTS, edit)
    fails(gen(tiny_copy), capsys, str(tiny_copy / WEIGHTS), repr(GATE), repr(UP), how, "corrupt")


@pytest.mark.parametrize("offsets", [lambda lo, hi: [lo - 20480 - 1000000, hi - 20480 - 1000000],
                                     lambda lo, hi: [-2, hi - lo - 2],
                                     lambda lo, hi: [hi, lo]])
def test_negative_or_reversed_data_offsets(tiny_copy, capsys, offsets):
    edit_header(tiny_copy / WEIGHTS, lambda h: h[UP].update(data_offsets=offsets(*h[UP]["data_offsets"])))
    err = fails(gen(tiny_copy), capsys, repr(UP), "data_offsets", "0 <= start <= end")
    assert "spans" not in err  # the old message blamed the size, which was right


@pytest.mark.parametrize("offsets", [[0.0, 128.0], [0, "128"], [0], [0, 128, 256], {"a": 0, "b": 128}])
def test_data_offsets_that_are_not_two_integers(tiny_copy, capsys, offsets):
    edit_header(tiny_copy / WEIGHTS, lambda h: h[NORM].update(data_offsets=offsets))
    fails(gen(tiny_copy), capsys, repr(NORM), "data_offsets", "not two integers")


def test_layers_beyond_num_hidden_layers(tiny_copy, capsys):
    edit_config(tiny_copy, num_hidden_layers=5)  # the checkpoint has 6
    fails(gen(tiny_copy), capsys, "11 tensor(s) that config.json does not use",
          "model.layers.5.input_layernorm.weight, model.layers.5.mlp.down_proj.weight", "num_hidden_layers=5")


def test_a_qwen3_checkpoint_read_as_llama_leaves_its_qk_norms_unused(tiny_copy, capsys):
    edit_config(tiny_copy, model_type="llama", architectures=["LlamaForCausalLM"])
    fails(gen(tiny_copy), capsys, "12 tensor(s)", "self_attn.k_norm.weight", "model_type llama")


def test_a_tied_model_with_its_own_lm_head(tiny_copy, capsys):
    add_tensor(tiny_copy / WEIGHTS, "lm_head.weight", torch.zeros(512, 64, dtype=torch.bfloat16))
    fails(gen(tiny_copy), capsys, "1 tensor(s)", "lm_head.weight", "set tie_word_embeddings false")


def test_old_rotary_inv_freq_buffers_are_tolerated(tiny_copy, capsys):
    # Pinned (old code accepted them too): HF once saved these non-persistent buffers.
    add_tensor(tiny_copy / WEIGHTS, "model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8))
    runs(gen(tiny_copy), capsys)


def test_q8_names_count_as_used_and_extras_do_not(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "q8"
    quantize_checkpoint(tiny_ckpt, out, group=32)
    runs(gen(out), capsys)
    edit_config(out, num_hidden_layers=5)
    fails(gen(out), capsys, "18 tensor(s)", "model.layers.5.mlp.down_proj.qweight")


def test_head_dim_zero_is_an_error(tiny_copy, capsys):
    edit_config(tiny_copy, head_dim=0)  # was silently hidden_size // num_attention_heads
    fails(gen(tiny_copy), capsys, "'head_dim' must be a positive integer, got 0")


@pytest.mark.parametrize("value", [None, DELETE])
def test_head_dim_null_or_absent_is_hidden_over_heads(tiny_copy, capsys, value):
    # Pinned: 64 // 4 = 16, what the weights have.
    edit_config(tiny_copy, head_dim=value)
    runs(gen(tiny_copy), capsys)


# --- B. one line, never a traceback: safetensors headers -------------------------------------

@pytest.mark.parametrize("meta, needle", [([1, 2], "__metadata__ is [1, 2]"), ("pt", '__metadata__ is "pt"'),
                                          ({"format": 1}, "__metadata__['format'] is 1, not a string")])
def test_metadata_that_is_not_str_to_str(tiny_copy, capsys, meta, needle):
    edit_header(tiny_copy / WEIGHTS, lambda h: h.update(__metadata__=meta))
    fails(gen(tiny_copy), capsys, str(tiny_copy / WEIGHTS), needle, "corrupt")


def test_a_tensor_defined_twice_in_one_header(tiny_copy, capsys):
    path = tiny_copy / WEIGHTS
    _, _, header = header_of(path)
    text = json.dumps(header)[:-1] + ", " + json.dumps({UP: header[GATE]})[1:]  # a second UP, over GATE's bytes
    write_header(path, text)
    fails(gen(tiny_copy), capsys, f"header defines {UP!r} twice")


@pytest.mark.parametrize("shape", [[64, True], [True, 64], [2**63]])
def test_shape_entries_that_are_not_sizes(tiny_copy, capsys, shape):
    edit_header(tiny_copy / WEIGHTS, lambda h: h[NORM].update(shape=shape))
    fails(gen(tiny_copy), capsys, repr(NORM), "shape", "not a list of")


def test_huge_dims_do_not_wrap_to_zero_bytes(tiny_copy, capsys):
    # 2**32 * 2**32 wraps to 0 in int64: an "empty" tensor that no reshape can make.
    edit_header(tiny_copy / WEIGHTS, lambda h: h.update(extra={"dtype": "BF16", "shape": [2**32, 2**32],
                                                                "data_offsets": [0, 0]}))
    fails(gen(tiny_copy), capsys, "'extra' spans 0 bytes", "needs 36893488147419103232")


@pytest.mark.parametrize("dtype", [["BF16"], {"x": 1}, None])
def test_dtype_that_is_not_a_string(tiny_copy, capsys, dtype):
    edit_header(tiny_copy / WEIGHTS, lambda h: h[NORM].update(dtype=dtype))
    fails(gen(tiny_copy), capsys, repr(NORM), "unsupported dtype", "BF16")


def test_a_weights_file_that_is_a_directory(tiny_copy, capsys):
    (tiny_copy / WEIGHTS).unlink()
    (tiny_copy / WEIGHTS).mkdir()
    fails(gen(tiny_copy), capsys, str(tiny_copy / WEIGHTS), "not a regular file")


# --- B. the index -----------------------------------------------------------------------------

def test_an_unreadable_index(tiny_sharded, capsys, monkeypatch):
    for attr in ("read_text", "read_bytes"):
        deny(monkeypatch, pathlib.Path, attr, tiny_sharded / INDEX)
    deny(monkeypatch, os, "open", tiny_sharded / INDEX)  # the bounded reader (readfile.py) opens it so
    fails(gen(tiny_sharded), capsys, str(tiny_sharded / INDEX), "cannot read (Permission denied)")


def test_an_index_that_is_a_directory(tiny_sharded, capsys):
    (tiny_sharded / INDEX).unlink()
    (tiny_sharded / INDEX).mkdir()
    fails(gen(tiny_sharded), capsys, str(tiny_sharded / INDEX), "cannot read (Is a directory)")


def test_an_index_that_is_not_utf8(tiny_sharded, capsys):
    (tiny_sharded / INDEX).write_bytes(b'{"weight_map": "\xff"}')
    fails(gen(tiny_sharded), capsys, str(tiny_sharded / INDEX), "not valid JSON")


def test_an_index_pointing_outside_the_directory(tiny_sharded, tmp_path, capsys):
    first = SHARDS[0]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(tiny_sharded / first, elsewhere / first)
    edit_index(tiny_sharded, lambda wm: wm.update({t: f"../elsewhere/{first}" for t, f in wm.items() if f == first}))
    fails(gen(tiny_sharded), capsys, f'"../elsewhere/{first}"', "file names in this directory")


@pytest.mark.parametrize("value", ["model.bin", 7])
def test_an_index_naming_what_is_not_a_safetensors_file(tiny_sharded, capsys, value):
    edit_index(tiny_sharded, lambda wm: wm.update({UP: value}))
    fails(gen(tiny_sharded), capsys, repr(UP), json.dumps(value), "*.safetensors file names")


def test_an_empty_weight_map(tiny_sharded, capsys):
    edit_index(tiny_sharded, lambda wm: wm.clear())
    fails(gen(tiny_sharded), capsys, "'weight_map' is empty")


# --- B. the model directory and config.json ---------------------------------------------------

def test_model_pointing_at_a_file(tiny_copy, capsys):
    fails(gen(tiny_copy / WEIGHTS), capsys, str(tiny_copy / WEIGHTS), "is a file, not a directory")


def test_a_model_directory_that_cannot_be_listed(tiny_copy, capsys, monkeypatch):
    deny(monkeypatch, os, "listdir", tiny_copy)
    deny(monkeypatch, os, "scandir", tiny_copy)
    fails(gen(tiny_copy), capsys, f"cannot list {tiny_copy} (Permission denied)")


def test_a_model_directory_that_cannot_be_reached(tiny_copy, capsys, monkeypatch):
    deny(monkeypatch, os, "stat", tiny_copy)
    fails(gen(tiny_copy), capsys, f"cannot access model directory {str(tiny_copy)!r} (Permission denied)")


def test_an_unreadable_config_json(tiny_copy, capsys, monkeypatch):
    for attr in ("read_text", "read_bytes"):
        deny(monkeypatch, pathlib.Path, attr, tiny_copy / "config.json")
    deny(monkeypatch, os, "open", tiny_copy / "config.json")  # the bounded reader (readfile.py) opens it so
    fails(gen(tiny_copy), capsys, str(tiny_copy / "config.json"), "cannot read (Permission denied)")


def test_a_config_json_that_is_a_directory(tiny_copy, capsys):
    (tiny_copy / "config.json").unlink()
    (tiny_copy / "config.json").mkdir()
    fails(gen(tiny_copy), capsys, str(tiny_copy / "config.json"), "cannot read (Is a directory)")


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize(
    "key, value, needle",
    [("head_dim", "16", "'head_dim' must be a positive integer, got \"16\""),
     ("rms_norm_eps", None, "'rms_norm_eps' must be a finite number > 0, got null"),
     ("rms_norm_eps", float("nan"), "'rms_norm_eps' must be a finite number > 0, got NaN"),
     ("rms_norm_eps", True, "'rms_norm_eps' must be a finite number > 0, got true"),
     ("rope_theta", "big", "'rope_theta' must be a finite number > 0, got \"big\""),
     ("rope_theta", 0, "'rope_theta' must be a finite number > 0, got 0"),
     ("rope_scaling", "llama3", "rope_scaling must be an object or null, got \"llama3\""),
     ("rope_scaling", {"factor": 8.0}, "rope_type null is not supported; supported: default, llama3"),
     ("rope_scaling", {"rope_type": ["llama3"]}, "rope_type [\"llama3\"] is not supported"),
     ("rope_scaling", {k: v for k, v in LLAMA3.items() if k != "factor"}, "(llama3): missing field 'factor'; add it"),
     ("rope_scaling", dict(LLAMA3, factor="8"), "(llama3): field 'factor' must be a finite number > 0, got \"8\""),
     ("rope_scaling", dict(LLAMA3, factor=0), "field 'factor' must be a finite number > 0, got 0"),
     ("rope_scaling", dict(LLAMA3, low_freq_factor=None), "field 'low_freq_factor' must be a finite number > 0"),
     ("rope_scaling", dict(LLAMA3, high_freq_factor=1.0), "low_freq_factor must be below high_freq_factor"),
     ("rope_scaling", dict(LLAMA3, original_max_position_embeddings=64.0),
      "'original_max_position_embeddings' must be a positive integer, got 64.0"),
     ("num_hidden_layers", True, "'num_hidden_layers' must be a positive integer, got true"),
     ("num_key_value_heads", True, "'num_key_value_heads' must be a positive integer, got true"),
     ("max_position_embeddings", True, "'max_position_embeddings' must be a positive integer, got true"),
     ("tie_word_embeddings", 0, "'tie_word_embeddings' must be true or false, got 0"),
     ("attention_bias", "false", "'attention_bias' must be true or false, got \"false\""),
     ("eos_token_id", "256", "'eos_token_id' must be a token id, a list of token ids, or null, got \"256\""),
     ("eos_token_id", [256, "x"], "'eos_token_id' must be a token id"),
     ("bos_token_id", True, "'bos_token_id' must be a token id"),
     ("torch_dtype", 16, "'torch_dtype' must be a string, got 16"),
     ("hidden_act", ["silu"], "'hidden_act' must be a string, got [\"silu\"]"),
     ("model_type", ["qwen3"], "model_type [\"qwen3\"] is not supported")],
)
def test_config_fields_of_the_wrong_type(tiny_copy, capsys, key, value, needle):
    edit_config(tiny_copy, **{key: value})
    fails(gen(tiny_copy), capsys, str(tiny_copy / "config.json"), needle)


def test_config_field_types_are_checked_at_parse_time():
    # Today an unsupported rope_scaling type only fails inside inv_freq, at the first forward.
    raw = json.loads(json.dumps(dict(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8,
                                     num_hidden_layers=1, num_attention_heads=1)))
    parse_model_config(raw)
    with pytest.raises(ConfigError, match='rope_type "yarn" is not supported'):
        parse_model_config(dict(raw, rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ConfigError, match=r"hidden_size // num_attention_heads is 0"):
        parse_model_config(dict(raw, num_attention_heads=16, num_key_value_heads=16))


@pytest.mark.parametrize("key, value", [("rope_scaling", None), ("num_key_value_heads", None),
                                        ("torch_dtype", None), ("eos_token_id", [256, 257]), ("bos_token_id", None)])
def test_nulls_and_lists_hf_writes_still_load(tiny_copy, capsys, key, value):
    # Pinned: what real Hugging Face configs hold must keep loading.
    edit_config(tiny_copy, **{key: value})
    if key == "num_key_value_heads":  # null means num_attention_heads: an MHA checkpoint
        tensors = load_file(str(tiny_copy / WEIGHTS))
        for name in [n for n in tensors if n.endswith(("k_proj.weight", "v_proj.weight"))]:
            tensors[name] = torch.cat([tensors[name]] * 2)
        save_file(tensors, str(tiny_copy / WEIGHTS), metadata={"format": "pt"})
    runs(gen(tiny_copy), capsys)
