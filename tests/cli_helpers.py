"""Helpers for tests that drive the CLI in-process: a one-line error, a short generate, a safetensors header."""

from __future__ import annotations

import json
import struct

from kestrel_core.cli import main

WEIGHTS = "model.safetensors"


def fails(argv: list[str], capsys, *needles: str) -> str:
    """Run the CLI in-process; it must exit 2 with exactly one line naming the problem."""
    rc = main(argv)
    captured = capsys.readouterr()
    err = captured.err
    assert rc == 2, (rc, err, captured.out)
    assert err.startswith("kestrel: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def gen(model_dir, *extra: str) -> list[str]:
    return ["generate", "--model", str(model_dir), "--prompt-ids", "1,2,3", "--max-new-tokens", "2", *extra]


def header_of(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return raw, n, json.loads(raw[8 : 8 + n])
