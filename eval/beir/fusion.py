"""Fusion of two or more runs (hit lists ``qid -> [(docid, score)]``, best first): reciprocal rank fusion with ranx
and Pyserini ``HybridSearcher``'s weighted sum of min-max centred scores."""
from __future__ import annotations

import warnings
from typing import Mapping, Sequence

Hits = Sequence[tuple[str, float]]


def rrf_fuse(runs: Sequence[Mapping[str, Hits]], k: int = 1000, rrf_k: int = 60) -> dict[str, list[tuple[str, float]]]:
    """Reciprocal rank fusion with ranx ``fuse(method="rrf")``: Σ 1/(rrf_k + rank); ``qid -> [(docid, score)]``
    top ``k``. A query with hits in only some runs is fused over those."""
    from ranx import fuse

    from pyserini_aligner.metrics import to_ranx_run

    qids = list(dict.fromkeys(q for run in runs for q in run))
    full = [q for q in qids if all(run.get(q) for run in runs)]
    fused: dict[str, dict[str, float]] = {}
    if full:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = fuse([to_ranx_run({q: run[q] for q in full}) for run in runs], norm=None, method="rrf",
                          params={"k": rrf_k})
        fused = {q: dict(result[q]) for q in full}
    for q in qids:
        if q not in fused:
            scores: dict[str, float] = {}
            for run in runs:
                for rank, (docid, _) in enumerate(sorted(run.get(q, []), key=lambda h: -h[1]), 1):
                    scores[docid] = scores.get(docid, 0.0) + 1.0 / (rrf_k + rank)
            fused[q] = scores
    return {q: sorted(((d, float(s)) for d, s in fused[q].items()), key=lambda h: (-h[1], h[0]))[:k] for q in qids}


def _centred(scores: dict[str, float]) -> tuple[float, float]:
    """(min, max) of a hit list's scores; (0, 1) for none (Pyserini's convention)."""
    return (min(scores.values()), max(scores.values())) if scores else (0.0, 1.0)


def hybrid_fuse(dense: Hits, sparse: Hits, alpha: float, k: int, normalization: bool = True) -> list[tuple[str, float]]:
    """One query's ``alpha · sparse + dense`` over the union of both hit lists, top ``k`` best first (equal scores
    by docid), as Pyserini's ``HybridSearcher`` fuses them: a document missing from one list takes that list's
    lowest score; with ``normalization`` each list is min-max centred, ``(s − (min + max)/2) / (max − min)``.
    A list whose hits share a single score cannot be centred: the query is then fused unnormalised."""
    d, s = dict(dense), dict(sparse)
    d_min, d_max = _centred(d)
    s_min, s_max = _centred(s)
    if normalization and (d_max == d_min or s_max == s_min):
        normalization = False
    fused = []
    for doc in set(d) | set(s):
        dense_score, sparse_score = d.get(doc, d_min), s.get(doc, s_min)
        if normalization:
            sparse_score = (sparse_score - (s_min + s_max) / 2) / (s_max - s_min)
            dense_score = (dense_score - (d_min + d_max) / 2) / (d_max - d_min)
        fused.append((doc, float(alpha * sparse_score + dense_score)))
    return sorted(fused, key=lambda hit: (-hit[1], hit[0]))[:k]
