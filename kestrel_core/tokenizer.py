"""Text in and out: a model directory's ``tokenizer.json``, read with the ``tokenizers`` package."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from .errors import ConfigError


class Tokenizer:
    def __init__(self, path: Path):
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception on a bad file
            raise ConfigError(f"{path}: cannot be read as a tokenizer ({exc})") from None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def load_tokenizer(model_dir: Path) -> Tokenizer | None:
    """The directory's tokenizer, or None where it has no tokenizer.json (ids only, then)."""
    path = Path(model_dir) / "tokenizer.json"
    return Tokenizer(path) if path.is_file() else None
