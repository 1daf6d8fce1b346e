"""A Hugging Face ``tokenizer.json`` as a GGUF's vocabulary: the ``tokenizer.ggml.*`` keys llama.cpp's converter
writes for a byte-level BPE tokenizer (model ``gpt2``), and the ids that begin and end a generation.

As ``convert_hf_to_gguf.py``'s ``get_vocab_base``: one token for each row of the embedding, in id order, ids that
the tokenizer lacks as ``[PAD<id>]`` of type UNUSED; added tokens CONTROL where they are special (or look it:
``<|...|>``) and USER_DEFINED otherwise; every other token NORMAL; the merges as "a b" strings.

``tokenizer.ggml.pre`` names how text is split before BPE. llama.cpp's converter recognises it from a hash of the
ids of a test text; here each split that kestrel's GGUF reader knows (``gguf_tokenizer.PRE_TOKENIZERS``) is tried
by building the reader's tokenizer from these keys and comparing its ids with the directory's on ``SAMPLE``, and
the first that agrees is written. Where none does (not byte-level BPE, another split), no vocabulary is written
and the GGUF runs on token ids, with a note.

The ids that end a generation (config.json's and generation_config.json's eos ids, as kestrel reads a directory)
go into the three keys a GGUF has for them: ``eos_token_id`` (the tokenizer_config.json's ``eos_token`` where it is
one of them), then ``eot_token_id`` and ``eom_token_id`` (kestrel's GGUF reader stops at all three).
"""

from __future__ import annotations

import json
from typing import Any

import attrs
from tokenizers import Tokenizer as HFTokenizer

from kestrel_core.errors import CheckpointError, ConfigError
from kestrel_core.formats.gguf_tokenizer import CONTROL, SPECIAL_IDS, USER_DEFINED, build_tokenizer
from kestrel_core.formats.modelconfig import ModelConfig

NORMAL, UNUSED = 1, 5  # llama.cpp's token types (gguf.TokenType)
# Text that tells the known splits apart: runs of digits (single, up to three, whole), case-folded contractions,
# runs of newlines and spaces, a decomposed accent (NFC or not), other scripts and emoji.
SAMPLE = (
    "Hello world! IT'S 2024 -- we'll pay $1,234.56 for 3333333 units; they've 42 (or 7)...",
    "\n\n  \t leading spaces\r\n and\u00a0nbsp   trailing   \n \n\n\n",
    "caf\u00e9 vs cafe\u0301, \u00c5ngstr\u00f6m, \u4f60\u597d\u4e16\u754c, \u0645\u0631\u062d\u0628\u0627, \U0001F600\U0001F999",
    "def f(x):\n    return x ** 2  # ok?!\n\n\n```python\nprint('hi')\n```",
)
PRE_ORDER = ("gpt-2", "smollm", "qwen2", "llama-bpe")  # one of each split PRE_TOKENIZERS builds, by llama.cpp's names


@attrs.frozen
class Vocabulary:
    """The tokenizer.ggml.* keys of one GGUF."""

    pre: str
    tokens: list[str]
    types: list[int]
    merges: list[str]
    ids: dict[str, int]  # GGUF key (tokenizer.ggml.bos_token_id, ...) -> id
    add_bos: bool | None  # tokenizer.ggml.add_bos_token, where the model has a bos token


def token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it (a string, or an AddedToken object), or None."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _looks_special(token: str) -> bool:
    """convert_hf_to_gguf.py's does_token_look_special, for the tokens byte-level vocabularies have."""
    return (token.startswith("<|") and token.endswith("|>")) or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))


def _merges(model: dict) -> list[str] | None:
    """The merges as "a b" strings (tokenizer.json writes "a b" or ["a", "b"]); None where one cannot be written so."""
    out = []
    for m in model.get("merges") or []:
        parts = m.split(" ") if isinstance(m, str) else m
        if not (isinstance(parts, list) and len(parts) == 2 and all(isinstance(p, str) and p and " " not in p for p in parts)):
            return None
        out.append(f"{parts[0]} {parts[1]}")
    return out


def _pre(tokens: list[str], types: list[int], merges: list[str], hf: HFTokenizer, data: dict, where: str) -> str | None:
    """The first split kestrel's GGUF reader knows whose tokenizer gives the directory's ids on SAMPLE."""
    shape = json.dumps([data.get("normalizer"), data.get("pre_tokenizer")])
    order = list(PRE_ORDER)  # the likeliest first (each is still checked)
    for hint, pre in (("{1,3}", "llama-bpe"), ("NFC", "qwen2"), ("Digits", "smollm")):
        if hint in shape:
            order.insert(0, order.pop(order.index(pre)))
    want = [hf.encode(text, add_special_tokens=False).ids for text in SAMPLE]
    for pre in order:
        meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges}
        try:
            built = build_tokenizer(meta, where)
        except CheckpointError:
            return None  # the merges do not fit the tokens: no split will
        if [built.encode(text, add_special_tokens=False).ids for text in SAMPLE] == want:
            return pre
    return None


def gguf_vocabulary(tokenizer_json: str, tokenizer_config: dict, cfg: ModelConfig, end_ids: frozenset[int],
                    where: str) -> tuple[Vocabulary | None, list[str]]:
    """(the vocabulary, notes to tell the user); the vocabulary is None, with a note saying why, where this tokenizer
    cannot be carried as a GGUF ``gpt2`` tokenizer that kestrel and llama.cpp rebuild with the same ids."""
    data = json.loads(tokenizer_json)
    model = data.get("model") or {}
    no_vocab = "the GGUF gets no vocabulary and runs on token ids (--prompt-ids)"
    if model.get("type") != "BPE":
        return None, [f"{where} is a {model.get('type', 'non-BPE')} tokenizer; a GGUF carries byte-level BPE ('gpt2') "
                      f"here: {no_vocab}"]
    hf = HFTokenizer.from_str(tokenizer_json)
    vocab = hf.get_vocab(with_added_tokens=True)
    size = cfg.vocab_size
    top = max(vocab.values(), default=-1)
    if top >= size:
        raise ConfigError(f"{where} has token id {top} but the model's embedding has {size} rows (vocab_size); a GGUF "
                          "holds one token a row: fix config.json's vocab_size or the tokenizer")
    by_id = {i: t for t, i in sorted(vocab.items(), key=lambda kv: kv[0])}
    added = {a["id"]: a for a in data.get("added_tokens") or [] if isinstance(a, dict) and isinstance(a.get("id"), int)}
    tokens, types = [], []
    for i in range(size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif i in added:
            tokens.append(token)
            types.append(CONTROL if added[i].get("special") or _looks_special(token) else USER_DEFINED)
        else:
            tokens.append(token)
            types.append(NORMAL)
    merges = _merges(model)
    if merges is None:
        return None, [f"{where} has a merge with a space inside a token, which GGUF's 'a b' merges cannot hold: {no_vocab}"]
    pre = _pre(tokens, types, merges, hf, data, where)
    if pre is None:
        return None, [f"{where} splits text in a way none of kestrel's GGUF splits ({', '.join(PRE_ORDER)}) reproduces "
                      f"(checked on a sample text): {no_vocab}"]
    ids, notes = _special_ids(vocab, tokenizer_config, cfg, end_ids, where)
    bos = ids.get("tokenizer.ggml.bos_token_id")
    add_bos = None if bos is None else hf.encode("a", add_special_tokens=True).ids[:1] == [bos]
    return Vocabulary(pre, tokens, types, merges, ids, add_bos), notes


def _special_ids(vocab: dict[str, int], tokenizer_config: dict, cfg: ModelConfig, end_ids: frozenset[int],
                 where: str) -> tuple[dict[str, int], list[str]]:
    """tokenizer.ggml.{bos,eos,eot,eom,unk,pad}_token_id, and notes."""
    named = {key: vocab.get(token_text(tokenizer_config.get(key))) for key in ("bos_token", "eos_token", "unk_token",
                                                                               "pad_token")}
    ids: dict[str, int] = {}
    bos = cfg.bos_token_id if isinstance(cfg.bos_token_id, int) else named["bos_token"]
    if bos is not None:
        ids["tokenizer.ggml.bos_token_id"] = bos
    ends = sorted(end_ids)
    if ends:
        first = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, list) and cfg.eos_token_id else cfg.eos_token_id
        eos = named["eos_token"] if named["eos_token"] in end_ids else first if first in end_ids else ends[0]
        rest = [i for i in ends if i != eos]
        ids["tokenizer.ggml.eos_token_id"] = eos
        for key, i in zip(("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"), rest):
            ids[key] = i
    notes = []
    if len(ends) > 3:
        notes.append(f"{where}: the model ends a generation at {len(ends)} ids ({', '.join(map(str, ends))}) but a GGUF "
                     f"holds three (eos, eot, eom): {', '.join(map(str, rest[2:]))} will not end one")
    for key in ("unk_token", "pad_token"):
        if named[key] is not None:
            ids[SPECIAL_IDS[key]] = named[key]
    for key, i in list(ids.items()):
        if not 0 <= i < cfg.vocab_size:  # kestrel's GGUF reader refuses such a file; the id names no token anyway
            del ids[key]
            notes.append(f"{key.removeprefix('tokenizer.ggml.')} {i} is outside the {cfg.vocab_size}-token vocabulary "
                         "(config.json): left out of the GGUF")
    return ids, notes
