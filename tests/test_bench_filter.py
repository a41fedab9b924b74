"""eval.bench_filter: a tiny end-to-end run on the CPU fills every row of its report."""
import json

import pytest

from eval import bench_filter
from test_bench_scale import SCIFACT, _tiny_zip


def test_tiny_run_times_every_filter_against_no_filter(tmp_path, capsys, monkeypatch):
    archive = _tiny_zip(tmp_path / "scifact.zip")
    out = tmp_path / "out"
    monkeypatch.setattr(bench_filter, "WARMUP", 1)  # the harness runs and fills its rows: one pass of each suffices
    monkeypatch.setattr(bench_filter, "REPEATS", 1)
    assert bench_filter.main(["--beir-zip", str(archive), "--size", "60", "--device", "cpu", "--codec", "IVF8,PQ4",
                              "--max-queries", "4", "--batch", "4", "--cpu-threads", "1", "--output", str(out),
                              "--quiet"]) == 0
    report = json.loads((out / "bench_filter.json").read_text())
    assert report["docs"] == 60 and report["queries"] == 4
    places = list(report["places"])
    assert places == ["cpu (torch)", "cpu (faiss, 1 thread)"]
    for rows in report["places"].values():
        assert [row["filter"] for row in rows] == ["none", "50.0%", "5.0%", "0.1%"]
        assert [row["matching"] for row in rows] == [60, 30, 3, 1]
        assert all(0 < row["p50_ms"] <= row["p95_ms"] and row["qps_b4"] > 0 for row in rows)
        assert all(row["p50_vs_unfiltered"] > 0 for row in rows[1:])
        assert all(0.5 <= row["found@10_exhaustive"] <= 1 for row in rows)
        assert rows[-1]["found@10_exhaustive"] == 1.0  # one match, refined unprobed
    table = (out / "bench_filter.md").read_text()
    assert capsys.readouterr().out.endswith(table) and table.count("\n| cpu") == 8


def test_bad_shares_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as stop:
        bench_filter.main(["--beir-zip", str(SCIFACT), "--size", "2k", "--output", "x", "--selectivities", "0.5,2"])
    assert stop.value.code == 2 and "every share must be in (0, 1]" in capsys.readouterr().err
