"""bench grammar's rows, measured on the tiny preset as the real model's are: plain and a schema's generate
interleaved, the schema's ids replayed through a fresh grammar state timing every token, the headline taken from
them; and its hand check of a value against a schema. Nothing here depends on how fast the machine is."""

from __future__ import annotations

import json
from argparse import Namespace

import pytest
import torch

from bench.__main__ import main as bench
from bench.scenarios import SCENARIOS, grammar
from kestrel_core.engine.run import load
from kestrel_core.tools.presets import preset_config, write_checkpoint
from serve_helpers import chat_model

YES_NO = {"enum": ["yes", "no"]}
PROMPT = [5, 17, 42]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    d = write_checkpoint(preset_config("tiny"), tmp_path_factory.mktemp("grammar") / "tiny")
    with load(d) as model, model.open(backend="cpu_ref") as r:
        yield grammar.measure(r, PROMPT, {"yes_no": YES_NO}, tokens=12, repeats=2)


def test_the_rows_are_plain_then_each_schema_interleaved_over_the_repeats(measured):
    assert "grammar" in SCENARIOS
    plain, yes_no = measured["rows"]
    assert (plain["row"], yes_no["row"]) == ("plain", "yes_no")
    for row in (plain, yes_no):
        assert len(row["repeats"]) == 2
        steps = sum(len(r["decode_ms"]) for r in row["repeats"])
        assert row["ms_per_token"]["n"] == steps > 0
    assert plain["tokens"] == [12, 12]  # plain runs to --tokens
    assert not plain["parses"] and plain["valid_against"] == "yes_no"  # random weights write no JSON of their own
    # held to the schema: a value it accepts, then an end id, well short of --tokens
    assert yes_no["valid"] and yes_no["parses"] and yes_no["ended_at_eos"]
    assert all(r["text"] in ('"yes"', '"no"') for r in yes_no["repeats"])
    assert all(n < 12 for n in yes_no["tokens"])


def test_mask_only_times_every_replayed_id_and_each_was_allowed(measured):
    ids = [r["token_ids"] for r in measured["rows"][1]["repeats"]]
    masks = {m["library"]: m for m in measured["mask_only"]}
    assert {"kestrel", "llguidance"} <= set(masks)
    for lib, m in masks.items():
        assert m["schema"] == "yes_no" and m["row"] == "mask_only"
        for replay, got in zip(m["repeats"], ids):
            assert replay["ids"] == len(got) == len(replay["mask_ms"]) == len(replay["accept_ms"]), lib
            assert replay["rejected_at"] is None
        assert m["ids_allowed"] == m["ids_replayed"] == sum(map(len, ids))  # the sampler chose only allowed ids
        assert m["per_token_ms"]["n"] == m["ids_replayed"]
        assert m["compile_ms"] > 0


def test_the_headline_is_the_rows_p50s(measured):
    plain, yes_no = measured["rows"]
    kestrel = next(m for m in measured["mask_only"] if m["library"] == "kestrel")
    h = measured["headline"]["yes_no"]
    base = plain["ms_per_token"]["p50"]
    assert h["over_plain_p50"] == pytest.approx(yes_no["ms_per_token"]["p50"] / base)
    assert h["plain_plus_mask_over_plain_p50"] == pytest.approx((base + kestrel["per_token_ms"]["p50"]) / base)
    assert h["within_target"] == (h["over_plain_p50"] <= grammar.TARGET)
    xg = measured["xgrammar"]
    assert isinstance(xg, str) and xg  # a version where it imports, else why not
    assert ("xgrammar" in {m["library"] for m in measured["mask_only"]}) == ("xgrammar_from" in measured)


@pytest.mark.parametrize("value, ok", [
    ([{"name": "A", "age": 3, "city": "B"}] * 3, True),
    ([{"name": "A", "age": 3, "city": "B"}] * 2, False),  # two, not three
    ([{"name": "A", "age": 3.5, "city": "B"}] * 3, False),  # age not an integer
    ([{"name": "A", "age": True, "city": "B"}] * 3, False),  # a bool is no integer
    ([{"name": "A", "age": 3}] * 3, False),  # city missing
    ([{"name": "A", "age": 3, "city": "B", "x": 1}] * 3, False),  # a key the schema does not name
    ({"name": "A", "age": 3, "city": "B"}, False),  # an object, not an array
])
def test_the_hand_check_holds_a_value_to_the_people_schema(value, ok):
    assert grammar.conforms(value, grammar.SCHEMAS["schema"]) is ok
    assert grammar.conforms(value, grammar.SCHEMAS["json_object"]) is isinstance(value, dict)


def test_the_scenario_runs_on_a_model_given_and_names_it(tiny_ckpt, tmp_path):
    """``--model DIR`` in place of the real model (a device machine without a network): the record names it, its
    backend and the run's compute dtype."""
    d = chat_model(tiny_ckpt, tmp_path / "shape-only")
    out = tmp_path / "out"
    assert bench(["grammar", "--model", str(d), "--tokens", "4", "--repeats", "1", "--schemas", "json_object",
                  "--threads", "1", "--out", str(out)]) == 0
    res = json.loads(next(out.glob("grammar_*.json")).read_text())["result"]
    assert (res["model"], res["backend"], res["compute_dtype"]) == ("shape-only (--model)", "cpu_ref", "float32")
    assert [r["row"] for r in res["rows"]] == ["plain", "json_object"]
    if not torch.cuda.is_available():  # --backend cuda says why it cannot run here, and how to run on the CPU
        assert "--backend cpu_ref" in grammar.needs_gpu(Namespace(backend="cuda"))
    assert grammar.needs_gpu(Namespace(backend="cpu_ref")) is None
