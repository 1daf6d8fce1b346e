"""Hostile files: a trace, config.json, kestrel.toml or a safetensors header that is huge, endless, nested without
end, non-finite or wrong in a field is a one-line error found quickly, and --json never prints NaN."""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import struct

import pytest

from kestrel_core.formats import modelconfig

from kestrel_core.io import readfile
from kestrel_core.cli import main
from kestrel_core.errors import ConfigError
from cli_helpers import WEIGHTS, fails, gen, header_of

REPLAY = ["--policy", "expert_lru", "--expert-budget-mb", "1"]


def trace_doc(**changes) -> dict:
    """A valid trace of 4 experts (top-2) in sparse layers 1 and 2, with ``changes`` applied (path: value)."""
    doc = {"format": "kestrel-expert-trace", "version": 1,
           "model": {"dir": "m", "num_experts": 4, "num_experts_per_tok": 2, "sparse_layers": [1, 2],
                     "expert_bytes": {f"{layer}.{e}": 1000 for layer in (1, 2) for e in range(4)}, "backend": "cpu_ref"},
           "events": [{"phase": "prefill", "token": 0, "layer": 1, "experts": [0, 1, 2]},
                      {"phase": "decode", "token": 1, "layer": 1, "experts": [0, 3]},
                      {"phase": "decode", "token": 1, "layer": 2, "experts": [1, 2]}]}
    for path, value in changes.items():
        *head, last = path.split("/")
        node = doc
        for key in head:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[int(last) if isinstance(node, list) else last] = value
    return doc


def write(tmp_path, doc, name="t.json") -> str:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


def test_a_valid_trace_replays(tmp_path, capsys):
    assert main(["replay", "--trace", write(tmp_path, trace_doc()), *REPLAY]) == 0
    assert "3 decision points, 1 decoded tokens" in capsys.readouterr().out


# --- every field with its type and range -------------------------------------------------------

BAD_FIELDS = [
    ({"model/expert_bytes/1.0": -1000}, "model.expert_bytes 1.0 must be a whole number in 1..1099511627776, got -1000"),
    ({"model/expert_bytes/1.0": 1.5}, "model.expert_bytes 1.0 must be a whole number"),
    ({"model/expert_bytes/1.0": True}, "model.expert_bytes 1.0 must be a whole number"),
    ({"model/expert_bytes": {"1.x": 10}}, "key \"1.x\" must be \"layer.expert\""),
    ({"model/expert_bytes": {"1.9": 10}}, "the expert must be a whole number in 0..3, got 9"),
    ({"model/expert_bytes": {}}, "model.expert_bytes must be an object"),
    ({"model/expert_bytes": {"5.0": 10}}, "5.0 is in layer 5, which is not one of model.sparse_layers"),
    ({"model/num_experts_per_tok": 0}, "model.num_experts_per_tok must be a whole number in 1..4, got 0"),
    ({"model/num_experts_per_tok": -2}, "model.num_experts_per_tok must be a whole number in 1..4"),
    ({"model/num_experts_per_tok": 5}, "model.num_experts_per_tok must be a whole number in 1..4, got 5"),
    ({"model/num_experts_per_tok": "2"}, "model.num_experts_per_tok must be a whole number"),
    ({"model/num_experts": 0}, "model.num_experts must be a whole number in 1..16384, got 0"),
    ({"model/sparse_layers": [1, 1]}, "model.sparse_layers must be a list of distinct layer numbers"),
    ({"events/1/experts": "12"}, "event 1: experts must be a list of 1..2 distinct expert numbers in 0..3, got \"12\""),
    ({"events/1/experts": [0, 0]}, "event 1: experts must be a list of 1..2 distinct expert numbers"),
    ({"events/1/experts": [0, 1, 2]}, "event 1: experts must be a list of 1..2"),  # a decode step routes top-k
    ({"events/1/experts": []}, "event 1: experts must be a list of 1..2"),
    ({"events/1/experts": [0, -1]}, "event 1: experts must be a list"),
    ({"events/1/experts": [0, 1.0]}, "event 1: experts must be a list"),
    ({"events/1/phase": "warmup"}, "event 1: phase must be one of prefill, decode, got \"warmup\""),
    ({"events/1/token": -1}, "event 1: token must be a whole number in 0.."),
    ({"events/2/token": 0}, "event 2: token must be a whole number in 1.."),  # out of order
    ({"events/1/layer": "1"}, "event 1: layer must be a whole number"),
    ({"events/1/layer": 3}, "event 1: names expert (3, 0), which model.expert_bytes has not"),
    ({"events/1": [1, 2]}, "event 1: must be an object"),
    ({"events": {}}, "events must be a list"),
    ({"model": []}, "model must be an object"),
]


@pytest.mark.parametrize("changes, needle", BAD_FIELDS, ids=[next(iter(c)) + "=" + json.dumps(next(iter(c.values())))
                                                              for c, _ in BAD_FIELDS])
def test_every_trace_field_is_checked(tmp_path, capsys, changes, needle):
    """Negative sizes gave negative byte figures; "experts": "12" was read as [1, 2]; a top-k of 0 skipped the
    budget check; an unknown phase and repeated experts were accepted."""
    fails(["replay", "--trace", write(tmp_path, trace_doc(**changes)), *REPLAY], capsys, "malformed", needle)


def test_a_missing_trace_field_is_named(tmp_path, capsys):
    doc = trace_doc()
    del doc["events"][1]["phase"]
    fails(["replay", "--trace", write(tmp_path, doc), *REPLAY], capsys, "malformed: event 1: phase is missing")


@pytest.mark.parametrize("text, needle", [
    ('{"format": "kestrel-expert-trace", "version": 1, "model": ' + "[" * 100000 + "]" * 100000 + "}",
     "not valid JSON (nested too deeply)"),
    (json.dumps(trace_doc()).replace('"token": 1', '"token": NaN', 1), "not valid JSON (NaN is not a JSON number)"),
    (json.dumps(trace_doc()).replace("1000", "Infinity", 1), "not valid JSON (Infinity is not a JSON number)"),
    (json.dumps(trace_doc()).replace("1000", "1e400", 1), "model.expert_bytes 1.0 must be a whole number"),
])
def test_a_trace_nested_without_end_or_not_finite(tmp_path, capsys, text, needle):
    """Deep nesting raised RecursionError; NaN and 1e400 (inf) went through int() into OverflowError."""
    fails(["replay", "--trace", write(tmp_path, text), *REPLAY], capsys, needle)


# --- files read whole, bounded -------------------------------------------------------------------

def read_chars() -> int:
    """The bytes this process has read through read() and its kin (/proc/self/io's rchar), page cache or not."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def test_replay_of_a_device_stops_at_once(capsys):
    """/dev/zero ran until MemoryError."""
    fails(["replay", "--trace", "/dev/zero", *REPLAY], capsys, "--trace /dev/zero: cannot read (not a regular file")


def test_replay_of_a_fifo_does_not_hang(tmp_path, capsys):
    """Opening a fifo for reading blocks until a writer comes: refused before it is opened, or the alarm (minutes, so
    only a hang sets it off, never a loaded machine) fails the test."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def hung(*_):
        raise AssertionError("replay blocked on the fifo")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(300)
    try:
        fails(["replay", "--trace", str(fifo), *REPLAY], capsys, "not a regular file")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_replay_of_a_huge_file_is_refused_before_reading_it(tmp_path, capsys):
    """A 3 GB trace reached 6.5 GB of memory."""
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(3 * 2**30)  # sparse: no disk, and reading it would take seconds and gigabytes
    before = read_chars()
    fails(["replay", "--trace", str(big), *REPLAY], capsys, "3,072.0 MiB, over the 256 MiB limit",
          "replay a trace of fewer tokens")
    assert read_chars() - before < 64 * 2**20  # refused from its size: none of its 3 GiB read


def test_a_file_that_grows_past_the_limit_while_read_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    real = os.fstat

    class Small:  # as /proc files report: size 0, whatever they hold
        def __init__(self, st):
            self.st_mode, self.st_size = st.st_mode, 0

    monkeypatch.setattr(os, "fstat", lambda fd: Small(real(fd)))
    with pytest.raises(ConfigError, match="over the 0 MiB limit \\(it grew while it was read\\); fix"):
        readfile.read_bounded(path, 50, "f", "fix")
    assert readfile.read_bounded(path, 100, "f", "fix") == b"x" * 100


@pytest.mark.parametrize("name", ["config.json", "kestrel.toml", "tokenizer.json"])
def test_other_files_read_whole_are_bounded(tiny_copy, tmp_path, capsys, monkeypatch, name):
    if name == "kestrel.toml":
        target = tmp_path / name
        target.write_text("")
        argv = gen(tiny_copy, "--config", str(target))
    else:
        target, argv = tiny_copy / name, gen(tiny_copy)
    with open(target, "r+b") as f:
        f.truncate(2**31)
    fails(argv, capsys, "MiB, over the", "MiB limit")


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_a_model_file_that_is_a_device_is_refused(tiny_copy, capsys, name):
    (tiny_copy / name).unlink()
    (tiny_copy / name).symlink_to("/dev/zero")
    fails(gen(tiny_copy), capsys, "not a regular file")


# --- config.json: the fields that size an allocation -------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("num_hidden_layers", 1_000_000_000), ("hidden_size", 2**20), ("vocab_size", 2**30), ("intermediate_size", 2**30),
    ("num_attention_heads", 2**20), ("num_key_value_heads", 2**20), ("head_dim", 2**20),
    ("max_position_embeddings", 2**62)])
def test_config_json_sizes_are_bounded(tiny_copy, capsys, field, value):
    """num_hidden_layers 1e9 ground for over 2 minutes to 5.5 GB and a MemoryError traceback."""
    cfg = json.loads((tiny_copy / "config.json").read_text())
    cfg[field] = value
    (tiny_copy / "config.json").write_text(json.dumps(cfg))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fails(gen(tiny_copy), capsys, f"field {field!r} is {value:,}, over the {modelconfig.LIMITS[field]:,} kestrel allows")
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB: refused from the config, nothing built
    assert grew < 512 * 2**10, f"the peak grew {grew / 2**10:,.0f} MiB"


@pytest.mark.parametrize("field, value, needle", [
    ("num_experts", 2**20, "field 'num_experts' is 1,048,576, over the 16,384"),
    ("moe_intermediate_size", 2**30, "field 'moe_intermediate_size' is"),
    ("decoder_sparse_step", 2**20, "field 'decoder_sparse_step' is"),
    ("num_experts_per_tok", 2**20, "field 'num_experts_per_tok' is"),
])
def test_config_json_expert_sizes_are_bounded(field, value, needle):
    raw = {"model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 160,
           "num_hidden_layers": 48, "num_attention_heads": 4, "num_experts": 128, "num_experts_per_tok": 8,
           "moe_intermediate_size": 32, field: value}
    with pytest.raises(ConfigError, match=needle):
        modelconfig.parse_model_config(raw)


def test_layers_times_experts_is_bounded():
    raw = {"model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 160,
           "num_hidden_layers": 4096, "num_attention_heads": 4, "num_experts": 16384, "num_experts_per_tok": 8,
           "moe_intermediate_size": 32}
    with pytest.raises(ConfigError, match="num_hidden_layers x num_experts = 4,096 x 16,384 expert units, over the"):
        modelconfig.parse_model_config(raw)


def test_a_config_with_more_layers_than_the_checkpoint(tiny_copy, capsys):
    cfg = json.loads((tiny_copy / "config.json").read_text())
    cfg["num_hidden_layers"] = 4096
    (tiny_copy / "config.json").write_text(json.dumps(cfg))
    fails(gen(tiny_copy), capsys, "config.json says num_hidden_layers=4,096, but the checkpoint's tensors stop at "
                                  "layer 5 (6 layers)")


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "generation_config.json"])
def test_json_nested_without_end(tiny_copy, capsys, name):
    """json.loads raised RecursionError, a traceback."""
    (tiny_copy / name).write_text('{"x": ' + "[" * 100000 + "]" * 100000 + "}")
    argv = gen(tiny_copy)
    if name == "tokenizer_config.json":
        argv = ["chat", "--model", str(tiny_copy)]
    fails(argv, capsys, "not valid JSON (nested too deeply)")


def test_kestrel_toml_nested_without_end(tiny_ckpt, tmp_path, capsys):
    path = tmp_path / "kestrel.toml"
    path.write_text("x = " + "[" * 100000 + "]" * 100000 + "\n")
    fails(gen(tiny_ckpt, "--config", str(path)), capsys, "not valid TOML")


def test_a_safetensors_header_nested_without_end(tiny_copy, capsys):
    path = tiny_copy / WEIGHTS
    raw, n, _ = header_of(path)
    text = b'{"a": ' + b"[" * 50000 + b"]" * 50000 + b"}"
    text += b" " * max(0, n - len(text))
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    fails(gen(tiny_copy), capsys, "header is not valid JSON (nested too deeply)")


def test_a_number_past_pythons_4300_digits_is_a_one_line_error(tiny_copy, tmp_path, capsys):
    """int() refuses more than 4300 digits with a ValueError that json.loads and tomllib let through: a traceback."""
    path = tmp_path / "kestrel.toml"
    path.write_text("[generation]\nseed = " + "1" * 5000 + "\n")
    fails(gen(tiny_copy, "--config", str(path)), capsys, "kestrel.toml: a number of more than 4300 digits")
    weights = tiny_copy / WEIGHTS
    raw, n, _ = header_of(weights)
    text = b'{"a": ' + b"1" * 5000 + b"}"
    weights.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    fails(gen(tiny_copy), capsys, "header holds a number of more than 4300 digits; the file is corrupt")


def test_a_config_json_number_past_pythons_4300_digits_says_so_in_kestrels_words(tiny_copy, capsys):
    """config.json (and a trace, read the same way) passed Python's own message on, which tells the user to call
    sys.set_int_max_str_digits()."""
    cfg = (tiny_copy / "config.json").read_text()
    (tiny_copy / "config.json").write_text(cfg.replace("{", '{"max_position_embeddings": ' + "1" * 5000 + ",", 1))
    err = fails(gen(tiny_copy), capsys, "config.json: not valid JSON (a number of more than 4300 digits)")
    assert "sys." not in err
    with pytest.raises(ConfigError, match=r"^t: not valid JSON \(NaN is not a JSON number\)$"):  # a hook's own refusal
        modelconfig.loads('{"a": NaN}', "t", finite=True)


def test_a_header_over_the_format_limit_is_not_called_truncated(tiny_copy, capsys):
    path = tiny_copy / WEIGHTS
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 200_000_000) + raw[8:])
    err = fails(gen(tiny_copy), capsys, "header length 200,000,000 exceeds the 100 MB limit")
    assert "truncated" not in err


# --- JSON output -------------------------------------------------------------------------------

def _strict(text: str):
    def refuse(name):
        raise AssertionError(f"{name} in JSON output")

    return json.loads(text, parse_constant=refuse)


def test_replay_of_a_trace_without_events(tmp_path, capsys):
    """hit_rate was NaN in --json and 'nan%' in text."""
    path = write(tmp_path, trace_doc(events=[]))
    assert main(["replay", "--trace", path, *REPLAY, "--json"]) == 0
    rows = _strict(capsys.readouterr().out)["rows"]
    assert [r["hit_rate"] for r in rows] == [None, None]
    assert main(["replay", "--trace", path, *REPLAY]) == 0
    out = capsys.readouterr().out
    assert "no events" in out and "nan" not in out


def test_json_never_holds_nan(tiny_ckpt, capsys):
    """ms_per_token of a one-token run was NaN, which strict parsers reject."""
    assert main(gen(tiny_ckpt, "--max-new-tokens", "1", "--json")) == 0
    doc = _strict(capsys.readouterr().out)
    assert doc["ms_per_token"] is None


def test_emit_json_turns_every_non_finite_number_to_null(capsys):
    from kestrel_core.io.jsonout import emit_json

    emit_json({"a": math.nan, "b": [math.inf, -math.inf, 1.5], "c": (1, {"d": math.nan})})
    assert _strict(capsys.readouterr().out) == {"a": None, "b": [None, None, 1.5], "c": [1, {"d": None}]}
