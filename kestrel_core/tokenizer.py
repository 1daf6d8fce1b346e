"""Optional text: a ``tokenizer.json`` read with the ``tokenizers`` package when both are present."""

from __future__ import annotations

import sys
from pathlib import Path

from .errors import ConfigError


class Tokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception on a bad file
            raise ConfigError(f"{path}: cannot be read as a tokenizer ({exc})") from None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def load_tokenizer(model_dir: Path) -> Tokenizer | None:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        print(
            f"kestrel: note: {path} found but the 'tokenizers' package is not installed; "
            "showing token ids only (pip install tokenizers)",
            file=sys.stderr,
        )
        return None
    return Tokenizer(path)
