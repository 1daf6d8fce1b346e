"""Text in and out: a model directory's ``tokenizer.json``, read with the ``tokenizers`` package."""

from __future__ import annotations

import functools
import os
import re
import warnings
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

from kestrel_core.errors import ConfigError, KestrelNote
from kestrel_core.io.readfile import read_bounded

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21: TextStream does the same windowed decode itself
    DecodeStream = None

INCOMPLETE = "\ufffd"
TOKENIZER_LIMIT = 512 * 2**20  # the largest published tokenizer.json files are tens of MiB  # what a decoder gives for bytes that do not (yet) make a whole character


class Tokenizer:
    def __init__(self, path: Path):
        data = read_bounded(path, TOKENIZER_LIMIT, str(path), "this is not a tokenizer.json; re-download the model's")
        try:
            self._tok = HFTokenizer.from_str(data.decode("utf-8"))
        except UnicodeDecodeError:
            raise ConfigError(f"{path}: cannot be read as a tokenizer (not UTF-8 text)") from None
        except Exception as exc:  # the library raises a bare Exception on a bad file
            raise ConfigError(f"{path}: cannot be read as a tokenizer ({' '.join(str(exc).split())})") from None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """``text`` as ids, as kestrel prefills it; ``add_special_tokens``: with what the tokenizer's post-processor
        adds (a BOS, for some models), which kestrel's own prompts never are."""
        check_utf8(text)
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_at_most(self, text: str, limit: int) -> list[int] | None:
        """``encode(text)``, or None where it is certainly more than ``limit`` ids, found by encoding prefixes of
        growing length first: text far longer than a model's context is not tokenized whole."""
        check_utf8(text)
        probe = 4 * limit + 64  # prose runs 3 to 5 characters a token
        while probe < len(text):
            # A prefix cut mid-word may spend a few more ids on its last word than the whole text does there.
            if len(self._tok.encode(text[:probe], add_special_tokens=False).ids) > limit + 64:
                return None
            probe *= 4
        ids = self.encode(text)
        return ids if len(ids) <= limit else None

    @property
    def hf(self) -> HFTokenizer:
        """The ``tokenizers`` library's tokenizer (a library that reads a vocabulary whole takes its JSON)."""
        return self._tok

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def vocab(self) -> dict[str, int]:
        """Every token (added ones too) and its id: two models share a vocabulary where these are equal."""
        return self._tok.get_vocab(with_added_tokens=True)

    def stream(self) -> "TextStream":
        return TextStream(self)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes (OpenAI's logprobs ``bytes``): a byte-level token's (maybe part of a character), a
        byte-fallback piece's (``<0xE2>``) one byte, else the UTF-8 of the token decoded alone."""
        piece = self._tok.id_to_token(token_id)
        if piece is not None:
            if isinstance(self._tok.decoder, decoders.ByteLevel):
                table = _byte_decoder()
                if all(ch in table for ch in piece):
                    return bytes(table[ch] for ch in piece)
            elif m := _BYTE_PIECE.fullmatch(piece):
                return bytes([int(m[1], 16)])
        return self._tok.decode([token_id], skip_special_tokens=False).encode("utf-8")


class TextStream:
    """The text of ids that arrive one at a time: ``push(id)`` gives the text that is ready, ``finish()`` the rest.

    The pieces joined equal ``tokenizer.decode`` of every id pushed. A piece that would end in an
    incomplete character (a byte-level or byte-fallback token that starts a multi-byte UTF-8
    sequence) is held back until a later token completes it, so no replacement character appears
    mid-stream; ``finish`` gives what is still held, as the whole decode has it.

    Each step decodes a short window of ids (the last piece's and the new ones) and emits what the
    new ids add to it, so that a decoder that treats a first token specially (a leading space) decodes
    each token in context: the tokenizer's ``DecodeStream`` where the installed ``tokenizers`` has it,
    else the same algorithm here.
    """

    def __init__(self, tokenizer: Tokenizer, native: bool = True):
        self._tok = tokenizer
        self.ids: list[int] = []
        self.text = ""  # given out so far
        self._native = DecodeStream(skip_special_tokens=False) if native and DecodeStream is not None else None
        self._window: list[int] = []  # the last piece's ids, then the ids held back since
        self._prefix = ""  # the window's text before the held ids
        self._last = 0  # how many of the window's ids are the last piece's
        self._diverged = False

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self._diverged:
            return ""
        if self._native is not None:
            try:
                piece = self._native.step(self._tok._tok, token_id) or ""
            except Exception:  # the library's InvalidPrefix: the window's text no longer starts as it did
                piece, self._diverged = "", True
        else:
            piece = self._step(token_id)
        self.text += piece
        return piece

    def _step(self, token_id: int) -> str:
        """DecodeStream's step, for a ``tokenizers`` without it."""
        self._window.append(token_id)
        text = self._tok.decode(self._window)
        if len(text) <= len(self._prefix) or text.endswith(INCOMPLETE):
            return ""
        if not text.startswith(self._prefix):
            self._diverged = True
            return ""
        piece = text[len(self._prefix):]
        self._window, self._last = self._window[self._last:], len(self._window) - self._last
        self._prefix = self._tok.decode(self._window)
        return piece

    def finish(self) -> str:
        """The text still held back (an incomplete character at the end decodes as the whole decode has it)."""
        full = self._tok.decode(self.ids)
        if not full.startswith(self.text):
            warnings.warn("the streamed text differs from the decode of the whole generation (the tokenizer's decoder "
                          "rewrote text it had already given); the result's text (--json) is the exact decode",
                          KestrelNote, stacklevel=2)
            return ""
        rest = full[len(self.text):]
        self.text = full
        return rest


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


@functools.cache
def byte_chars() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table, which ByteLevel tokenizers spell their tokens in."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]  # the printable bytes stand for themselves; the others take U+0100 on, in order
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """``byte_chars`` the other way: a character of a ByteLevel token -> its byte."""
    return {c: b for b, c in byte_chars().items()}


def check_utf8(text: str) -> None:
    """Text that came in as bytes not valid UTF-8 (an argument or a stdin line in another encoding) holds lone
    surrogates (Python's surrogateescape), which no tokenizer can encode: refused, naming the byte."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = ord(text[exc.start])
        what = f"byte 0x{bad - 0xDC00:02x}" if 0xDC80 <= bad <= 0xDCFF else f"code point U+{bad:04X}"
        raise ConfigError(f"the text is not valid UTF-8 ({what} at character {exc.start}); pass UTF-8 text, e.g. "
                          "convert it with iconv -f latin1 -t utf-8") from None


def load_tokenizer(model_dir: Path) -> Tokenizer | None:
    """The directory's tokenizer, or None where it has no tokenizer.json (ids only, then); one that is there but
    cannot be read (a directory, a device, a dangling link) is an error, not a model without a tokenizer."""
    path = Path(model_dir) / "tokenizer.json"
    return Tokenizer(path) if os.path.lexists(path) else None
