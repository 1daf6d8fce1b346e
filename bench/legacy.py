"""The older scripts' records (bench/results/*.json without ``format``), read into the shape ``python -m bench``
writes, so one table function serves both. Nothing is measured or typed in here: each figure is the record's own,
or computed from the record's own step times by ``bench.stats`` (the function new records use).

- ``decode_graphs_*`` (stream_bench.py --graphs): every row kept every decode step's time and its step counts;
  the modes are rebuilt from the counts (the first step eager, the second captured, the rest replayed), so a row's
  figure is over its replayed steps, or its eager steps after the first, as a new row's is.
- ``stream_*`` (stream_bench.py): a row kept only its median over every decode step (the first included), eager
  (the captured step did not exist yet); that median is the figure, with its n.
- ``host_tier_*`` (host_tier_bench.py): every decode step's time and the step counts, as decode_graphs.

A retired scenario (``RETIRED``) is one whose question is settled and whose figures no page quotes, or one folded
into the scenarios that share its harness: its module is gone from ``python -m bench``, its records stay in bench/results/, listed by ``python -m bench render`` as any other, and
the harness names it as retired, with what settled it, rather than as unknown.
"""

from __future__ import annotations

import re

from bench.rows import compare_ids
from bench.stats import steady_steps, summary

# The older scripts, and the scenario of python -m bench that runs what each ran.
SCENARIO_OF = {"stream_bench.py": "stream", "decode_graphs.py": "stream", "moe_bench.py": "moe",
               "moe_host_cost.py": "moe-host-cost", "moe_peers.py": "peers", "airllm_peer.py": "peers",
               "host_tier_bench.py": "host-tier", "host_fill_bench.py": "host-fill",
               "expert_staging_bench.py": "expert-staging", "map_register_bench.py": "map-register",
               "ring_copy_bench.py": "ring-copy", "q8_gemv_bench.py": "q8-gemv", "rss_window.py": "rss-window",
               "rss_experts.py": "rss-experts", "window_overhead.py": "window-overhead",
               "profile_decode.py": "profile", "demo_record.py": "demo", "plot_cost_curve.py": "plot"}
# Retired scenarios, and what settled each; their records stay, read as they are (every figure is the record's own).
RETIRED = {
    "window-overhead": "the window's bookkeeping was 0.67 us a layer boundary over off's on the CPU "
                       "(window_overhead_20261203T114827Z.json), against decode steps of milliseconds",
    "peers": "never recorded, and folded: the same peers run beside kestrel's rows, through bench.peers.beside, in "
             "stream --peers, moe --peers and host-tier --rows peers",
    "profile": "the profile of a qwen3-1.7b decode step at keep=off (profile_qwen3-1.7b_off_20261202T1340Z.txt) led "
               "to the captured decode step, which docs/decode-graphs.md measures; moe-host-cost profiles a MoE step",
}
_SETTING = re.compile(r"^(?P<policy>\w+) keep=(?P<keep>\d+)(?: pf=(?P<pf>\d))?(?P<free> free)?$")


def step_modes(steps: dict | None, n: int) -> list[str] | None:
    """Each step's mode, from a legacy row's counts where they can only have come in one order; else None."""
    if not steps:
        return None
    e, c, r = steps.get("eager", 0), steps.get("captured", 0), steps.get("replayed", 0)
    if e + c + r != n:
        return None
    if c == 0 and r == 0:
        return ["eager"] * n
    if c == 1 and e >= 1:  # eager until two steps' plans match, that one captured, then replays
        return ["eager"] * e + ["captured"] + ["replayed"] * r
    return None


def settings_of(label: str) -> dict:
    """A legacy label's settings: "asymmetric keep=1 pf=1 +compile", "q8 off", "asymmetric keep=4 free"."""
    text = label.removeprefix("q8 ")
    compiled = text.endswith(" +compile")
    text = text.removesuffix(" +compile")
    if text == "off":
        s: dict = {"keep": "off"}
    else:
        m = _SETTING.match(text)
        if not m:
            raise ValueError(f"unrecognised legacy row label {label!r}")
        s = {"policy": m["policy"], "keep": int(m["keep"]), "prefetch": int(m["pf"] or 0)}
        if m["free"]:
            s["allocator"] = "free"
    if compiled:
        s["compile"] = True
    return s


def scenario_of(command: str) -> str | None:
    """The scenario that replaced the script a legacy record's command ran, or None."""
    m = re.match(r"(?:python )?bench/(\w+\.py)", command)
    return SCENARIO_OF.get(m[1]) if m else None


def now_of(scenario: str | None) -> str:
    """What runs a legacy script's measurement now: its command, or that its scenario is retired."""
    if scenario is None:
        return ""
    return "retired (bench/legacy.py)" if scenario in RETIRED else f"`python -m bench {scenario}`"


def label_of(s: dict) -> str:
    """The label ``python -m bench stream`` gives these settings."""
    from bench.scenarios.stream import label_of as new_label

    return new_label(s)


def _timed_row(r: dict, prefix: str, pinned: float | None) -> dict:
    """A legacy row with every step's time, as a new row."""
    s = settings_of(r["label"])
    ms = r.get("decode_ms") or []
    modes = step_modes(r.get("steps"), len(ms))
    if modes is None:
        raise ValueError(f"legacy row {r['label']!r}: its step counts {r.get('steps')} do not give each step's mode")
    mode, steady = steady_steps(modes)
    sm = summary([ms[i] for i in steady])
    bytes_tok = r.get("bytes_uploaded_per_token")
    out = {"label": prefix + label_of(s), "settings": s, "graphs": r.get("graphs", "off"), "decode_ms": ms,
           "step_modes": modes, "steady_mode": mode, "steady_steps": steady, "summary": sm,
           "captured_ms": [t for t, m in zip(ms, modes) if m == "captured"],
           "eager_ms": [t for t, m in zip(ms, modes) if m == "eager"],
           "bytes_uploaded_per_token": bytes_tok, "peak_device_bytes": r.get("peak_device_bytes"),
           "allocations_after_first_token": r.get("allocations_after_first_token"),
           "token_ids": r.get("token_ids"), "legacy_label": r["label"]}
    if "error" in r:
        out["error"] = r["error"]
    if bytes_tok is not None and sm["p50"]:
        out["effective_GBps"] = bytes_tok / sm["p50"] / 1e6
        if pinned:
            out["of_pinned"] = out["effective_GBps"] / pinned
    return out


def _baselines(rows: list[dict]) -> None:
    """Each row's ids against the first off row's, as ``python -m bench stream`` compares them (a --compile row's
    against the first compiled off's, and also against the uncompiled off's)."""
    off = next((r for r in rows if r["settings"] == {"keep": "off"}), None)
    off_c = next((r for r in rows if r["settings"] == {"keep": "off", "compile": True}), None)
    for r in rows:
        base = off_c if r["settings"].get("compile") else off
        if base is not None:
            r.update(compare_ids(r, base))
        if r["settings"].get("compile") and off is not None:
            r["vs_uncompiled_off"] = compare_ids(r, off)


def stream_from_decode_graphs(rec: dict, preset: str) -> dict:
    """A decode_graphs record's shape, as ``python -m bench stream``'s result."""
    shape = rec["shapes"][preset]
    pinned = shape.get("pinned_h2d_GBps") or rec["ceilings"]["pinned_h2d_GBps"]
    rows = [_timed_row(r, "", pinned) for r in shape["rows"] if "decode_ms" in r]
    rows += [{"label": r["label"], "graphs": r.get("graphs"), "settings": {}, "error": r["error"]}
             for r in shape["rows"] if "error" in r]
    _baselines([r for r in rows if "error" not in r])
    out: dict = {"preset": preset, "backend": "cuda", "legacy": "decode_graphs", "rows": rows,
                 "ceilings": {"pinned_h2d": {"GBps": pinned}},
                 "floor": {"summary": {"n": None, "p50": shape["floor"]["ms"]}, "bytes": shape["floor"]["bytes"],
                           "TBps": shape["floor"]["TBps"]},
                 "tokens": rec.get("tokens")}
    if shape.get("q8_rows"):
        q8 = [_timed_row(r, "q8 ", pinned) for r in shape["q8_rows"] if "decode_ms" in r]
        _baselines(q8)
        bf16_off = {r["graphs"]: r for r in rows if r.get("settings") == {"keep": "off"}}
        for r in q8:
            if r["graphs"] in bf16_off:
                r["vs_bf16_off"] = compare_ids(r, bf16_off[r["graphs"]])
        out["q8"] = {"rows": q8}
    peer = shape.get("peer") or {}
    out["peers"] = {"versions": {"transformers": peer.get("transformers_version")}}
    for key, name, skip in (("dynamic_cache_eager", "transformers", 2), ("static_cache_compiled", "transformers-static", 3)):
        p = peer.get(key)
        if p and "decode_ms" in p:  # the old script's skips: the eager and captured steps; compile's three
            out["peers"][name] = {"label": name, "decode_ms": p["decode_ms"], "skipped_steps": skip,
                                  "summary": summary(p["decode_ms"][skip:]), "token_ids": p.get("token_ids")}
        elif p:
            out["peers"][name] = {"label": name, "error": p.get("error")}
    if shape.get("interleaved"):
        il = shape["interleaved"]
        out["interleaved"] = {"off": {"summary": summary(il["off"]["decode_ms"])},
                              "keep_all": {"summary": summary(il["keep_all"]["decode_ms"])}}
        out["interleaved"]["ratio_p50"] = (out["interleaved"]["keep_all"]["summary"]["p50"] /
                                           out["interleaved"]["off"]["summary"]["p50"])
    return out


def stream_from_stream_bench(rec: dict) -> dict:
    """A stream_bench record (eager; each row only its median over every decode step), as a stream result."""
    pinned = rec["ceilings"]["pinned_h2d_GBps"]
    rows = []
    for r in rec["rows"]:
        s = settings_of(r["label"])
        rows.append({"label": label_of(s), "settings": s, "graphs": "off", "legacy_label": r["label"],
                     "summary": {"n": r["decode_steps"], "p50": r["ms_per_token"], "p10": None, "p90": None},
                     "steady_mode": "eager, every step (the first included)",
                     "bytes_uploaded_per_token": r["bytes_uploaded_per_token"],
                     "effective_GBps": r["effective_GBps"], "of_pinned": r["effective_GBps"] / pinned,
                     "peak_device_bytes": r["peak_device_bytes"],
                     "allocations_after_first_token": r["allocations_after_warmup"], "token_ids": r["token_ids"],
                     "ids_match_baseline": r.get("ids_match_off")})
    peers = {}
    for key, name in (("hf_resident", "transformers"), ("accelerate_offload", "accelerate")):
        p = (rec.get("peers") or {}).get(key)
        if p:
            peers[name] = {"label": name, "decode_ms": p["decode_ms"], "skipped_steps": 0,
                           "summary": summary(p["decode_ms"]), "token_ids": p.get("token_ids"),
                           "peak_device_bytes": p.get("peak_device_bytes")}
    if rec.get("peers"):
        peers["versions"] = {"transformers": rec["peers"].get("transformers_version"),
                             "accelerate": rec["peers"].get("accelerate_version")}
    return {"preset": rec["model"]["preset"], "backend": "cuda", "legacy": "stream", "rows": rows,
            "model": rec["model"], "ceilings": {"pinned_h2d": {"GBps": pinned}}, "peers": peers}


def host_tier_rows(rec: dict) -> list[dict]:
    """A host_tier record's kestrel rows, each with its figure over its replayed steps, or its eager steps after
    the first (every step's time is in the record)."""
    out = []
    for r in rec.get("rows", []):
        ms = r["decode_ms"]
        modes = step_modes(r.get("steps"), len(ms))
        mode, steady = steady_steps(modes)
        sm = summary([ms[i] for i in steady])
        out.append({"label": r["label"], "cold": r["cold"], "mode": r["mode"], "decode_ms": ms, "step_modes": modes,
                    "steady_mode": mode, "summary": sm, "bytes_uploaded_per_token": r["bytes_uploaded_per_token"],
                    "upload_GBps": r["bytes_uploaded_per_token"] / sm["p50"] / 1e6,
                    "host_pinned_bytes": r.get("peak_host_pinned_bytes"),
                    "peak_rss_over_before_bytes": r.get("peak_rss_over_before_bytes"),
                    "disk_GBps": r.get("disk_GBps"), "odirect_adjacent_GBps": r.get("odirect_adjacent_GBps"),
                    "token_ids": r.get("token_ids")})
    return out
