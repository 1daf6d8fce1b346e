"""``keep = "auto"``'s choice at its edges (``engine.fit``): the window one layer short of the whole model, an expert
cache no larger than every expert, and which runs get an expert cache at all (``moe_facts``)."""

from __future__ import annotations

from kestrel_core.config import ResidencyConfig
from kestrel_core.engine.fit import FitFacts, choose_keep, moe_facts

MIB = 2**20


def test_the_largest_keep_tried_is_one_layer_short_of_every_layer():
    facts = FitFacts(710 * MIB, "test", "budget", 10 * MIB, 8, lambda n: 100 * MIB * min(n, 8))
    c = choose_keep(facts, lambda k: k, 0, "lru")  # keep k peaks at k layers: keep 7 needs 710 MiB
    assert (c.keep, c.peak_layers, c.need) == (7, 7, 710 * MIB)


def test_an_expert_cache_is_never_given_more_than_every_expert():
    """Own units of 100 MiB a layer that do not fit all four beside one token's experts: a window of three does, and
    the budget left (90 MiB) is more than the experts' 30 MiB, which is all the cache gets."""
    facts = FitFacts(400 * MIB, "test", "budget", 10 * MIB, 4, lambda n: (100 * min(n, 4) + 30) * MIB,
                     own_peak_bytes=lambda n: 100 * MIB * min(n, 4), experts_bytes=30 * MIB, routed_bytes=20 * MIB)
    c = choose_keep(facts, lambda k: k, 0, "lru")
    assert (c.keep, c.peak_layers) == (3, 3)
    assert c.expert_budget == 30 * MIB and c.need == 340 * MIB
    assert c.to_json()["expert_budget_bytes"] == 30 * MIB


class _Cfg:
    num_experts_per_tok = 2


def test_moe_facts_only_for_routed_experts_with_no_policy_given():
    own, experts = [30, 10, 20], [4, 7, 5]
    got = moe_facts(ResidencyConfig(), _Cfg(), own, experts)
    assert got["experts_bytes"] == 16 and got["routed_bytes"] == 2 * 7
    assert [got["own_peak_bytes"](n) for n in (0, 1, 2, 3)] == [0, 30, 50, 60]  # the largest own units first
    assert moe_facts(ResidencyConfig(expert_fetch="layer"), _Cfg(), own, experts) == {}  # experts come with the layer
    assert moe_facts(ResidencyConfig(expert_policy="expert_lfu"), _Cfg(), own, experts) == {}  # the user's policy
    assert moe_facts(ResidencyConfig(), _Cfg(), own, []) == {}  # a dense model
