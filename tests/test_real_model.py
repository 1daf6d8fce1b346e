"""A real trained model: SmolLM2-135M-Instruct, run from its GGUF and from its Hugging Face conversion.

The GGUF reader against the converted directory (the same tensors), its config and tokenizer; then kestrel's
cpu_ref on each (``load`` of the directory, and of the .gguf itself): greedy ids equal to transformers' float32
eager ones (tests/golden, made by tests/golden/make_smollm2_golden.py), the same ids across keep, policy and
allocator, a chat that knows the capital of France, and a story that reads as words. Skips where the wheel cannot
be fetched.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kestrel_core import load

from kestrel_core.formats import quant
from kestrel_core.formats.chat_template import load_chat_template
from kestrel_core.cli import main
from kestrel_core.formats.tensor_table import all_specs, validate_checkpoint
from kestrel_core.formats.tokenizer import load_tokenizer
from tests.real_model import smollm2_ckpt, smollm2_gguf, smollm2_hf  # noqa: F401  (fixtures)

GOLDEN = json.loads((Path(__file__).parent / "golden" / "smollm2_golden.json").read_text())
PROMPTS = GOLDEN["prompts"]
TEXTS = [
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog. 1234567890",
    "naïve café, Straße, 日本語のテキスト, emoji 🙂🚀 and Ελληνικά",
    "def f(x):\n    return x ** 2  # tabs\tand   spaces\n\n",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "   leading and trailing spaces   ",
]


# --- the GGUF reader on it ----------------------------------------------------------------
def test_config_from_the_gguf(smollm2_ckpt):
    cfg = smollm2_ckpt.model_config()
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == ("llama", 30, 576, 9, 3, 64, 1536, 49152)
    assert cfg.tie_word_embeddings and "lm_head.weight" not in smollm2_ckpt
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == (100000.0, 1e-05, 8192)
    assert (cfg.bos_token_id, cfg.eos_token_id, smollm2_ckpt.eos_ids()) == (1, 2, frozenset({2}))
    validate_checkpoint(smollm2_ckpt, cfg)
    types = {smollm2_ckpt.info(n).ggml_type for n in smollm2_ckpt.names()}
    assert types == {"Q4_1", "Q8_0", "F32"}


def test_every_gguf_tensor_equals_the_converted_directorys(smollm2_ckpt, smollm2_hf):
    names = list(all_specs(smollm2_ckpt.model_config()))
    with safe_open(str(smollm2_hf / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(names)
        for name in names:
            assert torch.equal(smollm2_ckpt.view(name).float(), f.get_tensor(name)), name


def test_the_q8_0_embedding_repacks_into_kestrels_q8_exactly(smollm2_ckpt):
    name = "model.embed_tokens.weight"
    assert smollm2_ckpt.info(name).ggml_type == "Q8_0"
    qweight, scales = smollm2_ckpt.q8(name)
    assert torch.equal(quant.dequantize(qweight, scales, 49152, 32), smollm2_ckpt.view(name))


def test_tokenizer_round_trips_and_keeps_special_tokens_whole(smollm2_ckpt, smollm2_hf):
    tok = smollm2_ckpt.tokenizer()
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    for i, special in enumerate(("<|endoftext|>", "<|im_start|>", "<|im_end|>")):
        assert tok.encode(special) == [i] and tok.token_to_id(special) == i
    assert tok.encode("2024") == [tok.token_to_id(d) for d in "2024"]  # SmolLM splits digits, as llama.cpp's "smollm"
    assert tok.encode(" the") == [tok.token_to_id("Ġthe")]
    saved = load_tokenizer(smollm2_hf)  # the tokenizer.json the conversion wrote: the same ids
    for name, p in PROMPTS.items():
        assert tok.encode(p["text"]) == saved.encode(p["text"]) == p["ids"], name


def test_chat_template_from_the_gguf(smollm2_ckpt, smollm2_hf):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = smollm2_ckpt.chat_template().render(messages)
    assert text == PROMPTS["chat"]["text"] == load_chat_template(smollm2_hf).render(messages)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


# --- kestrel on its Hugging Face directory, and on the GGUF itself ----------------------------------
@pytest.fixture(scope="module", params=["hf", "gguf"])
def model(request):
    """The model loaded from its Hugging Face directory, or from the .gguf file (Q4_1 dequantized as it is read)."""
    with load(request.getfixturevalue(f"smollm2_{request.param}")) as m:
        yield m


@pytest.fixture(scope="module")
def greedy(model):
    """kestrel's greedy ids for each golden prompt: cpu_ref, float32, every layer resident."""
    n = GOLDEN["tokens"]
    with model.open(backend="cpu_ref", keep="off") as run:
        return {name: run.generate(prompt_ids=p["ids"], max_new_tokens=n, stop_at_eos=False).token_ids
                for name, p in PROMPTS.items()}


@pytest.mark.parametrize("prompt", sorted(PROMPTS))
def test_greedy_ids_equal_transformers_float32(greedy, prompt):
    assert len(greedy[prompt]) == GOLDEN["tokens"] == 64
    assert greedy[prompt] == PROMPTS[prompt]["greedy_ids"]


RUNS = {
    "keep1-asymmetric-pool": dict(keep=1, policy="asymmetric", allocator="pool"),
    "keep1-asymmetric-free": dict(keep=1, policy="asymmetric", allocator="free"),
    "keep2-pinned_set-pool": dict(keep=2, policy="pinned_set", allocator="pool"),
    "keep2-belady-free": dict(keep=2, policy="belady", allocator="free"),
    "keep2-asymmetric-pool": dict(keep=2, policy="asymmetric", allocator="pool"),
}
# A GGUF streamed at keep 1 or 2 dequantizes every Q4_1 layer it fetches (about 20 ms a layer here): on it, three runs
# that change keep, policy and allocator stand for the rest, over fewer tokens.
GGUF_RUNS = ("keep1-asymmetric-free", "keep2-pinned_set-pool", "keep2-belady-free")


def test_residency_changes_no_id(model):
    gguf = model.dir.suffix == ".gguf"
    p, n = PROMPTS["capital"], 8 if gguf else 16
    for name, settings in RUNS.items():
        if gguf and name not in GGUF_RUNS:
            continue
        with model.open(backend="cpu_ref", **settings) as run:
            got = run.generate(prompt_ids=p["ids"], max_new_tokens=n, stop_at_eos=False).token_ids
        assert got == p["greedy_ids"][:n], name


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_kestrel_chat_knows_the_capital_of_france(source, request, monkeypatch, capsys):
    path = request.getfixturevalue(f"smollm2_{source}")  # the GGUF: its own tokenizer and chat template
    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?\n"))
    rc = main(["chat", "--model", str(path), "--backend", "cpu_ref", "--max-new-tokens", "24"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "Paris" in out.out, out.out


def test_a_story_reads_as_words(greedy, model):
    text = model.tokenizer.decode(greedy["story"])
    assert "<|" not in text and "\ufffd" not in text
    words = text.split()
    wordlike = [w for w in words if re.fullmatch(r"[\"'(]?[A-Za-z]{1,15}(['-][a-z]+)?[.,;:!?\"')]*", w)]
    assert len(words) >= 30 and len(wordlike) >= 0.9 * len(words), text
