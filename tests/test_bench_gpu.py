"""eval.bench_gpu end to end on the CPU (the same torch backend the GPU runs), on a small real SciFact cut."""
import json
import zipfile

from conftest import make_beir_folder
from eval import bench_gpu


def test_measure_then_score(tmp_path, monkeypatch):
    folder = make_beir_folder(tmp_path / "scifact", n_docs=30, words=32)
    archive = tmp_path / "scifact.zip"
    with zipfile.ZipFile(archive, "w") as out:
        for path in folder.rglob("*"):
            if path.is_file():
                out.write(path, f"scifact/{path.relative_to(folder)}")
    monkeypatch.setattr(bench_gpu, "BATCHES", (4, 16))
    corpus, queries = bench_gpu.read_beir_zip(archive, tmp_path / "extracted")
    first = json.loads((folder / "corpus.jsonl").read_text().splitlines()[0])
    assert len(corpus) == 30 and corpus[0] == (first["_id"], f"{first['title']} {first['text']}")
    assert 0 < len(queries) <= len((folder / "queries.jsonl").read_text().splitlines())
    report = bench_gpu.measure(archive, tmp_path / "out", "cpu", "aligner", codec="IVF8,PQ4")
    assert list(report["configs"]) == list(bench_gpu.CONFIGS)
    for row in report["configs"].values():
        assert row["build_seconds"] > 0 and 0 < row["k10"]["p50_ms"] <= row["k10"]["p95_ms"]
        assert row["qps_batch4"] > 0 and row["qps_batch16"] > 0 and row["bytes_per_doc"] > 0
        assert (tmp_path / "out" / row["run"]).stat().st_size > 0
    scored = bench_gpu.score(tmp_path / "out", str(folder))
    assert all(row["ndcg@10"] > 0.5 for row in scored["configs"].values())
    table = (tmp_path / "out" / "bench_gpu.md").read_text()
    assert "IVF8,PQ4" in table and table.count("\n| β^d=") == len(bench_gpu.CONFIGS)


def test_agreement_counts_same_order_and_score_gap():
    a = [[("d1", 0.9), ("d2", 0.5)], [("d3", 0.7), ("d4", 0.6)]]
    b = [[("d1", 0.9), ("d2", 0.5001)], [("d4", 0.7), ("d3", 0.6)]]
    assert bench_gpu.agreement(a, b) == {"same_order": 1, "queries": 2, "max_score_diff": 0.0001}
