"""kestrel replay: an expert policy over a recorded routing trace, offline, against expert_belady."""

from __future__ import annotations

import math

from kestrel_core import plugins

from kestrel_core.tools import traces
from kestrel_core.errors import ConfigError
from kestrel_core.engine.expert_cache import budget_bytes
from kestrel_core.io.jsonout import emit_json

HELP = "replay a routing trace (kestrel generate --trace) through an expert policy at a budget, with no weights or GPU"


def add_arguments(p):
    p.add_argument("--trace", required=True, help="a trace written by kestrel generate --trace FILE")
    p.add_argument("--policy", required=True, help="expert policy: expert_lru, expert_lfu, or a plugin's")
    p.add_argument("--expert-budget-mb", type=float, required=True, help="MiB the policy keeps experts in")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args) -> int:
    trace = traces.read_trace(args.trace)
    if not math.isfinite(args.expert_budget_mb):
        raise ConfigError(f"--expert-budget-mb must be a finite number of MiB, got {args.expert_budget_mb:g}")
    if not args.expert_budget_mb > 0:
        raise ConfigError(f"--expert-budget-mb must be above 0, got {args.expert_budget_mb:g}")
    budget = budget_bytes(args.expert_budget_mb, int(trace["model"]["num_experts_per_tok"]), max(trace["sizes"].values()))
    policy = plugins.lookup("expert_policies", args.policy).factory(budget=budget)
    rows = [traces.replay(trace, policy), traces.replay(trace, traces.ExpertBelady(budget, trace["events"]))]
    if args.json:
        emit_json({"trace": args.trace, "expert_budget_mb": args.expert_budget_mb, "rows": rows})
        return 0
    print(f"trace {args.trace}: {len(trace['events'])} decision points, {rows[0]['decode_tokens']} decoded tokens, "
          f"budget {args.expert_budget_mb:g} MiB")
    if not trace["events"]:
        print("no events: the trace holds no decision point, so there is nothing to replay")
        return 0
    for r in rows:
        print(f"{r['policy']:14} hit rate {100 * r['hit_rate']:5.1f}%  {r['bytes_per_decoded_token'] / 2**20:8.3f} MiB "
              f"a decoded token  ({r['misses']} fetches, {r['bytes_fetched'] / 2**20:.3f} MiB in all)")
        if r["bytes_read_host"]:  # a table run's steps read their misses from host copies, then admitted them
            print(f"{'':14} and {r['bytes_read_host'] / 2**20:.3f} MiB read by steps from host copies, of which "
                  f"{r['bytes_reread'] / 2**20:.3f} MiB were fetched again")
    best = rows[1]["bytes_fetched"]
    if best:
        print(f"{args.policy} fetches {rows[0]['bytes_fetched'] / best:.2f}x the bytes of the offline optimum")
    return 0
