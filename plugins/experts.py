"""Built-in expert policies: which experts of a Mixture-of-Experts model stay resident under a byte budget.

Each ranks the eviction candidates of ``kestrel_core.engine.expert_cache.ExpertCache`` by its own rule.
"""

from __future__ import annotations

from kestrel_core.engine.expert_cache import ExpertCache
from kestrel_core.hookspecs import hookimpl


class ExpertLRU(ExpertCache):
    """Evict the expert routed to least recently."""

    name = "expert_lru"

    def rank(self, key):
        return (self.last.get(key, 0), key)


class ExpertLFU(ExpertCache):
    """Evict the expert routed to least often (the least recent among equals)."""

    name = "expert_lfu"

    def rank(self, key):
        return (self.uses.get(key, 0), self.last.get(key, 0), key)


@hookimpl
def register_expert_policies(register):
    register("expert_lru", ExpertLRU)
    register("expert_lfu", ExpertLFU)
