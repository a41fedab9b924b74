"""BM25 through Pyserini's Lucene reproduces Pyserini's published BEIR regressions (flat)."""
import json

import pytest

from eval.beir.context import work_dir
from eval.beir.harness import run_harness
from pyserini_aligner.bm25 import bm25_search, build_lucene_index
from pyserini_aligner.data import DataError, Dataset, Doc
from pyserini_aligner.trec import read_run

PUBLISHED = {"beir/scifact/test": 0.6789}  # NFCorpus (0.3218) reproduces too: `python -m eval.beir`


@pytest.mark.parametrize("dataset", sorted(PUBLISHED))
def test_bm25_reproduces_published_ndcg(dataset, tmp_path):
    """Every query, 100 hits each (nDCG@10 reads the top 10); the full depth of 1000 on a few queries."""
    results = run_harness(dataset, ["bm25"], tmp_path / "out", tmp_path / "cache", hits=100)
    row = results["systems"]["bm25"]
    assert abs(row["ndcg@10"] - PUBLISHED[dataset]) <= 0.005
    on_disk = json.loads((tmp_path / "out" / "results.json").read_text())
    assert on_disk["dataset"] == dataset and set(on_disk["systems"]["bm25"]) >= {"ndcg@10", "recall@100",
                                                                                  "recall@1000", "run"}
    run = read_run(row["run"])
    queries = Dataset(dataset).queries()
    assert set(run) == set(queries)
    assert max(len(hits) for hits in run.values()) == 100
    assert "| bm25 |" in (tmp_path / "out" / "results.md").read_text()
    lucene = work_dir(Dataset(dataset), tmp_path / "cache") / "lucene"
    deep = bm25_search(lucene, dict(list(queries.items())[:3]), k=1000)
    assert [len(hits) for hits in deep.values()] == [1000] * 3
    assert all(list(run[qid]) == [docid for docid, _ in hits[:100]] for qid, hits in deep.items())


def test_remove_query_drops_self_hit(tmp_path):
    docs = [Doc("q1", "", "alpha beta gamma"), Doc("d2", "", "alpha beta"), Doc("d3", "", "delta")]
    build_lucene_index(iter(docs), tmp_path / "idx")
    kept = bm25_search(tmp_path / "idx", {"q1": "alpha beta gamma"}, k=10)
    assert [docid for docid, _ in kept["q1"]] == ["d2"]
    everything = bm25_search(tmp_path / "idx", {"q1": "alpha beta gamma"}, k=10, remove_query=False)
    assert everything["q1"][0][0] == "q1"
    assert bm25_search(tmp_path / "idx", {"q2": "epsilon"}, k=10) == {"q2": []}  # a query that matches nothing


def test_empty_corpus_is_refused_and_nothing_left(tmp_path):
    with pytest.raises(DataError, match="empty corpus"):
        build_lucene_index(iter([]), tmp_path / "idx")
    assert not (tmp_path / "idx").exists()
    assert list(tmp_path.iterdir()) == []
