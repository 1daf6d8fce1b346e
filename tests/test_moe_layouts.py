"""Mixture-of-Experts checkpoints: the fused 3-D expert layout of transformers v5, and make-model's skewed router."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from cli_helpers import WEIGHTS, fails
from kestrel_core.tools.traces import TraceRecorder
from kestrel_core import load
from kestrel_core.formats.checkpoint import FUSED_DOWN, FUSED_GATE_UP, Checkpoint
from kestrel_core.cli import main
from kestrel_core.errors import CheckpointError, ConfigError
from kestrel_core.tools.presets import preset_config, router_ranks, write_checkpoint

INDEX = "model.safetensors.index.json"
PROMPT = [5, 17, 42, 99, 3]
CFG = preset_config("tiny-moe", "float32")
SPARSE = [layer for layer in range(CFG.num_hidden_layers) if CFG.moe_layer(layer)]
E, I = CFG.num_experts, CFG.moe_intermediate_size
EXPERT = 3 * I * CFG.hidden_size * 4  # one expert's float32 bytes


def per_expert(layer: int, e: int, role: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{e}.{role}_proj.weight"


def fuse(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The per-expert tensors of every sparse layer restacked as transformers v5 stores them."""
    out = dict(tensors)
    for layer in SPARSE:
        gate_up = [torch.cat([out.pop(per_expert(layer, e, "gate")), out.pop(per_expert(layer, e, "up"))]) for e in range(E)]
        out[FUSED_GATE_UP.format(layer=layer)] = torch.stack(gate_up)  # [E, 2I, H]: gate rows, then up rows
        out[FUSED_DOWN.format(layer=layer)] = torch.stack([out.pop(per_expert(layer, e, "down")) for e in range(E)])
    return out


def rewrite(model_dir, tensors: dict[str, torch.Tensor], shards: int = 1) -> None:
    """Replace the weights of ``model_dir`` with ``tensors``: one file, or ``shards`` files and their index."""
    for p in list(model_dir.glob("*.safetensors")) + list(model_dir.glob(INDEX)):
        p.unlink()
    if shards == 1:
        save_file(tensors, str(model_dir / WEIGHTS), metadata={"format": "pt"})
        return
    names = sorted(tensors)
    files = [f"model-{k:05d}-of-{shards:05d}.safetensors" for k in range(1, shards + 1)]
    weight_map = {n: files[i * shards // len(names)] for i, n in enumerate(names)}
    for f in files:
        save_file({n: tensors[n] for n in names if weight_map[n] == f}, str(model_dir / f), metadata={"format": "pt"})
    (model_dir / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def per_expert_dir(tmp_path_factory):
    return write_checkpoint(CFG, tmp_path_factory.mktemp("layouts") / "per-expert")


@pytest.fixture(scope="module")
def fused_dir(per_expert_dir, tmp_path_factory):
    out = shutil.copytree(per_expert_dir, tmp_path_factory.mktemp("layouts") / "fused")
    rewrite(out, fuse(load_file(str(per_expert_dir / WEIGHTS))))
    return out


@pytest.fixture
def fused_copy(fused_dir, tmp_path):
    return shutil.copytree(fused_dir, tmp_path / "fused")


def run(model_dir, tokens=10, **settings):
    with load(model_dir) as model, model.open(**settings) as r:
        return r.generate(prompt_ids=PROMPT, max_new_tokens=tokens, stop_at_eos=False, keep_logits=True)


# --- the fused 3-D layout --------------------------------------------------------------

def test_the_fused_file_really_is_fused(fused_dir):
    names = set(load_file(str(fused_dir / WEIGHTS)))
    assert FUSED_GATE_UP.format(layer=1) in names and per_expert(1, 0, "gate") not in names
    assert not any(".experts.0." in n for n in names)


@pytest.mark.parametrize("shards", [1, 3])
def test_the_fused_layout_gives_identical_ids_and_logits(per_expert_dir, fused_dir, tmp_path, shards):
    model = fused_dir
    if shards > 1:
        model = shutil.copytree(fused_dir, tmp_path / "fused-shards")
        rewrite(model, load_file(str(fused_dir / WEIGHTS)), shards)
    ref, got = run(per_expert_dir), run(model)
    assert got.token_ids == ref.token_ids and len(ref.token_ids) == 10
    assert len(got.logits) == len(ref.logits) and all(torch.equal(a, b) for a, b in zip(got.logits, ref.logits))


def test_expert_residency_runs_on_the_fused_layout(per_expert_dir, fused_dir):
    ref = run(per_expert_dir)
    for budget in (2, 5):
        settings = dict(keep=2, expert_policy="expert_lru", expert_budget_mb=budget * EXPERT / 2**20)
        want, got = run(per_expert_dir, **settings), run(fused_dir, **settings)
        assert got.token_ids == want.token_ids == ref.token_ids, budget
        assert got.counters["expert_misses"] == want.counters["expert_misses"] > 0
        assert got.counters["bytes_uploaded"] == want.counters["bytes_uploaded"]


def test_a_per_expert_name_is_a_zero_copy_slice(per_expert_dir, fused_dir):
    want = load_file(str(per_expert_dir / WEIGHTS))
    ckpt = Checkpoint(fused_dir)
    try:
        fused = ckpt.view(FUSED_GATE_UP.format(layer=2))
        item = fused.element_size()
        for e, role in [(0, "gate"), (3, "up"), (7, "up"), (5, "down")]:
            name = per_expert(2, e, role)
            assert name in ckpt and name not in ckpt.names() and ckpt.source(name) != name
            view = ckpt.view(name)
            assert torch.equal(view, want[name]) and ckpt.info(name).shape == tuple(want[name].shape)
            assert ckpt.info(name).dtype == "F32" and ckpt.info(name).nbytes == view.numel() * item
        up3 = ckpt.view(per_expert(2, 3, "up"))
        assert up3.data_ptr() == fused.data_ptr() + (3 * 2 * I + I) * CFG.hidden_size * item  # no copy
        assert torch.equal(up3, fused[3, I:])
        down = ckpt.view(FUSED_DOWN.format(layer=2))
        assert ckpt.view(per_expert(2, 5, "down")).data_ptr() == down[5].data_ptr()
        # Dropping every expert of a layer drops the fused tensors' pages, and they read back the same.
        names = [per_expert(layer, e, r) for layer in SPARSE for e in range(E) for r in ("gate", "up", "down")]
        before = {n: ckpt.view(n).clone() for n in names}
        touched = ckpt.mapping_rss()
        ckpt.drop_pages(names)
        assert ckpt.mapping_rss() <= touched - len(SPARSE) * E * EXPERT // 2
        assert all(torch.equal(ckpt.view(n), before[n]) for n in names)
    finally:
        ckpt.close()


@pytest.mark.parametrize("shape", [(E, 2 * I - 2, CFG.hidden_size), (E - 1, 2 * I, CFG.hidden_size),
                                   (E, 2 * I + 1, CFG.hidden_size), (E * 2 * I, CFG.hidden_size)])
def test_a_fused_tensor_of_the_wrong_shape_is_named(fused_copy, capsys, shape):
    name = FUSED_GATE_UP.format(layer=3)
    tensors = load_file(str(fused_copy / WEIGHTS))
    tensors[name] = torch.zeros(shape)
    rewrite(fused_copy, tensors)
    with pytest.raises(CheckpointError) as err:
        load(fused_copy)
    msg = str(err.value)
    assert name in msg and str(list(shape)) in msg and str([E, 2 * I, CFG.hidden_size]) in msg and "\n" not in msg
    fails(["generate", "--model", str(fused_copy), "--prompt-ids", "1,2"], capsys, name, "config.json implies")


def test_both_layouts_in_one_layer_is_an_error(fused_copy, per_expert_dir):
    tensors = load_file(str(fused_copy / WEIGHTS))
    stale = per_expert(1, 4, "up")
    tensors[stale] = load_file(str(per_expert_dir / WEIGHTS))[stale]
    rewrite(fused_copy, tensors)
    with pytest.raises(CheckpointError, match="both layouts") as err:
        load(fused_copy)
    assert stale in str(err.value) and FUSED_GATE_UP.format(layer=1) in str(err.value)


def test_half_a_fused_layer_names_the_missing_half(fused_copy):
    tensors = load_file(str(fused_copy / WEIGHTS))
    del tensors[FUSED_DOWN.format(layer=2)]
    rewrite(fused_copy, tensors)
    with pytest.raises(CheckpointError, match="missing tensor") as err:
        load(fused_copy)
    assert FUSED_DOWN.format(layer=2) in str(err.value)


def test_a_fused_tensor_config_json_does_not_use_is_named(fused_copy):
    tensors = load_file(str(fused_copy / WEIGHTS))
    tensors[FUSED_DOWN.format(layer=0)] = tensors[FUSED_DOWN.format(layer=1)].clone()  # layer 0 is dense
    rewrite(fused_copy, tensors)
    with pytest.raises(CheckpointError, match="does not use") as err:
        load(fused_copy)
    assert FUSED_DOWN.format(layer=0) in str(err.value)


# --- make-model --router-skew ----------------------------------------------------------

def routed_shares(model_dir, seed=0):
    """Over a few prompts: the mean (over sparse layers) share of routings that go to the most routed
    quarter of the experts, and to the quarter the skew ranks first."""
    g = torch.Generator().manual_seed(1)
    counts = {layer: [0] * E for layer in SPARSE}
    recorder = TraceRecorder()  # (phase, token, layer, experts) at each decision point
    with load(model_dir) as model, model.open(observers=[recorder]) as r:
        for _ in range(4):
            r.generate(prompt_ids=torch.randint(0, 256, (8,), generator=g).tolist(), max_new_tokens=24, stop_at_eos=False)
        for _, _, layer, experts in recorder.events:
                for e in experts:
                    counts[layer][e] += 1
    q = E // 4
    top = [sum(sorted(c, reverse=True)[:q]) / sum(c) for c in counts.values()]
    first = [sum(n for e, n in enumerate(c) if router_ranks(seed, layer, E)[e] < q) / sum(c) for layer, c in counts.items()]
    return sum(top) / len(top), sum(first) / len(first)


@pytest.mark.parametrize("seed", [0, 3])
def test_a_skewed_router_concentrates_the_routing(tmp_path, seed):
    plain = write_checkpoint(CFG, tmp_path / "plain", seed=seed)
    skewed = write_checkpoint(CFG, tmp_path / "skewed", seed=seed, router_skew=1.2)
    plain_top, plain_first = routed_shares(plain, seed)
    skew_top, skew_first = routed_shares(skewed, seed)
    # Zipf(1.2) over 8 experts, top-2: the first two ranks get about 56% of the routings; a random
    # router's most routed two get about 40% (it is not quite uniform), and its ranks mean nothing.
    assert skew_top >= plain_top + 0.1 and skew_top >= 0.5, (plain_top, skew_top)
    assert skew_first >= 0.4 and plain_first < skew_first - 0.1, (plain_first, skew_first)


def test_skew_0_is_the_plain_random_router(per_expert_dir, tmp_path):
    zero = write_checkpoint(CFG, tmp_path / "zero", router_skew=0.0)
    assert (zero / WEIGHTS).read_bytes() == (per_expert_dir / WEIGHTS).read_bytes()
    skewed = write_checkpoint(CFG, tmp_path / "skewed", router_skew=1.2)
    assert (skewed / "config.json").read_text() == (per_expert_dir / "config.json").read_text()  # a plain HF config
    ckpt = Checkpoint(skewed)
    assert ckpt.metadata["kestrel.router_skew"] == "1.2" and "kestrel.router_skew" not in Checkpoint(zero).metadata
    ckpt.close()


def test_router_skew_is_checked(tmp_path, capsys):
    with pytest.raises(ConfigError, match="must be a number >= 0"):
        write_checkpoint(CFG, tmp_path / "neg", router_skew=-0.5)
    with pytest.raises(ConfigError, match="is dense"):
        write_checkpoint(preset_config("tiny"), tmp_path / "dense", router_skew=1.0)
    fails(["make-model", "--preset", "tiny-moe", "--router-skew", "-1", "--out", str(tmp_path / "a")], capsys,
          "--router-skew must be a number >= 0")
    fails(["make-model", "--preset", "tiny", "--router-skew", "1", "--out", str(tmp_path / "b")], capsys,
          "needs a Mixture-of-Experts model", "drop --router-skew")
    fails(["make-model", "--preset", "tiny-moe", "--layers", "1", "--router-skew", "1", "--out", str(tmp_path / "c")],
          capsys, "has no sparse layer")
    assert not any(tmp_path.iterdir())
    assert main(["make-model", "--preset", "tiny-moe", "--router-skew", "1.5", "--out", str(tmp_path / "ok")]) == 0
    assert "router skew 1.5" in capsys.readouterr().out
