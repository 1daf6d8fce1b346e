"""A GGUF file as a model: ``load("x.gguf")``, ``--model x.gguf`` and ``model = "x.gguf"`` on small hand-made files.

Its greedy ids equal those of the Hugging Face layout of the same weights on cpu_ref with ``host_kernels = "off"``
(the weights computed by tests/gguf_files.py independently of kestrel's reader), across keep, policy and allocator,
and with the default ``auto`` (the host GGUF kernel) its own ids across them too; its Q8_0 units are
kestrel q8 with group 32; ``kestrel chat`` lays the conversation out with the GGUF's template; ``kestrel quantize
--from`` writes a q8 directory whose ids equal the GGUF's; a bad path is one line; and cpu_ref's mapping RSS follows
the window on a quantized GGUF as it does on safetensors.
"""

from __future__ import annotations

import io
import json
import os
import re
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from kestrel_core import load

from kestrel_core.formats import quant
from kestrel_core.formats.checkpoint import Checkpoint
from kestrel_core.io.mapped import PAGE
from kestrel_core.errors import CheckpointError, ConfigError, KestrelNote
from kestrel_core.formats.gguf import GGUFCheckpoint
from kestrel_core.formats.gguf_model import names_gguf, q8_info
from kestrel_core.hookspecs import hookimpl
from kestrel_core.formats.tensor_table import linear_specs, unit_specs
from cli_helpers import fails
from kestrel_core.cli import main
from tests.gguf_files import (CHAT_TEMPLATE, DIMS, K_DIMS, K_TYPES, LLAMA_TYPES, T, encode, model_metadata,
                              model_tensors, truth_dequantize, write_gguf, write_model)

PROMPT = [5, 40, 77, 120, 3]
F32_F16 = {"token_embd": T.F16, "attn_q": T.F32, "attn_k": T.F16, "attn_v": T.F32, "attn_output": T.F16,
           "ffn_gate": T.F32, "ffn_up": T.F16, "ffn_down": T.F32, "output": T.F16}
Q8_ONLY = {k: T.Q8_0 for k in LLAMA_TYPES}
MOE_TYPES = {**LLAMA_TYPES, "ffn_gate": T.Q4_0, "ffn_up": T.Q8_0, "ffn_down": T.BF16}


def hf_layout(gguf_path, truth: dict, out):
    """The Hugging Face directory of the same weights: ``truth`` (tests/gguf_files' own dequantization and
    un-permutation, not kestrel's reader) in float32, and the config the metadata describes."""
    out.mkdir()
    with GGUFCheckpoint(gguf_path) as ckpt:
        config = {**ckpt.config_dict(), "torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(config))
    save_file({k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in truth.items()},
              str(out / "model.safetensors"))
    return out


def greedy(path, n: int = 12, **settings) -> list[int]:
    with load(path) as model, model.open(backend="cpu_ref", **settings) as run:
        return run.generate(prompt_ids=PROMPT, max_new_tokens=n, stop_at_eos=False).token_ids


# --- the same weights, the same ids ---------------------------------------------------------------------
CASES = {
    "llama-f32-f16": ("llama", DIMS, F32_F16, False),
    "llama-every-type": ("llama", DIMS, LLAMA_TYPES, False),
    "llama-k-quants-tied": ("llama", K_DIMS, K_TYPES, True),
    "llama-q8_0": ("llama", DIMS, Q8_ONLY, False),
    "qwen3": ("qwen3", DIMS, LLAMA_TYPES, True),
    "qwen3moe": ("qwen3moe", DIMS, MOE_TYPES, False),
    "qwen3moe-q8_0": ("qwen3moe", DIMS, Q8_ONLY, True),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_a_gguf_and_the_hugging_face_layout_of_its_weights_give_the_same_ids(case, tmp_path):
    arch, dims, types, tied = case
    path, truth = write_model(tmp_path / "m.gguf", arch, dims, types, tied)
    # host_kernels = "off": every quantized tensor dequantized, the float math of the same weights; "auto" (the
    # default) quantizes x for the host kernel, so its ids are its own, the same across keep, policy and allocator
    ids = greedy(path, keep="off", host_kernels="off")
    assert ids == greedy(hf_layout(path, truth, tmp_path / "hf"), keep="off")
    assert len(set(ids)) > 1  # not one token over and over: the weights matter
    auto = greedy(path, keep="off")
    for settings in (dict(keep=1, policy="asymmetric", allocator="pool"), dict(keep=1, policy="belady", allocator="free"),
                     dict(keep=1, policy="pinned_set", allocator="pool")):
        assert greedy(path, host_kernels="off", **settings) == ids, settings
        assert greedy(path, **settings) == auto, settings


def test_load_names_the_file_and_reads_its_metadata(tmp_path):
    path, _ = write_model(tmp_path / "m.gguf")
    with load(path) as model:
        assert model.dir == path and model.checkpoint.path == path
        assert (model.config.model_type, model.n_layers, model.config.vocab_size) == ("llama", DIMS["layers"], 265)
        assert model.eos_ids == frozenset({2})
        assert model.tokenizer.encode("<|im_start|> the") == [1, model.tokenizer.token_to_id("Ġthe")]
        assert model.chat_template().source == CHAT_TEMPLATE
        assert model.quant is None  # no unit of it is Q8_0 throughout
        with model.open(backend="cpu_ref") as run:
            assert run.generate(prompt="the a", max_new_tokens=3, stop_at_eos=False).text


def test_names_gguf(tmp_path):
    path, _ = write_model(tmp_path / "m.bin")  # the magic, without the suffix
    (tmp_path / "dir.gguf").mkdir()
    assert names_gguf(path) and names_gguf(tmp_path / "dir.gguf") and names_gguf(tmp_path / "absent.GGUF")
    assert not names_gguf(tmp_path) and not names_gguf("Qwen/Qwen3-8B")


# --- Q8_0 as kestrel's q8 ------------------------------------------------------------------------------
def test_q8_0_units_are_q8_with_group_32_and_repack_the_stored_bytes(tmp_path):
    path, _ = write_model(tmp_path / "m.gguf", types=Q8_ONLY)
    with GGUFCheckpoint(path) as ckpt:
        cfg = ckpt.model_config()
        info = q8_info(ckpt, cfg)
        want = {n for u in unit_specs(cfg) for n, _ in u.tensors.values()} | {"lm_head.weight"}
        assert set(info.tensors) == want and (info.group_size, info.lm_head, info.method) == (32, "q8", "q8")
        t = info.tensors["model.layers.1.self_attn.k_proj.weight"]  # permuted in the file
        assert t.packed and t.stored == (t.name,) and (t.n, t.k, t.n_pad) == (32, 64, 64)
        qweight, scales = quant.read_q8(ckpt, t)
        assert qweight.dtype == torch.int8 and qweight.shape == (64, 64) and scales.shape == (2, 64)
        assert torch.equal(quant.dequantize(qweight, scales, t.n, 32), ckpt.view(t.name))
        raw = ckpt.files["m.gguf"].bytes(ckpt.info(t.name).start, ckpt.info(t.name).end)
        stored_q = np.sort(raw.reshape(-1, 34)[:, 2:].view(np.int8).reshape(-1))
        assert np.array_equal(np.sort(qweight[:, : t.n].numpy().reshape(-1)), stored_q)  # the same int8s, reordered


def test_a_unit_of_mixed_types_stays_float(tmp_path):
    mixed = {**Q8_ONLY, "ffn_down": T.Q4_0, "output": T.F16}
    path, _ = write_model(tmp_path / "m.gguf", types=mixed, tied=False)
    with GGUFCheckpoint(path) as ckpt:
        assert q8_info(ckpt, ckpt.model_config()) is None  # every layer holds a Q4_0 down_proj; lm_head is F16
    moe, _ = write_model(tmp_path / "moe.gguf", "qwen3moe", types={**Q8_ONLY, "ffn_down": T.Q4_0})
    with GGUFCheckpoint(moe) as ckpt:
        cfg = ckpt.model_config()
        info = q8_info(ckpt, cfg)
        layers = {n for layer in range(cfg.num_hidden_layers) for role, (n, _) in linear_specs(cfg, layer).items()
                  if role != "router"}
        assert set(info.tensors) == layers | {"lm_head.weight"}  # attention q8; experts (down Q4_0) and routers float
    tensors, _ = model_tensors("qwen3moe", types=Q8_ONLY, truth=False)
    with GGUFCheckpoint(write_gguf(tmp_path / "all.gguf", "qwen3moe", model_metadata("qwen3moe"), tensors)) as ckpt:
        experts = {n for n in q8_info(ckpt, ckpt.model_config()).tensors if ".experts." in n}
        assert len(experts) == 3 * DIMS["experts"] * DIMS["layers"]
    stack = tensors["blk.1.ffn_down_exps.weight"][0]  # one layer's down experts in Q4_0: no expert is q8
    tensors["blk.1.ffn_down_exps.weight"] = (encode(
        truth_dequantize(stack.view(np.uint8), T.Q8_0, (DIMS["experts"], DIMS["hidden"], DIMS["expert_ff"])), T.Q4_0,
        np.random.default_rng(0)), T.Q4_0)
    with GGUFCheckpoint(write_gguf(tmp_path / "one.gguf", "qwen3moe", model_metadata("qwen3moe"), tensors)) as ckpt:
        info = q8_info(ckpt, ckpt.model_config())
        assert not any(".experts." in n for n in info.tensors) and len(info.tensors) == 4 * DIMS["layers"] + 1


# --- the command line and kestrel.toml -----------------------------------------------------------------
def test_generate_model_gguf_on_the_command_line_and_in_kestrel_toml(tmp_path, capsys, monkeypatch):
    path, _ = write_model(tmp_path / "m.gguf")
    want = greedy(path, n=4, keep=1)
    argv = ["--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "4", "--ignore-eos", "--keep", "1", "--json"]
    assert main(["generate", "--model", str(path), *argv]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == want and out["model"] == str(path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kestrel.toml").write_text('model = "m.gguf"\n[backend]\nname = "cpu_ref"\n')
    assert main(["generate", "--config", "kestrel.toml", *argv]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == want


def test_chat_lays_the_conversation_out_with_the_ggufs_template(tmp_path, capsys, monkeypatch):
    path, _ = write_model(tmp_path / "m.gguf")
    monkeypatch.setattr("sys.stdin", io.StringIO("the a\nthe\n"))
    assert main(["chat", "--model", str(path), "--backend", "cpu_ref", "--max-new-tokens", "3", "--json"]) == 0
    replies = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    with load(path) as model:
        first = model.chat_template().render([{"role": "user", "content": "the a"}])
        assert first == "<|im_start|>user\nthe a<|im_end|>\n<|im_start|>assistant\n"
        assert replies[0]["prompt_tokens"] == len(model.tokenizer.encode(first))
        second = model.chat_template().render([{"role": "user", "content": "the a"},
                                               {"role": "assistant", "content": replies[0]["reply"]},
                                               {"role": "user", "content": "the"}])
        assert replies[1]["prompt_tokens"] == len(model.tokenizer.encode(second))


def test_a_gguf_without_a_template_cannot_chat_and_says_so(tmp_path, capsys, monkeypatch):
    path, _ = write_model(tmp_path / "m.gguf", meta={"tokenizer.chat_template": None})
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    fails(["chat", "--model", str(path), "--backend", "cpu_ref"], capsys, "no tokenizer.chat_template in its metadata",
          "kestrel generate --prompt TEXT")


def test_a_tokenizer_kestrel_cannot_build_leaves_the_model_running_on_ids(tmp_path, capsys):
    path, _ = write_model(tmp_path / "m.gguf", meta={"tokenizer.ggml.model": "llama"})
    with pytest.warns(KestrelNote, match="tokenizer.ggml.model is 'llama'.*runs on token ids alone"):
        model = load(path)
    with model:
        assert model.tokenizer is None
        with model.open(backend="cpu_ref") as run:
            assert len(run.generate(prompt_ids=PROMPT, max_new_tokens=3, stop_at_eos=False).token_ids) == 3
            with pytest.raises(ConfigError, match="--prompt needs a tokenizer"):
                run.generate(prompt="hello")


# --- bad paths: one line through load() and the command line ---------------------------------------------
def _bad_path(tmp_path, kind):
    p = tmp_path / "bad.gguf"
    if kind == "directory":
        p.mkdir()
        (p / "config.json").write_text("{}")
    elif kind == "missing":
        pass
    elif kind == "truncated":
        write_model(p)
        os.truncate(p, p.stat().st_size // 2)
    elif kind == "wrong magic":
        p.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 64)
    elif kind == "empty":
        p.write_bytes(b"")
    return p


BAD_PATHS = {
    "directory": "is a directory, and a GGUF model is one file; pass the .gguf file itself",
    "missing": r"cannot open \(No such file or directory\); pass the path of a .gguf file",
    "truncated": "ends at byte .* the file is truncated: re-download or re-create it",
    "wrong magic": r"not a GGUF file \(it starts with b'\\x89HDF', not b'GGUF'\); pass a .gguf file",
    "empty": r"truncated \(0 bytes, no GGUF header\); re-download or re-create it",
}


@pytest.mark.parametrize("kind", BAD_PATHS)
def test_a_bad_gguf_path_is_one_line_naming_it_and_the_fix(kind, tmp_path, capsys):
    path = _bad_path(tmp_path, kind)
    with pytest.raises(CheckpointError) as err:
        load(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(str(path)) and re.search(BAD_PATHS[kind], message), message
    out = fails(["generate", "--model", str(path), "--prompt-ids", "1"], capsys, str(path))
    assert re.search(BAD_PATHS[kind], out), out


# --- kestrel quantize --from -------------------------------------------------------------------------
def test_quantize_from_a_q8_0_gguf_copies_its_bytes_and_gives_its_ids(tmp_path, capsys):
    path, _ = write_model(tmp_path / "m.gguf", types=Q8_ONLY, tied=True)
    out = tmp_path / "q8"
    assert main(["quantize", "--from", str(path), "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["copied"] == summary["quantized"] == 7 * DIMS["layers"] + 1 and summary["untied"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                      "tokenizer.json", "tokenizer_config.json"]
    with GGUFCheckpoint(path) as g:
        written = Checkpoint(out)
        try:
            for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
                qweight, scales = g.q8(name)
                qname, sname = quant.q8_names(name)
                assert torch.equal(written.view(qname), qweight) and torch.equal(written.view(sname), scales)
            qweight, scales = g.q8("model.embed_tokens.weight")  # the tied lm_head: the Q8_0 embedding's own bytes
            assert torch.equal(written.view("lm_head.qweight"), qweight)
        finally:
            written.close()
    assert greedy(out, keep=1) == greedy(path, keep=1)
    with load(out) as q, load(path) as g:  # what the metadata held besides the weights, as files
        assert q.eos_ids == g.eos_ids and q.chat_template().source == g.chat_template().source
        assert q.tokenizer.encode("<|im_start|> the a") == g.tokenizer.encode("<|im_start|> the a")
    fails(["quantize", "--from", str(path), "--out", str(out)], capsys, "is not empty", "--force")


def test_quantize_from_a_gguf_quantizes_the_other_types_from_their_floats(tmp_path, capsys):
    path, _ = write_model(tmp_path / "m.gguf", dims=K_DIMS, types={**K_TYPES, "ffn_gate": T.Q8_0})  # among k-quants
    out = tmp_path / "q8"
    assert main(["quantize", "--from", str(path), "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["copied"] == DIMS["layers"]  # each layer's gate_proj
    out64 = tmp_path / "q8-64"
    assert main(["quantize", "--from", str(path), "--out", str(out64), "--group-size", "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["copied"] == 0  # Q8_0's group is 32: at 64 it is quantized afresh
    with GGUFCheckpoint(path) as g:
        written = Checkpoint(out)
        try:
            name = "model.layers.0.self_attn.q_proj.weight"  # Q4_K, permuted in the file
            qweight, scales = quant.quantize(g.view(name), 32)
            assert torch.equal(written.view("model.layers.0.self_attn.q_proj.qweight"), qweight)
            assert torch.equal(written.view("model.layers.0.self_attn.q_proj.scales"), scales)
            assert written.info("model.embed_tokens.weight").dtype == "F32"  # a Q6_K embedding, dequantized
        finally:
            written.close()


def test_quantize_from_refuses_what_is_not_a_gguf(tmp_path, capsys, tiny_ckpt):
    fails(["quantize", "--from", str(tiny_ckpt), "--out", str(tmp_path / "o")], capsys, "not a GGUF file",
          "quantize a Hugging Face directory with --model")
    fails(["quantize", "--from", str(tmp_path / "x.gguf"), "--model", str(tiny_ckpt), "--out", str(tmp_path / "o")],
          capsys, "not allowed with argument")
    assert not (tmp_path / "o").exists()


# --- cpu_ref's RSS follows the window on a quantized GGUF ------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_cpu_ref_mapping_rss_follows_the_window_on_a_quantized_gguf(tmp_path):
    dims = {**DIMS, "hidden": 1024, "heads": 8, "kv": 4, "head_dim": 128, "ff": 4096, "layers": 4}
    types = {**LLAMA_TYPES, "attn_q": T.Q4_0, "attn_v": T.Q4_1, "attn_output": T.Q8_0, "ffn_up": T.Q4_0,
             "ffn_gate": T.Q4_1, "ffn_down": T.Q8_0}
    path, _ = write_model(tmp_path / "big.gguf", dims=dims, types=types, truth=False)
    with GGUFCheckpoint(path) as ckpt:
        cfg = ckpt.model_config()
        layer = {sum(ckpt.info(n).nbytes for n, _ in linear_specs(cfg, i).values()) for i in range(cfg.num_hidden_layers)}
        assert len(layer) == 1
        layer = layer.pop()
        streamed = {n for i in range(cfg.num_hidden_layers) for n, _ in linear_specs(cfg, i).values()}
        resident = sum(ckpt.info(n).nbytes for n in ckpt.names() if n not in streamed)
        tensors, total = len(ckpt.names()), sum(ckpt.info(n).nbytes for n in ckpt.names())
    seen = []

    class Rss:
        @hookimpl
        def on_layer_advance(self, window, layer, phase):
            seen.append((len(window.resident), model.checkpoint.mapping_rss()))

    slack = tensors * (2 * PAGE + 64 * 1024)
    assert slack < layer / 2
    with load(path) as model:
        with model.open(backend="cpu_ref", keep=1, observers=[Rss()]) as run:
            run.generate(prompt_ids=PROMPT, max_new_tokens=3, stop_at_eos=False)
        peak = max(rss for _, rss in seen)
        assert peak <= 2 * layer + resident + slack, (peak, layer, resident)
        assert max(n for n, _ in seen) == 2 and all(rss >= n * layer + resident - slack for n, rss in seen)
        seen.clear()
        with model.open(backend="cpu_ref", keep="off", observers=[Rss()]) as run:
            run.generate(prompt_ids=PROMPT, max_new_tokens=2, stop_at_eos=False)
        assert max(rss for _, rss in seen) >= 0.99 * total
