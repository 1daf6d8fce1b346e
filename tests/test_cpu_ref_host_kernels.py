"""cpu_ref's ``[backend] host_kernels``: a GGUF's Q8_0, Q4_0, Q4_K and Q6_K linears held as their blocks and computed
by the host GGUF kernel (``auto``), or dequantized to float32 on each fetch (``off``).

The setting parses with one-line errors, as a flag and in kestrel.toml. With ``auto`` each linear's output is within
``host_gguf.bound`` of the float32 product on the same x (checked on every call of a run, prompt and decode); the logits
of a model whose only kernel-typed linear is lm_head are within that bound of ``off``'s; and greedy ids are the same
across keep, policy, allocator and batch companions, dense and MoE. Where the kernel cannot build, ``auto`` says so in
one note and runs as ``off``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from backends.cpu_ref import host_gguf
from backends.cpu_ref.backend import CpuRefBackend, HostBlocks
from cli_helpers import fails
from kestrel_core import load
from kestrel_core.config import BackendConfig
from kestrel_core.errors import ConfigError, KestrelNote
from kestrel_core.formats.gguf_quants import dequantize
from tests.gguf_files import DIMS, K_DIMS, T, write_model

PROMPT = [5, 40, 77, 120, 3]
PROMPTS = [[5, 40, 77], [120, 3], [9, 8, 7, 6, 5], [200]]
# every linear in a type the kernel computes (the embedding too, which stays float: a lookup)
KERNEL_TYPES = {"token_embd": T.Q8_0, "attn_q": T.Q4_K, "attn_k": T.Q4_0, "attn_v": T.Q6_K, "attn_output": T.Q8_0,
                "ffn_gate": T.Q4_K, "ffn_up": T.Q6_K, "ffn_down": T.Q4_0, "output": T.Q6_K}
MOE_TYPES = {"token_embd": T.F16, "attn_q": T.Q8_0, "attn_k": T.Q4_0, "attn_v": T.F32, "attn_output": T.Q4_0,
             "ffn_gate": T.Q4_0, "ffn_up": T.Q8_0, "ffn_down": T.Q4_0, "output": T.Q8_0}
# float everywhere but lm_head: both settings compute the same x for it
HEAD_ONLY = {"token_embd": T.F16, "attn_q": T.F32, "attn_k": T.F16, "attn_v": T.F32, "attn_output": T.F16,
             "ffn_gate": T.F32, "ffn_up": T.F16, "ffn_down": T.F32, "output": T.Q4_0}

needs_kernel = pytest.mark.skipif(host_gguf.usable() is not None, reason="the host GGUF kernel does not build here")


@pytest.fixture(scope="module")
def k_model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("hk") / "k.gguf", "llama", K_DIMS, KERNEL_TYPES, False, truth=False)[0]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("hk") / "moe.gguf", "qwen3moe", DIMS, MOE_TYPES, False, truth=False)[0]


def greedy(path, n=10, **settings):
    with load(path) as model, model.open(backend="cpu_ref", **settings) as run:
        return run.generate(prompt_ids=PROMPT, max_new_tokens=n, stop_at_eos=False).token_ids


# --- the setting ------------------------------------------------------------------------------------------------
def test_the_setting_parses_and_a_bad_value_is_one_line(tmp_path, capsys):
    assert BackendConfig().host_kernels == "auto" and BackendConfig(host_kernels="off").host_kernels == "off"
    with pytest.raises(ConfigError) as info:
        BackendConfig(host_kernels="on")
    assert str(info.value) == "host_kernels must be one of auto, off, got 'on'"
    path = write_model(tmp_path / "m.gguf", "llama", DIMS, HEAD_ONLY, False, truth=False)[0]
    fails(["generate", "--model", str(path), "--backend", "cpu_ref", "--prompt-ids", "1,2", "--host-kernels", "fast"],
          capsys, "host_kernels must be one of auto, off, got 'fast'")
    (tmp_path / "kestrel.toml").write_text(f'model = "{path}"\n[backend]\nname = "cpu_ref"\nhost_kernels = 3\n')
    fails(["generate", "--config", str(tmp_path / "kestrel.toml"), "--prompt-ids", "1,2"], capsys, "host_kernels")


@needs_kernel
def test_auto_holds_the_kernel_types_as_blocks_and_off_holds_none(k_model):
    with load(k_model) as model:
        with model.open(backend="cpu_ref", keep=1, host_kernels="auto") as run:
            backend = run.runner.backend
            held = {n: b.qtype for n, b in backend._blocks.items()}
            assert isinstance(backend.globals["lm_head"], HostBlocks)
        with model.open(backend="cpu_ref", keep=1, host_kernels="off") as run:
            assert not run.runner.backend._blocks and isinstance(run.runner.backend.globals["lm_head"], torch.Tensor)
    assert held["lm_head.weight"] == T.Q6_K and held["model.layers.0.self_attn.q_proj.weight"] == T.Q4_K
    assert held["model.layers.1.mlp.down_proj.weight"] == T.Q4_0 and len(held) == 7 * 2 + 1
    assert set(held.values()) == set(host_gguf.HELD)  # the four types cpu_ref computes with the kernel


# --- auto against off -------------------------------------------------------------------------------------------
@needs_kernel
def test_every_linear_is_within_the_kernels_bound_of_the_float32_product(k_model, monkeypatch):
    """Each call of a run (the prompt's rows at once, then each decode step): |y - x @ Wd.T| <= host_gguf.bound."""
    plain = CpuRefBackend.linear
    checked = []

    def linear(x, w):
        y = plain(x, w)
        if isinstance(w, HostBlocks):
            wd = dequantize(w.raw, w.qtype, (w.n, w.k)).double()
            err = (y.double() - x.double() @ wd.T).abs()
            assert (err <= host_gguf.bound(x, w.raw, w.qtype, w.n, w.k).double()).all()
            checked.append(x.shape[0])
        return y

    monkeypatch.setattr(CpuRefBackend, "linear", staticmethod(linear))
    greedy(k_model, n=3, keep=1, host_kernels="auto")
    assert max(checked) > 1 and 1 in checked  # the prompt's rows in one call, then one-row steps


@needs_kernel
def test_logits_are_within_the_stated_bound_of_off(tmp_path):
    """Float layers and a Q4_0 lm_head: both settings give lm_head the same x, so the logits of each step differ by
    at most the kernel's bound on that x plus off's own float32 rounding (1e-5 of sum |x| |Wd|, host_gguf.FLOAT_SLACK)."""
    path = write_model(tmp_path / "m.gguf", "llama", DIMS, HEAD_ONLY, False, truth=False)[0]
    xs = []
    plain = CpuRefBackend.linear

    def linear(x, w):
        if isinstance(w, HostBlocks):
            xs.append((x.clone(), w))
        return plain(x, w)

    with load(path) as model:
        with model.open(backend="cpu_ref", keep="off", host_kernels="off") as run:
            off = run.generate(prompt_ids=PROMPT, max_new_tokens=1, stop_at_eos=False, keep_logits=True).logits[0]
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(CpuRefBackend, "linear", staticmethod(linear))
            with model.open(backend="cpu_ref", keep="off", host_kernels="auto") as run:
                auto = run.generate(prompt_ids=PROMPT, max_new_tokens=1, stop_at_eos=False, keep_logits=True).logits[0]
    x, w = xs[-1]
    x = x[-1:]  # the last prompt row gives the first step's logits
    wd = dequantize(w.raw, w.qtype, (w.n, w.k)).double()
    tol = host_gguf.bound(x, w.raw, w.qtype, w.n, w.k).double() + host_gguf.FLOAT_SLACK * (x.double().abs() @ wd.abs().T)
    diff = (auto.double().reshape(-1) - off.double().reshape(-1)).abs()
    assert (diff <= tol.reshape(-1)).all(), (diff - tol.reshape(-1)).max()
    assert diff.max() > 0  # x was quantized: not off's bits


# --- the invariants within auto ---------------------------------------------------------------------------------
@needs_kernel
def test_auto_ids_are_the_same_across_keep_policy_and_allocator(k_model):
    ids = greedy(k_model, keep="off", host_kernels="auto")
    assert len(set(ids)) > 1
    for settings in (dict(keep=1, policy="asymmetric", allocator="pool"), dict(keep=1, policy="belady", allocator="free"),
                     dict(keep=2, policy="pinned_set", allocator="pool")):
        assert greedy(k_model, host_kernels="auto", **settings) == ids, settings


@needs_kernel
def test_auto_ids_in_a_batch_are_each_sequences_alone(k_model):
    with load(k_model) as model, model.open(backend="cpu_ref", keep=1, host_kernels="auto") as run:
        alone = [run.generate(prompt_ids=p, max_new_tokens=4 + i, stop_at_eos=False).token_ids
                 for i, p in enumerate(PROMPTS)]
        for max_batch, chunk in ((4, None), (2, 2)):
            got = run.generate_batch([dict(prompt_ids=p, max_new_tokens=4 + i, stop_at_eos=False)
                                      for i, p in enumerate(PROMPTS)], max_batch=max_batch, prefill_chunk=chunk)
            assert [r.token_ids for r in got] == alone, (max_batch, chunk)


@needs_kernel
def test_auto_moe_ids_are_the_same_across_keep_and_expert_paths(moe_model):
    ids = greedy(moe_model, keep="off", host_kernels="auto")
    assert len(set(ids)) > 1
    for settings in (dict(keep=1), dict(keep=1, expert_policy="expert_lru", expert_budget_mb=0.01),
                     dict(keep=1, expert_decode="host")):
        assert greedy(moe_model, host_kernels="auto", **settings) == ids, settings


# --- the fallback -----------------------------------------------------------------------------------------------
def test_where_the_kernel_cannot_build_auto_says_so_once_and_runs_as_off(k_model, monkeypatch):
    why = "the host GGUF kernel did not build (OSError: no c++); it needs a C++ compiler"
    monkeypatch.setattr(host_gguf.EXTENSION, "build", lambda: (_ for _ in ()).throw(RuntimeError(why)))
    host_gguf.EXTENSION.forget()
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            ids = greedy(k_model, n=6, keep=1, host_kernels="auto")
        notes = [str(w.message) for w in seen if issubclass(w.category, KestrelNote) and "host_kernels" in str(w.message)]
        assert len(notes) == 1 and why in notes[0] and "\n" not in notes[0], notes
        assert ids == greedy(k_model, n=6, keep=1, host_kernels="off")
    finally:
        monkeypatch.undo()
        host_gguf.EXTENSION.forget()  # the real build again for the tests after this one
