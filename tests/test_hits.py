"""drop_query_hits: the one place that removes a query's own id from its hits."""
from pyserini.search.faiss import DenseSearchResult

from pyserini_aligner.hits import drop_query_hits


def test_the_query_id_is_dropped_then_the_list_cut():
    hits = {"q": [("a", 3.0), ("q", 2.0), ("b", 1.0)], "r": [("r", 1.0)], "s": []}
    assert drop_query_hits(hits, 2) == {"q": [("a", 3.0), ("b", 1.0)], "r": [], "s": []}
    assert drop_query_hits(hits, 1) == {"q": [("a", 3.0)], "r": [], "s": []}
    assert drop_query_hits({"q": [("b", 1.0), ("a", 0.5)]}) == {"q": [("b", 1.0), ("a", 0.5)]}


def test_pyserini_hits_keep_their_type():
    hits = {"7": [DenseSearchResult("7", 0.9), DenseSearchResult("3", 0.5)]}
    kept = drop_query_hits(hits, 10)["7"]
    assert [h.docid for h in kept] == ["3"] and isinstance(kept[0], DenseSearchResult)
