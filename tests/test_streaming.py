"""Text as it is generated: TextStream's pieces, the on_token / on_text callbacks, and `kestrel generate`'s output."""

from __future__ import annotations

import json
import random
import shutil

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models

from kestrel_core.cli import main
from kestrel_core.engine.step_graphs import StepGraphs
from kestrel_core.engine.run import Model
from kestrel_core.errors import ConfigError
from kestrel_core.tools.presets import byte_level_tokenizer, preset_config
from kestrel_core.formats.tokenizer import TextStream, Tokenizer

from conftest import PROMPT, run_config

MODES = [pytest.param(True, id="DecodeStream"), pytest.param(False, id="windowed-fallback")]
TEXT = "héllo wörld: 3 € for a 😀, ok"


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory) -> Tokenizer:
    """The presets' tokenizer: ids 0..255 are bytes, 256 is <|endoftext|>."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(json.dumps(byte_level_tokenizer(preset_config("tiny"))))
    return Tokenizer(path)


@pytest.fixture(scope="module")
def byte_fallback(tmp_path_factory) -> Tokenizer:
    """A SentencePiece-style tokenizer (Llama's decoders): ▁ for a space, <0xNN> byte pieces, the first space stripped."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for word in ("▁Hello", "▁wor", "ld", "▁costs", "!"):
        vocab[word] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return Tokenizer(path)


def streamed(tok: Tokenizer, ids: list[int], native: bool) -> tuple[list[str], str]:
    stream = TextStream(tok, native)
    pieces = [stream.push(i) for i in ids]
    return pieces, stream.finish()


@pytest.mark.parametrize("native", MODES)
def test_utf8_split_across_byte_tokens_never_shows_a_replacement_character(byte_level, native):
    ids = list(TEXT.encode())
    pieces, rest = streamed(byte_level, ids, native)
    assert "".join(pieces) + rest == TEXT == byte_level.decode(ids)
    assert not any("\ufffd" in p for p in pieces)
    assert pieces.count("") == len(ids) - len(TEXT)  # one held-back step per continuation byte
    assert pieces[ids.index(0xE2) + 2] == "€" and rest == ""


@pytest.mark.parametrize("native", MODES)
def test_random_bytes_stream_to_exactly_the_whole_decode(byte_level, native):
    rng = random.Random(18)
    for _ in range(200):
        ids = [rng.choice([rng.randrange(257), rng.randrange(0x80, 0x100)]) for _ in range(rng.randrange(1, 25))]
        pieces, rest = streamed(byte_level, ids, native)
        assert "".join(pieces) + rest == byte_level.decode(ids), ids


@pytest.mark.parametrize("native", MODES)
def test_an_incomplete_character_at_the_end_comes_with_finish(byte_level, native):
    ids = list("ok €".encode())[:-1]  # the euro sign's last byte never comes
    pieces, rest = streamed(byte_level, ids, native)
    assert "".join(pieces) == "ok " and rest == byte_level.decode(ids)[3:] and rest.startswith("\ufffd")


@pytest.mark.parametrize("native", MODES)
def test_byte_fallback_pieces_and_a_stripped_first_space(byte_fallback, native):
    v = byte_fallback._tok.get_vocab()
    euro = [v[f"<0x{b:02X}>"] for b in "€".encode()]
    ids = [v["▁Hello"], v["▁wor"], v["ld"], v["▁costs"], v["<0x20>"], *euro, v["!"]]
    pieces, rest = streamed(byte_fallback, ids, native)
    assert byte_fallback.decode(ids) == "Hello world costs €!"
    assert pieces == ["Hello", " wor", "ld", " costs", " ", "", "", "€", "!"] and rest == ""
    bad = [v["▁Hello"], v["<0xFF>"], v["ld"]]  # an invalid byte mid-stream stays the decoder's own replacement
    pieces, rest = streamed(byte_fallback, bad, native)
    assert "".join(pieces) + rest == byte_fallback.decode(bad)


# --- the callbacks, through the token loop ------------------------------------------------

def hear(model_dir, temperature=0.0, stop_ids=(), count_steps=None, **flags):
    """Generate with both callbacks; returns (result, ids heard, text pieces, the event order)."""
    cfg = run_config(**flags, generation__temperature=temperature)
    events: list[tuple[str, object]] = []
    with Model(model_dir) as model, model.open(cfg) as run:
        result = run.generate(prompt_ids=PROMPT, stop_ids=stop_ids, on_token=lambda t: events.append(("id", t)),
                              on_text=lambda s: events.append(("text", s)))
    return result, [t for k, t in events if k == "id"], [s for k, s in events if k == "text"], events


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_callbacks_hear_exactly_the_result(tiny_ckpt, byte_level, temperature):
    result, ids, pieces, events = hear(tiny_ckpt, temperature, generation__max_new_tokens=12, generation__seed=3)
    assert ids == result.token_ids and len(ids) == 12
    assert "".join(pieces) == result.text == byte_level.decode(ids)
    last_id = max(i for i, (kind, _) in enumerate(events) if kind == "id")
    assert any(kind == "text" for kind, _ in events[:last_id])  # text came while tokens were still coming


@pytest.fixture
def counted_steps(monkeypatch):
    """How many decode steps ran, kept or dropped."""
    calls = []
    real = StepGraphs.__call__

    def counting(self, step, shape=None):
        calls.append(1)
        return real(self, step, shape)

    monkeypatch.setattr(StepGraphs, "__call__", counting)
    return calls


def first_new(ids: list[int], start: int) -> int:
    """The first index from ``start`` whose id did not come before: as an end-of-sequence id, the run stops there."""
    return next(i for i in range(start, len(ids)) if ids[i] not in ids[:i])


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_the_step_past_an_end_of_sequence_is_never_heard(tiny_ckpt, tmp_path, byte_level, counted_steps, temperature):
    free, *_ = hear(tiny_ckpt, temperature, generation__max_new_tokens=12, generation__seed=3)
    at = first_new(free.token_ids, 3)
    eos = free.token_ids[at]
    model_dir = shutil.copytree(tiny_ckpt, tmp_path / "tiny")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "eos_token_id": [eos]}))
    counted_steps.clear()
    result, ids, pieces, _ = hear(model_dir, temperature, generation__max_new_tokens=12, generation__seed=3,
                                  generation__stop_at_eos=True)
    assert result.token_ids == free.token_ids[: at + 1] and ids == result.token_ids
    # the end id ends the text without being part of it, as in the server's streams
    assert "".join(pieces) == result.text == byte_level.decode(free.token_ids[:at])
    ran, kept = len(counted_steps), len(result.decode_ms)
    assert kept == at and ran == kept + (1 if temperature == 0 else 0)  # greedy read back late: one step dropped


def test_stop_ids_end_a_generation_as_eos_does(tiny_ckpt, counted_steps):
    free, *_ = hear(tiny_ckpt, generation__max_new_tokens=12)
    at = first_new(free.token_ids, 2)
    result, ids, pieces, _ = hear(tiny_ckpt, stop_ids=[free.token_ids[at]], generation__max_new_tokens=12,
                                  generation__stop_at_eos=True)
    assert ids == result.token_ids == free.token_ids[: at + 1] and "".join(pieces) == result.text
    with Model(tiny_ckpt) as model, model.open(run_config()) as run:  # a batch's texts follow the same rule
        got = run.generate_batch([dict(prompt_ids=PROMPT, stop_ids=[free.token_ids[at]], max_new_tokens=12,
                                       stop_at_eos=True), dict(prompt_ids=PROMPT, max_new_tokens=12)])
    assert got[0].token_ids == result.token_ids and got[0].text == result.text == model.tokenizer.decode(ids[:-1])
    assert got[1].text == model.tokenizer.decode(free.token_ids)  # ended by length: every id is text
    assert len(counted_steps) > len(result.decode_ms)  # a step past the stop ran and was dropped, unheard
    ignored, *_ = hear(tiny_ckpt, stop_ids=[free.token_ids[at]], generation__max_new_tokens=12)
    assert ignored.token_ids == free.token_ids  # stop_at_eos off (--ignore-eos): stop ids are ignored too


def test_on_text_needs_a_tokenizer(tiny_copy):
    (tiny_copy / "tokenizer.json").unlink()
    with Model(tiny_copy) as model, model.open(run_config()) as run:
        heard = []
        result = run.generate(prompt_ids=PROMPT, on_token=heard.append)
        assert heard == result.token_ids and result.text is None
        with pytest.raises(ConfigError, match="on_text needs a tokenizer"):
            run.generate(prompt_ids=PROMPT, on_text=print)


# --- kestrel generate ---------------------------------------------------------------------

def test_generate_prints_the_text_as_it_streams_then_the_report(tiny_ckpt, capsys):
    argv = ["generate", "--model", str(tiny_ckpt), "--prompt", "hello", "--max-new-tokens", "9", "--ignore-eos"]
    assert main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    out = capsys.readouterr().out
    text, _, report = out.rpartition("token ids: ")
    assert text == data["text"] + "\n"
    assert report.startswith(" ".join(map(str, data["token_ids"])) + "\n")
    assert "ms/token" in report and "text: " not in out


def test_generate_without_a_tokenizer_streams_the_ids(tiny_copy, capsys):
    (tiny_copy / "tokenizer.json").unlink()
    argv = ["generate", "--model", str(tiny_copy), "--prompt-ids", "1,2,3", "--max-new-tokens", "5", "--ignore-eos"]
    assert main(argv + ["--json"]) == 0
    ids = json.loads(capsys.readouterr().out)["token_ids"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "token ids: " + " ".join(map(str, ids))
    assert sum(line.startswith("token ids:") for line in lines) == 1 and lines[1].startswith("setting: ")
