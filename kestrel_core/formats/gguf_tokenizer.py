"""A GGUF's tokenizer and chat template, from its metadata, as kestrel's ``Tokenizer`` and ``ChatTemplate``.

kestrel builds llama.cpp's ``gpt2`` tokenizer model (byte-level BPE: ``tokenizer.ggml.tokens``,
``tokenizer.ggml.merges``, ``tokenizer.ggml.token_type``) as a ``tokenizers.Tokenizer`` in memory. The text is
split before BPE as llama.cpp splits it for ``tokenizer.ggml.pre`` (``PRE_TOKENIZERS``: the regexes of
llama.cpp's ``llama-vocab.cpp``, written as the Hugging Face pre-tokenizers of the same models). Control
tokens (type 3) are added as special tokens and user-defined ones (type 4) as plain added tokens, so that
``<|im_start|>`` in a prompt is one id, as in both llama.cpp and transformers.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

from tokenizers import AddedToken, Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

from kestrel_core.formats.chat_template import TEMPLATE_LIMIT, ChatTemplate
from kestrel_core.errors import CheckpointError, ConfigError, KestrelNote
from kestrel_core.formats.tokenizer import Tokenizer

CONTROL, USER_DEFINED, MAX_TYPE = 3, 4, 6  # llama.cpp's token types (gguf.TokenType: 0 undefined to 6 byte)
# tokens added whole (control and user-defined): real vocabularies have a few hundred, or some thousands; tokenizers
# builds a matcher over them (2**20 took 6 s and 1 GiB)
MAX_ADDED = 2**17
_QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _gpt2():
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2():  # llama.cpp: "\p{N}", then GPT-2's regex (SmolLM's cosmo2 tokenizer: Digits + ByteLevel)
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _split_then_bytes(pattern: str):
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# tokenizer.ggml.pre -> (pre-tokenizer, NFC normalizer, ignore_merges), as llama.cpp reads each
PRE_TOKENIZERS = {
    "default": (_gpt2, False, False),
    "gpt-2": (_gpt2, False, False),
    "gpt2": (_gpt2, False, False),
    "smollm": (_digits_then_gpt2, False, False),
    "starcoder": (_digits_then_gpt2, False, False),
    "qwen2": (lambda: _split_then_bytes(_QWEN2), True, False),
    "llama-bpe": (lambda: _split_then_bytes(_LLAMA3), False, True),
    "llama3": (lambda: _split_then_bytes(_LLAMA3), False, True),
}


class GGUFTokenizer(Tokenizer):
    """kestrel's ``Tokenizer`` over a ``tokenizers.Tokenizer`` built in memory (not read from tokenizer.json)."""

    def __init__(self, hf: HFTokenizer):  # noqa: super().__init__ reads a file; this one has none
        self._tok = hf


def build_tokenizer(meta: Mapping[str, Any], where: str) -> HFTokenizer:
    """The ``tokenizers.Tokenizer`` a GGUF's metadata describes; anything kestrel cannot build is a CheckpointError
    naming the key."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(f"{where}: tokenizer.ggml.model is {kind!r}; kestrel builds only 'gpt2' (byte-level BPE) "
                              "tokenizers from a GGUF: pass --prompt-ids, or run the model's Hugging Face directory")
    pre = meta.get("tokenizer.ggml.pre")
    if pre is None:  # llama.cpp's default too, which it warns about: the split may not be the model's
        warnings.warn(f"{where}: no tokenizer.ggml.pre in its metadata: text is split as GPT-2 splits it (llama.cpp's "
                      "'default'), which may not be how the model was trained; re-convert it with a current llama.cpp",
                      KestrelNote, stacklevel=2)
        pre = "default"
    if not isinstance(pre, str):
        raise CheckpointError(f"{where}: tokenizer.ggml.pre is {_kind(pre)}, not a string; the file is corrupt: re-convert it")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"{where}: tokenizer.ggml.pre is {pre!r}, which kestrel does not know; known: "
                              f"{', '.join(PRE_TOKENIZERS)} (pass --prompt-ids, or run the model's Hugging Face directory)")
    tokens = _array(meta, "tokenizer.ggml.tokens", str, where)
    merges = _array(meta, "tokenizer.ggml.merges", str, where)
    if not tokens:
        raise CheckpointError(f"{where}: tokenizer.ggml.tokens is missing or empty; the GGUF has no vocabulary: re-convert it")
    if merges is None:
        raise CheckpointError(f"{where}: tokenizer.ggml.merges is missing; a gpt2 tokenizer needs its merges: re-convert it")
    types = _array(meta, "tokenizer.ggml.token_type", int, where) or [1] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(f"{where}: tokenizer.ggml.token_type has {len(types)} entries but tokenizer.ggml.tokens "
                              f"has {len(tokens)}; the file is corrupt: re-convert it")
    odd = next((k for k in types if not 0 <= k <= MAX_TYPE), None)
    if odd is not None:
        raise CheckpointError(f"{where}: tokenizer.ggml.token_type holds {odd}, not one of llama.cpp's token types (0 to "
                              f"{MAX_TYPE}); the file is corrupt: re-convert it")
    added = sum(1 for k in types if k in (CONTROL, USER_DEFINED))
    if added > MAX_ADDED:
        raise CheckpointError(f"{where}: tokenizer.ggml.token_type marks {added:,} tokens control or user-defined, over the "
                              f"{MAX_ADDED:,} kestrel builds (real vocabularies have a few hundred); the file is corrupt: "
                              "re-convert it")
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # a duplicate (some converters pad with repeats) keeps its first id, as llama.cpp's map
    pairs = []
    for m in merges:
        parts = m.split(" ")
        if len(parts) != 2 or not all(parts):
            raise CheckpointError(f"{where}: tokenizer.ggml.merges holds {m[:60]!r}, not two tokens separated by a space; "
                                  "the file is corrupt: re-convert it")
        pairs.append((parts[0], parts[1]))
    make_pre, nfc, ignore_merges = PRE_TOKENIZERS[pre]
    try:
        extra = {"ignore_merges": True} if ignore_merges else {}  # tokenizers >= 0.19; llama.cpp's llama3 looks words up first
        bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False, **extra)
    except Exception as exc:  # a merge of a token not in the vocabulary
        raise CheckpointError(f"{where}: tokenizer.ggml.merges do not fit tokenizer.ggml.tokens "
                              f"({' '.join(str(exc).split())[:160]}); re-convert it") from None
    tok = HFTokenizer(bpe)
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = make_pre()
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL]
    plain = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(plain)
    return tok


def _kind(value: Any) -> str:
    """What a metadata value is, for an error: "an array", "a string", "an int"..."""
    name = {list: "array", str: "string", int: "int", float: "float", bool: "bool"}.get(type(value), type(value).__name__)
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _array(meta: Mapping[str, Any], key: str, kind: type, where: str) -> list | None:
    """Metadata array ``key`` whose every entry is a ``kind`` (None where it is absent); anything else is an error naming
    the key."""
    value = meta.get(key)
    if value is None:
        return None
    want = f"an array of {'strings' if kind is str else 'ints'}"
    if not isinstance(value, list):
        raise CheckpointError(f"{where}: {key} is {_kind(value)}, not {want}; the file is corrupt: re-convert it")
    for v in value:
        if not isinstance(v, kind) or isinstance(v, bool):
            raise CheckpointError(f"{where}: {key} holds {repr(v)[:60]}, not {'a string' if kind is str else 'an int'}; "
                                  "the file is corrupt: re-convert it")
    return value


SPECIAL_IDS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
               "unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id",
               "sep_token": "tokenizer.ggml.seperator_token_id", "cls_token": "tokenizer.ggml.cls_token_id",
               "mask_token": "tokenizer.ggml.mask_token_id"}


def special_tokens(meta: Mapping[str, Any]) -> dict[str, str]:
    """bos_token, eos_token, ... as strings (what a chat template is rendered with), for the ids the metadata names."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    out = {}
    for name, key in SPECIAL_IDS.items():
        i = meta.get(key)
        if isinstance(i, int) and 0 <= i < len(tokens):
            out[name] = tokens[i]
    return out


def template_source(meta: Mapping[str, Any], where: str) -> str | None:
    """``tokenizer.chat_template``'s text, None where there is none; one that is not a string, or is larger than a
    directory's chat template may be (``TEMPLATE_LIMIT``), is a ConfigError naming the key."""
    source = meta.get("tokenizer.chat_template")
    if source is None:
        return None
    if not isinstance(source, str):
        raise ConfigError(f"{where}: tokenizer.chat_template is {_kind(source)}, not a string; the GGUF is corrupt: "
                          "re-convert it, or run the model's Hugging Face directory")
    if len(source) > TEMPLATE_LIMIT:  # characters: at least as many bytes
        raise ConfigError(f"{where}: tokenizer.chat_template is {len(source) / 2**20:,.1f} MiB, over the "
                          f"{TEMPLATE_LIMIT // 2**20} MiB limit; a chat template is a few KiB: take the model's own")
    return source


def chat_template(meta: Mapping[str, Any], where: str) -> ChatTemplate:
    """``tokenizer.chat_template`` as kestrel's ChatTemplate; a GGUF without one is a ConfigError saying what to do."""
    source = template_source(meta, where)
    if source is None:
        raise ConfigError(f"{where} has no chat template (no tokenizer.chat_template in its metadata), so kestrel cannot "
                          "lay out a conversation for it: a base model may have none; use `kestrel generate --prompt TEXT` "
                          "for plain continuation")
    return ChatTemplate(source, f"{where} (tokenizer.chat_template)", special_tokens(meta))
