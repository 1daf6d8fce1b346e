"""A Mixture-of-Experts model in a batch, a scheduler and the server (tiny-moe, cpu_ref, which has the expert table).

Every decode step of a batch reads the expert table, one row or many; a step with prompt rows routes on the host. Which
a step does is one fact (``Runner.reads_table``). Every sequence's greedy ids are its solo ids, and the policy hears the
union of the rows' routing a step later.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench.serve_process import ServeProcess
from kestrel_core import load
from kestrel_core.engine.batch import Batch
from kestrel_core.tools.presets import preset_config, write_checkpoint
from kestrel_core.engine.scheduler import Scheduler

EXPERT = 3 * 32 * 64 * 4  # one tiny-moe expert in cpu_ref's float32 buffers
LONG_FIRST = [([5, 17, 42, 99, 3], 12), ([1, 2, 3], 3), ([7, 8, 9], 5)]  # the longest generation takes slot 0


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> Path:
    return write_checkpoint(preset_config("tiny-moe"), tmp_path_factory.mktemp("moe-batches") / "tiny-moe")


@pytest.fixture(scope="module", params=["off-lru", "keep2", "whole-layers"])
def run(request, tiny_moe):
    settings = {"off-lru": dict(keep="off", expert_policy="expert_lru", expert_budget_mb=5 * EXPERT / 2**20),
                "keep2": dict(keep=2), "whole-layers": dict(keep="off")}[request.param]
    with load(tiny_moe) as model, model.open(backend="cpu_ref", **settings) as r:
        assert r.runner.schedule is not None  # these runs have the expert table
        yield r


def solo(run) -> list[list[int]]:
    return [run.generate(prompt_ids=p, max_new_tokens=n, stop_at_eos=False).token_ids for p, n in LONG_FIRST]


@pytest.mark.parametrize("max_batch", [2, 8])
def test_generate_batch_with_the_long_request_in_slot_0_is_each_solo_run(run, max_batch):
    got = run.generate_batch([dict(prompt_ids=p, max_new_tokens=n, stop_at_eos=False) for p, n in LONG_FIRST],
                             max_batch=max_batch)
    assert [r.token_ids for r in got] == solo(run)


def test_every_decode_step_of_a_batch_reads_the_table_and_the_policy_hears_the_union_of_its_rows(run, monkeypatch):
    from kestrel_core.config import GenerationConfig
    from kestrel_core.engine.batch import Request

    from kestrel_core.engine import runner as runner_mod

    heard = []
    real = runner_mod.hear_routing

    def hear(runner, step, routed, landed=None):
        heard.append([len(set(chosen)) for chosen in routed])
        return real(runner, step, routed, landed)

    monkeypatch.setattr(runner_mod, "hear_routing", hear)
    with Batch(run.runner, slots=4, max_seq=64) as b:
        seqs = [b.add(Request(p, GenerationConfig(max_new_tokens=n, stop_at_eos=False))) for p, n in LONG_FIRST]
        b.run_until_done()
    assert [s.tokens for s in seqs] == solo(run)
    decode = [p for p in b.passes if p.decode_index >= 0]
    assert decode and all(p.table for p in decode)  # one row or three: every decode step reads the table
    k = run.model.config.num_experts_per_tok
    assert all(k <= n <= 3 * k for layers in heard for n in layers)
    assert any(n > k for layers in heard for n in layers)  # three rows' experts heard together: more than one row's


def test_the_scheduler_serves_a_moe_model(run):
    sched = Scheduler(run, max_batch=8, max_queue=8)
    sched.start()
    try:
        seqs = [sched.submit(run.request(prompt_ids=p, max_new_tokens=n, stop_at_eos=False)) for p, n in LONG_FIRST]
        assert all(s.finished.wait(60) for s in seqs)
    finally:
        sched.stop(cancel=True)
    assert [s.error for s in seqs] == [None] * 3
    assert [s.tokens for s in seqs] == solo(run)


def test_kestrel_serve_starts_on_a_moe_model_and_answers_each_solo_run(tiny_moe, tmp_path):
    with load(tiny_moe) as model, model.open(backend="cpu_ref") as r:
        want = solo(r)
    d = Path(shutil.copytree(tiny_moe, tmp_path / "tiny-moe"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    server = ServeProcess(d, "--backend", "cpu_ref")  # the default --max-batch 8: its warm-up died on MoE
    try:
        client = server.client()
        import concurrent.futures

        def ask(i):
            p, n = LONG_FIRST[i]
            got = client.completions.create(model=server.name, prompt=p, max_tokens=n, temperature=0,
                                            extra_body={"return_token_ids": True, "ignore_eos": True})
            return got.choices[0].token_ids

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            assert list(pool.map(ask, range(3))) == want
    finally:
        server.stop(30)


@pytest.mark.parametrize("settings, limit, chunk, why", [
    (dict(expert_policy="expert_lru", expert_budget_mb=5 * EXPERT / 2**20), None, 8192, "streams its layers' routed"),
    ({}, None, 512, "the decoding sequences wait"),
    (dict(expert_policy="expert_lru", expert_budget_mb=5 * EXPERT / 2**20), 16, 16, "--prefill-chunk"),
])
def test_the_servers_prompt_chunk_defaults_by_whether_its_chunks_stream_experts(tiny_moe, tmp_path, settings, limit,
                                                                                  chunk, why):
    """Where a chunk streams its layers' experts a step costs about as much at 8,192 prompt tokens as at 512 (bench
    moe-prefill), so the server's default chunk is the larger there; a chunk given is the chunk."""
    from kestrel_core.config import KestrelConfig
    from kestrel_core.serve.service import READY, Limits, Service

    d = Path(shutil.copytree(tiny_moe, tmp_path / "tiny-moe"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    over = {f"residency__{k}": v for k, v in settings.items()}
    service = Service(KestrelConfig().override(model=str(d), backend__name="cpu_ref", **over), "m",
                      Limits(max_batch=2, prefill_chunk=limit))
    service.load()
    try:
        assert service.state == READY, service.load_error
        assert service.prefill_chunk == chunk and service.scheduler.prefill_chunk == chunk
        (line,) = [x for x in service.describe() if x.startswith("prefill: ")]
        assert line.startswith(f"prefill: {chunk:,} prompt tokens a step (") and why in line
    finally:
        service.close()


def test_a_servers_prompt_chunk_below_one_is_refused_naming_the_default(tiny_moe, tmp_path):
    import inspect

    from kestrel_core.config import KestrelConfig
    from kestrel_core.engine.scheduler import Scheduler
    from kestrel_core.engine.batch import PREFILL_CHUNK
    from kestrel_core.serve.service import FAILED, Limits, Service

    service = Service(KestrelConfig().override(model=str(tiny_moe), backend__name="cpu_ref"), "m",
                      Limits(prefill_chunk=0))
    service.load()
    assert service.state == FAILED
    assert str(service.load_error) == ("prefill_chunk must be a whole number >= 1 (or left out: 512, or 8192 for a MoE "
                                       "model under an expert policy), got 0")
    assert inspect.signature(Scheduler).parameters["prefill_chunk"].default == PREFILL_CHUNK == 512  # the API's
