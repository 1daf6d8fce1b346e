"""bench pipeline's rows on the tiny preset: one process, then 2 ranks under torchrun, each rank a fresh process
writing its own figures; the row of 2 ranks has both ranks' RSS and the split, and its ids equal the one process's.
Nothing here depends on how fast the machine is."""

from __future__ import annotations

import argparse

from bench.scenarios import SCENARIOS, pipeline
from kestrel_core.tools.presets import preset_config, write_checkpoint


class Record:
    def save_partial(self, data) -> None:
        self.partial = data


def test_one_process_then_two_ranks_each_with_its_own_figures(tmp_path, monkeypatch):
    assert "pipeline" in SCENARIOS
    d = write_checkpoint(preset_config("tiny"), tmp_path / "tiny")
    monkeypatch.setattr(pipeline.models, "ensure_preset", lambda models, preset: d)
    args = argparse.Namespace(models=str(tmp_path), preset="tiny", ranks=[2], keep="off", tokens=6, repeats=1,
                              threads=1, batch=1)
    result = pipeline.run(args, Record())
    one, two = result["rows"]
    assert (one["ranks"], two["ranks"]) == (1, 2)
    assert two["parts"] == [[0, 3], [3, 3]] and one["parts"] == []
    assert len(two["peak_rss_bytes_per_rank"]) == 2 and all(b > 0 for b in two["peak_rss_bytes_per_rank"])
    # each rank holds its own part's layers resident (less than the whole), and the embeddings and head besides
    # (every rank loads them today: together more than the whole)
    whole = one["peak_resident_bytes_per_rank"][0]
    assert all(b < whole for b in two["peak_resident_bytes_per_rank"]) and sum(two["peak_resident_bytes_per_rank"]) > whole
    assert two["ids_equal_one_process"] and one["ms_per_token"]["n"] == 5  # 6 tokens: the first from the prefill
    assert result["over_one_process"]["2"] == two["ms_per_token"]["p50"] / one["ms_per_token"]["p50"]
    # every rank computed on the --threads asked (the run sets its threads: one set before it opened would not hold)
    assert [rank["threads"] for row in (one, two) for rank in row["runs"][0]] == [1, 1, 1]


def test_a_batch_row_gives_tokens_per_second_and_ids_equal_one_process(tmp_path, monkeypatch):
    d = write_checkpoint(preset_config("tiny"), tmp_path / "tiny")
    monkeypatch.setattr(pipeline.models, "ensure_preset", lambda models, preset: d)
    args = argparse.Namespace(models=str(tmp_path), preset="tiny", ranks=[2], keep="off", tokens=5, repeats=2,
                              threads=1, batch=3)
    result = pipeline.run(args, Record())
    one, on, off = result["rows"]
    assert result["batch"] == 3 and [(r["ranks"], r["micro_batches"]) for r in result["rows"]] == [
        (1, None), (2, "on"), (2, "off")]
    assert all(len(ids) == 5 for ids in one["runs"][0][0]["token_ids"]) and len(one["runs"][0][0]["token_ids"]) == 3
    assert on["ids_equal_one_process"] and off["ids_equal_one_process"] and one["tokens_per_s"]["n"] == 2
    assert len(on["peak_rss_bytes_per_rank"]) == 2 and all(b > 0 for b in on["peak_rss_bytes_per_rank"])
    assert all(rate == 15 / wall for rate, wall in zip(on["tokens_per_s_runs"], on["wall_s_runs"]))
    over = result["tokens_per_s_over_one_process"]
    assert over == {"2 on": on["tokens_per_s"]["p50"] / one["tokens_per_s"]["p50"],
                    "2 off": off["tokens_per_s"]["p50"] / one["tokens_per_s"]["p50"]}
