"""The docs' tables come from the records: every ``<!-- bench:NAME -->`` block of README.md and docs/*.md equals
what ``python -m bench render`` draws from bench/results/ now, and the headline and picture follow the newest
``python -m bench stream`` record of the Qwen3-8B shape, or say that they come from the older scripts' record."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from bench import legacy, tables
from bench.records import Records
from bench.render import BLOCK, blocks_of, render_text, rendered
from bench.scenarios import plot

ROOT = Path(__file__).resolve().parent.parent


def test_every_block_equals_what_its_records_render():
    pages = rendered()
    assert {p.name for p in pages} >= {"README.md", "performance.md", "backends.md", "moe.md", "decode-graphs.md"}
    stale = [f"{page.name}: {name}" for page, (now, new) in pages.items()
             for name, body in blocks_of(new).items() if blocks_of(now).get(name) != body]
    assert not stale, f"run `python -m bench render`: these blocks differ from their records: {stale}"


def test_the_readme_headline_and_picture_have_their_blocks():
    names = blocks_of((ROOT / "README.md").read_text())
    assert {"headline", "headline-picture"} <= set(names)
    assert "host-tier" in blocks_of((ROOT / "docs" / "backends.md").read_text())
    assert "docs/cost-curve.png" in (ROOT / "README.md").read_text()


def test_a_changed_figure_is_caught():
    text = (ROOT / "docs" / "performance.md").read_text()
    tampered = text.replace("| off | 9.65 (9.60–9.67, n=31)", "| off | 9.70 (9.60–9.67, n=31)", 1)
    assert tampered != text, "the 8B table's off row moved: update this test's figure"
    assert render_text(tampered, Records.load()) == text


def test_a_block_renders_alone_and_an_unknown_one_is_an_error():
    recs = Records.load()
    page = "a\n<!-- bench:rss-window -->\n<!-- /bench -->\nb\n<!-- bench:records -->\nstale\n<!-- /bench -->\nc\n"
    out = render_text(page, recs)
    assert out.startswith("a\n<!-- bench:rss-window -->\nFrom ") and "\nb\n<!-- bench:records -->\n| record |" in out
    assert out.endswith("<!-- /bench -->\nc\n") and len(BLOCK.findall(out)) == 2
    with pytest.raises(KeyError):
        render_text("<!-- bench:no-such-table -->\n<!-- /bench -->", recs)


def test_without_a_new_record_the_headline_says_it_reads_the_older_scripts():
    recs = Records.load()
    if recs.newest("stream", lambda r: r["result"].get("preset") == "qwen3-8b"):
        pytest.skip("a python -m bench stream record of the 8B shape is committed")
    text = tables.headline(recs)
    assert "decode_graphs_qwen3-8b_20261203T132426Z.json" in text and "older bench scripts" in text
    assert "| off | 7.76 (7.76–7.77, n=31) |" in text  # the replayed steps only: 33 decode steps less two
    name, _, _ = plot.source(None, recs)
    assert name == "decode_graphs_qwen3-8b_20261203T132426Z.json" and name in tables.headline_picture(recs)


def test_new_stream_records_take_over_the_headline_and_the_picture(tmp_path):
    """python -m bench stream records (here CPU runs, relabelled as the 8B shape on cuda: only the choice of record
    and the rendering are under test): the headline is drawn from the newest --rows headline record, the picture
    and its sentence from the newest --rows sweep record."""
    from bench.__main__ import main as bench

    recs = Records.load()
    made = {}
    for row_set in ("headline", "sweep"):
        out = tmp_path / row_set
        assert bench(["stream", "--backend", "cpu_ref", "--preset", "tiny", "--tokens", "5", "--rows", row_set,
                      "--models", str(tmp_path / "models"), "--peers", "", "--out", str(out)]) == 0
        (path,) = out.glob("stream_*.json")
        rec = json.loads(path.read_text())
        fake = copy.deepcopy(rec)
        fake["result"].update(preset="qwen3-8b", backend="cuda", ceilings={"pinned_h2d": {"GBps": 50.0}})
        if row_set == "headline":
            fake["result"]["q8"] = {"rows": []}  # the headline's command has its q8 rows
        name = f"stream_29991231T00000{len(made)}Z.json"  # two runs may share their second; these are the newest
        recs.by_name[name] = fake
        made[row_set] = (name, fake)
    narrow = copy.deepcopy(made["headline"][1])  # newer, but a headline run without the q8 rows (a --gguf run)
    del narrow["result"]["q8"]
    recs.by_name["stream_29991231T000009Z.json"] = narrow
    head, picture = tables.headline(recs), tables.headline_picture(recs)
    assert "stream_29991231T000009Z.json" not in head
    for text, (name, rec) in ((head, made["headline"]), (picture, made["sweep"])):
        assert name in text and "older bench scripts" not in text
        assert tables.short(rec["stamp"]["commit"]) in text and rec["stamp"]["command"] in text
    assert made["sweep"][0] not in head and made["headline"][0] not in picture
    off = made["sweep"][1]["result"]["rows"][0]
    assert f"{off['summary']['p50']:.2f}" in picture
    name, rec, result = plot.source(None, recs)
    assert name == made["sweep"][0]
    plot.plot(name, rec, result, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_legacy_graph_rows_are_the_replayed_steps_the_old_script_took():
    """The older script's median of a graph row was over its steps after the first two (the eager one and the
    capture); read through bench.legacy, the figure is over the replayed steps, which are the same 31 steps."""
    rec = Records.load()["decode_graphs_qwen3-8b_20261203T132426Z.json"]
    result = legacy.stream_from_decode_graphs(rec, "qwen3-8b")
    for old in rec["shapes"]["qwen3-8b"]["rows"]:
        if old.get("graphs") == "auto" and "decode_ms" in old:
            new = next(r for r in result["rows"] if r.get("legacy_label") == old["label"] and r["graphs"] == "auto")
            assert new["summary"]["n"] == old["n"] == 31 and new["summary"]["p50"] == pytest.approx(old["median"])
            assert new["captured_ms"] == [old["decode_ms"][1]]


def test_the_q8_compile_row_says_its_ids_leave_q8_off():
    text = (ROOT / "docs" / "performance.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| q8 off, --compile |"))
    assert re.search(r"leave q8 off's after 10 of 34 tokens", row)


def test_every_script_the_docs_name_exists_or_names_its_scenario():
    """A `bench/NAME.py` in the README or docs is a module of the harness, or an older script whose scenario the
    page names beside it (the records' provenance)."""
    from bench.legacy import RETIRED, SCENARIO_OF
    from bench.scenarios import SCENARIOS

    assert set(SCENARIO_OF.values()) <= set(SCENARIOS) | set(RETIRED)
    assert not set(RETIRED) & set(SCENARIOS)
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        for script in set(re.findall(r"bench/(\w+\.py)", text)):
            if (ROOT / "bench" / script).exists():
                continue
            assert script in SCENARIO_OF, f"{page.name} names bench/{script}, which is gone and replaced by nothing"
            if SCENARIO_OF[script] in RETIRED:  # its scenario is gone too: the page may name only the record
                assert f"python -m bench {SCENARIO_OF[script]}" not in text, \
                    f"{page.name} names python -m bench {SCENARIO_OF[script]}, which is retired"
                continue
            assert f"python -m bench {SCENARIO_OF[script]}" in text, \
                f"{page.name} names bench/{script} without its scenario, python -m bench {SCENARIO_OF[script]}"


def test_the_picture_names_the_models_depth_not_its_largest_keep():
    """A sweep that stops at keep = 4 of 36 layers is still a 36-layer model; a legacy record names only its preset."""
    assert plot.depth({"preset": "qwen3-8b", "model": {"layers": 36}, "rows": []}) == 36
    assert plot.depth({"preset": "qwen3-8b", "model": {"preset": "qwen3-8b"}}) == 36
    assert plot.depth({"preset": "tiny", "model": {"layers": 2}}) == 2
