"""Bad input, round four: what round three left (each was accepted silently or worded wrongly)."""

from __future__ import annotations

import pytest
from cli_helpers import fails, gen

from kestrel_core import load
from kestrel_core.cli import main
from kestrel_core.errors import ConfigError


def test_expert_fetch_layer_on_a_dense_model_is_refused(tiny_ckpt, capsys):
    with load(tiny_ckpt) as model:
        with pytest.raises(ConfigError, match="expert_fetch = 'layer' is for Mixture-of-Experts models; .* has no "
                                              "experts: leave --expert-fetch out"):
            model.open(expert_fetch="layer")
    fails(gen(tiny_ckpt, "--expert-fetch", "layer"), capsys, "expert_fetch = 'layer' is for Mixture-of-Experts")


def test_an_unknown_gate_is_named_before_the_missing_model(capsys):
    assert main(["gate", "nope"]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "no model given" not in err and len(err.strip().splitlines()) == 1


def test_a_kestrel_toml_with_a_byte_order_mark_is_read(tiny_ckpt, tmp_path, capsys):
    """Windows editors write a UTF-8 BOM; tomllib then said "Invalid statement (at line 1, column 1)"."""
    (tmp_path / "kestrel.toml").write_bytes(b"\xef\xbb\xbf[generation]\nmax_new_tokens = 3\n")
    assert main(gen(tiny_ckpt, "--config", str(tmp_path / "kestrel.toml"), "--json")) == 0
    import json

    assert len(json.loads(capsys.readouterr().out)["token_ids"]) <= 3


def test_a_gguf_whose_metadata_is_wrong_is_not_told_to_fix_config_json(tmp_path):
    """A GGUF has no config.json: its metadata errors named one."""
    from gguf_files import write_model

    from kestrel_core.errors import CheckpointError

    path, _ = write_model(tmp_path / "m.gguf", meta={"llama.block_count": 10**9})
    with pytest.raises((ConfigError, CheckpointError)) as err:
        load(path)
    assert "config.json" not in str(err.value) and "the GGUF's metadata is wrong" in str(err.value)
    assert "re-convert the model" in str(err.value)
