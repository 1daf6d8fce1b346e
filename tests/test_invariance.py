"""Token ids do not depend on the residency window: keep x policy x allocator, greedy and sampled."""

from __future__ import annotations

import itertools
import json

import pytest

POLICIES = ["asymmetric", "future_evicting", "pinned_set"]
ALLOCATORS = ["pool", "free"]


def keeps_for(n_layers: int) -> list:
    return sorted({1, 2, n_layers // 2, n_layers - 1, n_layers}) + ["off"]


@pytest.mark.parametrize("ckpt", ["tiny_ckpt", "tiny_llama_ckpt"])
def test_greedy_ids_identical_across_keep_policy_allocator(request, run_model, backend, ckpt):
    model_dir = request.getfixturevalue(ckpt)
    ref, _ = run_model(model_dir, backend, residency__keep="off")
    L = _layers(model_dir)
    assert len(ref.token_ids) == 6
    seen = 0
    for keep, policy, allocator in itertools.product(keeps_for(L), POLICIES, ALLOCATORS):
        got, _ = run_model(model_dir, backend, residency__keep=keep, residency__policy=policy,
                           residency__allocator=allocator)
        assert got.token_ids == ref.token_ids, (keep, policy, allocator)
        seen += 1
    assert seen == len(keeps_for(L)) * 6


SAMPLING = dict(generation__temperature=0.9, generation__top_k=40, generation__top_p=0.9)


def test_sampled_ids_identical_across_keeps(tiny_ckpt, run_model, backend):
    L = _layers(tiny_ckpt)
    ref, _ = run_model(tiny_ckpt, backend, residency__keep="off", generation__seed=11, **SAMPLING)
    greedy, _ = run_model(tiny_ckpt, backend, residency__keep="off")
    assert ref.token_ids != greedy.token_ids  # sampling really sampled
    for keep, policy in itertools.product(keeps_for(L), POLICIES):
        got, _ = run_model(tiny_ckpt, backend, residency__keep=keep, residency__policy=policy,
                           generation__seed=11, **SAMPLING)
        assert got.token_ids == ref.token_ids, (keep, policy)


def test_the_seed_decides_sampled_ids(tiny_ckpt, run_model, backend):
    runs = [run_model(tiny_ckpt, backend, residency__keep=2, generation__seed=s, **SAMPLING)[0].token_ids
            for s in range(4)]
    assert len({tuple(r) for r in runs}) > 1, runs
    again, _ = run_model(tiny_ckpt, backend, residency__keep=3, generation__seed=2, **SAMPLING)
    assert again.token_ids == runs[2]


def _layers(model_dir) -> int:
    return json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
