"""kestrel.toml: loading, flags over the file, and swapping the eviction policy (the headline use)."""

from __future__ import annotations

import json

import pytest

from kestrel_core.cli import main
from kestrel_core.config import KestrelConfig, load_config
from kestrel_core.errors import ConfigError

FULL = """
model = "{model}"

[backend]
name = "cpu_ref"
dtype = "float64"

[residency]
policy = "{policy}"
keep = {keep}
allocator = "free"
pool_slots = 7

[generation]
max_new_tokens = 5
temperature = 0
top_k = 3
top_p = 0.5
seed = 9
stop_at_eos = false
prompt_ids = [4, 5, 6]
"""


def write(tmp_path, name="kestrel.toml", **values):
    values = {"model": "m", "policy": "asymmetric", "keep": 2, **values}
    path = tmp_path / name
    path.write_text(FULL.format(**values))
    return path


def generate_json(capsys, *argv) -> dict:
    assert main(["generate", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_every_section_loads_with_its_types(tmp_path):
    cfg = load_config(write(tmp_path, model="/some/dir", keep='"off"'))
    assert cfg.model == "/some/dir"
    assert (cfg.backend.name, cfg.backend.dtype) == ("cpu_ref", "float64")
    r = cfg.residency
    assert (r.policy, r.keep, r.allocator, r.pool_slots, r.windowed) == ("asymmetric", "off", "free", 7, False)
    g = cfg.generation
    assert (g.max_new_tokens, g.top_k, g.top_p, g.seed, g.stop_at_eos, g.prompt_ids) == (5, 3, 0.5, 9, False, (4, 5, 6))
    assert load_config(write(tmp_path, keep=3)).residency.keep == 3
    assert load_config(None) == KestrelConfig()


def test_a_section_may_be_left_out(tmp_path):
    path = tmp_path / "k.toml"
    path.write_text('[residency]\nkeep = 4\n')
    cfg = load_config(path)
    assert cfg.residency.keep == 4 and cfg.residency.policy == "asymmetric"
    assert cfg.generation == KestrelConfig().generation


def test_flags_override_the_file(tiny_ckpt, tmp_path, capsys):
    path = write(tmp_path, model=tiny_ckpt, policy="future_evicting", keep=1)
    from_file = generate_json(capsys, "--config", str(path))
    assert (from_file["policy"], from_file["keep"], from_file["allocator"]) == ("future_evicting", 1, "free")
    assert from_file["prompt_ids"] == [4, 5, 6] and len(from_file["token_ids"]) == 5
    flagged = generate_json(capsys, "--config", str(path), "--keep", "3", "--allocator", "pool",
                            "--prompt-ids", "7,8", "--max-new-tokens", "3")
    assert (flagged["policy"], flagged["keep"], flagged["allocator"]) == ("future_evicting", 3, "pool")
    assert flagged["prompt_ids"] == [7, 8] and len(flagged["token_ids"]) == 3
    assert flagged["counters"]["pool_hits"] > 0 and from_file["counters"]["pool_hits"] == 0


def test_swapping_the_policy_in_the_config_changes_the_counters(tiny_ckpt, tmp_path, capsys):
    runs = {}
    for policy in ("asymmetric", "future_evicting", "pinned_set"):
        runs[policy] = generate_json(capsys, "--config", str(write(tmp_path, f"{policy}.toml", model=tiny_ckpt,
                                                                   policy=policy, keep=2)))
    uploads = {p: r["uploads_per_token"] for p, r in runs.items()}
    assert uploads == {"asymmetric": [4] * 4, "future_evicting": [6] * 4, "pinned_set": [3] * 4}
    assert len({tuple(r["token_ids"]) for r in runs.values()}) == 1


def test_keep_off_in_the_config_means_no_window(tiny_ckpt, tmp_path, capsys):
    out = generate_json(capsys, "--config", str(write(tmp_path, model=tiny_ckpt, keep='"off"')))
    assert out["policy"] == "off" and out["uploads_per_token"] == [0] * 4


@pytest.mark.parametrize(
    "toml, needle",
    [("[backend]\nname = 3\n", "name must be str"),
     ("[backend]\nprefetch = 1.5\n", "prefetch must be int"),
     ("[residency]\npool_slots = true\n", "pool_slots must be int"),
     ("[residency]\nkeep = [1]\n", "keep"),
     ("[residency]\nkeep = 1.0\n", "keep"),
     ('[residency]\nkeep = "some"\n', "keep"),
     ('[generation]\ntemperature = "hot"\n', "temperature must be float"),
     ("[generation]\nstop_at_eos = 1\n", "stop_at_eos must be bool"),
     ('[residency]\nexpert_staging = "off"\n', "expert_staging must be bool"),
     ("[residency]\nexpert_landing = 0\n", "expert_landing must be bool"),
     ("[generation]\nprompt_ids = [1, true]\n", "prompt_ids must be a list of integers"),
     ("[generation]\nprompt_ids = [1.5]\n", "prompt_ids must be a list of integers"),
     ("model = 5\n", "model must be a path string")],
)
def test_type_errors_are_rejected(tmp_path, toml, needle):
    path = tmp_path / "k.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[")) as exc:
        load_config(path)
    assert str(path) in str(exc.value)


def test_an_int_is_a_fine_float(tmp_path):
    path = tmp_path / "k.toml"
    path.write_text("[generation]\ntemperature = 1\ntop_p = 1\n")
    assert load_config(path).generation.temperature == 1


def test_override_ignores_flags_not_given():
    cfg = KestrelConfig().override(residency__keep=3, residency__policy=None, model=None)
    assert cfg.residency.keep == 3 and cfg.residency.policy == "asymmetric" and cfg.model == ""


def test_a_setting_given_its_default_value_is_given(tmp_path):
    """Whether a setting was given is asked of the config, never read off a value that differs from the default."""
    from kestrel_core.config import KestrelConfig, load_config, with_settings

    assert not KestrelConfig().was_given("generation", "max_new_tokens")
    assert KestrelConfig().override(generation__max_new_tokens=16).was_given("generation", "max_new_tokens")
    assert not KestrelConfig().override(generation__max_new_tokens=None).was_given("generation", "max_new_tokens")
    (tmp_path / "k.toml").write_text("[generation]\nseed = 0\n")
    from_file = load_config(tmp_path / "k.toml")
    assert from_file.was_given("generation", "seed") and not from_file.was_given("generation", "temperature")
    opened = with_settings(from_file, {"temperature": 0.0, "keep": 2})
    assert opened.was_given("generation", "temperature") and opened.was_given("residency", "keep")
    assert opened.was_given("generation", "seed") and not opened.was_given("generation", "top_k")
