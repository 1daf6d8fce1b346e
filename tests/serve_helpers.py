"""Helpers for the server's tests: the tiny preset given a chat template, and OpenAI's error shape."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_model(tiny_ckpt: Path, where: Path, positions: int | None = None) -> Path:
    """A copy of the tiny preset at ``where`` with ``TEMPLATE`` (its <|endoftext|> ends a turn) and, where given, that
    many positions."""
    d = Path(shutil.copytree(tiny_ckpt, where))
    if positions is not None:
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**config, "max_position_embeddings": positions}))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|endoftext|>"}))
    return d


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None):
    """The response is ``status`` with OpenAI's error object: a one-line message, no traceback, the parameter and code
    where given. Returns the error."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "\n" not in error["message"] and "Traceback" not in response.text
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error
