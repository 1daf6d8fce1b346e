"""A GGUF's quantized weights on the GPU, held and computed as the file's own blocks (backends/cuda/blocks.py):
every entry is blocks, a token streams the stored bytes, ids are the same at every keep and in a batch as alone,
and the logits agree with cpu_ref's (which computes from the same blocks, dequantized to float32) within the
stated tolerance (docs/backends.md)."""

from __future__ import annotations

import pytest
import torch

from kestrel_core import load
from tests.gguf_files import DIMS, K_DIMS, K_TYPES, T, write_model

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[5, 40, 77], [99, 3], [7, 7, 7, 7], [200, 1], [11, 12, 13, 14, 15]]
# the largest difference of a first-step logit, cuda (float32 activations) against cpu_ref, over the logits' scale, by
# [backend] gguf_kernels: the int8 kernels quantize each linear's input to two int8 digits a value; that quantization,
# applied to cpu_ref's linears on these models, moved the logits by 0.4e-4 to 1.4e-4 of their scale (5 prompts); "auto"
# computes a prompt's rows (the first step's) with the int8 kernels
LOGIT_TOLERANCE = {"float": 1e-4, "int8": 5e-4, "auto": 5e-4}


@pytest.fixture(scope="module")
def k_model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("blocks") / "k.gguf", dims=K_DIMS, types=K_TYPES)[0]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_entry_is_blocks_and_ids_do_not_move_with_keep(k_model, dtype):
    ids, per_token = {}, {}
    with load(k_model) as model:
        stored = {spec.key: sum(model.checkpoint.info(n).nbytes for n, _ in spec.tensors.values())
                  for spec in model.units}
        for keep in ("off", 1, 2):
            with model.open(backend={"name": "cuda", "dtype": dtype}, keep=keep) as run:
                units = run.backend.units.units
                assert {e.geometry.dtype for u in units.values() for e in u.entries} == {"gguf-blocks"}
                assert {key: u.nbytes for key, u in units.items()} == stored  # the file's bytes, nothing added
                res = run.generate(prompt_ids=PROMPTS[0], max_new_tokens=12, stop_at_eos=False)
                assert res.memory["gguf_dequantized_entries"] == 0
                ids[keep], per_token[keep] = res.token_ids, [p["bytes_uploaded"] for p in res.per_token[1:]]
    assert ids[1] == ids[2] == ids["off"]
    layer = next(iter(stored.values()))
    assert all(b > 0 and b % layer == 0 for b in per_token[1])  # whole layers of stored bytes a token
    assert per_token["off"] == [0] * len(per_token["off"])


@pytest.mark.parametrize("kernels", ["float", "int8", "auto"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_batch_of_block_weights_is_its_solo_runs(k_model, dtype, kernels):
    with load(k_model) as model, model.open(backend={"name": "cuda", "dtype": dtype, "gguf_kernels": kernels},
                                            keep=1) as run:
        alone = [run.generate(prompt_ids=p, max_new_tokens=10, stop_at_eos=False).token_ids for p in PROMPTS]
        got = run.generate_batch([dict(prompt_ids=p, max_new_tokens=10, stop_at_eos=False) for p in PROMPTS],
                                 max_batch=4)
    assert [r.token_ids for r in got] == alone


# one model a type: every linear stored in it (rows of 256 for the k-quants, 64 for the 32-value types)
TYPE_MODELS = {t: ({k: (T.F32 if k in ("token_embd", "output") else getattr(T, t)) for k in K_TYPES},
                   K_DIMS if t.endswith("_K") or t == "IQ4_XS" else DIMS)
               for t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_NL",
                         "IQ4_XS")}


@pytest.mark.parametrize("kernels", ["float", "int8", "auto"])
@pytest.mark.parametrize("qtype", sorted(TYPE_MODELS))
def test_cuda_logits_agree_with_cpu_ref_within_the_stated_tolerance(qtype, kernels, tmp_path):
    types, dims = TYPE_MODELS[qtype]
    path = write_model(tmp_path / f"{qtype}.gguf", dims=dims, types=types)[0]
    logits = {}
    with load(path) as model:
        # cpu_ref's float32 path (host_kernels off: its host kernel quantizes x, as the int8 kernels do)
        for backend in ({"name": "cuda", "dtype": "float32", "gguf_kernels": kernels},
                        {"name": "cpu_ref", "host_kernels": "off"}):
            with model.open(backend=backend, keep=1) as run:
                if backend["name"] == "cuda" and qtype != "Q8_0":  # a layer all Q8_0 streams as kestrel's q8
                    assert {e.geometry.dtype for u in run.backend.units.units.values() for e in u.entries} == {"gguf-blocks"}
                res = run.generate(prompt_ids=PROMPTS[0], max_new_tokens=1, keep_logits=True, stop_at_eos=False)
                logits[str(backend)] = res.logits[0].float().cpu().reshape(-1)
    cuda, ref = logits.values()
    assert (cuda - ref).abs().max() <= LOGIT_TOLERANCE[kernels] * ref.abs().max()


def test_a_host_ring_stages_the_blocks_and_ids_do_not_move(k_model):
    """A host budget below the model: the ring stages each unit's blocks as stored (not floats), eagerly. (The model's
    streamed units are about half a MiB: the budget is set just below what pinning them all takes.)"""
    with load(k_model) as model:
        with model.open(backend="cuda", keep=1) as run:
            assert run.backend.host_budget.mode == "all"
            pinned = run.backend.host_pinned_bytes
            want = run.generate(prompt_ids=PROMPTS[0], max_new_tokens=8, stop_at_eos=False)
        with model.open(backend="cuda", keep=1, host_budget_mb=(pinned - 1) / 2**20) as run:
            assert run.backend.host_budget.mode == "ring"
            got = run.generate(prompt_ids=PROMPTS[0], max_new_tokens=8, stop_at_eos=False)
    assert got.token_ids == want.token_ids
    assert [p["bytes_uploaded"] for p in got.per_token] == [p["bytes_uploaded"] for p in want.per_token]
    assert got.memory["host_ring_hot_bytes"] + got.memory["host_ring_cold_bytes"] > 0


def test_block_experts_run_through_the_expert_table_with_the_ids_of_every_path(tmp_path):
    """A Qwen3-MoE GGUF whose experts are blocks (gate Q5_K beside up Q6_K, down Q4_K): the grouped kernels read them
    through the expert table and on the host path, and the ids equal every expert resident's."""
    path = write_model(tmp_path / "moe.gguf", arch="qwen3moe", dims={**K_DIMS, "expert_ff": 256}, types=K_TYPES)[0]
    ids = {}
    with load(path) as model:
        with model.open(backend="cuda", keep="off") as run:
            assert run.backend.expert_table, run.backend.expert_table_refusal
            experts = [u.nbytes for u in run.backend.units.experts()]
            ids["off"] = run.generate(prompt_ids=PROMPTS[0], max_new_tokens=10, stop_at_eos=False).token_ids
        budget = 3 * max(experts) / 2**20  # three of a layer's four experts
        for decode in ("table", "host"):
            with model.open(backend="cuda", keep=1, expert_policy="expert_lru", expert_budget_mb=budget,
                            expert_decode=decode) as run:
                res = run.generate(prompt_ids=PROMPTS[0], max_new_tokens=10, stop_at_eos=False)
                ids[decode] = res.token_ids
                assert {e.geometry.dtype for u in run.backend.units.units.values() for e in u.entries
                        if e.name != "router"} == {"gguf-blocks"}
    assert ids["table"] == ids["host"] == ids["off"]


def test_a_prompts_block_experts_run_every_expert_at_once_and_ids_hold(tmp_path, monkeypatch):
    """gguf_kernels = "auto": a prompt's routed experts (blocks of the tensor-core types) run through
    ``prompt_experts``, every expert of a layer in one launch a projection; the ids equal every expert resident's
    with an expert budget (the experts then fetched a chunk at a time), and the first logits stay within the int8
    kernels' tolerance of the float kernels' run."""
    from backends.cuda import prompt_experts

    path = write_model(tmp_path / "moe.gguf", arch="qwen3moe", dims={**K_DIMS, "expert_ff": 256}, types=K_TYPES)[0]
    rows, real = [], prompt_experts.prompt_experts
    monkeypatch.setattr(prompt_experts, "prompt_experts", lambda x, *a: rows.append(x.shape[0]) or real(x, *a))
    ids, logits = {}, {}
    with load(path) as model:
        for kernels in ("auto", "float"):
            with model.open(backend={"name": "cuda", "dtype": "float32", "gguf_kernels": kernels}, keep="off") as run:
                res = run.generate(prompt_ids=PROMPTS[4], max_new_tokens=8, stop_at_eos=False, keep_logits=True)
                ids[kernels], logits[kernels] = res.token_ids, res.logits[0].float().cpu()
                budget = 3 * max(u.nbytes for u in run.backend.units.experts()) / 2**20  # 3 of a layer's 4 experts
            if kernels == "auto":
                assert rows and rows[0] == len(PROMPTS[4])  # the prompt's rows, every sparse layer
                rows.clear()
        with model.open(backend={"name": "cuda", "dtype": "float32"}, keep=1, expert_policy="expert_lru",
                        expert_budget_mb=budget, expert_decode="host") as run:
            assert run.generate(prompt_ids=PROMPTS[4], max_new_tokens=8, stop_at_eos=False).token_ids == ids["auto"]
    assert rows  # the budgeted run's prompt took them too
    ref = logits["float"]
    assert (logits["auto"] - ref).abs().max() <= LOGIT_TOLERANCE["auto"] * ref.abs().max()
