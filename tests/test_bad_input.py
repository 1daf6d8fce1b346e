"""Bad input gets one clear line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import json
import struct
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from cli_helpers import WEIGHTS, fails, gen, header_of

A_LINEAR = "model.layers.2.mlp.up_proj.weight"


# --- the checkpoint --------------------------------------------------------------------

def test_truncated_file(tiny_copy, capsys):
    path = tiny_copy / WEIGHTS
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    fails(gen(tiny_copy), capsys, str(path), "truncated")


@pytest.mark.parametrize("size", [0, 5])
def test_file_too_short_for_a_header(tiny_copy, capsys, size):
    (tiny_copy / WEIGHTS).write_bytes(b"\x01" * size)
    fails(gen(tiny_copy), capsys, "truncated")


def test_corrupt_header_json(tiny_copy, capsys):
    path = tiny_copy / WEIGHTS
    raw, n, _ = header_of(path)
    path.write_bytes(raw[:8] + b"{not json" + b" " * (n - 9) + raw[8 + n :])
    fails(gen(tiny_copy), capsys, "header is not valid JSON")


@pytest.mark.parametrize("entry", [5, {"dtype": "BF16"}, {"dtype": "BF16", "shape": [64], "data_offsets": "x"},
                                   {"dtype": "BF16", "shape": ["a"], "data_offsets": [0, 128]},
                                   {"dtype": "BF16", "shape": [64], "data_offsets": ["a", "b"]}])
def test_malformed_header_entry(tiny_copy, capsys, entry):
    path = tiny_copy / WEIGHTS
    raw, n, header = header_of(path)
    header["model.norm.weight"] = entry
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    path.write_bytes(raw[:8] + text + b" " * (n - len(text)) + raw[8 + n :])
    fails(gen(tiny_copy), capsys, "model.norm.weight")


@pytest.mark.parametrize("lie", [lambda n, size: 2**60, lambda n, size: size, lambda n, size: n - 7,
                                 lambda n, size: n + 8])
def test_header_that_lies_about_its_length(tiny_copy, capsys, lie):
    path = tiny_copy / WEIGHTS
    raw, n, _ = header_of(path)
    path.write_bytes(struct.pack("<Q", lie(n, len(raw))) + raw[8:])
    fails(gen(tiny_copy), capsys, str(path))


def test_tensor_data_past_the_end(tiny_copy, capsys):
    path = tiny_copy / WEIGHTS
    raw, n, header = header_of(path)
    lo, hi = header[A_LINEAR]["data_offsets"]
    header[A_LINEAR]["data_offsets"] = [len(raw), len(raw) + hi - lo]
    text = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(raw[:8] + text + b" " * (n - len(text)) + raw[8 + n :])
    fails(gen(tiny_copy), capsys, A_LINEAR, "truncated")


def _resave(model_dir, edit):
    tensors = load_file(str(model_dir / WEIGHTS))
    edit(tensors)
    save_file(tensors, str(model_dir / WEIGHTS))


def test_missing_tensor(tiny_copy, capsys):
    _resave(tiny_copy, lambda t: t.pop(A_LINEAR))
    fails(gen(tiny_copy), capsys, "missing tensor", A_LINEAR)


def test_wrong_shape(tiny_copy, capsys):
    _resave(tiny_copy, lambda t: t.update({A_LINEAR: t[A_LINEAR].t().contiguous()}))
    fails(gen(tiny_copy), capsys, A_LINEAR, "[64, 160]", "[160, 64]")


@pytest.mark.parametrize("dtype, shown", [(torch.int32, "I32"), (torch.int8, "I8"), (torch.float64, "F64")])
def test_wrong_dtype(tiny_copy, capsys, dtype, shown):
    _resave(tiny_copy, lambda t: t.update({A_LINEAR: t[A_LINEAR].to(dtype)}))
    fails(gen(tiny_copy), capsys, A_LINEAR, shown)


def test_missing_model_dir(tmp_path, capsys):
    fails(gen(tmp_path / "nowhere"), capsys, "does not exist", "make-model")


def test_no_weights(tiny_copy, capsys):
    (tiny_copy / WEIGHTS).unlink()
    fails(gen(tiny_copy), capsys, "no *.safetensors")


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "vocab_size"])
def test_missing_config_field(tiny_copy, capsys, field):
    cfg = json.loads((tiny_copy / "config.json").read_text())
    del cfg[field]
    (tiny_copy / "config.json").write_text(json.dumps(cfg))
    fails(gen(tiny_copy), capsys, "config.json", repr(field))


@pytest.mark.parametrize("text, needle", [("{", "not valid JSON"), ("[1]", "JSON object"),
                                          ('{"model_type": "gpt2"}', "not supported")])
def test_bad_config_json(tiny_copy, capsys, text, needle):
    (tiny_copy / "config.json").write_text(text)
    fails(gen(tiny_copy), capsys, needle)


def test_config_that_does_not_match_the_weights(tiny_copy, capsys):
    cfg = json.loads((tiny_copy / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (tiny_copy / "config.json").write_text(json.dumps(cfg))
    fails(gen(tiny_copy), capsys, "do not match")


# --- names and numbers -----------------------------------------------------------------

@pytest.mark.parametrize(
    "flag, value, available",
    [("--policy", "lru", ["asymmetric", "belady", "future_evicting", "pinned_set", "off"]),
     ("--backend", "tpu", ["cpu_ref", "cuda"]),
     ("--allocator", "slab", ["pool", "free"])],
)
def test_unknown_plugin_names_list_the_available_ones(tiny_ckpt, capsys, flag, value, available):
    kind = flag[2:]
    fails(gen(tiny_ckpt, flag, value, "--keep", "2"), capsys, f"unknown {kind} {value!r}", *available)


@pytest.mark.parametrize("keep, needle", [("0", "keep=0"), ("-1", "keep=-1"), ("7", "keep=7"), ("x", "'x'"),
                                          ("1.5", "'1.5'")])
def test_keep_out_of_range(tiny_ckpt, capsys, keep, needle):
    fails(gen(tiny_ckpt, "--keep", keep), capsys, needle)


def test_keep_out_of_range_in_a_sweep(tiny_ckpt, capsys):
    fails(["sweep", "--model", str(tiny_ckpt), "--keep", "1,9", "--max-new-tokens", "2"], capsys, "keep=9", "1..6")


@pytest.mark.parametrize("argv", [["--prompt", ""], ["--prompt", "   "], ["--prompt-ids", ""], ["--prompt-ids", ","]])
def test_empty_prompt(tiny_ckpt, capsys, argv):
    fails(["generate", "--model", str(tiny_ckpt), *argv], capsys, "empty")


def test_no_prompt_at_all(tiny_ckpt, capsys):
    fails(["generate", "--model", str(tiny_ckpt)], capsys, "empty")


@pytest.mark.parametrize("ids, needle", [("1,a", "comma-separated integers"), ("1,512", "outside the vocabulary"),
                                         ("-3", "outside the vocabulary")])
def test_bad_prompt_ids(tiny_ckpt, capsys, ids, needle):
    fails(["generate", "--model", str(tiny_ckpt), "--prompt-ids", ids], capsys, needle)


def test_max_new_tokens_beyond_max_position_embeddings(tiny_ckpt, capsys):
    fails(gen(tiny_ckpt, "--max-new-tokens", "510"), capsys, "the model's context is 512 tokens (max_position_embeddings); "
          "the prompt takes 3 and 510 to generate (max_new_tokens (--max-new-tokens)); shorten the prompt or lower")


@pytest.mark.parametrize("n", ["0", "-4"])
def test_max_new_tokens_below_one(tiny_ckpt, capsys, n):
    fails(gen(tiny_ckpt, "--max-new-tokens", n), capsys, "max-new-tokens")


@pytest.mark.parametrize("flags, needle", [(["--temperature", "-1"], "temperature"), (["--top-p", "0"], "top_p"),
                                           (["--top-k", "-2"], "top_k"), (["--pool-slots", "-1"], "pool_slots"),
                                           (["--dtype", "int8"], "int8")])
def test_bad_generation_and_backend_numbers(tiny_ckpt, capsys, flags, needle):
    fails(gen(tiny_ckpt, "--keep", "2", *flags), capsys, needle)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cuda_backend_without_a_gpu(tiny_ckpt, capsys):
    fails(gen(tiny_ckpt, "--backend", "cuda"), capsys, "needs an NVIDIA GPU", "--backend cpu_ref")


def test_prefetch_on_the_cpu_reference(tiny_ckpt, capsys):
    fails(gen(tiny_ckpt, "--keep", "2", "--prefetch", "1"), capsys, "prefetch")


# --- config files ----------------------------------------------------------------------

@pytest.mark.parametrize(
    "toml, needle",
    [('modle = "x"\n', "unknown key(s) modle"),
     ('[residency]\npolicy = "asymmetric"\nkeeep = 2\n', "[residency]: unknown key(s) keeep"),
     ('[generaton]\nseed = 1\n', "unknown key(s) generaton"),
     ('[residency]\nkeep = true\n', "keep"),
     ('[residency]\nkeep = 2.5\n', "keep"),
     ('[generation]\nmax_new_tokens = "5"\n', "max_new_tokens must be int"),
     ('[generation]\nprompt_ids = [1, "a"]\n', "prompt_ids"),
     ('[generation]\nprompt_ids = 3\n', "prompt_ids"),
     ('residency = 3\n', "[residency] must be a table"),
     ('[residency\n', "not valid TOML")],
)
def test_bad_config_file(tiny_ckpt, tmp_path, capsys, toml, needle):
    path = tmp_path / "kestrel.toml"
    path.write_text(toml)
    fails(gen(tiny_ckpt, "--config", str(path)), capsys, needle)


def test_missing_config_file(tiny_ckpt, tmp_path, capsys):
    fails(gen(tiny_ckpt, "--config", str(tmp_path / "none.toml")), capsys, "does not exist")


# --- a real process --------------------------------------------------------------------

@pytest.mark.parametrize("case", ["truncated", "unknown-policy"])
def test_a_real_process_prints_one_line_and_exits_2(tiny_copy, case):
    argv = gen(tiny_copy, "--keep", "1")
    if case == "truncated":
        path = tiny_copy / WEIGHTS
        path.write_bytes(path.read_bytes()[:100])
    else:
        argv += ["--policy", "clairvoyant"]
    proc = subprocess.run([sys.executable, "-m", "kestrel_core.cli", *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("kestrel: error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert ("truncated" if case == "truncated" else "unknown policy 'clairvoyant'") in proc.stderr


def test_a_reader_that_leaves_early_is_not_an_error(tiny_ckpt):
    """`kestrel generate ... | head -0`: the pipe is closed before the first line; kestrel exits quietly (141, as a
    shell reports SIGPIPE), without the disk advice an OSError gets."""
    read, write = os.pipe()
    os.close(read)  # no reader at all: the first write fails with EPIPE
    proc = subprocess.run([sys.executable, "-m", "kestrel_core.cli", "generate", "--model", str(tiny_ckpt),
                           "--prompt-ids", "1,2,3", "--max-new-tokens", "3", "--ignore-eos"],
                          stdout=write, stderr=subprocess.PIPE, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"})  # block-buffered, as in a pipe
    os.close(write)
    err = proc.stderr.decode()
    assert proc.returncode == 141, (proc.returncode, err)
    assert "check the path" not in err and "Traceback" not in err and "Exception ignored" not in err, err
