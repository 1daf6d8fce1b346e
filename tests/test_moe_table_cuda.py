"""A Mixture-of-Experts decode step on the GPU with no host in the loop: routing on the device, each routed expert read
through the expert table (its slot, or its page-locked host copy), the whole step captured as one CUDA graph, and the
expert policy a step behind. Ids are the same whatever the budget, policy, path or graph mode, in bfloat16 and q8."""

from __future__ import annotations

import itertools

import pytest
import torch

from kestrel_core import load
from kestrel_core.tools.presets import preset_config, write_checkpoint

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPT = [5, 17, 42, 99, 3]
EXPERT_BF16 = 3 * 32 * 64 * 2  # one tiny-moe expert in bfloat16


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return write_checkpoint(preset_config("tiny-moe"), tmp_path_factory.mktemp("table-cuda") / "tiny-moe", seed=3)


@pytest.fixture(scope="module")
def tiny_moe_q8(tiny_moe, tmp_path_factory):
    from kestrel_core.tools.quantize import quantize_checkpoint

    out = tmp_path_factory.mktemp("table-cuda") / "tiny-moe-q8"
    quantize_checkpoint(tiny_moe, out, 32)
    return out


def generate(model_dir, tokens=16, **settings):
    with load(model_dir) as model, model.open(backend="cuda", **settings) as run:
        if run.backend._grouped is None:
            pytest.skip("the grouped expert kernels need Triton")
        table = run.runner.schedule is not None
        return run.generate(prompt_ids=PROMPT, max_new_tokens=tokens, stop_at_eos=False), table


@pytest.mark.parametrize("checkpoint", ["bf16", "q8"])
def test_ids_are_off_s_across_budgets_policies_paths_and_graphs(tiny_moe, tiny_moe_q8, checkpoint):
    path = tiny_moe if checkpoint == "bf16" else tiny_moe_q8
    ref, table = generate(path, keep="off")
    assert table and ref.steps["replayed"] > 0  # the whole step, sparse layers too, replayed as one graph
    with load(path) as model, model.open(backend="cuda") as run:
        expert = run.backend.units[(1, 0)].nbytes
    for policy, n, graphs, decode in itertools.product(["expert_lru", "expert_lfu"], [2, 5, 24], ["auto", "off"],
                                                       ["table", "host"]):
        got, _ = generate(path, keep="off", expert_policy=policy, expert_budget_mb=n * expert / 2**20, graphs=graphs,
                          expert_decode=decode)
        assert got.token_ids == ref.token_ids, (policy, n, graphs, decode)
    for keep in (1, 2):
        got, _ = generate(path, keep=keep, prefetch=1)
        assert got.token_ids == ref.token_ids, keep


def strictly(fn):
    """``fn`` under torch's sync debug mode set to error: an operation that waits for the device raises."""

    def run(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    return run


def test_no_decode_step_waits_for_the_host(tiny_moe, monkeypatch):
    """Every decode step's work, eager or captured, and every replay, runs with a sync an error (the capture's own
    synchronize before it starts is the capture's, not the step's; a prompt's pass may route on the host)."""
    from kestrel_core.engine.runner import Runner
    from backends.cuda.backend import CudaBackend

    real = Runner.decode_step

    def decode_step(self, state, cache, boundaries, rows, spans=(), every_row=frozenset(), bound=None):
        if spans:  # a prompt's pass may route on the host
            return real(self, state, cache, boundaries, rows, spans, every_row, bound)
        return strictly(real)(self, state, cache, boundaries, rows, bound=bound)

    monkeypatch.setattr(Runner, "decode_step", decode_step)
    monkeypatch.setattr(CudaBackend, "replay", strictly(CudaBackend.replay))
    result, table = generate(tiny_moe, 24, keep="off", expert_policy="expert_lru",
                             expert_budget_mb=4 * EXPERT_BF16 / 2**20)
    assert table and result.steps["replayed"] > 0
    assert sum(p["expert_misses"] for p in result.per_token) > 0  # host copies were read, and no step waited


def test_no_allocation_after_warm_up(tiny_moe):
    result, _ = generate(tiny_moe, 32, keep="off", expert_policy="expert_lfu", expert_budget_mb=5 * EXPERT_BF16 / 2**20)
    steady = result.per_token[6:]
    assert sum(p["layer_uploads"] for p in steady) > 0  # the cache turns over
    assert sum(p["allocations"] + p["frees"] for p in steady) == 0
    assert result.step_modes[-10:] == ["replayed"] * 10


def test_the_kernel_reads_a_host_copy_as_it_reads_a_slot(tiny_moe):
    """The same bytes from pinned host memory and from a device buffer give bitwise the same output."""
    with load(tiny_moe) as model, model.open(backend="cuda", keep="off", expert_policy="expert_lru",
                                              expert_budget_mb=2 * EXPERT_BF16 / 2**20) as run:
        backend = run.backend
        if backend._experts is None:
            pytest.skip("no expert table here")
        table = backend._experts
        x = torch.randn(1, model.config.hidden_size, dtype=backend.dtype, device=backend.device)
        w = torch.tensor([[0.6, 0.4]], dtype=backend.dtype, device=backend.device)
        ids = torch.tensor([[3, 6]], device=backend.device)
        from_host = backend.routed_experts(1, x, w, ids).clone()
        for e in (3, 6):  # copy both to device buffers and point the table there
            bufs = [torch.empty_like(backend._host[entry.source], device=backend.device)
                    for entry in backend.units[(1, e)].entries]
            for b, entry in zip(bufs, backend.units[(1, e)].entries):
                b.copy_(backend._host[entry.source])
            table.point([], [((1, e), bufs)], torch.cuda.current_stream(), lambda key: None)
            assert int(table.table[1, e, 0]) == bufs[0].data_ptr()
            keep = getattr(table, "_test_keep", [])
            keep.append(bufs)
            table._test_keep = keep
        from_device = backend.routed_experts(1, x, w, ids)
        assert torch.equal(from_host, from_device)


@pytest.mark.parametrize("checkpoint", ["bf16", "q8"])
def test_a_batch_through_the_table_is_its_solo_runs_and_replays(tiny_moe, tiny_moe_q8, checkpoint):
    """A batched decode step reads each routed expert once for the rows routed to it (the grouped kernels), captured
    with the rest of the step: each sequence's ids are its solo run's, with its experts in slots and on the host. In
    float32, as tests/test_batch_cuda.py: a step's dense linears are GEMMs of another shape than a one-row step's (a q8
    one's is the GEMV kernel against dequantize-then-matmul), which on cuda is not bitwise; the experts' rows are."""
    path = tiny_moe if checkpoint == "bf16" else tiny_moe_q8
    prompts = [PROMPT, [1, 2, 3], [7, 8, 9, 10, 11], [200, 3, 9]]
    for settings in (dict(keep="off"), dict(keep="off", expert_policy="expert_lru", expert_budget_mb=0.1)):
        with load(path) as model, model.open(backend={"name": "cuda", "dtype": "float32"}, **settings) as run:
            if run.backend._grouped is None:
                pytest.skip("the grouped expert kernels need Triton")
            assert run.runner.schedule is not None
            alone = [run.generate(prompt_ids=p, max_new_tokens=10, stop_at_eos=False).token_ids for p in prompts]
            got = run.generate_batch([dict(prompt_ids=p, max_new_tokens=10, stop_at_eos=False) for p in prompts],
                                     max_batch=4)
        assert [g.token_ids for g in got] == alone, settings
        assert sum(g.steps["replayed"] for g in got) > 0, settings  # batched steps came from a captured graph
