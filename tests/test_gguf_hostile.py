"""Hostile GGUF files: headers whose counts and lengths point past the file, arrays of absurd length, tensors that
overlap, metadata of the wrong type. Each is one line naming the field and the fix, refused fast and small (the
reader must not loop over a declared length or allocate for it before it finds the file too short)."""

from __future__ import annotations

import io
import re
import resource
import signal
import struct
import time
import warnings

import numpy as np
import pytest

from kestrel_core import load
from kestrel_core.formats import chat_template
from kestrel_core.formats.chat_template import TEMPLATE_LIMIT
from kestrel_core.errors import CheckpointError, ConfigError, KestrelNote
from kestrel_core.formats.gguf import GGUFCheckpoint
from kestrel_core.formats.gguf_header import MAX_ARRAY, MAX_KEYS
from kestrel_core.formats.gguf_tokenizer import MAX_ADDED, build_tokenizer
from tests.cli_helpers import fails
from tests.gguf_files import DIMS, LLAMA_TYPES, MERGES, VOCAB, T, model_metadata, model_tensors, write_gguf, write_model

ARRAY, UINT8, INT32, STRING = 9, 0, 5, 8
MOE_TYPES = {**LLAMA_TYPES, "ffn_gate": T.Q4_0, "ffn_up": T.Q8_0, "ffn_down": T.BF16}


def string(b: bytes) -> bytes:
    """A GGUF string: its u64 length, then its bytes."""
    return struct.pack("<Q", len(b)) + b


def _key_end(data: bytes, key: str) -> int:
    """The offset just after metadata key ``key`` (its u64 length and bytes) in ``data``."""
    k = string(key.encode())
    return data.index(k) + len(k)


def _tensor_info(data: bytes, name: str) -> int:
    """The offset of tensor ``name``'s n_dims in the header (after its name)."""
    return _key_end(data, name)


def _patched(tmp_path, edit) -> str:
    """A small valid model GGUF with ``edit(bytearray)`` applied to its bytes."""
    path, _ = write_model(tmp_path / "m.gguf")
    data = bytearray(path.read_bytes())
    edit(data)
    path.write_bytes(bytes(data))
    return path


def _put(at: int, fmt: str, *values):
    def edit(data: bytearray):
        packed = struct.pack(fmt, *values)
        data[at : at + len(packed)] = packed
    return edit


def _array(key: str, itype: int, length: int):
    """Re-declare metadata array ``key`` as ``length`` entries of ``itype``."""
    def edit(data: bytearray):
        at = _key_end(data, key) + 4  # past the value type (ARRAY)
        data[at : at + 12] = struct.pack("<IQ", itype, length)
    return edit


def _tensor_offset(name: str, offset: int):
    def edit(data: bytearray):
        at = _tensor_info(data, name)
        n_dims = struct.unpack_from("<I", data, at)[0]
        struct.pack_into("<Q", data, at + 4 + 8 * n_dims + 4, offset)
    return edit


def _data_offset(data: bytes, name: str) -> int:
    at = _tensor_info(data, name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    return struct.unpack_from("<Q", data, at + 4 + 8 * n_dims + 4)[0]


class TookTooLong(BaseException):  # not caught as a parse error
    pass


def _opened_within(path, seconds: float = 2.0):
    """GGUFCheckpoint(path), stopped by an alarm after ``seconds`` of this process's own CPU time (a reader that
    loops over a declared length would otherwise run for hours). CPU time, not the wall clock: a loaded machine does
    not ring it."""
    def ring(*_):
        raise TookTooLong(f"opening {path} took over {seconds} s of CPU")

    old = signal.signal(signal.SIGPROF, ring)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        return GGUFCheckpoint(path)
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, old)


HOSTILE = {
    # an array of bytes declared 2**60 long: gguf's reader loops over the declared length, reading nothing past the end
    "u8 array of 2**60": (_array("tokenizer.ggml.token_type", UINT8, 2**60),
                          r"metadata tokenizer.ggml.token_type declares 1,152,921,504,606,846,976 entries"),
    "u8 array of 10**9": (_array("tokenizer.ggml.token_type", UINT8, 10**9),
                          r"metadata tokenizer.ggml.token_type declares 1,000,000,000 entries, more than the .* bytes"),
    "array of arrays": (_array("tokenizer.ggml.merges", ARRAY, 5), r"metadata tokenizer.ggml.merges is an array of arrays"),
    "string of 2**60": (lambda d: struct.pack_into("<Q", d, _key_end(d, "tokenizer.ggml.model") + 4, 2**60),
                        r"metadata tokenizer.ggml.model runs past the end of the file"),
    "tokens of 2**60": (_array("tokenizer.ggml.tokens", STRING, 2**60),
                        r"metadata tokenizer.ggml.tokens declares 1,152,921,504,606,846,976 entries"),
    "n_kv 2**63": (_put(16, "<Q", 2**63), r"the header declares 9,223,372,036,854,775,808 metadata keys"),
    "n_tensors 2**63": (_put(8, "<Q", 2**63), r"the header declares 9,223,372,036,854,775,808 tensors"),
    "version 1": (_put(4, "<I", 1), r"GGUF version 1, which kestrel does not read \(it reads versions 2 and 3"),
    "version 999": (_put(4, "<I", 999), r"GGUF version 999, which kestrel does not read"),
    "big-endian": (_put(4, ">I", 3), r"a big-endian GGUF; kestrel reads little-endian"),
    "5 dims": (lambda d: struct.pack_into("<I", d, _tensor_info(d, "blk.0.ffn_up.weight"), 5),
               r"tensor 'blk.0.ffn_up.weight' has 5 dimensions"),
    "0 dims": (lambda d: struct.pack_into("<I", d, _tensor_info(d, "blk.0.ffn_up.weight"), 0),
               r"tensor 'blk.0.ffn_up.weight' has 0 dimensions"),
    "overlapping tensors": (lambda d: _tensor_offset("blk.0.ffn_up.weight", _data_offset(d, "blk.0.ffn_gate.weight"))(d),
                            r"tensors 'blk.0.ffn_gate.weight' \(data bytes \d+-\d+\) and 'blk.0.ffn_up.weight' "
                            r"\(data bytes \d+-\d+\) overlap"),
    "unaligned tensor": (lambda d: _tensor_offset("blk.0.ffn_up.weight", _data_offset(d, "blk.0.ffn_up.weight") + 4)(d),
                         r"tensor 'blk.0.ffn_up.weight' starts at data byte \d+, not a multiple of the file's alignment 32"),
}


@pytest.mark.parametrize("kind", HOSTILE)
def test_a_hostile_header_is_refused_fast_and_small_in_one_line(kind, tmp_path):
    edit, want = HOSTILE[kind]
    path = _patched(tmp_path, edit)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.process_time()
    with pytest.raises(CheckpointError) as err:
        _opened_within(path)
    took = time.process_time() - t0
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB
    message = str(err.value)
    assert "\n" not in message and message.startswith(str(path)), message
    assert re.search(want, message), message
    assert took < 1.0 and grew < 64 * 1024, (took, grew)


# --- the vocabulary's metadata of the wrong type or shape ---------------------------------------------------------
BAD_VOCAB = {
    "pre an array": ({"tokenizer.ggml.pre": ["qwen2"]}, r"tokenizer.ggml.pre is an array, not a string"),
    "tokens a string": ({"tokenizer.ggml.tokens": "abc"}, r"tokenizer.ggml.tokens is a string, not an array of strings"),
    "tokens ints": ({"tokenizer.ggml.tokens": list(range(VOCAB))}, r"tokenizer.ggml.tokens holds 0, not a string"),
    "merges a string": ({"tokenizer.ggml.merges": "a b"}, r"tokenizer.ggml.merges is a string, not an array of strings"),
    "merges ints": ({"tokenizer.ggml.merges": [1, 2, 3]}, r"tokenizer.ggml.merges holds 1, not a string"),
    "merge of 3 parts": ({"tokenizer.ggml.merges": ["Ġ t x", *MERGES[1:]]},
                         r"tokenizer.ggml.merges holds 'Ġ t x', not two tokens separated by a space"),
    "token_type a scalar": ({"tokenizer.ggml.token_type": 1}, r"tokenizer.ggml.token_type is an int, not an array of ints"),
    "token_type strings": ({"tokenizer.ggml.token_type": ["x"] * VOCAB}, r"tokenizer.ggml.token_type holds 'x', not an int"),
    "token_type 999": ({"tokenizer.ggml.token_type": [999] * VOCAB},
                       r"tokenizer.ggml.token_type holds 999, not one of llama.cpp's token types \(0 to 6\)"),
}


@pytest.mark.parametrize("kind", BAD_VOCAB)
def test_a_vocabulary_of_the_wrong_type_is_one_line_naming_the_key(kind, tmp_path):
    meta, want = BAD_VOCAB[kind]
    path, _ = write_model(tmp_path / "m.gguf", meta=meta)
    with GGUFCheckpoint(path) as ckpt, pytest.raises(CheckpointError) as err:
        ckpt.tokenizer()
    message = str(err.value)
    assert "\n" not in message and message.startswith(str(path)), message
    assert re.search(want, message) and "re-convert" in message, message
    with pytest.warns(KestrelNote, match=re.escape(want[:20].replace("\\", ""))):  # load() runs it on ids, and says why
        load(path).close()


# --- metadata kestrel acts on, out of range or contradictory ---------------------------------------------------------
BAD_META = {
    "eos out of the vocabulary": ({"tokenizer.ggml.eos_token_id": 10**6},
                                  r"metadata tokenizer.ggml.eos_token_id=1000000 is not a token id of the 265-token vocabulary"),
    "eot out of the vocabulary": ({"tokenizer.ggml.eot_token_id": VOCAB},
                                  r"metadata tokenizer.ggml.eot_token_id=265 is not a token id of the 265-token vocabulary"),
    "bos out of the vocabulary": ({"tokenizer.ggml.bos_token_id": 10**6},
                                  r"metadata tokenizer.ggml.bos_token_id=1000000 is not a token id"),
    "rope scaling factor without a type": ({"llama.rope.scaling.factor": 8.0},
                                           r"metadata llama.rope.scaling.factor is 8 .*linear rope scaling.*does not compute"),
    "rope scaling factor a string": ({"llama.rope.scaling.factor": "8"},
                                     r"metadata llama.rope.scaling.factor is '8', not a float"),
    "legacy linear rope scale": ({"llama.rope.scale_linear": 4.0}, r"metadata llama.rope.scale_linear is 4 "),
}


@pytest.mark.parametrize("kind", BAD_META)
def test_metadata_kestrel_would_misread_is_one_line_naming_the_key(kind, tmp_path):
    meta, want = BAD_META[kind]
    path, _ = write_model(tmp_path / "m.gguf", meta=meta)
    with pytest.raises(CheckpointError) as err:
        GGUFCheckpoint(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(str(path)), message
    assert re.search(want, message), message


def test_a_rope_scaling_factor_of_one_changes_nothing_and_opens(tmp_path):
    path, _ = write_model(tmp_path / "m.gguf", meta={"llama.rope.scaling.factor": 1.0})
    with GGUFCheckpoint(path) as ckpt:
        assert ckpt.model_config().rope_scaling is None


# --- the chat template: a string, of a template's size ---------------------------------------------------------------
def test_a_chat_template_of_the_wrong_type_says_so_not_that_there_is_none(tmp_path):
    path, _ = write_model(tmp_path / "m.gguf", meta={"tokenizer.chat_template": 5})
    with load(path) as model, pytest.raises(ConfigError) as err:
        model.chat_template()
    message = str(err.value)
    assert "\n" not in message and "tokenizer.chat_template is an int, not a string" in message, message


def test_a_huge_chat_template_is_refused_before_it_is_compiled(tmp_path, capsys, monkeypatch):
    path, _ = write_model(tmp_path / "m.gguf", meta={"tokenizer.chat_template": "x" * (TEMPLATE_LIMIT + 1)})
    compiled = []
    monkeypatch.setattr(chat_template, "_environment", lambda: compiled.append(1) or pytest.fail("compiled"))
    with load(path) as model:
        with pytest.raises(ConfigError) as err:
            model.chat_template()
    assert not compiled  # refused from its length, before Jinja saw it
    message = str(err.value)
    assert "\n" not in message and re.search(r"tokenizer.chat_template is 4.0 MiB, over the 4 MiB limit", message), message
    out = tmp_path / "q8"  # kestrel quantize would copy it into tokenizer_config.json: refused there too, before any weight
    fails(["quantize", "--from", str(path), "--out", str(out)], capsys, "tokenizer.chat_template is 4.0 MiB")
    assert not out.exists()


def _dim(name: str, index: int, value: int):
    """Set ne[index] of tensor ``name`` in the header."""
    def edit(data: bytearray):
        struct.pack_into("<Q", data, _tensor_info(data, name) + 4 + 8 * index, value)
    return edit


@pytest.mark.parametrize("arch,name,index", [("qwen3moe", "blk.0.ffn_up_exps.weight", 2), ("llama", "blk.0.ffn_up.weight", 0)],
                         ids=["an expert stack of 0 experts", "a row of 0 values"])
def test_a_tensor_with_a_dimension_of_0_is_one_line(arch, name, index, tmp_path):
    path, _ = write_model(tmp_path / "m.gguf", arch=arch, types=MOE_TYPES)
    data = bytearray(path.read_bytes())
    _dim(name, index, 0)(data)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as err:
        GGUFCheckpoint(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(str(path)), message
    assert re.search(rf"tensor '{re.escape(name)}' has a dimension of 0 \(GGUF ne \[.*\]\)", message), message


# --- a GGUF whose tokenizer kestrel cannot build: every text path says why, not "no tokenizer.json" ---------------------
def test_text_on_a_gguf_without_a_tokenizer_says_why_there_is_none(tmp_path, capsys, monkeypatch):
    path, _ = write_model(tmp_path / "m.gguf", meta={"tokenizer.ggml.merges": ["ab", *MERGES[1:]]})
    why = "has no tokenizer kestrel can build (tokenizer.ggml.merges holds 'ab', not two tokens separated by a space"
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    out = fails(["chat", "--model", str(path), "--backend", "cpu_ref"], capsys, why, "cannot chat")
    assert "tokenizer.json" not in out, out
    out = fails(["generate", "--model", str(path), "--prompt", "the"], capsys, "--prompt needs a tokenizer", why)
    assert "tokenizer.json" not in out, out
    with pytest.warns(KestrelNote), load(path) as model, model.open(backend="cpu_ref") as run:
        with pytest.raises(ConfigError, match=re.escape(why)):
            run.generate(prompt_ids=[1, 2], max_new_tokens=1, on_text=print)


# --- arrays as long as kestrel reads: read whole, fast and small -----------------------------------------------------
def _raw_gguf(path, key: str, itype: int, n: int, items: bytes):
    """A GGUF of general.architecture llama and one array ``key`` of ``n`` entries of ``itype`` (``items``), no tensors."""
    kvs = (string(b"general.architecture") + struct.pack("<I", STRING) + string(b"llama")
           + string(key.encode()) + struct.pack("<IIQ", ARRAY, itype, n) + items)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + kvs)
    return path


@pytest.mark.parametrize("itype,item", [(UINT8, b"\x01"), (STRING, struct.pack("<Q", 1) + b"a")], ids=["bytes", "strings"])
def test_an_array_of_the_most_entries_kestrel_reads_is_read_small(itype, item, tmp_path):
    """Its memory only: the CPU alarm is a minute, so no clock decides this test."""
    n = MAX_ARRAY
    path = _raw_gguf(tmp_path / "m.gguf", "junk.array", itype, n, item * n)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CheckpointError, match="metadata has no llama.embedding_length"):  # read whole, then refused
        _opened_within(path, 60.0)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 160 * 1024  # KiB: was 0.9-1.6 GiB
    path = _raw_gguf(tmp_path / "m.gguf", "junk.array", itype, n + 1, item * (n + 1))
    with pytest.raises(CheckpointError, match=r"metadata junk.array declares 1,048,577 entries.*over the 1,048,576"):
        _opened_within(path, 60.0)


@pytest.mark.parametrize("itype,item", [(UINT8, b"\x01"), (STRING, struct.pack("<Q", 1) + b"a")], ids=["bytes", "strings"])
def test_an_array_of_the_most_entries_kestrel_reads_is_read_fast(itype, item, tmp_path):
    """Its time only, in this process's CPU seconds (a loaded machine does not move them)."""
    path = _raw_gguf(tmp_path / "m.gguf", "junk.array", itype, MAX_ARRAY, item * MAX_ARRAY)
    t0 = time.process_time()
    with pytest.raises(CheckpointError, match="metadata has no llama.embedding_length"):
        _opened_within(path)
    assert time.process_time() - t0 < 1.5


def test_a_string_that_is_not_utf8_names_its_key(tmp_path):
    path = _raw_gguf(tmp_path / "m.gguf", "tokenizer.ggml.tokens", STRING, 2, struct.pack("<Q", 1) + b"a" +
                     struct.pack("<Q", 2) + b"\xff\xfe")
    with pytest.raises(CheckpointError, match=r"metadata tokenizer.ggml.tokens holds a string that is not UTF-8"):
        GGUFCheckpoint(path)


def test_an_architecture_that_is_not_a_string_is_one_line(tmp_path):
    def as_array(data: bytearray):  # general.architecture = "llama" (type, length, 5 bytes) -> an array of one byte
        at = _key_end(data, "general.architecture")
        data[at : at + 17] = struct.pack("<IIQ", ARRAY, UINT8, 1) + b"l"
    path = _patched(tmp_path, as_array)
    with pytest.raises(CheckpointError, match=r"general.architecture is \[108\], not a string; the file is not a model GGUF"):
        GGUFCheckpoint(path)


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_rope_freqs_that_are_not_finite_positive_factors_are_refused_quietly(value, tmp_path, recwarn):
    tensors, _ = model_tensors("llama")
    tensors["rope_freqs.weight"] = (np.full(DIMS["head_dim"] // 2, value, np.float32), T.F32)
    path = write_gguf(tmp_path / "m.gguf", "llama", model_metadata("llama"), tensors)
    with pytest.raises(CheckpointError, match=r"tensor 'rope_freqs.weight' holds .*, not the finite positive factors"):
        GGUFCheckpoint(path)
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in recwarn]


def test_a_file_kestrel_may_not_read_is_one_line(tmp_path, monkeypatch, capsys):
    path, _ = write_model(tmp_path / "m.gguf")
    real_open = open

    def denied(file, *args, **kwargs):  # what open() does on a file without read permission (the tests run as root)
        if str(file) == str(path):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("kestrel_core.formats.gguf.open", denied, raising=False)
    with pytest.raises(CheckpointError, match=r"m.gguf: cannot open \(Permission denied\)"):
        GGUFCheckpoint(path)
    fails(["generate", "--model", str(path), "--prompt-ids", "1"], capsys, "cannot open (Permission denied)")


@pytest.mark.parametrize("shape", [(VOCAB * DIMS["hidden"],), (1, VOCAB, DIMS["hidden"])], ids=["1-D", "3-D"])
def test_an_embedding_that_is_not_2d_says_so(shape, tmp_path):
    tensors, _ = model_tensors("llama")
    tensors["token_embd.weight"] = (np.ones(shape, np.float32), T.F32)
    path = write_gguf(tmp_path / "m.gguf", "llama", model_metadata("llama"), tensors)
    with pytest.raises(CheckpointError) as err:
        GGUFCheckpoint(path)
    assert re.search(rf"tensor 'token_embd.weight' has shape \[{', '.join(map(str, shape))}\]; an embedding is 2-D "
                     r"\[vocab, hidden\]", str(err.value)), str(err.value)


def _many_tensors(path, names: list[str]):
    """A GGUF of general.architecture llama and one F32 [8] tensor (32 bytes, one alignment) of each name."""
    infos = b"".join(string(n.encode()) + struct.pack("<IQIQ", 1, 8, 0, 32 * i) for i, n in enumerate(names))
    head = (b"GGUF" + struct.pack("<IQQ", 3, len(names), 1) + string(b"general.architecture") + struct.pack("<I", STRING)
            + string(b"llama") + infos)
    path.write_bytes(head + b"\0" * (-len(head) % 32) + b"\0" * (32 * len(names)))
    return path


def test_a_long_tensor_list_is_read_small(tmp_path):
    path = _many_tensors(tmp_path / "m.gguf", [f"t{i}" for i in range(2**16)])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CheckpointError, match="metadata has no llama.embedding_length"):  # listed whole, then refused
        _opened_within(path, 60.0)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 160 * 1024  # KiB: was 340 MiB


def test_a_long_tensor_list_is_read_fast(tmp_path):
    path = _many_tensors(tmp_path / "m.gguf", [f"t{i}" for i in range(2**16)])
    t0 = time.process_time()
    with pytest.raises(CheckpointError, match="metadata has no llama.embedding_length"):
        _opened_within(path)
    assert time.process_time() - t0 < 1.5  # CPU seconds; was 5.4 s


def test_a_tensor_listed_twice_is_one_line(tmp_path):
    path = _many_tensors(tmp_path / "m.gguf", ["a", "b", "a"])
    with pytest.raises(CheckpointError, match=r"m.gguf: tensor 'a' is listed twice; the file is truncated or corrupt"):
        GGUFCheckpoint(path)


def test_more_metadata_keys_than_kestrel_reads_are_refused_before_they_are_read(tmp_path):
    n = MAX_KEYS + 1
    kvs = string(b"general.architecture") + struct.pack("<I", STRING) + string(b"llama")
    kvs += b"".join(string(f"k{i}".encode()) + struct.pack("<IB", UINT8, 1) for i in range(n - 1))
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, n) + kvs)
    t0 = time.process_time()
    with pytest.raises(CheckpointError, match=rf"the header declares {n:,} metadata keys.*over the {MAX_KEYS:,} kestrel reads"):
        _opened_within(path)
    assert time.process_time() - t0 < 0.5


def test_a_directory_of_gguf_files_names_them(tmp_path, capsys):
    d = tmp_path / "repo"  # a GGUF repository as downloaded: .gguf files, no config.json
    d.mkdir()
    write_model(d / "m-Q8_0.gguf")
    (d / "m-Q4_K_M.gguf").write_bytes(b"")
    fails(["generate", "--model", str(d), "--prompt-ids", "1"], capsys, "config.json: missing",
          "it holds m-Q4_K_M.gguf, m-Q8_0.gguf: pass a .gguf file itself", f"--model {d / 'm-Q4_K_M.gguf'}")


def test_a_key_name_with_a_newline_stays_one_line(tmp_path):
    path = tmp_path / "m.gguf"  # key "evil\nkey": an array of 2**40 bytes that the file cannot hold
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + string(b"evil\nkey") + struct.pack("<IIQ", ARRAY, UINT8, 2**40))
    with pytest.raises(CheckpointError) as err:
        GGUFCheckpoint(path)
    message = str(err.value)
    assert "\n" not in message and r"metadata 'evil\nkey' declares 1,099,511,627,776 entries" in message, message


def test_a_string_value_that_is_not_utf8_names_its_key(tmp_path):
    def bad_model(data: bytearray):  # tokenizer.ggml.model = "gpt2" -> b"gp\xff2"
        at = _key_end(data, "tokenizer.ggml.model") + 4 + 8
        data[at : at + 4] = b"gp\xff2"
    path = _patched(tmp_path, bad_model)
    with pytest.raises(CheckpointError, match=r"metadata tokenizer.ggml.model is not UTF-8 text"):
        GGUFCheckpoint(path)


def test_more_special_tokens_than_kestrel_builds_are_refused_before_they_are_built():
    n = MAX_ADDED + 1
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": [f"<t{i}>" for i in range(n)],
            "tokenizer.ggml.merges": [], "tokenizer.ggml.token_type": [3] * n}
    t0 = time.process_time()
    with pytest.raises(CheckpointError, match=rf"x.gguf: tokenizer.ggml.token_type marks {n:,} tokens control or "
                                              rf"user-defined, over the {MAX_ADDED:,} kestrel builds"):
        build_tokenizer(meta, "x.gguf")
    assert time.process_time() - t0 < 0.5  # 2**20 of them took 6 s and 1 GiB in tokenizers


def test_a_vocabulary_without_its_pre_tokenizer_says_which_one_kestrel_uses(tmp_path):
    path, _ = write_model(tmp_path / "m.gguf", meta={"tokenizer.ggml.pre": None})
    with pytest.warns(KestrelNote, match=r"m.gguf: no tokenizer.ggml.pre in its metadata: text is split as GPT-2 splits it"):
        model = load(path)
    with model:
        assert model.tokenizer is not None
    with GGUFCheckpoint(path) as ckpt, warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always")
        ckpt.tokenizer(), ckpt.hf_tokenizer()  # what load() and kestrel quantize ask for: the note once
    assert len([n for n in notes if issubclass(n.category, KestrelNote)]) == 1, [str(n.message) for n in notes]


@pytest.mark.parametrize("part", [0, 1])
def test_one_part_of_a_split_gguf_says_how_to_merge_it(part, tmp_path):
    extra = {"split.no": part, "split.count": 3, "split.tensors.count": 30}
    if part:  # llama-gguf-split writes the model's metadata into the first part only
        extra |= {"general.architecture": None}
    path, _ = write_model(tmp_path / f"m-0000{part + 1}-of-00003.gguf", meta=extra)
    if part:
        data = bytearray(path.read_bytes())
        at = _key_end(data, "general.architecture")
        data[at - len("general.architecture")] = ord("x")  # the writer's own architecture key, renamed away
        path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as err:
        GGUFCheckpoint(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(str(path)), message
    assert f"part {part + 1} of 3 of a split GGUF" in message and "llama-gguf-split --merge" in message, message


def test_a_lora_adapter_gguf_says_it_is_not_a_model(tmp_path):
    path, _ = write_model(tmp_path / "lora.gguf", meta={"general.type": "adapter", "adapter.type": "lora"},
                          drop=("blk.1.ffn_down.weight",))
    with pytest.raises(CheckpointError, match=r"lora.gguf: a lora adapter \(general.type 'adapter'\), not a model; "
                                              "pass the base model's .gguf"):
        GGUFCheckpoint(path)


def test_a_padding_id_outside_the_vocabulary_is_a_note_not_silence(tmp_path):
    path, _ = write_model(tmp_path / "m.gguf", meta={"tokenizer.ggml.padding_token_id": VOCAB})
    with pytest.warns(KestrelNote, match=r"m.gguf: tokenizer.ggml.padding_token_id=265 is outside the 265-token "
                                         r"vocabulary; the chat template gets no pad_token"):
        ckpt = GGUFCheckpoint(path)  # llama.cpp warns and runs on too: pad, unk, sep, cls and mask are not acted on
    with ckpt:
        assert "pad_token" not in ckpt.special_tokens()


@pytest.mark.parametrize("gone", ["_build_fields", "_build_tensor_info"])
def test_a_gguf_release_without_the_internals_kestrel_checks_through_says_which(tmp_path, monkeypatch, gone):
    """kestrel's header checks ride on gguf.GGUFReader's internals; a release without them is one line, not a bypass."""
    import gguf

    path, _ = write_model(tmp_path / "m.gguf")
    GGUFCheckpoint(path).close()
    monkeypatch.delattr(gguf.GGUFReader, gone)
    with pytest.raises(CheckpointError, match=rf"other internals than the ones kestrel checks \({gone} is gone\); "
                                              r"install the gguf kestrel is tested with: pip install 'gguf==0.19.0'$"):
        GGUFCheckpoint(path)
