"""The residual-bytes study's pure parts: overlap with the exact ranking and its table."""
from eval.experiments.refine_bytes import markdown, overlap_at


def test_overlap_counts_shared_documents_of_each_top_k_against_a_loop():
    reference = {"a": [(f"d{i}", 1.0 - i / 10) for i in range(10)], "b": [("x", 1.0), ("y", 0.5)]}
    run = {"a": [(f"d{i}", 0.0) for i in range(5, 15)], "b": [("y", 2.0), ("z", 1.0)]}
    want = []
    for q, ranked in reference.items():
        top = [d for d, _ in ranked[:2]]
        want.append(sum(1 for d, _ in run[q][:2] if d in top) / 2)
    assert overlap_at(run, reference, k=2) == sum(want) / len(want) == 0.25
    assert overlap_at(run, reference) == (5 / 10 + 1 / 10) / 2
    assert overlap_at({}, reference) == 0.0 and overlap_at(run, {}) == 0.0


def test_markdown_has_the_exact_row_then_one_row_a_codec():
    report = {"dataset": "beir/x/dev", "queries": 3, "query_prune": 0.5, "hits": 1000,
              "exact": {"ndcg@10": 0.5, "recall@1000": 0.9},
              "rows": [{"codec": "IVF64,PQ4,Refine(PQ32)", "doc_prune": 0.2, "bytes_per_doc": 100, "overlap@10": 0.9,
                        "ndcg@10": 0.49, "recall@1000": 0.9}]}
    lines = markdown(report).splitlines()
    assert lines[0].startswith("beir/x/dev, 3 queries, β^q 0.5, 1000 hits")
    assert lines[-2] == "| exact (fp16, every token) | 1 | | 1.0 | 0.5 | 0.9 |"
    assert lines[-1] == "| IVF64,PQ4,Refine(PQ32) | 0.2 | 100 | 0.9 | 0.49 | 0.9 |"
