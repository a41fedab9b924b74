"""eval.experiments.filter_fidelity: the exact filtered top 10 it compares with, and its table."""
import numpy as np

from eval.experiments.filter_fidelity import exact_top, markdown


def test_exact_top_ranks_only_the_allowed_documents_ties_to_the_lower_row():
    scores = np.array([[0.1, 0.9, 0.5, 0.9], [0.3, 0.2, 0.1, 0.0]], dtype=np.float32)
    docids = ["a", "b", "c", "d"]
    assert [[d for d, _ in top] for top in exact_top(scores, docids, None)] == [["b", "d", "c", "a"],
                                                                                ["a", "b", "c", "d"]]
    assert [[d for d, _ in top] for top in exact_top(scores, docids, {"a", "d"})] == [["d", "a"], ["a", "d"]]


def test_markdown_has_a_row_per_filter():
    row = {"filter": "none", "matching": 4, "depth": [100, 8, 0, 128], "full_hits": 1.0, "outside": 0,
           "overlap@10": 0.8, "overlap@10_index": 0.9, "p50_ms": 5.0, "p50_vs_unfiltered": 1.0}
    every = {**row, "filter": "50.0%", "matching": 2, "depth": [0, 0, 0, 2], "p50_ms": 2.5, "p50_vs_unfiltered": 0.5}
    table = markdown({"dataset": "d", "documents": 4, "queries": 2, "index_type": "IVF4,PQ4", "threads": 1,
                      "rows": [row, every]})
    assert "| none | 4 | 100, 8, 0, 128 | 1.000 | 0 | 0.8000 | 0.9000 | 5.0 | 1.00× |" in table
    assert "| 50.0% | 2 | every match refined | 1.000 | 0 | 0.8000 | 0.9000 | 2.5 | 0.50× |" in table
