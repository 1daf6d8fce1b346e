"""Qwen3-MoE against transformers itself: greedy ids identical, logits within a stated tolerance, both ways.

1. A checkpoint transformers writes (``Qwen3MoeForCausalLM.save_pretrained``, whatever expert layout and
   config.json spelling this transformers version uses) is read by kestrel, and cpu_ref's greedy ids equal
   transformers' own, under expert settings that must not change a result (no expert policy or expert_lru
   under a small budget, speculative expert prefetch off and on, experts fetched with their layer).
2. A checkpoint kestrel writes (``presets.write_checkpoint``) is read by transformers, with the same parity.

Tolerance: every step's logits within 1e-5 of transformers', relative to that step's largest |logit|
(measured with transformers 5.24 / torch 2.13 CPU, float32: first step 9.1e-7, all 12 steps 2.4e-6 at most).

Skips where transformers (or its Qwen3-MoE model) is not installed; CI has none.
"""

from __future__ import annotations

import attrs
import pytest
import torch

transformers = pytest.importorskip("transformers")
try:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
except ImportError:  # transformers older than 4.51
    pytest.skip(f"transformers {transformers.__version__} has no Qwen3-MoE model", allow_module_level=True)

from kestrel_core import load
from kestrel_core.config import ResidencyConfig
from kestrel_core.formats.modelconfig import read_model_config
from kestrel_core.tools.presets import preset_config, write_checkpoint

PROMPT = [7, 300, 12, 45, 511, 2, 90, 128]
NEW = 12
TOL = 1e-5
ROPE_THETA = 1e6  # not kestrel's default (10000): a checkpoint whose rope_theta is not read shows in the logits
EXPERT = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
              mlp_only_layers=[0], norm_topk_prob=True)
H = 64


def hf_config(tied: bool) -> Qwen3MoeConfig:
    """kestrel's tiny-moe shape: 4 layers, layer 0 dense, 8 experts top-2."""
    return Qwen3MoeConfig(vocab_size=512, hidden_size=H, intermediate_size=160, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                          rope_theta=ROPE_THETA, rms_norm_eps=1e-6, tie_word_embeddings=tied, attention_bias=False,
                          eos_token_id=256, bos_token_id=None, **EXPERT)


def reinit_(model: torch.nn.Module, seed: int) -> None:
    """Weights with the scales of kestrel's presets (transformers' std 0.02 gives near-flat logits and routing);
    the routers larger still, so each token's top 2 stand clear of the rest."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name or name == "lm_head.weight":
                p.copy_(torch.randn(p.shape, generator=g) * 2 / H**0.5)
            elif name.endswith("mlp.gate.weight"):  # the router
                p.copy_(torch.randn(p.shape, generator=g) * 3 / H**0.5)
            else:  # linears, and transformers 5's fused experts [E, out, in]: fan-in is the last dim
                p.copy_(torch.randn(p.shape, generator=g) * 1.5 / p.shape[-1] ** 0.5)


def router_logits_hooks(model) -> tuple[list[torch.Tensor], list]:
    """Capture every router's logits (4.x: the gate is a Linear; 5.x: a router module returning (logits, ...))."""
    seen: list[torch.Tensor] = []

    def hook(_mod, _inp, out):
        seen.append((out[0] if isinstance(out, tuple) else out).detach().reshape(-1, EXPERT["num_experts"]))

    handles = [m.register_forward_hook(hook) for n, m in model.named_modules() if n.endswith(".mlp.gate")]
    assert len(handles) == 3  # layers 1..3 are sparse
    return seen, handles


def hf_greedy(model, prompt=PROMPT, n=NEW) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy ids and each step's logits [n, vocab], full recompute (no cache)."""
    ids, steps = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=ids).logits[0, -1].double()
            steps.append(logits)
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist(), torch.stack(steps)


def kestrel_greedy(model_dir, n=NEW, **settings) -> tuple[list[int], torch.Tensor]:
    with load(model_dir) as model, model.open(backend="cpu_ref", dtype="float32", **settings) as run:
        res = run.generate(prompt_ids=PROMPT, max_new_tokens=n, stop_at_eos=False, keep_logits=True)
    return res.token_ids, torch.stack([t.double() for t in res.logits])


def worst(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest per-step error relative to that step's largest |logit|."""
    return float(((got - want).abs().amax(-1) / want.abs().amax(-1)).max())


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def hf_ckpt(request, tmp_path_factory):
    """(dir, greedy ids, logits, router logits) of a float32 Qwen3MoeForCausalLM that transformers saved."""
    tied = request.param
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(hf_config(tied)).float().eval()
    reinit_(model, seed=1 if tied else 2)
    out = tmp_path_factory.mktemp("hf-moe") / ("tied" if tied else "untied")
    model.save_pretrained(str(out), safe_serialization=True)
    seen, handles = router_logits_hooks(model)
    ids, logits = hf_greedy(model)
    for h in handles:
        h.remove()
    with torch.no_grad():
        gen = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW,
                             pad_token_id=0)[0, len(PROMPT):].tolist()
    assert gen == ids, "transformers' generate() and its own argmax loop disagree"
    return out, ids, logits, torch.cat(seen)


def test_routing_is_not_degenerate(hf_ckpt):
    """Many experts are used, and each token's 2nd choice stands clear of its 3rd (no float-noise ties)."""
    _, _, _, router = hf_ckpt
    probs = torch.softmax(router.double(), -1)
    top3 = probs.topk(3, dim=-1).values
    assert len(torch.unique(probs.topk(2, dim=-1).indices)) == 8
    assert float((top3[:, 1] - top3[:, 2]).min()) > 1e-5
    assert float(top3[:, 0].max()) < 0.999  # not one expert taking every token's whole weight


def test_kestrel_reads_the_config_transformers_writes(hf_ckpt):
    cfg = read_model_config(hf_ckpt[0])
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert [cfg.moe_layer(layer) for layer in range(4)] == [False, True, True, True]
    assert cfg.rope_theta == ROPE_THETA


_FIELDS = {f.name for f in attrs.fields(ResidencyConfig)}
SETTINGS = [
    pytest.param(dict(expert_policy=policy, expert_budget_mb=budget, expert_prefetch=prefetch),
                 id=f"{policy or 'no-policy'}-prefetch{int(prefetch)}",
                 marks=[] if "expert_prefetch" in _FIELDS else [pytest.mark.skip("no expert_prefetch setting")])
    # 0.05 MiB: two of the 24 KiB float32 experts, one token's worth; evictions at every sparse layer.
    for policy, budget in (("", 0.0), ("expert_lru", 0.05)) for prefetch in (False, True)
]
if "expert_fetch" in _FIELDS:
    SETTINGS.append(pytest.param(dict(expert_fetch="layer", keep=1), id="expert_fetch-layer-keep1"))


@pytest.mark.parametrize("settings", SETTINGS)
def test_greedy_ids_and_logits_match_transformers(hf_ckpt, settings):
    model_dir, want_ids, want_logits, _ = hf_ckpt
    ids, logits = kestrel_greedy(model_dir, **settings)
    assert logits.shape == want_logits.shape
    assert worst(logits[:1], want_logits[:1]) < TOL, "first-step (prefill) logits"
    assert worst(logits, want_logits) < TOL, "decode logits"
    assert ids == want_ids


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_transformers_reads_a_kestrel_checkpoint(tmp_path, tied):
    cfg = attrs.evolve(preset_config("tiny-moe", "float32"), tie_word_embeddings=tied, rope_theta=ROPE_THETA)
    model_dir = write_checkpoint(cfg, tmp_path / "tiny-moe", seed=3)
    want_ids, want_logits = kestrel_greedy(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir)).float().eval()  # stored float32: nothing is rounded
    assert isinstance(hf, Qwen3MoeForCausalLM) and hf.config.tie_word_embeddings == tied
    ids, logits = hf_greedy(hf)
    assert worst(logits, want_logits) < TOL
    assert ids == want_ids
