"""Filtered search on real SciFact documents with the shipped model: for filters keeping 50 %, 5 % and 0.1 % of the
documents (seeded random docid subsets), every backend returns k hits whenever k documents match (all of them
otherwise), none outside the filter, ranked as exhaustive scoring of the matching documents ranks them; deleted
documents stay out; a filter matching every document ranks exactly as no filter."""
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

from conftest import assert_same_ranking, scifact_docs
from workers import built_once

DOCS = 1200  # SciFact documents indexed (texts cut to WORDS words): 50 % of them is more than the CPU's depth
WORDS = 64  # refines unprobed, so that filter probes the index
QUERIES = 30  # SciFact queries searched
SHARES = (0.5, 0.05, 0.001)
K = 10
CLOSE = 0.95  # overlap@10 with exhaustive filtered scoring


@pytest.fixture(scope="module")
def fp16_index(tmp_path_factory, model) -> Path:
    """The first DOCS SciFact documents, every token stored in float16 (β^d = 1, FAISS Flat)."""
    from pyserini_aligner.index import build_index
    from pyserini_aligner.index.format import MANIFEST

    with built_once(tmp_path_factory, f"scifact{DOCS}_fp16") as target:
        if not (target / MANIFEST).is_file():
            docs = [(r["id"], r["contents"]) for r in scifact_docs(DOCS, WORDS)]
            build_index(docs, target, model, codec="fp16", doc_prune=1.0, progress=False, model_name="aligner")
    return target


@pytest.fixture(scope="module")
def compressed_index(tmp_path_factory, fp16_index) -> Path:
    """The same documents stored as build_index's defaults store them (derived without encoding them again)."""
    from pyserini_aligner.index import derive_index
    from pyserini_aligner.index.format import MANIFEST
    from pyserini_aligner.index.options import DEFAULT_CODEC, DEFAULT_DOC_PRUNE
    from pyserini_aligner.salience import DEFAULT_PRUNE_REDUNDANCY

    with built_once(tmp_path_factory, f"scifact{DOCS}_default") as target:
        if not (target / MANIFEST).is_file():
            derive_index(fp16_index, target, codec=DEFAULT_CODEC, doc_prune=DEFAULT_DOC_PRUNE,
                         prune_redundancy=DEFAULT_PRUNE_REDUNDANCY, progress=False)
    return target


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
    "compressed-faiss": ("compressed_index", "faiss"),
    "compressed-torch": ("compressed_index", "torch"),
    "fp16-faiss": ("fp16_index", "faiss"),
    "fp16-torch": ("fp16_index", "torch"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_filtered_search_ranks_the_matching_documents_as_exhaustive_scoring(request, model, queries,
                                                                            exhaustive_scores, case):
    """k hits whenever k documents match (all of them otherwise), none outside the filter; overlap@10 with
    exhaustive scoring of the matching documents at least CLOSE (a filter that probes a compressed index: at least
    the index's own fidelity, the unfiltered search's overlap with unfiltered exhaustive scoring, where lower)."""
    fixture, backend = CASES[case]
    index = request.getfixturevalue(fixture)
    searcher = AlignerSearcher(index, encoder=model, backend=backend)
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
        want = CLOSE if not (probed and store.codec is not None) else min(CLOSE, fidelity)
        assert overlap(ranked, exhaustive_top(scores, store, allowed)) >= want, (share, fidelity)


@pytest.mark.parametrize("backend", ["faiss", "torch"])
def test_a_filter_of_every_document_ranks_as_no_filter(compressed_index, model, queries, backend):
    """A filter matching every document searches at the unfiltered depth and returns the unfiltered ranking; a
    filter given as a Filter, as a list or as a set of docids is the same filter."""
    searcher = AlignerSearcher(compressed_index, encoder=model, backend=backend)
    every = Filter.docids(searcher.docids)
    assert searcher.depth(K, every) == searcher.depth(K) and searcher.matching(every) == searcher.num_docs
    for got, want in zip(searcher.rank(queries, K, filter=every), searcher.rank(queries, K)):
        assert_same_ranking(got, want)
    chosen = random_docids(list(searcher.docids), 0.05)
    assert searcher.rank(queries[:3], K, filter=chosen) == searcher.rank(queries[:3], K, filter=set(chosen)) \
        == searcher.rank(queries[:3], K, filter=Filter.docids(chosen))


def test_a_filter_matching_nothing_returns_no_hits(compressed_index, model, queries):
    searcher = AlignerSearcher(compressed_index, encoder=model)
    nothing = Filter.docids(["no such document"])
    assert searcher.matching(nothing) == 0
    assert searcher.rank(queries[:2], K, filter=nothing) == [[], []]
    assert searcher.search(queries[0], K, filter=[]) == []
    with pytest.raises(TypeError, match="single string"):
        searcher.rank(queries[:1], K, filter=searcher.docids[0])


def test_search_and_batch_search_take_a_filter(compressed_index, model, queries):
    """Pyserini's search and batch_search return DenseSearchResults of the filter's documents only."""
    searcher = AlignerSearcher(compressed_index, encoder=model)
    chosen = random_docids(list(searcher.docids), 0.05)
    hits = searcher.search(queries[0], K, filter=chosen)
    assert [(h.docid, h.score) for h in hits] == searcher.rank(queries[:1], K, filter=chosen)[0]
    batch = searcher.batch_search(queries[:2], ["a", "b"], K, filter=chosen)
    assert [[(h.docid, h.score) for h in batch[qid]] for qid in "ab"] == searcher.rank(queries[:2], K, filter=chosen)


@pytest.mark.parametrize("share", [0.5, 0.05])
def test_deleted_documents_stay_out_of_a_filtered_search(tmp_path, compressed_index, model, queries,
                                                         exhaustive_scores, share):
    """Documents of the filter deleted from the index are neither counted nor returned; the others rank as
    exhaustive scoring of the live matching documents ranks them (the probed filter to the index's fidelity)."""
    copy = tmp_path / "index"
    shutil.copytree(compressed_index, copy)
    before = AlignerSearcher(copy, encoder=model)
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
    fidelity = overlap(before.rank(queries, K), exhaustive_top(exhaustive_scores(compressed_index), store, None))
    assert overlap(ranked, exhaustive_top(exhaustive_scores(compressed_index), store, allowed)) >= \
        min(CLOSE, fidelity)


def test_rarer_matches_probe_deeper_and_still_fill_k(compressed_index, model, queries):
    """With a shallow depth (few candidates refined), a 10 % filter is probed with its lists deepened, and every
    query still gets k hits of the filter."""
    searcher = AlignerSearcher(compressed_index, encoder=model, max_candidates=8)
    chosen = random_docids(list(searcher.docids), 0.1)
    depth, plain = searcher.depth(K, chosen), searcher.depth(K)
    assert not depth.every_row and depth.nprobe > plain.nprobe and depth.per_probe == plain.per_probe
    for hits in searcher.rank(queries, K, filter=chosen):
        assert len(hits) == K and {d for d, _ in hits} <= set(chosen)


def test_allowed_rows_cross_processes_as_bits():
    """Rows packed one bit a row come back the same."""
    mask = np.random.default_rng(3).random(77) < 0.3
    rows = AllowedRows.unpack(AllowedRows(mask).packed())
    assert np.array_equal(rows.mask, mask) and rows.count == int(mask.sum())
    assert rows.rows(torch.device("cpu")).tolist() == np.flatnonzero(mask).tolist()
