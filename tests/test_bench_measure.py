"""The benchmark's measuring functions, on plain data."""
import numpy as np
import pytest

from eval.bench import measure
from eval.bench_startup import hook_microseconds


def test_percentiles_ms():
    result = measure.percentiles_ms([0.001 * i for i in range(1, 101)])
    assert result["p50_ms"] == pytest.approx(50.5) and result["p95_ms"] == pytest.approx(95.05)


def test_file_bytes_and_stream(tmp_path):
    np.arange(1024, dtype=np.float16).tofile(tmp_path / "a.f16")
    (tmp_path / "b.txt").write_text("xyz")
    assert measure.file_bytes(tmp_path) == 2048 + 3
    assert measure.file_bytes(tmp_path, ["a.f16", "missing"]) == 2048
    assert measure.stream_seconds(tmp_path / "a.f16", repeats=1) > 0.0


def test_timed_module_reports_peak_rss():
    stats = measure.timed_module("json.tool", ["--help"])
    assert stats["seconds"] < 60 and 1 < stats["peak_rss_mib"] < 4096  # seconds rounded to 0.1


def test_hook_microseconds_reads_importtime_report():
    report = ("import time: self [us] | cumulative | imported package\n"
              "import time:       296 |       5785 |       importlib.abc\n"
              "import time:       850 |       7130 |     pyserini_aligner\n"
              "import time:         8 |       7138 |   pyserini_aligner._startup\n")
    assert hook_microseconds(report) == 7138
    assert hook_microseconds("import time:  1 | 2 | os\n") == 0
