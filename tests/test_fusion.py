"""The harness's fusion functions against obvious references (and Pyserini's HybridSearcher arithmetic)."""
import random

import pytest
from pyserini.search.faiss import DenseSearchResult
from pyserini.search.hybrid import HybridSearcher

from eval.beir.fusion import hybrid_fuse


def reference(dense: dict, sparse: dict, alpha: float, k: int, normalization: bool) -> dict[str, float]:
    """alpha · sparse + dense over the union, a missing score replaced by its list's minimum, min-max centred."""
    def centred(scores, doc, low, high):
        value = scores.get(doc, low)
        return (value - (low + high) / 2) / (high - low) if normalization else value

    d_low, d_high = min(dense.values()), max(dense.values())
    s_low, s_high = min(sparse.values()), max(sparse.values())
    fused = {doc: alpha * centred(sparse, doc, s_low, s_high) + centred(dense, doc, d_low, d_high)
             for doc in set(dense) | set(sparse)}
    return dict(sorted(fused.items(), key=lambda item: -item[1])[:k])


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("normalization", [True, False])
def test_hybrid_fuse_equals_the_formula_and_pyserini(seed, normalization):
    rng = random.Random(seed)
    docs = [f"d{i}" for i in range(40)]
    dense = {d: rng.uniform(-1, 1) for d in rng.sample(docs, 25)}
    sparse = {d: rng.uniform(0, 30) for d in rng.sample(docs, 20)}
    alpha = rng.choice([0.05, 0.5, 2.0])
    fused = hybrid_fuse(list(dense.items()), list(sparse.items()), alpha, 30, normalization)
    assert [d for d, _ in fused] == list(reference(dense, sparse, alpha, 30, normalization))
    assert dict(fused) == pytest.approx(reference(dense, sparse, alpha, 30, normalization), abs=1e-12)
    pyserini = HybridSearcher._hybrid_results([DenseSearchResult(d, s) for d, s in dense.items()],
                                              [DenseSearchResult(d, s) for d, s in sparse.items()], alpha, 30,
                                              normalization)
    assert [(h.docid, h.score) for h in pyserini] == fused


def test_a_single_score_is_fused_unnormalised_and_ties_go_by_docid():
    dense, sparse = [("a", 1.0)], [("b", 20.0), ("c", 10.0)]
    assert hybrid_fuse(dense, sparse, 0.1, 10) == [("b", pytest.approx(3.0)), ("a", pytest.approx(2.0)),
                                                   ("c", pytest.approx(2.0))]
    assert hybrid_fuse([], [], 0.5, 10) == []
    assert hybrid_fuse([("y", 1.0), ("x", 1.0), ("z", 0.0)], [], 1.0, 2) == [("x", 0.0), ("y", 0.0)]
