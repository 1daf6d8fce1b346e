"""``python -m bench verify`` on cpu_ref with the tiny preset: plain steps, verify passes at each K (an always-right
drafter, so every full pass keeps K+1 tokens and the ids are plain greedy's), and the draft model's proposals. Nothing
here depends on a timing's value, only on its being there."""

from __future__ import annotations

import json

import pytest
import torch

from bench.__main__ import main as bench


def test_verify_records_passes_at_each_k_with_plain_ids(tmp_path):
    out = tmp_path / "out"
    assert bench(["verify", "--backend", "cpu_ref", "--preset", "tiny", "--ks", "1,4", "--tokens", "8",
                  "--repeats", "2", "--passes", "2", "--draft-preset", "tiny", "--draft-layers", "2",
                  "--draft-proposals", "2", "--models", str(tmp_path / "models"), "--out", str(out)]) == 0
    (path,) = out.glob("verify_*.json")
    rec = json.loads(path.read_text())
    assert rec["complete"] is True and rec["scenario"] == "verify"
    res = rec["result"]
    rows = res["rows"]
    assert [r["label"] for r in rows] == ["plain", "K=1", "K=4"] and [r["k"] for r in rows] == [0, 1, 4]
    assert all(r["ids_equal"] is True for r in rows) and res["ids_equal"] is True
    plain = rows[0]
    assert len(plain["repeats"]) == 2 and all(len(r["step_ms"]) == 7 for r in plain["repeats"])  # 8 tokens, 7 steps
    assert plain["summary"]["n"] >= 1 and plain["summary"]["p50"] > 0
    for r in rows[1:]:
        k = r["k"]
        assert r["tokens"] == max(8, 1 + 2 * (k + 1))
        assert len(r["repeats"]) == 2
        for rep in r["repeats"]:
            assert len(rep["pass_ms"]) == len(rep["tokens_per_pass"]) >= 2 and all(ms > 0 for ms in rep["pass_ms"])
            assert sum(rep["tokens_per_pass"]) == r["tokens"] - 1  # the first token comes from prefill
            assert len(rep["full_passes"]) >= 2 and all(rep["tokens_per_pass"][i] == k + 1 for i in rep["full_passes"])
            assert rep["speculative"]["acceptance_rate"] == 1.0
        s = r["summary"]
        assert s["n"] == sum(len(rep["full_passes"]) for rep in r["repeats"]) and s["p10"] <= s["p50"] <= s["p90"]
        assert r["pass_over_step"] == pytest.approx(s["p50"] / plain["summary"]["p50"])
        assert r["ms_per_token"] > 0
    assert res["target"]["statement"] == "K=16 <= 1.15x a step" and res["target"]["met"] is None  # no K=16 here
    draft = res["draft"]
    assert [d["k"] for d in draft["rows"]] == [4, 16]
    for d in draft["rows"]:
        assert len(d["proposal_ms"]) == 2 and d["ms_per_drafted_token_p50"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_verify_on_cuda_without_a_gpu_says_so_in_one_line(capsys, tmp_path):
    assert bench(["verify", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "python -m bench verify: needs a CUDA GPU" in err
    assert not list(tmp_path.iterdir())
