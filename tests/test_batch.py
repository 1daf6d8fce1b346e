"""Batched decoding on cpu_ref: one pass over the layers serves every decoding sequence, and each sequence's ids are
its ids alone, whoever joins or leaves beside it (cpu_ref computes row by row, so a row never depends on its batch)."""

from __future__ import annotations

import pytest

from kestrel_core import load
from kestrel_core.engine.batch import Batch, Request
from kestrel_core.config import GenerationConfig
from kestrel_core.errors import ConfigError
from kestrel_core.tools.presets import preset_config, write_checkpoint
from kestrel_core.engine.scheduler import Scheduler

PROMPTS = [[5, 17, 42, 99, 3], [1, 2, 3], [7, 8, 9, 10, 11, 12, 13], [100, 200], [300, 301, 302, 303]]


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return write_checkpoint(preset_config("tiny-moe"), tmp_path_factory.mktemp("batch") / "tiny-moe")


def solo(run, i, prompt, **gen):
    return run.generate(prompt_ids=prompt, **{"max_new_tokens": 5 + i, "stop_at_eos": False, **gen}).token_ids


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("keep, policy", [("off", "asymmetric"), (1, "asymmetric"), (2, "pinned_set"), (3, "belady")])
def test_each_sequence_in_a_batch_is_its_solo_run(tiny_ckpt, dtype, keep, policy):
    with load(tiny_ckpt) as model, model.open(keep=keep, policy=policy, dtype=dtype) as run:
        alone = [solo(run, i, p) for i, p in enumerate(PROMPTS)]
        for max_batch, chunk in ((2, None), (4, 2), (8, 3)):
            got = run.generate_batch([dict(prompt_ids=p, max_new_tokens=5 + i, stop_at_eos=False)
                                      for i, p in enumerate(PROMPTS)], max_batch=max_batch, prefill_chunk=chunk)
            assert [r.token_ids for r in got] == alone, (max_batch, chunk)


def test_sequences_join_and_leave_between_steps(tiny_ckpt):
    """Two start, three join three steps later with a prompt cut in chunks; each ends at its own length or EOS."""
    with load(tiny_ckpt) as model, model.open(keep=2) as run:
        alone = [solo(run, i, p) for i, p in enumerate(PROMPTS)]
        eos_at = alone[1][3]  # sequence 1 stops at its fourth token
        stopped = run.generate(prompt_ids=PROMPTS[1], max_new_tokens=6, stop_ids=[eos_at]).token_ids
        with Batch(run.runner, slots=3, max_seq=64, prefill_chunk=3) as b:
            gens = [GenerationConfig(max_new_tokens=5 + i, stop_at_eos=i == 1) for i in range(len(PROMPTS))]
            seqs = [b.add(Request(PROMPTS[0], gens[0])), b.add(Request(PROMPTS[1], gens[1], frozenset([eos_at])))]
            for _ in range(3):
                b.step()
            seqs += [b.add(Request(p, gens[i])) for i, p in enumerate(PROMPTS[2:], start=2)]  # more than the slots
            rows = []
            while b.busy:
                b.step()
                rows.append(len(b.passes[-1].rows) if b.passes else 0)
        assert [s.tokens for s in seqs] == [alone[0], stopped] + alone[2:]
        assert [s.finish_reason for s in seqs] == ["length", "stop", "length", "length", "length"]
        assert max(rows) == 3  # never more than the slots decoded together


def test_a_batch_streams_each_layer_once_a_step(tiny_ckpt):
    """At keep=1 every step streams every layer but the last: B sequences share it, so the bytes a generated token
    costs fall as 1/B."""
    per_token = {}
    with load(tiny_ckpt) as model, model.open(keep=1) as run:
        for b in (1, 2, 4):
            got = run.generate_batch([dict(prompt_ids=[3 + i], max_new_tokens=9, stop_at_eos=False) for i in range(b)],
                                     max_batch=b)
            steady = got[0].per_token[2:]  # every sequence decodes in every one of these steps
            assert {p["sequences_in_step"] for p in steady} == {b}  # the prompts went through in one pass
            per_token[b] = sum(p["bytes_uploaded"] for p in steady) / (len(steady) * b)
    assert per_token[2] == per_token[1] / 2 and per_token[4] == per_token[1] / 4


def test_the_batch_job_reports_bytes_a_generated_token(tiny_ckpt, tmp_path, capsys):
    import json

    from kestrel_core.cli import main

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt_ids": [3 + i], "max_new_tokens": 9, "stop_at_eos": False}) + "\n"
                           for i in range(4)))
    with load(tiny_ckpt) as model, model.open(keep=1) as run:
        solo_bytes = run.generate(prompt_ids=[3], max_new_tokens=9, stop_at_eos=False).counters["bytes_uploaded"]
    got = {}
    for b in (1, 4):
        out = tmp_path / f"out{b}.jsonl"
        argv = ["generate", "--model", str(tiny_ckpt), "--keep", "1", "--prompts", str(src), "--out", str(out),
                "--max-batch", str(b), "--json"]
        assert main(argv) == 0
        got[b] = json.loads(capsys.readouterr().out)
        assert got[b]["tokens"] == 36
    # One at a time: about each solo run's bytes (a little less: a sequence finds the last one's layers resident).
    assert 0.9 * solo_bytes / 9 < got[1]["bytes_per_generated_token"] <= solo_bytes / 9
    # Shared by four: the four prompts ride one pass, then every pass decodes all four, so the job costs a solo run.
    assert got[4]["bytes_per_generated_token"] == solo_bytes / 36


def test_sampled_sequences_draw_as_they_do_alone(tiny_ckpt):
    with load(tiny_ckpt) as model, model.open(keep=2) as run:
        alone = [solo(run, i, p, temperature=0.9, seed=11 + i) for i, p in enumerate(PROMPTS[:3])]
        got = run.generate_batch([dict(prompt_ids=p, max_new_tokens=5 + i, stop_at_eos=False, temperature=0.9,
                                       seed=11 + i) for i, p in enumerate(PROMPTS[:3])], max_batch=3)
        assert [r.token_ids for r in got] == alone


def test_moe_batches_fetch_the_union_of_their_rows_experts(tiny_moe):
    with load(tiny_moe) as model, model.open(keep="off", expert_policy="expert_lru",
                                             expert_budget_mb=4 * 3 * 32 * 64 * 4 / 2**20) as run:
        alone = [solo(run, i, p) for i, p in enumerate(PROMPTS[:4])]
        got = run.generate_batch([dict(prompt_ids=p, max_new_tokens=5 + i, stop_at_eos=False)
                                  for i, p in enumerate(PROMPTS[:4])], max_batch=4)
        assert [r.token_ids for r in got] == alone


def test_a_cancelled_sequence_leaves_and_frees_its_slot(tiny_ckpt):
    with load(tiny_ckpt) as model, model.open() as run:
        alone = solo(run, 3, PROMPTS[1])
        with Batch(run.runner, slots=1, max_seq=64) as b:
            first = b.add(Request(PROMPTS[0], GenerationConfig(max_new_tokens=50, stop_at_eos=False)))
            second = b.add(Request(PROMPTS[1], GenerationConfig(max_new_tokens=8, stop_at_eos=False)))
            for _ in range(4):
                b.step()
            first.cancel()
            b.run_until_done()
        assert first.finish_reason == "cancelled" and len(first.tokens) < 50
        assert second.tokens == alone and second.finish_reason == "length"


@pytest.mark.parametrize("kwargs, needle", [
    (dict(max_batch=0), "max_batch must be a whole number in 1..256"),
    (dict(prefill_chunk=0), "prefill_chunk must be a whole number >= 1"),
])
def test_batch_settings_are_checked(tiny_ckpt, kwargs, needle):
    with load(tiny_ckpt) as model, model.open() as run:
        with pytest.raises(ConfigError, match=needle):
            run.generate_batch([dict(prompt_ids=[1, 2])], **kwargs)
        with pytest.raises(ConfigError, match=needle):  # a scheduler took prefill_chunk=0; its batch died on its first step
            Scheduler(run, **kwargs)
        with pytest.raises(ConfigError, match="request 0: a dict"):
            run.generate_batch([[1, 2]])


def test_a_batch_job_writes_each_line_in_order(tiny_ckpt, tmp_path, capsys):
    import json

    from kestrel_core.cli import main

    lines = [{"prompt_ids": PROMPTS[0], "max_new_tokens": 4, "stop_at_eos": False},
             {"prompt": "hello", "max_new_tokens": 3, "stop_at_eos": False}, None,
             {"prompt_ids": PROMPTS[2], "temperature": 0.8, "seed": 3, "max_new_tokens": 5, "stop_at_eos": False}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join((json.dumps(x) if x else "   ") + "\n" for x in lines))
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(tiny_ckpt), "--prompts", str(src), "--out", str(out), "--max-batch", "2"]
    assert main(argv) == 0 and "wrote 3 results (0 errors" in capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["line"] for r in rows] == [1, 2, 4]  # the file's line numbers; the blank one is skipped
    with load(tiny_ckpt) as model, model.open() as run:
        for row, line in zip(rows, [x for x in lines if x]):
            assert row["token_ids"] == run.generate(**line).token_ids  # each as it runs alone
    before = out.read_bytes()
    assert main(argv) == 2 and "already exists" in capsys.readouterr().err
    assert out.read_bytes() == before  # never replaced


@pytest.mark.parametrize("content, needle", [
    ('{"prompt": 5}\n', "line 1: prompt must be text"),
    ('{"prompt_ids": [1]}\n{"prompt_ids": [1], "prompt": "x"}\n', "line 2: give exactly one of prompt"),
    ('{"prompt_ids": [1]}\n\n[1, 2]\n', "line 3: a JSON object is needed"),
    ('{"prompt_ids": [1], "top_p": 2}\n', "top_p (--top-p) must be in (0, 1], got 2"),
    ('{"prompt_ids": [1], "colour": 2}\n', "line 1: unknown key(s) colour"),
    ('{"prompt_ids": [1\n', "line 1: not valid JSON"),
    ('\n\n', "no prompts"),
    # these named the --prompt and --prompt-ids flags
    ('{"prompt": ""}\n', "line 1: the prompt is empty; give some text as prompt, or ids as prompt_ids"),
    ('{"prompt": null}\n', "line 1: the prompt is empty; give some text as prompt"),
    ('{"prompt_ids": []}\n', "line 1: the prompt is empty; give some text as prompt"),
    ('{"prompt": "a", "max_new_tokens": 2, "prompt": "b"}\n', "line 1: the key 'prompt' appears twice"),  # was: "b"
    ('{"prompt_ids": [%s]}\n' % ("1" * 5000), "line 1: not valid JSON (a number of more than 4300 digits)"),  # was: a
    # traceback (int() refuses more than 4300 digits with a ValueError json.loads lets through)
])
def test_a_bad_line_is_named_before_any_work(tiny_ckpt, tmp_path, capsys, content, needle):
    from cli_helpers import fails

    src = tmp_path / "in.jsonl"
    src.write_text(content)
    fails(["generate", "--model", str(tiny_ckpt), "--prompts", str(src), "--out", str(tmp_path / "o.jsonl")], capsys,
          needle)
    assert not (tmp_path / "o.jsonl").exists()


def test_waiting_prompts_share_a_pass_up_to_the_chunk(tiny_ckpt):
    """Five prompts of 3 tokens and one generated token each, so every pass is a prefill pass: with no chunk they all
    ride one pass; with a chunk of 4 tokens a pass takes what fits (15 tokens: 4 passes, a prompt split across two
    where it must). At keep=1 each pass uploads the same layers. Ids are each solo run's either way."""
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(5)]
    with load(tiny_ckpt) as model, model.open(keep=1) as run:
        alone = [run.generate(prompt_ids=p, max_new_tokens=4, stop_at_eos=False).token_ids for p in prompts]
        uploads = {}
        for chunk in (None, 4):
            before = run.runner.counters.snapshot()["layer_uploads"]
            got = run.generate_batch([dict(prompt_ids=p, max_new_tokens=1, stop_at_eos=False) for p in prompts],
                                     max_batch=5, prefill_chunk=chunk)
            uploads[chunk] = run.runner.counters.snapshot()["layer_uploads"] - before
            assert [r.token_ids for r in got] == [a[:1] for a in alone]
        assert uploads[4] == 4 * uploads[None] > 0
        got = run.generate_batch([dict(prompt_ids=p, max_new_tokens=4, stop_at_eos=False) for p in prompts],
                                 max_batch=5, prefill_chunk=4)
        assert [r.token_ids for r in got] == alone


def test_a_prompt_that_no_token_of_a_step_went_to_does_not_count_that_step(tiny_ckpt):
    """A chunk of 4 tokens, prompts of 4 and 3: the first takes the whole first step, the second rides only the next,
    so that is its one prefill pass (its prefill time runs from the step before it)."""
    gen = GenerationConfig(max_new_tokens=1, stop_at_eos=False)
    with load(tiny_ckpt) as model, model.open(keep=1) as run:
        with Batch(run.runner, slots=2, max_seq=16, prefill_chunk=4) as batch:
            first, second = batch.add(Request([10, 20, 30, 40], gen)), batch.add(Request([11, 21, 31], gen))
            batch.run_until_done()
    assert first.prefill_passes == [0] and second.prefill_passes == [1]


@pytest.mark.parametrize("flags, toml, needle", [
    (["--draft-tokens", "3"], None, "--draft-tokens sets how many tokens a drafter proposes, and no draft is set"),
    (["--draft", " "], None, "--draft is empty"),
    (["--max-batch", "0"], None, "--max-batch must be a whole number in 1..256, got 0"),
    (["--prefill-chunk", "0"], None, "--prefill-chunk must be a whole number >= 1 (or left out: a whole prompt a step), got 0"),
])
def test_a_batch_job_refuses_what_it_cannot_do_before_the_model_loads(tiny_ckpt, tmp_path, capsys, monkeypatch, flags,
                                                                     toml, needle):
    """--draft-tokens without a draft would draft nothing; --max-batch 0 named max_batch, not the flag."""
    from cli_helpers import fails

    import kestrel_core.commands.generate as generate

    def no_load(*a, **kw):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(generate, "load", no_load)
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt_ids": [1, 2], "max_new_tokens": 2}\n')
    if toml is not None:
        (tmp_path / "kestrel.toml").write_text(toml)
        flags = [*flags, "--config", str(tmp_path / "kestrel.toml")]
    fails(["generate", "--model", str(tiny_ckpt), "--prompts", str(src), "--out", str(tmp_path / "o.jsonl"), *flags],
          capsys, needle)
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize("flags, needle", [
    (["--max-batch", "4"], "--max-batch sets a batch job's batch: add --prompts IN.jsonl --out OUT.jsonl, or drop it"),
    (["--prefill-chunk", "-5", "--max-batch", "0"], "--max-batch and --prefill-chunk set a batch job's batch"),
])
def test_batch_flags_without_a_batch_job_are_refused(tiny_ckpt, capsys, flags, needle):
    """They were silently ignored by a one-prompt generate."""
    from cli_helpers import fails, gen

    fails(gen(tiny_ckpt, *flags), capsys, needle)


def test_a_prompts_file_from_any_editor_is_read_as_written(tiny_ckpt, tmp_path, capsys):
    """A byte-order mark was "not valid JSON" on line 1, and a raw U+2028 or U+0085 inside a prompt (JSON allows
    them) split its line in two: "Unterminated string"."""
    import json

    from kestrel_core.cli import main

    prompts = ["one\u2028two", "three\x85four", "five"]
    src = tmp_path / "in.jsonl"
    body = "\r\n".join(json.dumps({"prompt": p, "max_new_tokens": 1}, ensure_ascii=False) for p in prompts)
    src.write_bytes(b"\xef\xbb\xbf" + body.encode() + b"\r\n")
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--model", str(tiny_ckpt), "--prompts", str(src), "--out", str(out)]) == 0
    assert "wrote 3 results (0 errors" in capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().split("\n") if line]
    assert [(r["line"], r["prompt"]) for r in rows] == [(1, prompts[0]), (2, prompts[1]), (3, prompts[2])]


def test_a_text_line_far_past_the_context_is_refused_without_tokenizing_it_whole(tiny_ckpt, tmp_path, monkeypatch):
    """A line of a million tokens was tokenized whole before the length check (a 256 MiB line: minutes, gigabytes)."""
    from kestrel_core.tools.batch_job import read_requests
    from kestrel_core.formats.tokenizer import Tokenizer

    real = Tokenizer.encode

    def encode(self, text):
        assert len(text) < 100_000, "tokenized whole"
        return real(self, text)

    monkeypatch.setattr(Tokenizer, "encode", encode)
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hello", "max_new_tokens": 2}\n' + '{"prompt": "%s"}\n' % ("ab " * 10**6))
    with load(tiny_ckpt) as model, model.open(backend="cpu_ref") as run:
        with pytest.raises(ConfigError, match="line 2: the model's context is 512 tokens \\(max_position_embeddings\\); the prompt takes over 511"):
            read_requests(run, str(src))
        src.write_text('{"prompt": "hello", "max_new_tokens": 2}\n')
        (request,), _ = read_requests(run, str(src))
        assert request.prompt_ids == model.tokenizer.encode("hello")
        with pytest.raises(ConfigError, match="^the model's context is 512 tokens \\(max_position_embeddings\\); the prompt takes over 511"):  # the Python API, the same way
            run.generate(prompt="ab " * 10**6)


@pytest.mark.parametrize("content, needle", [('{"prompt_ids": [1\n', "line 1: not valid JSON"),
                                             ('{"prompt": "a", "colour": 1}\n', "line 1: unknown key(s) colour"),
                                             (None, "cannot read (No such file or directory)")])
def test_the_prompts_file_is_read_and_checked_before_the_model_loads(tiny_ckpt, tmp_path, capsys, monkeypatch,
                                                                       content, needle):
    """It was read after the model loaded and the run opened (on cuda: after pinning every weight)."""
    from cli_helpers import fails

    import kestrel_core.commands.generate as generate

    def no_load(*a, **kw):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(generate, "load", no_load)
    src = tmp_path / "in.jsonl"
    if content is not None:
        src.write_text(content)
    fails(["generate", "--model", str(tiny_ckpt), "--prompts", str(src), "--out", str(tmp_path / "o.jsonl")], capsys,
          needle)
