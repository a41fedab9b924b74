"""The search-steps study over a real two-segment index: one device and a two-rank shard group (Gloo)."""
import json
import os
from pathlib import Path

from eval.experiments import search_steps

SCIFACT = Path(os.environ["PYSERINI_ALIGNER_BEIR_DIR"]) / "scifact.zip"


def test_search_steps_times_every_step_of_one_device_and_of_each_rank(two_segment_index, tmp_path):
    out = tmp_path / "out"
    assert search_steps.main(["--index", str(two_segment_index), "--beir-zip", str(SCIFACT), "--size", "10k",
                              "--devices", "cpu", "cpu", "--output", str(out), "--batch", "4", "--passes", "1",
                              "--quiet"]) == 0
    report = json.loads((out / "search_steps.json").read_text())
    assert report["queries"] == 4 and [row["rank"] for row in report["shard"]] == [0, 1]
    assert sum(row["rows_held"] for row in report["shard"]) == 200
    for row in [report["one"], *report["shard"]]:
        assert row["wall_ms"] > 0 and all(row[step] > 0 for step in ("encode", "probe", "select", "refine"))
    assert "| shard rank 1 cpu |" in (out / "search_steps.md").read_text()
