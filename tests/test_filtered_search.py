"""Filtered search on real SciFact documents with the shipped model (the session's 200-document indexes): for filters
keeping 50 %, 5 % and 0.1 % of the documents (seeded random docid subsets), every backend returns k hits whenever k
documents match (all of them otherwise), none outside the filter, ranked as exhaustive scoring of the matching
documents ranks them; deleted documents stay out; a filter matching every document ranks exactly as no filter.

200 documents are few: at the CPU's default depth every filter refines all its matches, unprobed. The searches here
refine SHALLOW candidates, so that the 50 % filter probes the index with its mask (the path a large index takes) and
the rarer ones refine every match. The fidelity at the real size and depth is eval.experiments.filter_fidelity's
(docs/results.md, "Filtered search")."""
from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from pyserini_aligner.filters import Filter
from pyserini_aligner.index.live import AlignerIndex
from pyserini_aligner.search import AlignerSearcher
from pyserini_aligner.search.allowed import AllowedRows
from pyserini_aligner.search.exhaustive import ExhaustiveScorer
from pyserini_aligner.search.options import FILTER_EXHAUSTIVE

from conftest import assert_same_ranking

QUERIES = 30  # SciFact queries searched
SHARES = (0.5, 0.05, 0.001)
K = 10
SHALLOW = 2 * K  # max_candidates: 20 documents refined, so that more than FILTER_EXHAUSTIVE × 20 matches probe
CLOSE = 0.95  # overlap@10 with exhaustive filtered scoring where every match is refined


@pytest.fixture(scope="module")
def queries() -> list[str]:
    """The first QUERIES SciFact queries."""
    with zipfile.ZipFile(Path(os.environ["PYSERINI_ALIGNER_BEIR_DIR"]) / "scifact.zip") as archive:
        lines = archive.read("scifact/queries.jsonl").decode().splitlines()
    return [json.loads(line)["text"] for line in lines[:QUERIES]]


@pytest.fixture(scope="module")
def exhaustive_scores(model, queries):
    """index folder -> exhaustive scores [queries, rows] of the index's stored tokens (computed once per index)."""
    found = {}

    def scores(index: Path) -> torch.Tensor:
        if index not in found:
            found[index] = ExhaustiveScorer(index, encoder=model).scores(queries)
        return found[index]

    return scores


def random_docids(docids: list[str], share: float, seed: int = 0) -> list[str]:
    """A seeded random ``share`` of ``docids`` (at least one)."""
    rng = np.random.default_rng(seed)
    return [docids[i] for i in rng.choice(len(docids), max(1, round(share * len(docids))), replace=False)]


def exhaustive_top(scores: torch.Tensor, store, allowed: set[str] | None) -> list[list[str]]:
    """Each query's top K live docids by exhaustive ``scores`` [queries, rows] among ``allowed`` (None: all)."""
    keep = torch.from_numpy(store.live & np.array([allowed is None or d in allowed for d in store.docids]))
    best = scores.masked_fill(~keep, -torch.inf).sort(dim=1, descending=True, stable=True)
    return [[store.docids[r] for r, s in zip(rows[:K], values[:K]) if s != -float("inf")]
            for rows, values in zip(best.indices.tolist(), best.values.tolist())]


def overlap(ranked: list[list[tuple[str, float]]], best: list[list[str]]) -> float:
    """Mean over queries of the share of the exhaustive top (``best``) that ``ranked`` holds."""
    return float(np.mean([len({d for d, _ in got} & set(want)) / len(want) for got, want in zip(ranked, best)]))


CASES = {  # name: (index fixture, backend)
    "compressed-faiss": ("default_index", "faiss"),
    "compressed-torch": ("default_index", "torch"),
    "fp16-faiss": ("index_dir", "faiss"),
    "fp16-torch": ("index_dir", "torch"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_filtered_search_ranks_the_matching_documents_as_exhaustive_scoring(request, model, queries,
                                                                            exhaustive_scores, case):
    """k hits whenever k documents match (all of them otherwise), none outside the filter. Overlap@10 with
    exhaustive scoring of the index's stored tokens restricted to the matching documents: at least CLOSE for the
    filters whose every match is refined (the same scores, so only ties could differ); for the probed 50 % filter at
    least the unfiltered search's own overlap with exhaustive scoring at the same shallow depth where that is lower
    than CLOSE (20 candidates of 200 documents: the filter must not lose what the depth finds)."""
    fixture, backend = CASES[case]
    index = request.getfixturevalue(fixture)
    searcher = AlignerSearcher(index, encoder=model, backend=backend, max_candidates=SHALLOW)
    store, scores = searcher.store, exhaustive_scores(index)
    fidelity = overlap(searcher.rank(queries, K), exhaustive_top(scores, store, None))
    docids = list(store.docids)
    for share in SHARES:
        chosen = random_docids(docids, share)
        allowed = set(chosen)
        assert searcher.matching(chosen) == len(allowed)
        ranked = searcher.rank(queries, K, filter=chosen)
        for hits in ranked:
            assert len(hits) == min(K, len(allowed)) and {d for d, _ in hits} <= allowed
        probed = not searcher.depth(K, chosen).every_row
        assert probed == (share == 0.5)  # the rarer filters refine every match, unprobed
        want = min(CLOSE, fidelity) if probed else CLOSE
        assert overlap(ranked, exhaustive_top(scores, store, allowed)) >= want, (share, fidelity)


@pytest.mark.parametrize("backend", ["faiss", "torch"])
def test_a_filter_of_every_document_ranks_as_no_filter(default_index, model, queries, backend):
    """A filter matching every document searches at the unfiltered depth (probed: SHALLOW) and returns the
    unfiltered ranking; a filter given as a Filter, as a list or as a set of docids is the same filter."""
    searcher = AlignerSearcher(default_index, encoder=model, backend=backend, max_candidates=SHALLOW)
    every = Filter.docids(searcher.docids)
    assert searcher.depth(K, every) == searcher.depth(K) and searcher.matching(every) == searcher.num_docs
    for got, want in zip(searcher.rank(queries, K, filter=every), searcher.rank(queries, K)):
        assert_same_ranking(got, want)
    chosen = random_docids(list(searcher.docids), 0.05)
    assert searcher.rank(queries[:3], K, filter=chosen) == searcher.rank(queries[:3], K, filter=set(chosen)) \
        == searcher.rank(queries[:3], K, filter=Filter.docids(chosen))


def test_a_filter_matching_nothing_returns_no_hits(default_index, model, queries):
    searcher = AlignerSearcher(default_index, encoder=model)
    nothing = Filter.docids(["no such document"])
    assert searcher.matching(nothing) == 0
    assert searcher.rank(queries[:2], K, filter=nothing) == [[], []]
    assert searcher.search(queries[0], K, filter=[]) == []
    with pytest.raises(TypeError, match="single string"):
        searcher.rank(queries[:1], K, filter=searcher.docids[0])


def test_search_and_batch_search_take_a_filter(default_index, model, queries):
    """Pyserini's search and batch_search return DenseSearchResults of the filter's documents only."""
    searcher = AlignerSearcher(default_index, encoder=model)
    chosen = random_docids(list(searcher.docids), 0.05)
    hits = searcher.search(queries[0], K, filter=chosen)
    assert [(h.docid, h.score) for h in hits] == searcher.rank(queries[:1], K, filter=chosen)[0]
    batch = searcher.batch_search(queries[:2], ["a", "b"], K, filter=chosen)
    assert [[(h.docid, h.score) for h in batch[qid]] for qid in "ab"] == searcher.rank(queries[:2], K, filter=chosen)


@pytest.mark.parametrize("share", [0.5, 0.25])  # probed; every match refined
def test_deleted_documents_stay_out_of_a_filtered_search(tmp_path, default_index, model, queries,
                                                         exhaustive_scores, share):
    """Documents of the filter deleted from the index (at most 10, the 50 or 100 matching documents keep k) are
    neither counted nor returned; the others rank as exhaustive scoring of the live matching documents ranks them
    (at least CLOSE, or the index's own fidelity at this depth where lower)."""
    copy = tmp_path / "index"
    shutil.copytree(default_index, copy)
    before = AlignerSearcher(copy, encoder=model, max_candidates=SHALLOW)
    chosen = random_docids(list(before.docids), share)
    ranked = before.rank(queries, K, filter=chosen)
    gone = sorted({d for hits in ranked[:5] for d, _ in hits[:2]})  # documents the filtered search returned
    AlignerIndex(copy, encoder=model).delete(gone)
    assert before.reopen()
    store = before.store
    assert before.matching(chosen) == len(chosen) - len(gone)
    ranked = before.rank(queries, K, filter=chosen)
    allowed = set(chosen) - set(gone)
    for hits in ranked:
        assert len(hits) == K and {d for d, _ in hits} <= allowed
    fidelity = overlap(before.rank(queries, K), exhaustive_top(exhaustive_scores(default_index), store, None))
    assert overlap(ranked, exhaustive_top(exhaustive_scores(default_index), store, allowed)) >= \
        min(CLOSE, fidelity)


def test_a_probed_filter_deepens_its_lists_and_still_fills_k(default_index, model, queries):
    """A filter of half the documents, more than a shallow depth refines unprobed, probes twice (live / matching)
    the inverted lists that an unfiltered search probes, as many entries each, narrows FILTER_EXHAUSTIVE times the
    refined count by centroid interaction (the CPU's defaults have no such stage), refines as many, and every query
    still gets k hits of the filter."""
    searcher = AlignerSearcher(default_index, encoder=model, max_candidates=SHALLOW)
    chosen = random_docids(list(searcher.docids), 0.5)
    depth, plain = searcher.depth(K, chosen), searcher.depth(K)
    assert not depth.every_row and depth.nprobe == 2 * plain.nprobe and depth.per_probe == plain.per_probe
    assert plain.interaction == 0 and depth.interaction == FILTER_EXHAUSTIVE * plain.refined
    assert depth.refined == plain.refined
    for hits in searcher.rank(queries, K, filter=chosen):
        assert len(hits) == K and {d for d, _ in hits} <= set(chosen)


def test_allowed_rows_cross_processes_as_bits():
    """Rows packed one bit a row come back the same."""
    mask = np.random.default_rng(3).random(77) < 0.3
    rows = AllowedRows.unpack(AllowedRows(mask).packed())
    assert np.array_equal(rows.mask, mask) and rows.count == int(mask.sum())
    assert rows.rows(torch.device("cpu")).tolist() == np.flatnonzero(mask).tolist()
