"""``python -m bench quant-quality``'s measurement on the tiny preset, set up as the real model is: a Q4_1 GGUF and the
float32 directory of its weights dequantized (bench.real_model.write_hf_dir), then q8_0, q4_0 and q4_1 written from that
directory by ``kestrel quantize --type``. Nothing here depends on a timing."""

from __future__ import annotations

import json

import pytest

from bench.real_model import write_hf_dir
from bench.scenarios.quant_quality import measure
from kestrel_core.formats.gguf import GGUFCheckpoint
from kestrel_core.tools.presets import preset_config, write_checkpoint
from kestrel_core.tools.quantize import quantize_to_gguf

PROMPTS = {"a": [1, 2, 3, 4, 5], "b": [7, 100, 42]}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant-quality")
    write_checkpoint(preset_config("tiny", "float32"), root / "f32")
    quantize_to_gguf(root / "f32", root / "source.gguf", "q4_1")
    with GGUFCheckpoint(root / "source.gguf") as ckpt:
        write_hf_dir(ckpt, root / "reference")
    config = root / "reference" / "tokenizer_config.json"  # the tiny model has no chat template: say none, not null
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if v is not None}))
    (root / "work").mkdir()
    return measure(root / "reference", root / "source.gguf", ["q8_0", "q4_0", "q4_1"], PROMPTS, 8, root / "work")


def rows(result) -> dict[str, dict]:
    return {r["label"]: r for r in result["rows"]}


def test_each_row_has_its_file_and_every_quantized_tensor(result):
    by = rows(result)
    assert list(by) == ["source", "q8_0", "q4_0", "q4_1"]
    for label, r in by.items():
        expect = "Q4_1" if label == "source" else label.upper()
        assert r["tensor_types"] == {"F32": r["tensor_types"]["F32"], expect: len(r["tensors"])}
        assert all(t["type"] == expect for t in r["tensors"]) and len(r["tensors"]) == 43  # tiny's 2-D weights
        assert r["file_bytes"] > r["tensor_bytes"] > 0 and r["float_tensors_max_abs_error"] == 0.0
        assert r["rmse_summary"]["tensors"] == 43
    # bits a weight of the quantized tensors: 8.5 (Q8_0), 4.5 (Q4_0), 5.0 (Q4_1); the norms' F32 raise the whole file's
    assert by["q8_0"]["bits_per_weight_quantized"] == pytest.approx(8.5)
    assert by["q4_0"]["bits_per_weight_quantized"] == pytest.approx(4.5)
    assert by["q4_1"]["bits_per_weight_quantized"] == pytest.approx(5.0)
    assert by["q4_0"]["bits_per_weight"] > 4.5


def test_the_source_is_its_reference_and_more_bits_lose_less(result):
    by = rows(result)
    src = by["source"]["rmse_summary"]
    assert src["max_rmse"] == 0.0 and by["source"]["greedy_all_equal"]  # the reference is the source dequantized
    q8, q4 = by["q8_0"]["rmse_summary"], by["q4_0"]["rmse_summary"]
    assert 0 < q8["max_rel_rmse"] < q4["median_rel_rmse"]  # every Q8_0 tensor beats the median Q4_0 one
    assert q8["weighted_mean_rmse"] < q4["weighted_mean_rmse"] / 5
    for t in by["q4_0"]["tensors"]:
        assert t["rmse"] > 0 and t["rel_rmse"] == pytest.approx(t["rmse"] / t["rms_weight"])


def test_q4_1_of_q4_1_weights_gives_back_the_source_blocks(result):
    r = rows(result)["q4_1"]
    s = r["rmse_summary"]
    assert s["tensors_typed_as_source"] == 43 and s["blocks_equal_source"] > 0.99
    assert s["max_rel_rmse"] < 1e-3 < rows(result)["q4_0"]["rmse_summary"]["median_rel_rmse"]
    assert r["greedy_all_equal"]
    assert rows(result)["q4_0"]["rmse_summary"]["blocks_equal_source"] is None  # another type: nothing to compare


def test_greedy_agreement_names_the_first_position_that_differs(result):
    ref = result["reference"]["prompts"]
    assert set(ref) == set(PROMPTS) and all(len(p["ids"]) == 8 for p in ref.values())
    for r in result["rows"]:
        for name, g in r["greedy"].items():
            want = ref[name]["ids"]
            assert len(g["ids"]) == 8 and g["equal"] == (g["ids"] == want)
            first = g["first_difference"]
            assert (first is None) == g["equal"]
            if first is not None:  # float32 took its argmax there: its logit is above the other id's
                assert g["ids"][:first] == want[:first] and g["ids"][first] != want[first]
                assert g["float32_logit_gap"] > 0
            else:
                assert g["float32_logit_gap"] is None
    assert any(g["first_difference"] is not None for g in rows(result)["q4_0"]["greedy"].values())
