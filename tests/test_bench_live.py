"""eval.bench_live end to end on a tiny SciFact cut: corpus mode, then index mode on a linked copy of its index."""
import json

import pytest

from eval import bench_live
from pyserini_aligner.index import read_manifest

from test_live import read_scifact, write_jsonl


def test_corpus_mode_then_index_mode(tmp_path):
    out = tmp_path / "corpus"
    assert bench_live.main(["--corpus", "beir/scifact", "--output", str(out), "--max-docs", "30", "--max-queries",
                            "4", "--segments", "3", "--upsert-size", "2", "--codec", "IVF8,PQ4", "--quiet"]) == 0
    report = json.loads((out / "bench_live.json").read_text())
    assert (report["docs"], report["base_docs"], report["added_docs"]) == (30, 29, 1)
    assert report["add_s"] > 0 and report["rebuild_s"] > 0 and report["upserts"]["count"] == 2
    states = report["latency"]
    assert list(states) == ["built", "3 small segments", "compacted"]
    assert [row["segments"] for row in states.values()] == [1, 4, 1]
    assert [row["live_docs"] for row in states.values()] == [29, 30, 30]
    assert states["3 small segments"]["deleted_rows"] == 4 and states["compacted"]["deleted_rows"] == 0
    assert all(0 < row["p50_ms"] <= row["p95_ms"] and row["queries"] == 4 for row in states.values())
    assert "| add 1% (one segment) | 1 |" in (out / "bench_live.md").read_text()

    index = out / "index"
    before = (index / "manifest.json").read_bytes()
    docs, queries = read_scifact()
    topics = tmp_path / "topics.tsv"
    topics.write_text("".join(f"q{i}\t{text}\n" for i, text in enumerate(queries[:3])))
    out2 = tmp_path / "indexed"
    assert bench_live.main(["--index", str(index), "--add-corpus", str(write_jsonl(tmp_path / "new.jsonl",
                            docs[100:103])), "--topics", str(topics), "--output", str(out2), "--quiet"]) == 0
    report = json.loads((out2 / "bench_live.json").read_text())
    assert (report["docs"], report["added_docs"]) == (30, 3) and report["add_s"] > 0
    assert report["latency"]["after_add"]["live_docs"] == 33 and report["latency"]["after_add"]["segments"] == 2
    assert (index / "manifest.json").read_bytes() == before  # the benchmark updated its own copy
    assert read_manifest(out2 / "index").num_docs == 33


def test_index_mode_needs_docs_to_add(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_live.main(["--index", str(tmp_path), "--output", str(tmp_path / "out")])
    assert exit_.value.code == 2
    assert "--index needs --add-corpus" in capsys.readouterr().err
