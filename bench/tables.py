"""The docs' tables, each drawn from records: ``BLOCKS[name](records) -> markdown``. A doc holds a block between
``<!-- bench:NAME -->`` and ``<!-- /bench -->``; ``python -m bench render`` writes each block from these functions,
and tests/test_bench_docs.py fails where a doc and its records disagree.

Every number comes from a record: a time is the p50 of a row's steps by ``bench.stats`` (with p10-p90 and n where the
record kept every step), never a best run. The README's headline and picture come from the newest complete
``python -m bench stream`` record of the Qwen3-8B shape on cuda; until one is committed, from the older harness's
record, read through ``bench.legacy`` and labelled so.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable

from bench import legacy
from bench.records import Records, is_new

LEGACY_GRAPHS = {"qwen3-8b": "decode_graphs_qwen3-8b_20261203T132426Z.json",
                 "qwen3-1.7b": "decode_graphs_qwen3-1.7b_20261203T130901Z.json"}
LEGACY_SWEEP = "stream_qwen3-8b_20261202T134400Z.json"
LEGACY_Q8_STREAM = "stream_qwen3-8b_20261202T211758Z.json"
LEGACY_Q8_GEMV = "q8_gemv_20261202T211558Z.json"
LEGACY_MOE = ("moe_qwen3-30b-a3b_L8_20261203T150206Z.json", "moe_qwen3-30b-a3b_L8_20261203T154747Z.json")
LEGACY_MOE_HOST_COST = "moe_host_cost_20261203T171706Z.json"
LEGACY_RSS_WINDOW = "rss_window_20261202T143303Z.json"
# The runs of host_tier_bench.py's kestrel rows that backends.md compared as one bench (1b02c98 .. 5e48b12).
LEGACY_HOST_TIER = ("host_tier_20261204T041247Z.json", "host_tier_20261204T154941Z.json",
                    "host_tier_20261204T180236Z.json", "host_tier_20261204T182017Z.json")


# --- formatting ---------------------------------------------------------------------------------------------------

def ms(x: float | None, places: int = 2) -> str:
    return "—" if x is None else f"{x:.{places}f}"


def spread(s: dict | None, places: int = 2) -> str:
    """p50 (p10–p90, n=N), or p50 (n=N) where the record kept only the median."""
    if not s or s.get("p50") is None:
        return "—"
    n = f"n={s['n']}" if s.get("n") is not None else "n not recorded"
    if s.get("p10") is None:
        return f"{s['p50']:.{places}f} ({n})"
    return f"{s['p50']:.{places}f} ({s['p10']:.{places}f}–{s['p90']:.{places}f}, {n})"


def gigabytes(nbytes: int | None) -> str:
    return "(not recorded) GB" if nbytes is None else f"{nbytes / 1e9:.2f} GB"


def short(commit) -> str:
    text = str(commit or "not recorded")
    return text[:7] if re.fullmatch(r"[0-9a-f]{40}", text) else text


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def gpu_of(rec: dict) -> str:
    if is_new(rec):
        m = rec["stamp"]["machine"]
        return m.get("gpu") or f"CPU ({m.get('cpu_model') or 'model not recorded'})"
    hw = rec.get("hardware") or {}
    return hw.get("gpu") or ("CPU" if hw else "not recorded")


def source_line(name: str, rec: dict) -> str:
    """Where a table's figures come from: the record, its commit and command."""
    if is_new(rec):
        st = rec["stamp"]
        dirty = ", tree dirty" if st.get("dirty") else ""
        return (f"`bench/results/{name}` (commit {short(st.get('commit'))}{dirty}, {gpu_of(rec)}), produced by "
                f"`{st['command']}`")
    cmd = rec.get("command", "not recorded")
    cmd = f"python {cmd}" if cmd.startswith("bench/") else cmd
    now = legacy.scenario_of(cmd)
    return (f"`bench/results/{name}` (a record of the older bench scripts, read through `bench/legacy.py`; commit "
            f"{short(rec.get('commit'))}, {gpu_of(rec)}), produced by `{cmd}`"
            + (f" (that script is now {legacy.now_of(now)})" if now else ""))


# --- the stream records -------------------------------------------------------------------------------------------

def stream_source(recs: Records, preset: str, sweep: bool = False) -> tuple[str, dict, dict]:
    """(record name, record, result) of the newest complete stream record of ``preset`` on cuda of the row set asked
    for (``--rows sweep``: the keeps the picture draws; ``--rows headline`` with its q8 rows: the settings the headline
    names), else the older harness's record of that shape, which has both."""
    row_set = "sweep" if sweep else "headline"
    found = recs.newest("stream", lambda r: r["result"].get("preset") == preset and r["result"].get("backend") == "cuda"
                        and r["result"].get("row_set") == row_set and (sweep or bool(r["result"].get("q8"))))
    if found:
        return found[0], found[1], found[1]["result"]
    name = LEGACY_GRAPHS[preset]
    return name, recs[name], legacy.stream_from_decode_graphs(recs[name], preset)


def find(rows: list[dict], label: str, graphs: str | None = None) -> dict | None:
    return next((r for r in rows if r.get("label") == label and "error" not in r
                 and (graphs is None or r.get("graphs") == graphs)), None)


def ids_note(r: dict | None) -> str:
    """How a row's greedy ids compare: with off's of its build (q8: q8 off's), a --compile row also with the
    uncompiled off's, and q8 off with bf16 off's."""
    if r is None:
        return "—"
    q8 = r["label"].startswith("q8 ")
    off_word = "q8 off's" if q8 else "off's"
    compiled = r["label"].endswith("--compile")
    is_base = r["label"] in ("off", "q8 off", "off, --compile", "q8 off, --compile")
    notes = []

    def parted(v: dict, whose: str) -> str:
        if v.get("ids_match_baseline"):
            return f"= {whose}"
        return f"leave {whose} after {v['leading_ids_match_baseline']} of {v['ids_compared']} tokens"

    if compiled:
        if r.get("vs_uncompiled_off"):
            notes.append(parted(r["vs_uncompiled_off"], off_word))
        if not is_base and r.get("ids_match_baseline") is not None:
            notes.append("= the compiled off's" if r["ids_match_baseline"] else "≠ the compiled off's")
    elif is_base:
        notes.append("the baseline")
    elif r.get("ids_match_baseline") is not None:
        notes.append(parted(r, off_word))
    if r["label"] == "q8 off" and r.get("vs_bf16_off"):
        notes.append(parted(r["vs_bf16_off"], "bf16 off's"))
    return "; ".join(notes) or "—"


def _graph_cells(rows, label: str, with_capture: bool) -> list[str]:
    g, e = find(rows, label, "auto"), find(rows, label, "off")
    cells = [spread(g["summary"]) if g else "—", spread(e["summary"]) if e else "—"]
    if with_capture:
        cells.insert(1, ", ".join(ms(x) for x in g["captured_ms"]) if g and g.get("captured_ms") else "—")
    return cells


def decode_table(result: dict, full: bool) -> str:
    """Graph against eager, setting by setting, with the floor and the peers."""
    rows, q8 = result.get("rows", []), (result.get("q8") or {}).get("rows", [])
    pinned = (result.get("ceilings") or {}).get("pinned_h2d", {}).get("GBps")
    L = max((r["settings"]["keep"] for r in rows if isinstance(r.get("settings", {}).get("keep"), int)), default=None)
    header = ["setting", "graph ms/tok: p50 (p10–p90, n replayed steps)", "eager ms/tok: p50 (p10–p90, n)", "ids"]
    if full:
        header.insert(2, "capture step ms")
    out = []
    floor = result.get("floor")
    if floor:
        cells = [spread(floor["summary"]), "—"] + (["—"] if full else [])
        out.append([f"GEMV floor: every weight read once ({floor['bytes'] / 1e9:.1f} GB, {floor['TBps']:.2f} TB/s)",
                    *cells, "—"])
    wanted = [("off", rows), ("off, --compile", rows)]
    if full and L:
        wanted.append((f"asymmetric keep={L}", rows))
    wanted += [("asymmetric keep=1, prefetch 1", rows), ("pinned_set keep=4, prefetch 1", rows)]
    if full:
        wanted.append(("q8 off", q8))
    wanted.append(("q8 off, --compile", q8))
    for label, rs in wanted:
        g = find(rs, label, "auto") or find(rs, label)
        if g is None:
            continue
        name = label
        if g.get("effective_GBps"):
            name += (f" ({g['bytes_uploaded_per_token'] / 1e9:.2f} GB/tok, {g['effective_GBps']:.1f} GB/s graph"
                     + (f", {100 * g['effective_GBps'] / pinned:.0f}% of the pinned copy" if pinned else "") + ")")
        out.append([name, *_graph_cells(rs, label, full), ids_note(g)])
    peers = result.get("peers") or {}
    versions = peers.get("versions") or {}
    tv = f" {versions['transformers']}" if versions.get("transformers") else ""
    static, dynamic = peers.get("transformers-static"), peers.get("transformers")
    if static and static.get("summary"):
        out.append([f'transformers{tv}, StaticCache + `torch.compile(mode="reduce-overhead")` '
                    f"(the first {static['skipped_steps']} steps left out)", spread(static["summary"]), "—",
                    *(["—"] if full else []), peer_ids(static, rows)])
    if dynamic and dynamic.get("summary"):
        out.append([f"transformers{tv}, DynamicCache, eager (the first {dynamic['skipped_steps']} steps left out)", "—",
                    *(["—"] if full else []), spread(dynamic["summary"]), peer_ids(dynamic, rows)])
    return table(header, out)


def peer_ids(p: dict, rows: list[dict]) -> str:
    off = find(rows, "off", "auto") or find(rows, "off")
    if not off or not p.get("token_ids"):
        return "—"
    n = min(len(p["token_ids"]), len(off["token_ids"]))
    lead = next((i for i in range(n) if p["token_ids"][i] != off["token_ids"][i]), n)
    return "= off's" if lead == n else f"first {lead} of {n} = off's"


def headline_picture(recs: Records) -> str:
    """The sentence under the README's picture: what the curve shows, from the record it is drawn from."""
    name, rec, result = stream_source(recs, "qwen3-8b", sweep=True)
    rows = result.get("rows", [])
    off = find(rows, "off", "auto") or find(rows, "off")
    stream = next(filter(None, (find(rows, label, g) for label in ("asymmetric keep=1, prefetch 1", "asymmetric keep=1")
                                for g in ("auto", None))))
    pinned = (result.get("ceilings") or {}).get("pinned_h2d", {}).get("GBps")
    return (f"The cost curve on the Qwen3-8B shape (bf16, one {gpu_of(rec)}; each point the p50 of a setting's "
            f"{off['steady_mode']} steps): `off` decodes at {off['summary']['p50']:.2f} ms/token in "
            f"{gigabytes(off.get('peak_device_bytes'))} of device memory, `{stream['label']}` at "
            f"{stream['summary']['p50']:.2f} ms/token in {gigabytes(stream.get('peak_device_bytes'))}, moving "
            f"{stream['bytes_uploaded_per_token'] / 1e9:.2f} GB a token at {stream['effective_GBps']:.1f} GB/s "
            f"against a pinned copy rate of {ms(pinned, 1)} GB/s measured in the same run. Drawn by "
            f"`python -m bench plot` from {source_line(name, rec)}.")


def headline(recs: Records) -> str:
    """The README's headline table: the captured decode step on the Qwen3-8B shape."""
    name, rec, result = stream_source(recs, "qwen3-8b")
    intro = (f"Decode ms/token by CUDA events, from {source_line(name, rec)}. \"graph\": the p50 (p10–p90, n) of the "
             "steps replayed as one CUDA graph, the eager first step and the capture step left out; \"eager\": "
             "`graphs = \"off\"`, the eager steps after the first. \"ids\": against `off` of the same build.")
    return "\n\n".join([intro, decode_table(result, full=False)])


def decode_graphs(preset: str) -> Callable[[Records], str]:
    def block(recs: Records) -> str:
        name, rec, result = stream_source(recs, preset)
        intro = (f"From {source_line(name, rec)}. Each row's graph and eager runs went one after the other; "
                 "\"capture step ms\": the one step captured, left out of the graph figure with the eager first step.")
        parts = [intro, decode_table(result, full=True)]
        il = result.get("interleaved")
        if il:
            parts.append(f"`off` against keep=L, run after run: p50 {il['off']['summary']['p50']:.3f} against "
                         f"{il['keep_all']['summary']['p50']:.3f} ms ({il['ratio_p50']:.4f}x; n="
                         f"{il['off']['summary']['n']} and {il['keep_all']['summary']['n']} replayed steps).")
        return "\n\n".join(parts)

    return block


def sweep(recs: Records) -> str:
    found = recs.newest("stream", lambda r: r["result"].get("preset") == "qwen3-8b" and r["result"].get("backend") == "cuda"
                        and r["result"].get("row_set") == "sweep")
    name, rec = found if found else (LEGACY_SWEEP, recs[LEGACY_SWEEP])
    result = rec["result"] if found else legacy.stream_from_stream_bench(rec)
    graphs = "auto" if found else "off"
    pinned = result["ceilings"]["pinned_h2d"]["GBps"]
    header = ["setting", "ms/tok: p50 (n)", "GB uploaded/tok", "GB/s", "of pinned", "peak device GB",
              "allocs after the first token", "ids = off"]
    out = []
    for r in result["rows"]:
        if "error" in r or r.get("graphs", graphs) != graphs:
            continue
        gbs = r.get("effective_GBps") or 0
        out.append([r["label"], spread({**r["summary"], "p10": None}), f"{r['bytes_uploaded_per_token'] / 1e9:.2f}",
                    f"{gbs:.1f}" if gbs else "—", f"{100 * gbs / pinned:.0f}%" if gbs else "—",
                    ms(r["peak_device_bytes"] / 1e9 if r.get("peak_device_bytes") else None),
                    str(r.get("allocations_after_first_token")), "yes" if r.get("ids_match_baseline") else "no"])
    peers = result.get("peers") or {}
    v = peers.get("versions") or {}
    if peers.get("transformers"):
        p = peers["transformers"]
        out.append([f"transformers {v.get('transformers') or ''}, resident, eager", spread({**p["summary"], "p10": None}),
                    "—", "—", "—", ms(p["peak_device_bytes"] / 1e9 if p.get("peak_device_bytes") else None), "—",
                    peer_ids(p, result["rows"])])
    if peers.get("accelerate"):
        p = peers["accelerate"]
        out.append([f"accelerate {v.get('accelerate') or ''} offload, every layer on the CPU",
                    spread({**p["summary"], "p10": None}), "—", "—", "—", "—", "—", "—"])
    how = ("each row's p50 over its replayed steps" if found else
           "eager (before the captured step existed); each row's figure is the median of its decode steps, the first "
           "included, which is all the older script kept")
    return (f"From {source_line(name, rec)}: {how}. Pinned host-to-device copy in the same run: "
            f"**{pinned:.1f} GB/s**.\n\n" + table(header, out))


def q8_stream(recs: Records) -> str:
    rec = recs[LEGACY_Q8_STREAM]
    bf16 = {r["label"]: r for r in rec["rows"]}
    out = []
    for r in rec["q8"]["rows"]:
        twin = bf16[r["label"].removeprefix("q8 ")]
        label = legacy.label_of(legacy.settings_of(r["label"].removeprefix("q8 ")))
        out.append([label, f"{r['ms_per_token']:.2f}", f"{r['bytes_uploaded_per_token'] / 1e9:.2f}",
                    f"{twin['ms_per_token']:.2f}", f"{twin['bytes_uploaded_per_token'] / 1e9:.2f}",
                    f"{r['ms_per_token'] / twin['ms_per_token']:.3f}",
                    "yes" if r["ids_match_q8_off"] else "no"])
    n = {r["decode_steps"] for r in rec["q8"]["rows"] + rec["rows"]}
    return (f"From {source_line(LEGACY_Q8_STREAM, rec)}; eager; each figure the median of a row's "
            f"{'/'.join(map(str, sorted(n)))} decode steps, the first included. Pinned copy "
            f"{rec['ceilings']['pinned_h2d_GBps']:.1f} GB/s.\n\n"
            + table(["setting", "q8 ms/tok", "q8 GB/tok", "bf16 ms/tok", "bf16 GB/tok", "q8 / bf16", "q8 ids = q8 off"],
                    out))


LAYER_OF = {(4096, 12288): "down (target)", (12288, 4096): "target", (6144, 4096): "fused qkv", (4096, 4096): "o",
            (24576, 4096): "fused gate-up", (151936, 4096): "lm_head"}


def _p50(x) -> float:
    return x if isinstance(x, (int, float)) else x["summary"]["p50"] if "summary" in x else statistics.median(x)


def q8_gemv(recs: Records) -> str:
    found = recs.newest("q8-gemv", lambda r: r["result"].get("group") == 64)
    name, rec = found if found else (LEGACY_Q8_GEMV, recs[LEGACY_Q8_GEMV])
    rows = rec["result"]["rows"] if found else rec["rows"]
    d2d = (rec["result"]["ceilings"]["d2d_read_plus_write"]["GBps"] if found
           else rec["ceilings"]["d2d_GBps_read_plus_write"])
    torch_path = {(r["n"], r["k"]): r for r in rows if r["variant"] == "torch"}
    out = []
    for r in rows:
        if r["variant"] != "auto":
            continue
        dev = r["device"]["p50"] if found else r["device_ms"]
        eager = r["eager"]["p50"] if found else r["eager_ms"]
        t = torch_path.get((r["n"], r["k"]))
        tms = (t["device"]["p50"] if found else t["device_ms"]) if t else None
        out.append([f"{r['n']} x {r['k']}", LAYER_OF.get((r["n"], r["k"]), ""),
                    " x ".join(map(str, r["plan"][:2])) if r.get("plan") else "—", f"{dev * 1e3:.1f}",
                    f"{r['GBps']:.0f}", f"{100 * r['fraction_of_d2d']:.0f}%", f"{eager * 1e3:.1f}",
                    ms(tms * 1e3 if tms else None, 1)])
    how = ("medians of every repetition kept in the record" if found else
           "each the median the older script recorded (its repetitions were not kept)")
    return (f"From {source_line(name, rec)}; device copy {d2d / 1e3:.2f} TB/s (read + write); {how}.\n\n"
            + table(["W [n x k]", "layer", "grid", "device µs", "GB/s", "of d2d copy", "eager µs",
                     "torch path device µs"], out))


# --- MoE ----------------------------------------------------------------------------------------------------------

def _moe_rows(rec: dict) -> dict[str, dict]:
    out = {}
    for sec in ("uniform", "skewed", "q8"):
        for r in rec.get(sec, {}).get("rows", []):
            out[r["label"]] = r
    return out


def _moe_ms(r: dict) -> float:
    return r["summary"]["p50"] if "summary" in r else r["ms_per_token"]


def moe_summary(recs: Records) -> str:
    a, b = (recs[n] for n in LEGACY_MOE)
    ra, rb = _moe_rows(a), _moe_rows(b)

    def cell(label: str, extra: bool = True) -> str:
        if label not in ra:
            return ""
        r = ra[label]
        text = f"{_moe_ms(r):.2f} / {_moe_ms(rb[label]):.2f}"
        if extra and r.get("expert_policy"):
            hit = f"{100 * r['hit_rate']:.1f}% hits" if r.get("hit_rate") is not None else ""
            rec_ = f", recall {100 * r['prefetch_recall']:.0f}%" if r.get("prefetch_recall") else ""
            text += f" ({hit}, {r['bytes_uploaded_per_token'] / 1e6:.0f} MB/tok{rec_})"
        return text

    whole = "uniform whole-layer asymmetric keep=1 pf=1"
    out = [["`off` (every expert resident)", cell("uniform off", False), cell("skewed off", False)]]
    for policy, pf in (("expert_lfu", 0), ("expert_lru", 0), ("expert_lru", 1)):
        out.append([f"{policy}, 4 GiB, {'speculative prefetch' if pf else 'no prefetch'}",
                    cell(f"uniform {policy} 4 GiB-eq pf={pf}"), cell(f"skewed {policy} 4 GiB-eq pf={pf}")])
    out.append(["whole layers (asymmetric keep=1, prefetch 1)",
                f"{_moe_ms(ra[whole]):.1f} / {_moe_ms(rb[whole]):.1f} ({ra[whole]['bytes_uploaded_per_token'] / 1e9:.1f} GB/tok)", ""])
    for key, label in (("transformers_resident", "transformers {v}, resident"),
                       ("accelerate_experts_on_cpu", "accelerate {a}, experts on the CPU"),
                       ("airllm", "AirLLM {air} (whole layers)")):
        pa, pb = a["peers"][key], b["peers"][key]
        out.append([label.format(v=pa.get("transformers_version"), a=pa.get("accelerate_version"),
                                 air=pa.get("airllm_version")), f"{pa['ms_per_token']:.1f} / {pb['ms_per_token']:.1f}", ""])
    steps = {r["decode_steps_measured"] for r in ra.values()} | {r["decode_steps_measured"] for r in rb.values()}
    return (f"From {source_line(LEGACY_MOE[0], a)}, and run 2: {source_line(LEGACY_MOE[1], b)}. Each time is the "
            f"median of a row's decode steps after its warm-up ({'/'.join(map(str, sorted(steps)))} steps: the "
            "older script kept only the median); run 1 / run 2.\n\n"
            + table(["row (ms/tok)", "uniform router", "skewed router"], out))


def moe_rows(recs: Records) -> str:
    a, b = (recs[n] for n in LEGACY_MOE)
    ra, rb = _moe_rows(a), _moe_rows(b)
    mib = 2**20
    out = []
    for label, r in ra.items():
        r2 = rb[label]
        hit = f"{100 * r['hit_rate']:.1f}" if r.get("expert_policy") and r.get("hit_rate") is not None else "-"
        rec_ = f"{100 * r['prefetch_recall']:.1f}" if r.get("prefetch_recall") else "-"
        ids = r.get("ids_match_off", r.get("ids_match_q8_off"))
        out.append([label.replace("-eq", ""), f"{_moe_ms(r):.2f}", f"{_moe_ms(r2):.2f}",
                    f"{r['bytes_uploaded_per_token'] / 1e6:.1f}", hit, rec_,
                    f"{r['peak_streamed_bytes_decode'] / mib:.0f}",
                    f"{r['allocations_after_warmup']} / {r2['allocations_after_warmup']}", "yes" if ids else "no"])
    off = ra["uniform off"]["token_ids"]
    for key, label in (("transformers_resident", "transformers resident"),
                       ("accelerate_experts_on_cpu", "accelerate experts on cpu"), ("airllm", "airllm")):
        pa, pb = a["peers"][key], b["peers"][key]
        lead = next((i for i, (x, y) in enumerate(zip(pa["token_ids"], off)) if x != y), min(len(off), len(pa["token_ids"])))
        out.append([label, f"{pa['ms_per_token']:.1f}", f"{pb['ms_per_token']:.1f}", "", "", "",
                    f"{pa['peak_device_bytes'] / mib:.0f} (device)", "", f"first {lead} equal"])
    return table(["row", "ms/tok run 1", "ms/tok run 2", "MB uploaded/tok", "hit %", "recall %", "peak streamed MiB",
                  "allocs after warm-up", "ids = off"], out)


def moe_host_cost(recs: Records) -> str:
    rec = recs[LEGACY_MOE_HOST_COST]
    s = rec["summary"]
    out = []
    for setting in ("off", "expert_lfu 4 GiB-eq", "expert_lfu 8 GiB-eq"):
        cells = []
        for router in ("uniform", "skewed"):
            x = s[f"{router} {setting}"]
            cells.append(f"{x['median']:.2f} ({x['min']:.2f}–{x['max']:.2f})")
        out.append([setting, *cells])
    return (f"From {source_line(LEGACY_MOE_HOST_COST, rec)}: each cell the median over the {rec['rounds']} rounds of "
            "each round's median decode step (min–max over the rounds), ms/token.\n\n"
            + table(["setting", "uniform", "skewed"], out))


# --- host memory --------------------------------------------------------------------------------------------------

def host_tier_runs(recs: Records) -> list[tuple[str, dict, list[dict]]]:
    runs = [(n, recs[n], legacy.host_tier_rows(recs[n])) for n in LEGACY_HOST_TIER]
    runs += [(n, r, r["result"]["rows"]) for n, r in recs.new("host-tier", lambda r: r["result"].get("rows_kind") == "kestrel")]
    return runs


def host_tier(recs: Records) -> str:
    runs = host_tier_runs(recs)
    out = []
    for budget in ("all", "4 GiB", "1 GiB"):
        for cold in (False, True):
            label = f"{budget} {'cold' if cold else 'hot'}"
            found = [next(r for r in rows if r["label"] == label) for _, _, rows in runs]
            p50s = [r["summary"]["p50"] for r in found]
            mid = sorted(found, key=lambda r: r["summary"]["p50"])[(len(found) - 1) // 2]  # the median run
            modes = sorted({f"{r['summary']['n']} {r['steady_mode']}" for r in found})
            disk = [r["disk_GBps"] for r in found if r.get("disk_GBps")]
            out.append([budget, "dropped" if cold else "hot",
                        f"{statistics.median(p50s):.1f} ({min(p50s):.1f}–{max(p50s):.1f})", " / ".join(modes),
                        f"{mid['upload_GBps']:.1f}",
                        f"{statistics.median(disk):.2f} ({min(disk):.2f}–{max(disk):.2f}, {len(disk)} of {len(found)} runs)"
                        if disk else "—",
                        f"{mid['host_pinned_bytes'] / 2**30:.2f}" if mid.get("host_pinned_bytes") else "—"])
    names = ", ".join(f"`{n}` ({short(r.get('commit') or r.get('stamp', {}).get('commit'))})" for n, r, _ in runs)
    return (f"{len(runs)} runs at keep=1 with prefetch 1 on the Qwen3-8B shape (13.51 GB a token), one H200: {names}. "
            "A run's figure is the p50 of its replayed steps (the all-pinned rows: the one step after the capture "
            "step), or of its eager steps after the first (the rings: two); the table gives the median run and the "
            "spread over the runs, and the median run's upload rate and pinned bytes. Disk GB/s: the runs that "
            "recorded it.\n\n"
            + table(["host budget", "pages", "ms/token: median run (min–max)", "steps a run", "GB/s uploaded",
                     "disk GB/s", "pinned GiB"], out))


def rss_window(recs: Records) -> str:
    found = recs.newest("rss-window", lambda r: r["result"].get("preset") == "small-300m")
    name, rec = found if found else (LEGACY_RSS_WINDOW, recs[LEGACY_RSS_WINDOW])
    res = rec["result"] if found else rec
    mib = 2**20
    out = [[str(r["keep"]), f"{r['peak_mapping_rss_bytes'] / mib:.2f} MiB",
            f"{r['bound_bytes'] / mib:.2f} MiB ({'every tensor' if r['keep'] == 'off' else str(r['peak_layers']) + ' layers'})"]
           for r in res["rows"]]
    return (f"From {source_line(name, rec)}: {res['layer_bytes'] / mib:.1f} MiB a layer, "
            f"{res['resident_bytes'] / mib:.2f} MiB never evicted.\n\n"
            + table(["keep", "mapping peak RSS", "layers at the peak + resident tensors"], out))


def real_model(recs: Records) -> str:
    """SmolLM2-135M on cpu_ref from its GGUF and from its float32 Hugging Face layout, by keep."""
    found = recs.newest("real-model", lambda r: {row["source"] for row in r["result"]["rows"]} >= {"hf", "gguf"})
    if found is None:
        return "No record yet: `python -m bench real-model --source hf,gguf --keep 1,off` makes one."
    name, rec = found
    res, mib = rec["result"], 2**20
    what = {"hf": "Hugging Face layout (float32)", "gguf": "GGUF (Q4_1, Q8_0 embedding)"}
    out = [[what[r["source"]], str(r["keep"]), spread(r["summary"], 1), f"{r['prefill_ms']:.0f}",
            f"{r['peak_rss_bytes'] / mib:.0f} (+{r['peak_over_before_bytes'] / mib:.0f})",
            f"{r['mapping_rss_end_bytes'] / mib:.0f}", "= golden" if r["ids_match_golden"] else "differ"]
           for r in res["rows"]]
    row = res["rows"][0]
    return (f"From {source_line(name, rec)}: {res['model']}, {res['backend']}, {row['threads']} threads, "
            f"{row['tokens']} tokens of the story prompt, each row in a fresh process. Decode ms/token is the p50 of "
            "its steps (p10–p90, n); peak RSS is the process's (ru_maxrss), and in brackets its rise over the RSS before "
            "load; the mapping's RSS is read at the end of the run.\n\n"
            + table(["weights", "keep", "decode ms/token", "prefill ms", "peak RSS MiB (+ over load)",
                     "mapping RSS MiB at the end", "ids"], out))


def _tensor(name: str) -> str:
    return name.removeprefix("model.").removesuffix(".weight")


def quant_quality(recs: Records) -> str:
    """Each ``kestrel quantize --type`` of SmolLM2's float32 layout beside the Q4_1 file it came from: bits a weight,
    relative RMSE against float32, the blocks equal to the file's, greedy ids against float32."""
    found = recs.newest("quant-quality")
    if found is None:
        return "No record yet: `python -m bench quant-quality` makes one."
    name, rec = found
    res = rec["result"]
    out = []
    for r in res["rows"]:
        s = r["rmse_summary"]
        kinds = sorted(((n, t) for t, n in r["tensor_types"].items() if t not in ("F32", "F16")), reverse=True)
        down = [t["rel_rmse"] for t in r["tensors"] if ".mlp.down_proj." in t["name"]]
        firsts = [("—" if g["first_difference"] is None else f"{g['first_difference']} ({g['float32_logit_gap']:.2f})")
                  for g in r["greedy"].values()]
        label = "the source file" if r["type"] is None else f"`{r['type']}`"
        out.append([label, ", ".join(f"{t} ×{n}" for n, t in kinds), f"{r['file_bytes'] / 1e6:.1f}",
                    f"{r['bits_per_weight']:.2f}", f"{s['median_rel_rmse']:.4f}",
                    f"{s['max_rel_rmse']:.4f} ({_tensor(s['max_rel_rmse_tensor'])})" if s["max_rel_rmse"] else "0",
                    f"{s['weighted_mean_rel_rmse']:.4f}", f"{statistics.median(down):.4f}" if down else "—",
                    "—" if s["blocks_equal_source"] is None else
                    f"{100 * s['blocks_equal_source']:.1f}% of {s['tensors_typed_as_source']}",
                    f"{sum(g['equal'] for g in r['greedy'].values())}/{len(r['greedy'])}", ", ".join(firsts)])
    return (f"From {source_line(name, rec)}: {res['model']}, {res['backend']}, keep {res['keep']}, {res['threads']} "
            "threads. Each type is written by `kestrel quantize --type` from the float32 Hugging Face layout, which is "
            "the source file's weights dequantized: every RMSE is against those weights, and the source file's is 0 by "
            "construction. Relative RMSE is a tensor's RMSE over its RMS, over the quantized (2-D) tensors: the "
            "median, the max (its tensor) and the mean weighted by values; ffn_down (rows of 1536) is the only "
            "tensor whose rows split into K-quant blocks. \"blocks = file's\": of the tensors written in the source "
            "file's type (how many), the share of their blocks byte-equal to the file's. Greedy: "
            f"{res['tokens']} new tokens on each of {len(res['prompt_texts'])} chat prompts "
            f"({', '.join(res['prompt_texts'])}), against float32's; where "
            "they differ, the first position, and in brackets float32's logit of its id less its logit of the id "
            "taken there.\n\n"
            + table(["type", "written as", "MB", "bits/weight", "rel. RMSE median", "max", "weighted mean",
                     "ffn_down median", "blocks = file's", "greedy = float32", "first difference (logit gap)"], out))


# --- every record -------------------------------------------------------------------------------------------------

def _text_header(text: str) -> tuple[str, str, str]:
    first = text.splitlines()[0].lstrip("# ").strip()
    m = re.search(r"commit ([0-9a-f]{7,40})", first)
    cmd = re.split(r"[,;] (?:H200|H100|NVIDIA)", first)[0].strip()
    cmd = f"python {cmd}" if cmd.startswith("bench/") else cmd
    dev = "NVIDIA H200" if "H200" in first else "not recorded"
    return cmd, short(m[1]) if m else "not recorded", dev


def every_record(recs: Records) -> str:
    out = []
    names = sorted([*recs.by_name, *recs.texts])
    for name in names:
        if name in recs.texts:
            cmd, commit, dev = _text_header(recs.texts[name])
        else:
            rec = recs[name]
            if is_new(rec):
                st = rec["stamp"]
                cmd, commit = st["command"], short(st.get("commit")) + (" (dirty)" if st.get("dirty") else "")
            else:
                cmd = rec.get("command") or "not recorded"
                cmd = f"python {cmd}" if cmd.startswith("bench/") else cmd
                commit = short(rec.get("commit"))
            dev = gpu_of(rec)
        now = legacy.scenario_of(cmd)
        out.append([f"`{name}`", f"`{cmd}`" if cmd != "not recorded" else cmd, legacy.now_of(now), commit, dev])
    return table(["record", "command (as recorded)", "that script now", "commit (as recorded)", "device"], out)


def gguf_stream(recs: Records) -> str:
    """A 4-bit GGUF of the 8B shape on cuda beside bf16, from the newest stream record with GGUF and bf16 rows."""
    found = recs.newest("stream", lambda r: r["result"].get("preset") == "qwen3-8b" and r["result"].get("backend") == "cuda"
                        and bool(r["result"].get("gguf")) and bool(r["result"].get("rows")))  # beside bf16's rows
    if not found:
        return "No `python -m bench stream --gguf` record of the 8B shape on cuda is committed yet."
    name, rec = found
    result, g = rec["result"], rec["result"]["gguf"]
    pinned = result["ceilings"]["pinned_h2d"]["GBps"]
    intro = (f"From {source_line(name, rec)}: the Qwen3-8B shape in bf16 and as a {g['type'].upper()} GGUF of random "
             f"valid blocks ({g['file_bytes'] / 1e9:.2f} GB), held and computed on cuda as its blocks; p50 ms a token "
             f"over the replayed steps, the pinned copy at {pinned:.1f} GB/s in the same run. \"ids\": against `off` "
             "of the same file.")
    out = []
    for label, rows in (("off", result["rows"]), ("asymmetric keep=1, prefetch 1", result["rows"]),
                        (f"{g['type']} off", g["rows"]), (f"{g['type']} asymmetric keep=1, prefetch 1", g["rows"])):
        r = find(rows, label, "auto") or find(rows, label)
        if r is None:
            continue
        gb = r["bytes_uploaded_per_token"] / 1e9
        out.append([label if label.startswith(g["type"]) else f"bf16 {label}", spread(r["summary"]),
                    f"{gb:.2f}" if gb else "—", f"{r['effective_GBps']:.1f}" if r.get("effective_GBps") else "—",
                    "the baseline" if r["settings"].get("keep") == "off" else ("= off's" if r.get("ids_match_baseline")
                                                                              else "leave off's")])
    parts = [intro, table(["setting", "ms/tok: p50 (p10–p90, n)", "GB uploaded/tok", "GB/s", "ids"], out)]
    parts.append("Targets: " + "; ".join(f"{t['statement']}: {t['ratio']:.3f}x, {'met' if t['met'] else 'not met'}"
                                          for t in g.get("targets", [])) + ".")
    return "\n\n".join(parts)


def versus_records(recs: Records) -> list[tuple[str, dict]]:
    """The newest stream and moe records that ran kestrel beside llama.cpp (``result["vs_llama_cpp"]``)."""
    found = (recs.newest(s, lambda r: bool(r["result"].get("vs_llama_cpp"))) for s in ("stream", "moe"))
    return [f for f in found if f]


def vs_llama_cpp(recs: Records) -> str:
    """kestrel beside llama.cpp on the same GGUF file and card, from the newest stream and moe records that ran it."""
    parts, rows, cards = [], [], set()
    for name, rec in versus_records(recs):
        parts.append(source_line(name, rec))
        for r in rec["result"]["vs_llama_cpp"]:
            cards.add(r["card"])
            rows.append([r["shape"], r["file_type"], r["phase"], str(r["rows"]), r.get("kestrel_kernels", "float"),
                         f"{r['kestrel_tokens_per_s']:,.1f}", f"{r['llama_cpp_tokens_per_s']:,.1f} "
                         f"({r['llama_cpp_program']})", f"{r['ratio']:.2f}x", f"{r['target']}x",
                         "met" if r["met"] else "not met"])
    if not rows:
        return "No record with `--llama-cpp` (kestrel beside llama.cpp on one file) is committed yet."
    intro = ("kestrel's `off` (every weight resident, the step replayed as a CUDA graph) beside llama.cpp's "
             "`llama-bench` (batch 1: tg128, pp512) and `llama-batched-bench` (S_TG at B sequences of 128 + 128 "
             "tokens), `-ngl 99`, on the very GGUF file kestrel ran, in the same run, on "
             f"{', '.join(sorted(cards))}. From "
             + "; and ".join(parts) + ". tokens/s; ratio: kestrel over llama.cpp.")
    return "\n\n".join([intro, table(["shape", "file", "phase", "B", "kestrel kernels", "kestrel", "llama.cpp",
                                       "ratio", "target", ""], rows)])


def vs_llama_cpp_headline(recs: Records) -> str:
    """One paragraph: each shape's rows against llama.cpp, kestrel's faster kernel family at each, with the records."""
    shapes, names, cards = {}, [], set()
    for name, rec in versus_records(recs):
        names.append(f"`bench/results/{name}`")
        for r in rec["result"]["vs_llama_cpp"]:
            cards.add(r["card"])
            key = (r["shape"], r["file_type"])
            best = shapes.setdefault(key, {})
            at = (r["phase"], r["rows"])
            if at not in best or r["ratio"] > best[at]["ratio"]:
                best[at] = r
    if not shapes:
        return "No record with `--llama-cpp` (kestrel beside llama.cpp on one file) is committed yet."
    ratios = [r["ratio"] for best in shapes.values() for r in best.values()]
    parts = []
    for (shape, ftype), best in shapes.items():
        cells = []
        for (phase, b), r in sorted(best.items(), key=lambda kv: (kv[0][0] != "decode", kv[0][1])):
            what = f"decode B={b}" if phase == "decode" else "prefill"
            cells.append(f"{what} {r['kestrel_tokens_per_s']:,.0f} ({r.get('kestrel_kernels', 'float')}) against "
                         f"{r['llama_cpp_tokens_per_s']:,.0f}, {r['ratio']:.2f}x")
        parts.append(f"{shape} {ftype}: " + "; ".join(cells))
    return (f"**kestrel beside llama.cpp** on the same GGUF file and card ({', '.join(sorted(cards))}), in one run a shape, "
            f"tokens/s, kestrel's faster kernel family named: " + ". ".join(parts) + f". kestrel runs at "
            f"{min(ratios):.2f}x to {max(ratios):.2f}x llama.cpp's speed there; its 4-bit kernels are the work in "
            f"hand ({', '.join(names)}; [performance.md](docs/performance.md#llamacpp-on-the-same-file-and-card)).")


def grammar(recs: Records) -> str:
    """Output held to a JSON schema on the real model against plain greedy decoding, and the libraries' mask cost a
    token, from the newest complete ``python -m bench grammar`` record of each backend."""
    found = [f for backend in ("cpu_ref", "cuda")
             if (f := recs.newest("grammar", lambda r, b=backend: r["result"].get("backend") == b)) is not None]
    if not found:
        return "No record yet: `python -m bench grammar` makes one."
    return "\n\n".join(grammar_record(name, rec) for name, rec in found)


def grammar_record(name: str, rec: dict) -> str:
    """One ``bench grammar`` record's rows, headline and mask costs."""
    res = rec["result"]
    plain = res["rows"][0]["ms_per_token"]["p50"]
    out = [[f"`{r['row']}`", spread(r["ms_per_token"]),
            "1" if r["row"] == "plain" else f"{r['ms_per_token']['p50'] / plain:.3f}", ", ".join(map(str, r["tokens"])),
            ("yes" if r["valid"] else "no") + (f" (against `{r['valid_against']}`)" if r["row"] == "plain" else "")]
           for r in res["rows"]]
    masks = [[f"`{m['schema']}`", m["library"], spread(m["per_token_ms"], 4), f"{m['setup_ms']:.0f}",
              f"{m['compile_ms']:.1f}", f"{m['ids_allowed']} of {m['ids_replayed']}"] for m in res["mask_only"]]
    xg = (f" xgrammar {res['xgrammar']} from {res['xgrammar_from']}." if res.get("xgrammar_from")
          else f" xgrammar: {res.get('xgrammar')}.")
    heads = [f"`{n}` {h['over_plain_p50']:.3f}x plain's p50 ({'within' if h['within_target'] else 'over'} the "
             f"target), plain's p50 plus the mask's {h['plain_plus_mask_over_plain_p50']:.3f}x"
             for n, h in res["headline"].items()]
    dtype = f" ({res['compute_dtype']})" if "compute_dtype" in res else ""
    return (f"From {source_line(name, rec)}: {res['model']}, {res['backend']}{dtype}, keep {res['keep']}, "
            f"{res['threads']} threads, {res['repeats']} repeats interleaved. Decode ms/token is the p50 of every "
            f"repeat's steps (p10–p90, n), the grammar's mask and the sampling inside each step; the target is at most "
            f"{res['target']}x plain's.\n\n"
            + table(["row", "decode ms/token", "x plain", "tokens (each repeat)", "valid JSON"], out)
            + "\n\nA token held to the schema: " + "; ".join(heads) + "."
            + "\n\nThe host's cost alone: each constrained row's ids replayed through a fresh grammar state, mask and "
              "accept timed a token (ms, p50 (p10–p90, n)); `kestrel` is the sampler's own calls, the mask unpacked "
              f"to a [vocab] bool tensor.{xg}\n\n"
            + table(["schema", "library", "mask + accept ms/token", "vocabulary setup ms", "compile ms",
                     "ids the mask allowed"], masks))


BLOCKS: dict[str, Callable[[Records], str]] = {
    "headline-picture": headline_picture,
    "headline": headline,
    "decode-graphs-8b": decode_graphs("qwen3-8b"),
    "decode-graphs-1.7b": decode_graphs("qwen3-1.7b"),
    "stream-sweep-8b": sweep,
    "q8-stream-8b": q8_stream,
    "gguf-stream-8b": gguf_stream,
    "vs-llama-cpp": vs_llama_cpp,
    "vs-llama-cpp-headline": vs_llama_cpp_headline,
    "q8-gemv": q8_gemv,
    "moe-summary": moe_summary,
    "moe-rows": moe_rows,
    "moe-host-cost": moe_host_cost,
    "host-tier": host_tier,
    "rss-window": rss_window,
    "real-model": real_model,
    "quant-quality": quant_quality,
    "grammar": grammar,
    "records": every_record,
}
