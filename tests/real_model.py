"""Fixtures of the suite's real trained model (bench/real_model.py fetches and converts it): import them into a test
module. A test that needs the model skips, saying why, where the wheel cannot be had."""

from __future__ import annotations

import pytest

from bench.real_model import WHEEL, Unavailable, smollm2_gguf_path, smollm2_hf_path  # noqa: F401


def _or_skip(get):
    try:
        return get()
    except Unavailable as exc:
        pytest.skip(f"the real model (SmolLM2-135M-Instruct from the {WHEEL} wheel) is not available: {exc}")
    except ValueError as exc:
        pytest.fail(str(exc))


# --- fixtures: import them into a test module (``from tests.real_model import smollm2_gguf``) ----------------------
@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of the GGUF file."""
    return _or_skip(smollm2_gguf_path)


@pytest.fixture(scope="session")
def smollm2_ckpt(smollm2_gguf):
    """The GGUF opened (a GGUFCheckpoint), shared by the session."""
    from kestrel_core.formats.gguf import GGUFCheckpoint

    ckpt = GGUFCheckpoint(smollm2_gguf)
    yield ckpt
    ckpt.close()


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf):
    """Path of the Hugging Face directory converted from it (config.json, float32 model.safetensors, tokenizer)."""
    return _or_skip(smollm2_hf_path)
