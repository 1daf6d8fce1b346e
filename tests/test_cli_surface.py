"""The command line itself: every flag and subcommand explained in --help, --version, argparse's errors in one line,
and a closed or full standard output met with one line rather than a traceback."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from kestrel_core import cli
from kestrel_core.cli import build_parser, main
from cli_helpers import fails


def _walk(parser: argparse.ArgumentParser, path: list[str]):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                yield [*path, choice.dest], choice.help
            for name, sub in action.choices.items():
                yield from _walk(sub, [*path, name])
        else:
            yield [*path, "/".join(action.option_strings) or action.dest], action.help


def test_every_subcommand_and_flag_has_help():
    entries = list(_walk(build_parser(), ["kestrel"]))
    assert len(entries) > 100  # the walk reached every subcommand's flags, the plugin command gate's too
    assert any(path[1] == "gate" for path, _ in entries)
    blank = [" ".join(path) for path, text in entries if not text or not text.strip() or text == argparse.SUPPRESS]
    assert blank == []


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"kestrel {cli.version()}\n"
    assert cli.version()[0].isdigit()


def test_help_returns_zero(capsys):
    assert main(["generate", "--help"]) == 0
    assert "--max-new-tokens" in capsys.readouterr().out


@pytest.mark.parametrize("argv, needles", [
    (["generate", "--max-new-tokens", "abc"], ["argument --max-new-tokens: invalid int value: 'abc'",
                                               "see kestrel generate --help"]),
    ([], ["the following arguments are required: COMMAND", "see kestrel --help"]),
    (["bogus"], ["invalid choice: 'bogus'", "make-model"]),
    (["generate", "--bogus", "x"], ["unrecognized arguments: --bogus x", "see kestrel generate --help"]),
    (["gate", "--slots", "x"], ["argument --slots", "see kestrel gate --help"]),
])
def test_a_bad_flag_is_one_line(capsys, argv, needles):
    """argparse printed its usage block first, burying the line that names the problem."""
    err = fails(argv, capsys, *needles)
    assert "usage:" not in err


def test_a_closed_stdout_is_one_line(tiny_ckpt):
    """`kestrel generate ... >&-` raised AttributeError: 'NoneType' object has no attribute 'flush'."""
    proc = subprocess.run([sys.executable, "-m", "kestrel_core.cli", "generate", "--model", str(tiny_ckpt),
                           "--prompt-ids", "1,2", "--max-new-tokens", "2"], stderr=subprocess.PIPE, text=True,
                          timeout=120, preexec_fn=lambda: os.close(1))
    assert proc.returncode == 2
    assert proc.stderr == "kestrel: error: standard output is closed; send it somewhere: a file, a pipe, or >/dev/null\n"


def test_a_full_stdout_is_one_line(tiny_ckpt):
    """`> /dev/full` was "No space left on device; check the path, ...", naming no path."""
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "kestrel_core.cli", "generate", "--model", str(tiny_ckpt),
                               "--prompt-ids", "1,2", "--max-new-tokens", "2"], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == ("kestrel: error: cannot write the output: No space left on device (standard output); "
                           "free space, or send it elsewhere\n")
