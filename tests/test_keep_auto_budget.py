"""Issue 59 item 15: ``--budget-mb`` bounds cpu_ref's resident layers, as it bounds cuda's device cache, so the
reference shows the window ``keep = auto`` picks under a budget: the same keep cuda's fit picks at the same budget and
the same unit bytes (both read the budget through ``fit.given_budget`` and choose through ``fit.choose_keep``).
cpu_ref weighs a GGUF's blocks it holds as blocks (``host_kernels = "auto"``) by their stored bytes."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from backends.cpu_ref import backend as cpu_ref_backend
from backends.cpu_ref import host_gguf
from backends.cpu_ref.backend import CpuRefBackend
from backends.cuda.backend import CudaBackend
from cli_helpers import fails
from kestrel_core import load
from kestrel_core.cli import main
from kestrel_core.config import WCACHE_ENV, KestrelConfig, with_settings
from kestrel_core.engine.backend import BackendContext
from kestrel_core.engine.fit import KVRoom, choose_keep
from kestrel_core.engine.plan import Counters
from kestrel_core.engine.assemble import make_policy
from kestrel_core.errors import BudgetError, KestrelNote
from kestrel_core.formats.gguf_model import block_tensors
from tests.gguf_files import K_DIMS, T, write_model

MIB = 2**20
KV = KVRoom(1, 64)


def context(model, **settings) -> BackendContext:
    cfg = with_settings(KestrelConfig(), settings)
    return BackendContext(model.checkpoint, model.config, cfg.backend, cfg.residency, Counters(), model.n_layers,
                          model.host, model.units, model.quant)


def pick(facts, n: int) -> int | str:
    return choose_keep(facts, lambda k: make_policy("asymmetric", k, n).peak_layers(), 0, "asymmetric", KV).keep


@pytest.fixture(autouse=True)
def _no_env_budget(monkeypatch):
    monkeypatch.delenv(WCACHE_ENV, raising=False)


def test_a_small_budget_gives_cpu_ref_a_smaller_keep_and_the_same_ids(demo_ckpt):
    with load(demo_ckpt) as model:
        n = model.n_layers
        with model.open(backend="cpu_ref", keep="off") as run:
            want = run.generate(prompt_ids=[5, 17, 42], max_new_tokens=6, stop_at_eos=False).token_ids
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the demo model fits half the host's memory: resident, and nothing said
            with model.open(backend="cpu_ref", kv=(1, 64)) as run:
                assert run.keep_choice.keep == "off"
        facts = CpuRefBackend.fit_facts(context(model))
        layer, fixed = facts.peak_bytes(1), facts.fixed
        budget_mb = math.ceil((fixed + 4 * layer) / MIB)  # 4 layers and not 5 (a demo layer is 3 MiB in float32)
        assert budget_mb * MIB < fixed + 5 * layer
        with pytest.warns(KestrelNote, match=rf"keep = auto: keep = 2 with asymmetric \(4 layers resident at most.*"
                                              rf"{budget_mb:.1f} MiB host budget for resident layers \(config\)"):
            run = model.open(backend="cpu_ref", budget_mb=budget_mb, kv=(1, 64))
        with run:
            assert run.config.residency.keep == 2 and run.keep_choice.need <= budget_mb * MIB
            res = run.generate(prompt_ids=[5, 17, 42], max_new_tokens=6, stop_at_eos=False)
        assert res.token_ids == want and res.counters["peak_resident_bytes"] <= budget_mb * MIB
        keeps = [pick(CpuRefBackend.fit_facts(context(model, budget_mb=mb)), n) for mb in (9, 12, 15, 18, 21)]
        assert keeps == sorted(keeps) and keeps[0] < keeps[-1]  # a smaller budget, a smaller keep


def test_the_budget_flag_and_the_environment_reach_cpu_ref(demo_ckpt, capsys, monkeypatch):
    import json

    assert main(["generate", "--model", str(demo_ckpt), "--backend", "cpu_ref", "--budget-mb", "15", "--prompt-ids",
                 "5,17,42", "--max-new-tokens", "3", "--max-seq", "64", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["keep"] == 2 and got["keep_auto"]["budget_bytes"] == 15 * MIB
    monkeypatch.setenv(WCACHE_ENV, "9")  # beats --budget-mb, as on cuda
    assert main(["generate", "--model", str(demo_ckpt), "--backend", "cpu_ref", "--budget-mb", "15", "--prompt-ids",
                 "5,17,42", "--max-new-tokens", "3", "--max-seq", "64", "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["keep"] == 1 and f"(KESTREL_WCACHE_MB)" in out.err


def test_cpu_ref_picks_the_keep_cuda_picks_at_the_same_budget(demo_ckpt):
    """cuda's fit is arithmetic over its layout (``CudaBackend.fit_facts_at``, no GPU asked): in float32 both hold the
    same bytes, so at every budget from one that holds nothing to one that holds every layer both pick alike."""
    with load(demo_ckpt) as model:
        n, cuda = model.n_layers, torch.device("cuda")
        picked = {}
        for mb in range(1, 30):
            ctx = context(model, budget_mb=mb, dtype="float32")
            cpu_facts, cuda_facts = CpuRefBackend.fit_facts(ctx), CudaBackend.fit_facts_at(ctx, torch.float32, cuda,
                                                                                            64 * 2**30)
            assert (cpu_facts.budget, cpu_facts.source) == (cuda_facts.budget, cuda_facts.source) == (mb * MIB, "config")
            assert cpu_facts.fixed == cuda_facts.fixed
            assert [cpu_facts.peak_bytes(k) for k in range(n + 1)] == [cuda_facts.peak_bytes(k) for k in range(n + 1)]
            try:
                cpu_keep = pick(cpu_facts, n)
            except BudgetError:
                with pytest.raises(BudgetError):
                    pick(cuda_facts, n)
                continue
            picked[mb] = cpu_keep
            assert cpu_keep == pick(cuda_facts, n), mb
        assert len(set(picked.values())) >= 4 and "off" in picked.values()  # the budgets spanned several windows


def test_an_impossible_budget_is_one_line_naming_it_and_the_fix(demo_ckpt, capsys):
    err = fails(["generate", "--model", str(demo_ckpt), "--backend", "cpu_ref", "--budget-mb", "2", "--prompt-ids",
                 "5,17", "--max-new-tokens", "2", "--max-seq", "64"], capsys,
                "keep = auto: even keep = 1 needs")
    line = err.strip().splitlines()[-1]
    assert "over the 2.0 MiB host budget for resident layers (config)" in line
    assert "raise --budget-mb or KESTREL_WCACHE_MB" in line


def test_an_explicit_keep_over_the_budget_is_refused_naming_both(demo_ckpt):
    with load(demo_ckpt) as model:
        with pytest.raises(BudgetError) as exc:
            model.open(backend="cpu_ref", keep=4, budget_mb=15)  # asymmetric keep 4: 8 layers at its peak
        msg = str(exc.value)
        assert "this run peaks at 8 resident layers" in msg and "15.0 MiB (config)" in msg and "\n" not in msg
        assert "use keep = auto, or keep <= 2 (4 layers resident at most)" in msg
        with model.open(backend="cpu_ref", keep=2, budget_mb=15) as run:  # 4 layers: within it
            assert run.config.residency.keep == 2


@pytest.mark.skipif(host_gguf.usable() is not None, reason="the host GGUF kernel does not build here")
def test_cpu_ref_weighs_a_ggufs_blocks_as_it_holds_them(tmp_path):
    """host_kernels = "auto" holds the kernel's types as the file's blocks: the fit weighs them so (not 4 bytes a
    weight), and the units the run lays out weigh what the fit said."""
    types = {"token_embd": T.F16, "attn_q": T.Q4_K, "attn_k": T.Q4_0, "attn_v": T.Q6_K, "attn_output": T.Q8_0,
             "ffn_gate": T.Q4_K, "ffn_up": T.Q6_K, "ffn_down": T.Q4_0, "output": T.Q6_K}
    path = write_model(tmp_path / "k.gguf", "llama", K_DIMS, types, False, truth=False)[0]
    with load(path) as model:
        blocks = block_tensors(model.checkpoint, model.config, host_gguf.TYPES)
        assert blocks
        auto, off = (CpuRefBackend.fit_facts(context(model, host_kernels=h)) for h in ("auto", "off"))
        layer0 = [s for s in model.units if s.layer == 0]
        stored = sum(blocks[name].nbytes if name in blocks else math.prod(shape) * 4
                     for spec in layer0 for name, shape in spec.tensors.values())
        assert max(auto.peak_bytes(1), 0) == stored < off.peak_bytes(1)
        assert off.peak_bytes(1) == sum(math.prod(s) * 4 for spec in layer0 for _, s in spec.tensors.values())
        with model.open(backend="cpu_ref", host_kernels="auto", keep=1) as run:
            assert max(run.backend.units.layer_bytes.values()) == auto.peak_bytes(1)
            assert run.backend.units.peak_bytes(model.n_layers) == auto.peak_bytes(model.n_layers)
