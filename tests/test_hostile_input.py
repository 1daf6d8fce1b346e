"""Hostile numbers: inf, nan, negatives and absurd sizes in flags, kestrel.toml, the environment and the API are
one-line errors on every backend, never a traceback and never a note that they had no effect."""

from __future__ import annotations

import json

import pytest

from kestrel_core import load
from kestrel_core.cli import main
from kestrel_core.config import HOST_ENV, WCACHE_ENV, check_environment
from kestrel_core.errors import ConfigError
from cli_helpers import fails, gen

RUN_FLAGS = [
    (["--expert-budget-mb", "inf"], "expert_budget_mb (--expert-budget-mb) must be a finite number of MiB, 0..2**40, got inf"),
    (["--expert-budget-mb", "nan"], "expert_budget_mb (--expert-budget-mb) must be a finite number of MiB"),
    (["--expert-budget-mb", "-1"], "expert_budget_mb (--expert-budget-mb) must be a finite number of MiB"),
    (["--host-budget-mb", "-5"], "host_budget_mb (--host-budget-mb) must be a finite number of MiB, 0..2**40 (0: the default), got -5.0"),
    (["--host-budget-mb", "nan"], "host_budget_mb (--host-budget-mb) must be a finite number of MiB"),
    (["--host-budget-mb", "inf"], "host_budget_mb (--host-budget-mb) must be a finite number of MiB"),
    (["--budget-mb", "-1"], "budget_mb (--budget-mb) must be whole MiB, 0..2**40 (0: the default), got -1"),
    (["--budget-mb", str(2**41)], "budget_mb (--budget-mb) must be whole MiB"),
    (["--pool-slots", "-1"], "pool_slots (--pool-slots) must be a whole number >= 0, got -1"),
    (["--prefetch", "-1"], "prefetch (--prefetch) must be a layer count >= 0, got -1"),
    (["--max-new-tokens", "0"], "max_new_tokens (--max-new-tokens) must be a whole number >= 1, got 0"),
    (["--temperature", "nan"], "temperature (--temperature) must be a finite number >= 0 (0 is greedy), got nan"),
    (["--temperature", "inf"], "temperature (--temperature) must be a finite number >= 0"),
    (["--top-p", "nan"], "top_p (--top-p) must be in (0, 1], got nan"),
    (["--top-p", "1.5"], "top_p (--top-p) must be in (0, 1], got 1.5"),
    (["--top-k", "-1"], "top_k (--top-k) must be a whole number >= 0 (0 means no cut), got -1"),
    (["--seed", str(2**64)], "seed (--seed) must be in 0..2**64-1"),
]


@pytest.mark.parametrize("flags, message", RUN_FLAGS, ids=[" ".join(f) for f, _ in RUN_FLAGS])
@pytest.mark.parametrize("command", ["generate", "sweep"])
def test_a_bad_number_is_refused_where_it_is_parsed(tiny_ckpt, capsys, command, flags, message):
    """--expert-budget-mb inf raised OverflowError in budget_bytes; --host-budget-mb -5|nan|inf and --budget-mb -1 on
    cpu_ref were a note that they had no effect."""
    argv = gen(tiny_ckpt, *flags)
    argv[0] = command
    if command == "sweep" and flags[0] == "--prefetch":  # a sweep's list of them
        message = "--prefetch must be layer counts >= 0, got '-1'"
    fails(argv, capsys, message)


@pytest.mark.parametrize("toml, message", [
    ("[residency]\nexpert_budget_mb = inf\n", "[residency]: expert_budget_mb (--expert-budget-mb) must be a finite"),
    ("[backend]\nhost_budget_mb = nan\n", "[backend]: host_budget_mb (--host-budget-mb) must be a finite"),
    ("[backend]\nhost_budget_mb = -1\n", "host_budget_mb (--host-budget-mb) must be a finite number of MiB"),
    ("[residency]\nbudget_mb = -1\n", "budget_mb (--budget-mb) must be whole MiB"),
    ("[generation]\ntop_p = -inf\n", "top_p (--top-p) must be in (0, 1], got -inf"),
    ("[generation]\nmax_new_tokens = -3\n", "max_new_tokens (--max-new-tokens) must be a whole number >= 1, got -3"),
])
def test_a_bad_number_in_kestrel_toml_is_refused(tiny_ckpt, tmp_path, capsys, toml, message):
    path = tmp_path / "kestrel.toml"
    path.write_text(toml)
    fails(gen(tiny_ckpt, "--config", str(path)), capsys, message)


@pytest.mark.parametrize("name, value, message", [
    (HOST_ENV, "lots", "KESTREL_HOST_MB='lots' must be a whole number of MiB; fix or unset it"),
    (HOST_ENV, "-5", "KESTREL_HOST_MB=-5 must be positive; unset it for the default"),
    (WCACHE_ENV, "abc", "KESTREL_WCACHE_MB='abc' must be a whole number of MiB; fix or unset it"),
    (WCACHE_ENV, str(2**41), f"KESTREL_WCACHE_MB={2**41} MiB is beyond any machine (at most 2**40)"),
])
def test_a_bad_environment_budget_is_an_error_on_the_cpu_reference_too(tiny_ckpt, capsys, monkeypatch, name, value,
                                                                        message):
    """cpu_ref used to note that the host budget "has no effect here", and said nothing of KESTREL_WCACHE_MB=abc."""
    monkeypatch.setenv(name, value)
    err = fails(gen(tiny_ckpt, "--backend", "cpu_ref"), capsys, message)
    assert "no effect" not in err
    with pytest.raises(ConfigError, match=message.split("=")[0]):
        check_environment()


def test_check_environment_accepts_good_and_unset_budgets(monkeypatch):
    """A good budget and an unset one pass, and the check reads them: the same variables, spoilt, are refused."""
    monkeypatch.setenv(HOST_ENV, "512")
    monkeypatch.delenv(WCACHE_ENV, raising=False)
    assert check_environment() is None
    monkeypatch.setenv(WCACHE_ENV, "1024")
    assert check_environment() is None
    for env in (HOST_ENV, WCACHE_ENV):
        monkeypatch.setenv(env, "lots")
        with pytest.raises(ConfigError, match=env):
            check_environment()
        monkeypatch.setenv(env, "512")


def test_the_api_checks_as_the_flags_do(tiny_ckpt):
    with load(tiny_ckpt) as model:
        with pytest.raises(ConfigError, match=r"expert_budget_mb \(--expert-budget-mb\) must be a finite number"):
            model.open(expert_budget_mb=float("inf"))
        with pytest.raises(ConfigError, match=r"temperature \(--temperature\) must be a finite number >= 0"):
            with model.open(keep=2) as run:
                run.generate(prompt_ids=[1, 2], temperature=float("nan"))


@pytest.mark.parametrize("budget, message", [("inf", "--expert-budget-mb must be a finite number of MiB, got inf"),
                                             ("nan", "--expert-budget-mb must be a finite number of MiB, got nan"),
                                             ("-1", "--expert-budget-mb must be above 0, got -1")])
def test_replay_refuses_a_budget_that_is_not_a_finite_positive_number(tmp_path, capsys, budget, message):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"format": "kestrel-expert-trace", "version": 1, "model": {
        "num_experts": 2, "num_experts_per_tok": 1, "expert_bytes": {"0.0": 10, "0.1": 10}},
        "events": [{"phase": "decode", "token": 0, "layer": 0, "experts": [0]}]}))
    fails(["replay", "--trace", str(trace), "--policy", "expert_lru", "--expert-budget-mb", budget], capsys, message)


def test_the_expert_budget_rule_holds_for_any_caller():
    from kestrel_core.engine.expert_cache import budget_bytes

    with pytest.raises(ConfigError, match="expert budget must be a finite number of MiB above 0, got inf"):
        budget_bytes(float("inf"), 2, 100)


@pytest.mark.parametrize("flags, message", [
    (["--total-mb", "inf"], "--total-mb must be a finite number of MiB in 1..2**40, got inf"),
    (["--total-mb", "1e-300"], "--total-mb must be a finite number of MiB in 1..2**40, got 1e-300"),
    (["--peak-mb", "nan"], "--peak-mb must be a finite number of MiB in 1..2**40, got nan"),
    (["--h2d-gbps", "inf"], "--h2d-gbps must be a positive, finite number, got inf"),
    (["--period-ms", "inf"], "--period-ms must be a positive, finite number, got inf"),
])
def test_gate_numbers(tiny_ckpt, capsys, flags, message):
    """--total-mb inf, 1e-300 and --peak-mb nan raised OverflowError, ZeroDivisionError and ValueError; --h2d-gbps inf
    and --period-ms inf passed."""
    fails(["gate", "kv-paging", "--model", str(tiny_ckpt), *flags], capsys, message)


def test_sweep_prefetch_list_must_be_counts(tiny_ckpt, capsys):
    fails(["sweep", "--model", str(tiny_ckpt), "--prompt-ids", "1,2", "--keep", "1", "--prefetch", "0,-1"], capsys,
          "--prefetch must be layer counts >= 0, got '0,-1'")


def test_demo_checks_its_settings_before_writing_its_cache(tmp_path, capsys):
    fails(["demo", "--cache-dir", str(tmp_path), "--max-new-tokens", "0"], capsys,
          "max_new_tokens (--max-new-tokens) must be a whole number >= 1, got 0")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_valid_cache_budget_on_the_cpu_reference_bounds_its_resident_layers(tiny_ckpt, monkeypatch, how):
    """Once noted as having no effect on cpu_ref, the budget now bounds its resident layers (issue 59 item 15): keep
    = auto fits it, named by its source, and a keep whose peak overruns it is refused."""
    from kestrel_core.errors import BudgetError

    monkeypatch.delenv(WCACHE_ENV, raising=False)
    monkeypatch.delenv(HOST_ENV, raising=False)
    mb, source = (100, "config") if how == "flag" else (1, WCACHE_ENV)
    settings = {"budget_mb": mb} if how == "flag" else {}
    if how == "env":
        monkeypatch.setenv(WCACHE_ENV, str(mb))
    with load(tiny_ckpt) as model:
        if how == "flag":
            with model.open(backend="cpu_ref", kv=(1, 8), **settings) as run:
                assert run.keep_choice.budget == mb * 2**20 and f"budget for resident layers ({source})" in \
                    run.keep_choice.line
        with pytest.raises(BudgetError, match=rf"over the host budget for resident layers of 1.0 MiB \({source}\)"):
            model.open(backend="cpu_ref", keep="off", budget_mb=1)  # the environment's 1 beats this 1, as on cuda


@pytest.mark.parametrize("toml, flags, message", [
    ("", ["--prompt", "hi", "--prompt-ids", "1,2"], "pass --prompt or --prompt-ids, not both"),
    ('[generation]\nprompt = "hi"\nprompt_ids = [1, 2]\n', [], "[generation]: both prompt and prompt_ids are set"),
])
def test_two_prompts_are_refused_not_one_silently_dropped(tiny_ckpt, tmp_path, capsys, toml, flags, message):
    """`--prompt hi --prompt-ids 1,2` ran the ids and ignored --prompt."""
    path = tmp_path / "kestrel.toml"
    path.write_text(toml)
    fails(["generate", "--model", str(tiny_ckpt), "--config", str(path), "--max-new-tokens", "1", *flags], capsys,
          message)


def test_a_prompt_flag_replaces_the_files_prompt_ids(tiny_ckpt, tmp_path, capsys):
    """kestrel.toml's prompt_ids (the README's example has them) beat a --prompt given on the command line."""
    path = tmp_path / "kestrel.toml"
    path.write_text("[generation]\nprompt_ids = [1, 2, 3]\n")
    assert main(["generate", "--model", str(tiny_ckpt), "--config", str(path), "--prompt", "hello", "--max-new-tokens",
                 "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_ids"] == list(b"hello")  # the byte-level tokenizer's ids


@pytest.mark.parametrize("flag, value, message", [
    ("--keep", "1,1", "--keep lists 1 twice"), ("--keep", "2,02", "--keep lists a value twice (2,02)"),
    ("--policy", "asymmetric,asymmetric", "--policy lists asymmetric twice"),
    ("--allocator", "pool,pool", "--allocator lists pool twice"), ("--prefetch", "0,00", "--prefetch lists a value twice"),
])
def test_a_sweep_list_with_a_value_twice(tiny_ckpt, capsys, flag, value, message):
    argv = ["sweep", "--model", str(tiny_ckpt), "--prompt-ids", "1,2", "--max-new-tokens", "1", flag, value]
    if flag != "--keep":
        argv += ["--keep", "1"]
    fails(argv, capsys, message, "list each value once")


def test_a_temperature_so_small_that_logits_overflow_samples_the_greedy_ids(tiny_ckpt):
    """temperature 1e-300 (in range: finite and above 0) made logits / temperature inf and the softmax NaN: a
    traceback from torch.multinomial in generate, the batch job and speculative decoding, and in the server a 500
    that stopped the batch for every later request."""
    prompt = [1, 2, 3, 1, 2, 3]
    with load(tiny_ckpt) as model:
        with model.open(backend="cpu_ref") as run:
            greedy = run.generate(prompt_ids=prompt, max_new_tokens=4).token_ids
            assert run.generate(prompt_ids=prompt, max_new_tokens=4, temperature=1e-300).token_ids == greedy
            batch = run.generate_batch([{"prompt_ids": prompt, "max_new_tokens": 4, "temperature": 1e-300}])
            assert batch[0].token_ids == greedy
        with model.open(backend="cpu_ref", draft="ngram") as run:
            assert run.generate(prompt_ids=prompt, max_new_tokens=4, temperature=1e-300).token_ids == greedy


def test_a_nul_in_a_model_or_draft_path_is_a_one_line_error(tiny_ckpt, tmp_path, capsys):
    """kestrel.toml can hold "\\u0000" where argv cannot: the model, or [speculative] draft, was a ValueError
    traceback (embedded null byte) from os.stat."""
    path = tmp_path / "kestrel.toml"
    path.write_text('model = "tiny\\u0000"\n')
    fails(["generate", "--config", str(path), "--prompt-ids", "1,2"], capsys, "holds a NUL character")
    path.write_text('[speculative]\ndraft = "tiny\\u0000"\n')
    fails(gen(tiny_ckpt, "--config", str(path)), capsys, "model 'tiny\\x00' holds a NUL character, which no path can")
    with pytest.raises(ConfigError, match="holds a NUL character"):
        load(str(tiny_ckpt) + "\x00")


def test_a_template_var_past_pythons_4300_digits_is_taken_as_text():
    """json.loads raised int()'s ValueError (more than 4300 digits), which only JSONDecodeError was caught for."""
    from kestrel_core.commands.chat import template_vars

    assert template_vars(["n=" + "1" * 5000]) == {"n": "1" * 5000}
