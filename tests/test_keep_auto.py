"""``keep = "auto"`` (the default): every layer resident where the model fits the backend's budget, else the largest
window whose peak fits, else a one-line refusal with the numbers; said on stderr when a window is chosen, carried by
``--json``, and never changing an id."""

from __future__ import annotations

import json
import math
import warnings

import pytest

from backends.cpu_ref import backend as cpu_ref_backend
from kestrel_core import load
from kestrel_core.cli import main
from kestrel_core.config import AUTO, KestrelConfig, parse_keep
from kestrel_core.engine.fit import FitFacts, KVRoom, choose_keep
from kestrel_core.errors import BudgetError, ConfigError, KestrelNote
from kestrel_core.formats.units import is_expert
from kestrel_core.formats.tensor_table import global_specs, small_specs

MIB = 2**20


def facts(budget_mib: float, fixed_mib: float = 10, layers=(100,) * 8) -> FitFacts:
    biggest = sorted((int(b * MIB) for b in layers), reverse=True)
    return FitFacts(int(budget_mib * MIB), "test", "device weight-cache budget", int(fixed_mib * MIB), len(layers),
                    lambda n: sum(biggest[:n]))


def asymmetric(k: int) -> int:
    return min(8, 2 * k)


def test_auto_is_the_default_and_parses():
    assert KestrelConfig().residency.keep == AUTO and parse_keep("auto") == AUTO
    with pytest.raises(ConfigError, match="a layer count, 'off' or 'auto'"):
        parse_keep("most")


def test_a_model_that_fits_is_resident():
    c = choose_keep(facts(810), asymmetric, 0, "asymmetric")
    assert (c.keep, c.peak_layers, c.need) == ("off", 8, 810 * MIB) and "every layer resident" in c.line


@pytest.mark.parametrize("budget, prefetch, keep, peak", [
    (809, 0, 3, 6),  # 8 layers do not fit; keep 3 peaks at 6 layers (610 MiB); keep 4 would peak at all 8
    (610, 0, 3, 6), (609, 0, 2, 4), (609, 1, 2, 5), (510, 1, 2, 5), (509, 1, 1, 3), (210, 0, 1, 2)])
def test_otherwise_the_largest_keep_whose_peak_fits(budget, prefetch, keep, peak):
    c = choose_keep(facts(budget), asymmetric, prefetch, "asymmetric")
    assert (c.keep, c.peak_layers) == (keep, peak) and c.need <= c.budget
    assert f"keep = auto: keep = {keep} with asymmetric ({peak} layers resident at most" in c.line
    assert "every layer would need 810.0 MiB" in c.line


def test_the_largest_layers_count_first():
    c = choose_keep(facts(259, layers=(50, 50, 200, 50)), lambda k: min(4, k), 0, "belady")
    assert c.keep == 1 and c.need == 210 * MIB  # one layer: the 200 MiB one, whichever comes when


def test_a_budget_below_one_layer_is_refused_with_the_numbers():
    with pytest.raises(BudgetError) as exc:
        choose_keep(facts(209), asymmetric, 0, "asymmetric")
    msg = str(exc.value)
    assert "even keep = 1 needs 210 MiB (10 MiB of it resident for good)" in msg and "over the 209.0 MiB" in msg
    assert "\n" not in msg


def _tiny_bytes(model) -> tuple[int, int]:
    """(one layer, the fixed bytes) of the tiny preset in float32, as cpu_ref holds them."""
    cfg = model.config
    layer = sum(math.prod(s) for spec in model.units if spec.layer == 0 for _, s in spec.tensors.values()) * 4
    fixed = sum(math.prod(s) for _, s in global_specs(cfg).values()) * 4
    fixed += sum(math.prod(s) for i in range(cfg.num_hidden_layers) for _, s in small_specs(cfg, i).values()) * 4
    return layer, fixed


def test_cpu_ref_fits_half_the_available_memory_and_ids_do_not_move(tiny_ckpt, monkeypatch):
    with load(tiny_ckpt) as model:
        layer, fixed = _tiny_bytes(model)
        with model.open(backend="cpu_ref", keep="off") as run:
            want = run.generate(prompt_ids=[5, 17, 42], max_new_tokens=8, stop_at_eos=False).token_ids
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a model that fits says nothing
            with model.open(backend="cpu_ref") as run:
                assert run.config.residency.keep == "off" and run.keep_choice.keep == "off"
        monkeypatch.setattr(cpu_ref_backend, "meminfo", lambda: {"MemAvailable": 2 * (fixed + 4 * layer)})
        with pytest.warns(KestrelNote, match=r"keep = auto: keep = 2 with asymmetric \(4 layers resident at most"):
            run = model.open(backend="cpu_ref", kv=(1, 8))  # a KV cache of 8 positions: half the memory binds
        with run:
            assert run.config.residency.keep == 2 and run.policy.peak_layers() == 4
            res = run.generate(prompt_ids=[5, 17, 42], max_new_tokens=8, stop_at_eos=False)
        assert res.token_ids == want and res.counters["peak_resident_entries"] > 0
        monkeypatch.setattr(cpu_ref_backend, "meminfo", lambda: {"MemAvailable": 2 * (fixed + layer)})
        with pytest.raises(BudgetError, match="even keep = 1 needs"):
            model.open(backend="cpu_ref", kv=(1, 8))


def test_generate_json_carries_the_choice_and_the_resolved_keep(tiny_ckpt, monkeypatch, capsys):
    with load(tiny_ckpt) as model:
        layer, fixed = _tiny_bytes(model)
    monkeypatch.setattr(cpu_ref_backend, "meminfo", lambda: {"MemAvailable": 2 * (fixed + 5 * layer)})
    assert main(["generate", "--model", str(tiny_ckpt), "--prompt-ids", "5,17,42", "--max-new-tokens", "3",
                 "--json"]) == 0
    out = capsys.readouterr()
    got = json.loads(out.out)
    assert got["keep"] == 2 and got["keep_auto"]["keep"] == 2 and got["keep_auto"]["peak_layers"] == 4
    assert "keep = auto: keep = 2" in out.err and got["keep_auto"]["why"] in out.err


def test_a_sweep_lists_its_keeps(tiny_ckpt, capsys):
    assert main(["sweep", "--model", str(tiny_ckpt), "--keep", "1,auto"]) == 2
    assert "--keep auto picks one keep from the budget" in capsys.readouterr().err


@pytest.mark.cuda
def test_cuda_fits_its_weight_cache_budget_and_ids_do_not_move(demo_ckpt):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    with load(demo_ckpt) as model:
        with model.open(backend="cuda", keep="off") as run:
            want = run.generate(prompt_ids=[5, 17, 42], max_new_tokens=8, stop_at_eos=False).token_ids
            layer, fixed = max(run.backend.units.layer_bytes.values()), run.backend._global_bytes()
        budget_mb = math.ceil((fixed + 4 * layer) / MIB)
        assert budget_mb * MIB < fixed + 5 * layer  # the budget holds 4 layers and not 5
        with pytest.warns(KestrelNote, match=r"keep = auto: keep = 2 with asymmetric \(4 layers resident at most"):
            run = model.open(backend="cuda", budget_mb=budget_mb)
        with run:
            assert run.config.residency.keep == 2
            assert run.generate(prompt_ids=[5, 17, 42], max_new_tokens=8, stop_at_eos=False).token_ids == want
        with model.open(backend="cuda") as run:  # the default budget holds the demo model whole
            assert run.config.residency.keep == "off"
            assert run.config.residency.budget_mb == run.keep_choice.budget // MIB  # the backend holds the fit's


def test_a_moe_model_that_does_not_fit_gets_an_expert_cache_of_what_is_left(tmp_path, monkeypatch):
    """tiny-moe on cpu_ref: a budget that holds every layer's own units and a third of the experts keeps the own units
    resident and caches the experts (expert_lru, the rest of the budget); one that holds only part of the own units
    windows them too; ids equal every layer resident."""
    from kestrel_core.tools.presets import preset_config, write_checkpoint

    path = write_checkpoint(preset_config("tiny-moe"), tmp_path / "moe")
    with load(path) as model:
        cfg = model.config
        size = lambda spec: sum(math.prod(s) for _, s in spec.tensors.values()) * 4  # noqa: E731 - float32 bytes
        own = [size(s) for s in model.units if not is_expert(s.key)]
        experts = [size(s) for s in model.units if is_expert(s.key)]
        fixed = sum(math.prod(s) for _, s in global_specs(cfg).values()) * 4
        fixed += sum(math.prod(s) for i in range(cfg.num_hidden_layers) for _, s in small_specs(cfg, i).values()) * 4
        with model.open(backend="cpu_ref", keep="off") as run:
            want = run.generate(prompt_ids=[5, 17, 42], max_new_tokens=8, stop_at_eos=False).token_ids
        budget = fixed + sum(own) + sum(experts) // 3
        monkeypatch.setattr(cpu_ref_backend, "meminfo", lambda: {"MemAvailable": 2 * budget})
        with pytest.warns(KestrelNote, match="every layer's own units resident and an expert_lru expert cache of"):
            run = model.open(backend="cpu_ref", kv=(1, 8))
        with run:
            res = run.config.residency
            assert (res.keep, res.expert_policy) == ("off", "expert_lru")
            assert res.expert_budget_mb * 2**20 == budget - fixed - sum(own)
            assert run.keep_choice.to_json()["expert_budget_bytes"] == budget - fixed - sum(own)
            assert run.generate(prompt_ids=[5, 17, 42], max_new_tokens=8, stop_at_eos=False).token_ids == want
        two = sum(sorted(own)[-2:])  # keep = 1 peaks at two layers: the largest two own units
        assert two < sum(own)
        tight = fixed + two + cfg.num_experts_per_tok * max(experts)
        monkeypatch.setattr(cpu_ref_backend, "meminfo", lambda: {"MemAvailable": 2 * tight})
        with pytest.warns(KestrelNote, match=r"keep = 1 with asymmetric \(2 layers' own units resident at most\)"):
            run = model.open(backend="cpu_ref", kv=(1, 8))
        with run:
            assert run.config.residency.keep == 1 and run.config.residency.expert_policy == "expert_lru"
            assert run.generate(prompt_ids=[5, 17, 42], max_new_tokens=8, stop_at_eos=False).token_ids == want
        monkeypatch.setattr(cpu_ref_backend, "meminfo", lambda: {"MemAvailable": 2 * (tight - 1)})
        with pytest.raises(BudgetError, match="even keep = 1 with one token's routed experts needs"):
            model.open(backend="cpu_ref", kv=(1, 8))
        with model.open(backend="cpu_ref", expert_policy="expert_lfu", expert_budget_mb=1.0, keep=2) as run:
            assert run.config.residency.expert_policy == "expert_lfu"  # a policy given is the user's: not replaced


def test_a_prefetch_asked_of_a_model_that_fits_whole_is_said_to_be_off(tiny_ckpt):
    """cpu_ref refuses any prefetch; a plugin-free check of the rule itself, through the fit alone."""
    from kestrel_core.engine.assemble import fit_keep
    from kestrel_core.engine.plan import Counters

    with load(tiny_ckpt) as model:
        config = KestrelConfig().override(backend__prefetch=1)
        with pytest.warns(KestrelNote, match="every layer resident .*, so prefetch = 1 has nothing to fetch ahead"):
            got, choice = fit_keep(model, config, cpu_ref_backend.CpuRefBackend, Counters(), KVRoom())
    assert choice.keep == "off" and got.backend.prefetch == 0 and got.residency.keep == "off"


# --- the KV cache counted beside the weights --------------------------------------------------------------------------
def roomy(budget_mib: float, room_mib: float, fixed_mib: float = 10) -> FitFacts:
    """``facts`` whose weights share ``room_mib`` with a KV cache of slots x positions / 100 MiB."""
    import attrs

    return attrs.evolve(facts(budget_mib, fixed_mib), room=int(room_mib * MIB), room_what="of the test's memory",
                        kv_bytes=lambda slots, positions: slots * positions * MIB // 100)


def test_a_kv_cache_that_leaves_the_budget_whole_is_said_beside_it():
    c = choose_keep(roomy(810, 900), asymmetric, 0, "asymmetric", KVRoom(1, 5000))
    assert c.keep == "off" and c.kv == 50 * MIB and c.budget == 810 * MIB
    assert "within the 810.0 MiB device weight-cache budget (test), beside a KV cache of 50.0 MiB (1 x 5,000 positions)" \
        in c.line
    assert c.to_json()["kv_bytes"] == 50 * MIB


def test_a_kv_cache_cuts_the_budget_to_the_room_it_leaves():
    c = choose_keep(roomy(810, 900), asymmetric, 0, "asymmetric", KVRoom(2, 5000))  # 100 MiB of KV: 800 left
    assert (c.keep, c.peak_layers, c.budget, c.kv) == (3, 6, 800 * MIB, 100 * MIB)
    assert "the 800.0 MiB left of the 900.0 MiB of the test's memory beside a KV cache of 100.0 MiB (2 x 5,000 " \
           "positions)" in c.line
    assert choose_keep(roomy(810, 900), asymmetric, 0, "asymmetric").keep == "off"  # no KV asked of: none counted


def test_a_kv_cache_that_leaves_too_little_is_refused_with_the_numbers():
    with pytest.raises(BudgetError) as exc:
        choose_keep(roomy(810, 100), asymmetric, 0, "asymmetric", KVRoom(1, 9500))
    msg = str(exc.value)
    assert "a KV cache of 95.0 MiB (1 x 9,500 positions) leaves 5.0 MiB of the 100.0 MiB of the test's memory, " \
           "under the 10.0 MiB resident for good; open the run with a smaller kv=(sequences, positions)" in msg
    assert "\n" not in msg
    with pytest.raises(BudgetError, match=r"even keep = 1 needs 210 MiB .*, lower the door's flags, free memory"):
        choose_keep(roomy(810, 300), asymmetric, 0, "asymmetric", KVRoom(1, 9500, "lower the door's flags"))


def test_cpu_ref_counts_the_kv_cache_the_run_is_opened_for(tiny_ckpt, monkeypatch):
    import torch

    from kestrel_core.engine.kvcache import kv_bytes

    with load(tiny_ckpt) as model:
        layer, fixed = _tiny_bytes(model)
        with model.open(backend="cpu_ref", keep="off") as run:
            want = run.generate(prompt_ids=[5, 17, 42], max_new_tokens=8, stop_at_eos=False).token_ids
        kv = kv_bytes(model.config, 512, torch.float32, 4)
        assert kv > fixed + 4 * layer  # so the room less the KV cache binds, not half the memory
        monkeypatch.setattr(cpu_ref_backend, "meminfo", lambda: {"MemAvailable": kv + fixed + 4 * layer})
        with pytest.warns(KestrelNote, match=r"keep = auto: keep = 2 .*beside a KV cache of 3\.0 MiB \(4 x 512"):
            run = model.open(backend="cpu_ref", kv=(4, 512))
        with run:
            assert run.keep_choice.kv == kv and run.keep_choice.budget == fixed + 4 * layer
            assert run.generate(prompt_ids=[5, 17, 42], max_new_tokens=8, stop_at_eos=False).token_ids == want
        with pytest.raises(BudgetError, match=r"a KV cache of 6\.0 MiB \(8 x 512 positions\) leaves"):
            model.open(backend="cpu_ref", kv=(8, 512))
        for bad in [(0, 5), (1, -1), (True, 4), "8", (1, 2, 3)]:
            with pytest.raises(ConfigError, match="kv must be \\(sequences, positions each\\), positive ints"):
                model.open(backend="cpu_ref", kv=bad)


def test_the_server_fits_beside_its_whole_batch_of_kv(tiny_ckpt):
    import torch

    from kestrel_core.engine.kvcache import kv_bytes
    from kestrel_core.serve.service import Limits, Service

    service = Service(KestrelConfig().override(model=str(tiny_ckpt), backend__name="cpu_ref"), "tiny",
                      Limits(max_batch=3, max_seq=100))
    service.load()
    try:
        assert service.run.keep_choice.kv == kv_bytes(service.model.config, 100, torch.float32, 3)
    finally:
        service.close()


def test_the_budget_chosen_by_the_fit_is_the_one_the_backend_holds(tiny_ckpt, monkeypatch):
    """The run's backend is handed the budget the fit chose (``BackendContext.fitted_budget``), whether it was the
    backend's default or the user's: its own check holds that one, and nothing is written into the run's config."""
    held = []
    checked = cpu_ref_backend.CpuRefBackend._check_budget
    monkeypatch.setattr(cpu_ref_backend.CpuRefBackend, "_check_budget",
                        lambda self, ctx: (held.append(ctx.fitted_budget), checked(self, ctx))[1])
    with load(tiny_ckpt) as model, warnings.catch_warnings():
        warnings.simplefilter("error")  # the budget bounds cpu_ref's resident layers too: no note that it does nothing
        with model.open(backend="cpu_ref", kv=(1, 8)) as run:
            choice = run.keep_choice
            assert held[-1] == (choice.budget, choice.source) and choice.budget > 0
            assert choice.source.startswith("half of the host's available memory")
            assert run.config.residency.budget_mb == KestrelConfig().residency.budget_mb  # the user's, untouched
        with model.open(backend="cpu_ref", kv=(1, 8), budget_mb=100) as run:
            assert held[-1] == (100 * MIB, "config") and run.config.residency.budget_mb == 100
        with model.open(backend="cpu_ref", keep=2, budget_mb=100) as run:  # a keep given: its own budget
            assert held[-1] is None and run.keep_choice is None


def test_cpu_ref_ranks_of_one_host_fit_their_share_of_its_memory(tiny_ckpt, monkeypatch):
    """Two ranks on one host (LOCAL_WORLD_SIZE 2): each fits half of what one process would, and says so."""
    from backends.cpu_ref.backend import CpuRefBackend
    from kestrel_core.engine.backend import BackendContext
    from kestrel_core.engine.plan import Counters

    monkeypatch.setattr(cpu_ref_backend, "meminfo", lambda: {"MemAvailable": 1000 * MIB})
    with load(tiny_ckpt) as model:
        cfg = KestrelConfig()
        ctx = BackendContext(model.checkpoint, model.config, cfg.backend, cfg.residency, Counters(), model.n_layers,
                             model.host, model.units, model.quant)
        one = CpuRefBackend.fit_facts(ctx)
        for k, v in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
            monkeypatch.setenv(k, v)
        two = CpuRefBackend.fit_facts(ctx)
    assert (one.budget, one.room) == (500 * MIB, 1000 * MIB) and (two.budget, two.room) == (250 * MIB, 500 * MIB)
    assert two.source == "half of the host's available memory, shared by the 2 ranks of this host"


def test_the_kv_cache_edges_the_budget_and_the_fixed_bytes():
    """What is left equal to the budget keeps the budget (said beside the KV cache); what is left equal to the bytes
    resident for good is refused as the KV cache's doing."""
    c = choose_keep(roomy(810, 910), asymmetric, 0, "asymmetric", KVRoom(2, 5000))  # 910 - 100 = 810
    assert c.budget == 810 * MIB and "device weight-cache budget (test), beside a KV cache of 100.0 MiB" in c.line
    with pytest.raises(BudgetError, match="leaves 10.0 MiB of the 110.0 MiB of the test's memory, under the 10.0 MiB "
                                          "resident for good"):
        choose_keep(roomy(810, 110), asymmetric, 0, "asymmetric", KVRoom(2, 5000))


def test_a_kv_room_takes_the_default_context_or_the_models_fewer():
    assert KVRoom(3).resolve(512).positions == 512 and KVRoom(3).resolve(10**6).positions == 4096
    assert KVRoom(3, 100).resolve(10**6).positions == 100
    assert KVRoom.of((2, None)) == KVRoom(2, None) and KVRoom.of(None) == KVRoom()
