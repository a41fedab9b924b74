"""The batch-cost study: events attributed to the step whose end marker follows them, and a real CPU run over a
two-segment index."""
import json
import os
from pathlib import Path

import pytest

from eval.experiments import batch_cost

SCIFACT = Path(os.environ["PYSERINI_ALIGNER_BEIR_DIR"]) / "scifact.zip"


def test_events_count_toward_the_step_whose_end_follows_them():
    ends = [(10.0, "encode"), (20.0, "probe"), (35.0, "refine")]
    events = [("cudaLaunchKernel", False, 1.0, 2.0), ("cuLaunchKernel", False, 12.0, 1.0),
              ("cudaStreamSynchronize", False, 13.0, 4.0), ("cudaMemcpyAsync", False, 20.0, 1.0),
              ("kernel_a", True, 14.0, 1500.0), ("kernel_b", True, 21.0, 250.0), ("aten::mm", False, 22.0, 3.0),
              ("aten::add", False, 23.0, 1.0), ("aten::mm", False, 24.0, 3.0), ("aten::index", False, 25.0, 1.0),
              ("cudaDeviceSynchronize", False, 30.0, 5.0), ("cudaLaunchKernel", False, 36.0, 1.0)]
    steps = batch_cost.attribute(events, ends, top=2)
    assert steps == {"encode": {"launches": 1, "waits": 0, "copies": 0, "busy_ms": 0.0, "ops": [], "kernels": []},
                     "probe": {"launches": 1, "waits": 1, "copies": 1, "busy_ms": 1.5, "ops": [],
                               "kernels": [["kernel_a", 1.5]]},
                     "refine": {"launches": 0, "waits": 0, "copies": 0, "busy_ms": 0.25,
                                "ops": [["aten::mm", 2], ["aten::add", 1]], "kernels": [["kernel_b", 0.25]]}}
    assert batch_cost.step_of(10.0, ends) == "encode" and batch_cost.step_of(35.5, ends) is None


def test_batch_cost_profiles_each_batch_size_on_cpu(two_segment_index, tmp_path):
    out = tmp_path / "out"
    assert batch_cost.main(["--index", str(two_segment_index), "--beir-zip", str(SCIFACT), "--size", "10k",
                            "--device", "cpu", "--batches", "2,4", "--output", str(out), "--passes", "1",
                            "--quiet"]) == 0
    report = json.loads((out / "batch_cost.json").read_text())
    # a CPU searcher has no CUDA-graph front end: each batch is measured once, step by step
    assert [(row["batch"], row["front"]) for row in report["rows"]] == [(2, "steps"), (4, "steps")]
    for row in report["rows"]:
        assert row["wall_ms"] > 0 and {"encode", "probe", "refine"} <= set(row["profile"])
        assert row["busy_ms"] == 0 and row["wall_per_busy"] is None
        assert all(counts["launches"] == 0 and counts["busy_ms"] == 0 for counts in row["profile"].values())
    assert any(name.startswith("aten::") for name, _ in report["rows"][-1]["profile"]["probe"]["ops"])
    text = (out / "batch_cost.md").read_text()
    assert "| 4 | steps | refine |" in text and "| 2 | steps | " in text and "- probe: " in text
    for bad in (["--batches", "3,0"], ["--fronts", "graphed,eager"]):
        with pytest.raises(SystemExit) as refused:
            batch_cost.parse_args(["--index", "x", "--beir-zip", "y", "--size", "1k", "--output", str(out)] + bad)
        assert refused.value.code == 2
