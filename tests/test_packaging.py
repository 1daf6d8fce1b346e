"""How kestrel installs and is tested: the README's commands, its dependencies, and tox's shared torch."""

from __future__ import annotations

import importlib.metadata
import os
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def readme_setup_commands() -> list[str]:
    """The shell blocks of the README's set-up section."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```sh\n(.*?)```", section, re.S)]


def test_the_readme_gives_two_setup_commands_and_ci_runs_the_test_one():
    demo, tests = readme_setup_commands()
    assert demo.endswith("kestrel demo") and "\n" not in demo
    assert tests.endswith("tox") and "\n" not in tests
    ci = (ROOT / ".ci" / "run").read_text()
    runs = [line.strip() for line in ci.splitlines() if line.strip() == tests]
    assert len(runs) == 2  # once in a fresh venv, once on the system interpreter
    assert "python3 -m venv" in ci


def test_tokenizers_is_a_core_dependency():
    core = [r for r in importlib.metadata.requires("kestrel") if "extra ==" not in r]
    assert any(re.match(r"tokenizers\b", r) for r in core), core


@pytest.mark.skipif("TOX_ENV_DIR" not in os.environ, reason="checks what a tox environment holds")
def test_a_tox_env_uses_the_torch_tox_runs_beside():
    env = Path(os.environ["TOX_ENV_DIR"]).resolve()
    real = Path(torch.__file__).resolve()
    assert env not in real.parents, f"{real} was installed into the tox env; toxfile.py should link the host's torch"
    assert (env / "host-torch" / "torch").is_symlink()
