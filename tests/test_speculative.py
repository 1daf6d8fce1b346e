"""Speculative decoding: a drafter proposes, one pass of the target verifies; greedy ids are plain greedy decoding's
(bitwise on cpu_ref), and sampling follows the target's distribution."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from cli_helpers import fails

from bench.scenarios.speculative import Oracle, OraclePlugin  # a drafter plugin that knows the answer
from kestrel_core import load
from kestrel_core.cli import main
from kestrel_core.config import GenerationConfig
from kestrel_core.errors import ConfigError, KestrelNote
from kestrel_core.tools.presets import preset_config, write_checkpoint
from kestrel_core.engine.sampling import Sampler
from kestrel_core.engine.scheduler import Scheduler
from kestrel_core.engine.speculative import accept

REPEATING = [5, 17, 42, 99, 3, 5, 17, 42, 99, 3, 5, 17]


@pytest.fixture(scope="module")
def draft_ckpt(tmp_path_factory):
    """The tiny preset cut to 2 of its 6 layers: the same tokenizer, a smaller model."""
    return write_checkpoint(preset_config("tiny", layers=2), tmp_path_factory.mktemp("draft") / "tiny-2")


@pytest.mark.parametrize("settings", [dict(keep="off"), dict(keep=1), dict(keep=2, policy="pinned_set"),
                                      dict(keep=3, policy="belady", allocator="free")])
@pytest.mark.parametrize("draft", ["ngram", "ngram:1", "model"])
def test_greedy_ids_are_plain_greedy(tiny_ckpt, draft_ckpt, settings, draft):
    with load(tiny_ckpt) as model:
        with model.open(**settings) as run:
            plain = run.generate(prompt_ids=REPEATING, max_new_tokens=16, stop_at_eos=False)
        draft = str(draft_ckpt) if draft == "model" else draft
        with model.open(draft=draft, draft_tokens=4, **settings) as run:
            spec = run.generate(prompt_ids=REPEATING, max_new_tokens=16, stop_at_eos=False)
    assert spec.token_ids == plain.token_ids
    s = spec.speculative
    assert s["passes"] == len(spec.decode_ms) and s["kept"] == len(spec.token_ids) - 1
    assert s["kept"] == s["passes"] + s["accepted"]  # each pass keeps its accepted drafts and one of its own


def test_a_plugin_drafter_that_is_always_right_keeps_k_plus_one_a_pass(tiny_ckpt, register_plugin):
    register_plugin(OraclePlugin(), "oracle")
    with load(tiny_ckpt) as model:
        with model.open(keep=1) as run:
            plain = run.generate(prompt_ids=[1, 2, 3], max_new_tokens=16, stop_at_eos=False)
        Oracle.answer = plain.token_ids
        with model.open(keep=1, draft="oracle", draft_tokens=4) as run:
            spec = run.generate(prompt_ids=[1, 2, 3], max_new_tokens=16, stop_at_eos=False)
    assert spec.token_ids == plain.token_ids
    s = spec.speculative
    assert s["acceptance_rate"] == 1.0 and s["passes"] == 3 and s["tokens_per_pass"] == 5.0  # 1 + 3 x 5 = 16
    # One pass over the layers a verify: at keep=1 each streams what one plain step streams, for five tokens.
    per_pass = spec.per_token[0]["bytes_uploaded"]
    assert per_pass == plain.per_token[1]["bytes_uploaded"] > 0


def test_speculative_sampling_follows_the_targets_distribution():
    """accept() over many seeded draws: the token it emits first is distributed as p, whatever the draft (chi-square)."""
    g = torch.Generator().manual_seed(0)
    vocab, draws = 6, 6000
    logits = torch.randn(2, vocab, generator=g) * 1.5
    sampler = Sampler(GenerationConfig(temperature=1.0, seed=1))
    p = sampler.probs(logits[0])
    for q in (torch.softmax(torch.randn(vocab, generator=g), -1), None):  # a model's draft, then a one-hot draft
        counts = torch.zeros(vocab)
        for _ in range(draws):
            d = int(torch.multinomial(q, 1, generator=g)) if q is not None else 2
            n, own = accept(logits, [d], [q] if q is not None else None, sampler, greedy=False)
            counts[d if n else own] += 1
        expected = p * draws
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 20.5, (chi2, counts, expected)  # chi-square, 5 degrees of freedom: p = 0.001 at 20.5


def test_sampled_runs_are_reproducible_and_complete(tiny_ckpt):
    with load(tiny_ckpt) as model, model.open(keep=2, draft="ngram", draft_tokens=3) as run:
        a = run.generate(prompt_ids=REPEATING, max_new_tokens=12, stop_at_eos=False, temperature=0.8, seed=5)
        b = run.generate(prompt_ids=REPEATING, max_new_tokens=12, stop_at_eos=False, temperature=0.8, seed=5)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12


@pytest.mark.parametrize("settings, needle", [
    (dict(draft="ngram", draft_tokens=0), "draft_tokens (--draft-tokens) must be a whole number in 1..64, got 0"),
    (dict(draft="ngram:0"), "--draft ngram:N takes N in 1..16"),
])
def test_bad_draft_settings(tiny_ckpt, settings, needle):
    with load(tiny_ckpt) as model, pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        model.open(**settings)


def test_a_draft_with_another_vocabulary_or_larger_is_refused(tiny_ckpt, demo_ckpt, draft_ckpt, tmp_path):
    import shutil

    untokenized = Path(shutil.copytree(draft_ckpt, tmp_path / "no-tokenizer"))
    (untokenized / "tokenizer.json").unlink()
    with load(tiny_ckpt) as model:
        with pytest.raises(ConfigError, match="its vocabulary differs"):
            model.open(draft=str(demo_ckpt))
        with pytest.raises(ConfigError, match=f"{untokenized} has no tokenizer.json, so the vocabularies cannot be "
                                              "compared"):
            model.open(draft=str(untokenized))
    with load(draft_ckpt) as small:
        with pytest.raises(ConfigError, match="is not smaller than the target"):
            small.open(draft=str(tiny_ckpt))
    same = shutil.copytree(tiny_ckpt, tmp_path / "same-size")  # no smaller either: refused
    with load(tiny_ckpt) as model:
        with pytest.raises(ConfigError, match="is not smaller than the target"):
            model.open(draft=str(same))


def test_generate_prints_and_records_the_drafts(tiny_ckpt, capsys):
    argv = ["generate", "--model", str(tiny_ckpt), "--prompt-ids", ",".join(map(str, REPEATING)), "--max-new-tokens",
            "10", "--ignore-eos", "--draft", "ngram:1", "--draft-tokens", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "speculative: ngram" in out and "acceptance" in out and "tokens a pass" in out
    assert main([*argv, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)["speculative"]
    assert s["passes"] >= 1 and s["drafted"] >= 1 and 0 <= s["acceptance_rate"] <= 1
    fails(argv[:-2] + ["--draft-tokens", "99"], capsys, "must be a whole number in 1..64")


def test_ngram_drafts_from_the_longest_match_of_two_tokens_or_more():
    from plugins.drafters import NGram

    seq = [1, 2, 3, 4, 9, 2, 3, 7, 9, 2]
    assert NGram().propose(seq, 3) == ([3, 7, 9], None)  # [9, 2] matched at 4, the latest: what followed it
    assert NGram("3").propose([1, 2, 3, 4, 1, 2, 3], 2) == ([4, 1], None)  # three tokens matched
    assert NGram().propose([5, 6, 7, 8, 6], 4) == ([], None)  # a one-token match drafts nothing by default
    assert NGram("1").propose([5, 6, 7, 8, 6], 4) == ([7, 8, 6], None)  # ngram:1 takes it


def test_a_moe_target_fetches_each_routed_expert_once_a_verify_pass(tmp_path, register_plugin):
    """Five tokens a pass, top-2 of 8 experts on 3 sparse layers: up to 10 routings a layer, but each expert comes at
    most once a pass (the union), and the ids are plain greedy's whatever the expert budget."""
    moe = write_checkpoint(preset_config("tiny-moe"), tmp_path / "tiny-moe")
    register_plugin(OraclePlugin(), "oracle")
    expert = 3 * 32 * 64 * 4
    for budget in (4 * expert, 24 * expert):
        settings = dict(keep=2, expert_policy="expert_lru", expert_budget_mb=budget / 2**20)
        with load(moe) as model:
            with model.open(**settings) as run:
                plain = run.generate(prompt_ids=[1, 2, 3], max_new_tokens=16, stop_at_eos=False)
            Oracle.answer = plain.token_ids
            with model.open(draft="oracle", draft_tokens=4, **settings) as run:
                spec = run.generate(prompt_ids=[1, 2, 3], max_new_tokens=16, stop_at_eos=False)
        assert spec.token_ids == plain.token_ids and spec.speculative["tokens_per_pass"] == 5.0
        for p in spec.per_token:
            assert p["expert_misses"] <= 3 * 8


@pytest.mark.parametrize("keep", [1, "off"])
def test_a_draft_model_proposes_its_own_greedy_continuation(tiny_ckpt, draft_ckpt, keep):
    """Whatever the kept sequence did to its cache (drafts kept, drafts rolled back), a draft model's proposal is what
    that model alone would generate greedily from the context."""
    with load(draft_ckpt) as small, small.open(keep="off") as alone:
        def own(context, k):
            return alone.generate(prompt_ids=context, max_new_tokens=k, stop_at_eos=False).token_ids

        with load(tiny_ckpt) as model, model.open(keep=keep, draft=str(draft_ckpt), draft_tokens=4) as run:
            drafter = run.drafter
            contexts = [list(REPEATING), [9, 8, 7, 6]]
            seqs = [drafter.begin(c) for c in contexts]  # two sequences of a batch, drafting in turn from one slot
            for k, keep_n in [(4, 2), (5, 0), (3, 3), (6, 1)]:
                for i, seq in enumerate(seqs):
                    proposal, probs = seq.propose(contexts[i], k)
                    assert proposal == own(contexts[i], k) and probs is None
                    contexts[i] = contexts[i] + proposal[:keep_n] + [(proposal[keep_n] + 1) % 256 if keep_n < k else 7]
                    seq.accepted(contexts[i])


@pytest.mark.parametrize("flags, needle", [
    (["--draft-tokens", "4"], "--draft-tokens sets how many tokens a drafter proposes, and no draft is set"),
    (["--draft", ""], "--draft is empty"),
    (["--draft", "  "], "--draft is empty"),
])
def test_a_draft_setting_that_would_do_nothing_is_refused(tiny_ckpt, capsys, flags, needle):
    """--draft-tokens without a draft, and an empty --draft, ran plain decoding without a word."""
    from cli_helpers import gen

    fails(gen(tiny_ckpt, *flags), capsys, needle)


def test_draft_tokens_with_kestrel_tomls_draft_is_taken(tiny_ckpt, tmp_path, capsys):
    (tmp_path / "kestrel.toml").write_text('[speculative]\ndraft = "ngram:1"\n')
    from cli_helpers import gen

    argv = gen(tiny_ckpt, "--config", str(tmp_path / "kestrel.toml"), "--draft-tokens", "3", "--json")
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["speculative"]["passes"] >= 1


def test_a_draft_with_fewer_positions_says_so_and_the_target_decodes_on_undrafted(tmp_path, tiny_ckpt):
    """A draft model that holds fewer positions than the target drafts up to its own end, with a note saying so; past
    it every pass is one plain token, and the ids stay plain greedy decoding's."""
    short = write_checkpoint(preset_config("tiny", layers=2), tmp_path / "short")
    cfg = json.loads((short / "config.json").read_text())
    cfg["max_position_embeddings"] = 16
    (short / "config.json").write_text(json.dumps(cfg))
    with load(tiny_ckpt) as model:
        with model.open(keep=1) as run:
            plain = run.generate(prompt_ids=REPEATING, max_new_tokens=12, stop_at_eos=False)
        with pytest.warns(KestrelNote, match=r"the draft model .*short holds 16 positions, fewer than the target's "
                                             r"[\d,]+: past position 16 the target decodes one token a pass, undrafted"):
            run = model.open(keep=1, draft=str(short), draft_tokens=4)
        with run:
            spec = run.generate(prompt_ids=REPEATING, max_new_tokens=12, stop_at_eos=False)
    assert spec.token_ids == plain.token_ids
    s = spec.speculative
    assert s["drafted"] <= 16 - len(REPEATING) - 1  # drafts only where the draft's positions reach
    assert s["passes"] > (12 - 1) - s["drafted"] - 1  # the rest one plain token a pass


def test_the_summary_line_says_what_its_figure_is(tiny_ckpt, capsys):
    """A speculative run's ms/token is its passes' time over the tokens they kept (a mean), a plain run's the median of
    its decode steps: each line says which."""
    from kestrel_core.cli import main

    ids = "5,17,42,99,3,5,17,42,99,3"
    assert main(["generate", "--model", str(tiny_ckpt), "--prompt-ids", ids, "--max-new-tokens", "8", "--ignore-eos",
                 "--draft", "ngram:1", "--draft-tokens", "3"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("prefill:"))
    assert re.search(r"ms/token \(the \d+ passes' time over the 7 tokens they kept\)", line), line
    assert main(["generate", "--model", str(tiny_ckpt), "--prompt-ids", ids, "--max-new-tokens", "8", "--ignore-eos"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("prefill:"))
    assert "ms/token (median of 7 decode steps)" in line, line


def test_a_draft_drawn_from_the_targets_own_distribution_is_always_kept():
    """A draft d with its distribution q is kept with probability min(1, p(d) / q(d)): where q is p, every time (a
    draft taken as one-hot would be kept only p(d) of the time)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 6, generator=g)
    sampler = Sampler(GenerationConfig(temperature=1.0, seed=2))
    p = sampler.probs(logits[0])
    drafts = [int(torch.multinomial(p, 1, generator=g)) for _ in range(300)]
    assert all(accept(logits, [d], [p], sampler, greedy=False)[0] == 1 for d in drafts)
