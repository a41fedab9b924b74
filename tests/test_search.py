"""AlignerSearcher, ExhaustiveScorer and AlignmentReranker on the first 200 SciFact documents with the real model."""
import copy
import json
import os
import shutil
import zipfile
from collections import Counter
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from pyserini_aligner.alignment import alignment_scores
from pyserini_aligner.index import IndexFormatError, derive_index
from pyserini_aligner.index.commit import write_manifest
from pyserini_aligner.index.format import DOCIDS, FAISS_INDEX, MANIFEST, SALIENCE, SMALL_FILE, read_manifest
from pyserini_aligner.index.reader import StoredIndex
from pyserini_aligner.search import AlignerSearcher, AlignmentReranker, ExhaustiveScorer
from pyserini_aligner.search.encoding import pad_encoded
from pyserini_aligner.strategy import MAXSIM

from conftest import DOC_WORDS, N_DOCS, scifact_docs
from conftest import assert_same_ranking as same_ranking

N_QUERIES = 12


@pytest.fixture(scope="session")
def data() -> tuple[list[dict], list[dict]]:
    """The 200 indexed SciFact documents (JsonCollection records) and the first 12 SciFact queries."""
    with zipfile.ZipFile(Path(os.environ["PYSERINI_ALIGNER_BEIR_DIR"]) / "scifact.zip") as archive:
        lines = archive.read("scifact/queries.jsonl").decode().splitlines()[:N_QUERIES]
    return scifact_docs(N_DOCS, DOC_WORDS), [{"id": q["_id"], "text": q["text"]} for q in map(json.loads, lines)]


@pytest.fixture(scope="session")
def exhaustive(index_dir, model):
    return ExhaustiveScorer(index_dir, encoder=model)


VARIANTS = {  # name: (derive_index arguments or "default", searcher arguments for exhaustive-equality runs)
    "fp16": (None, {}),
    "fp16-pruned": (dict(doc_prune=0.3), {}),
    "compressed": (dict(codec="IVF64,PQ16"), dict(nprobe=64)),
    "default": ("default", None),  # build_index's defaults: codec auto, β^d 0.2; nprobe = every list
}


@pytest.fixture(scope="session", params=list(VARIANTS))
def variant(request, tmp_path_factory, index_dir, default_index, model, data):
    """(name, index folder, searcher arguments, exhaustive top-10 per query over that same index): the shared
    fp16 index, a β^d-pruned one, a compressed one and the compressed default one."""
    derive, knobs = VARIANTS[request.param]
    folder = index_dir
    if derive == "default":
        folder = default_index
        knobs = dict(nprobe=StoredIndex(folder).codec_spec.nlist)
    elif derive is not None:
        folder = tmp_path_factory.getbasetemp() / f"variant-{request.param}"
        if not (folder / MANIFEST).is_file():
            derive_index(index_dir, folder, progress=False, **derive)
    queries = data[1]
    want = ExhaustiveScorer(folder, encoder=model).batch_search([q["text"] for q in queries],
                                                               [q["id"] for q in queries], k=10)
    return request.param, folder, knobs, want


@pytest.fixture(scope="session")
def expected(exhaustive, data):
    queries = data[1]
    return exhaustive.batch_search([q["text"] for q in queries], [q["id"] for q in queries], k=10)


def as_pairs(hits) -> list[tuple[str, float]]:
    return [(h.docid, h.score) for h in hits]


assert_same_ranking = partial(same_ranking, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["faiss", "torch"])
def test_searcher_equals_exhaustive_with_large_k(variant, model, data, backend):
    name, folder, knobs, want = variant
    searcher = AlignerSearcher(folder, encoder=model, k_per_token=1000, max_candidates=N_DOCS, backend=backend,
                               **knobs)
    queries = data[1]
    got = searcher.batch_search([q["text"] for q in queries], [q["id"] for q in queries], k=10)
    assert list(got) == [q["id"] for q in queries]
    for q in queries:
        assert_same_ranking(as_pairs(got[q["id"]]), as_pairs(want[q["id"]]))
    for q in queries[:3]:  # one query at a time: the same ranking
        assert_same_ranking(as_pairs(searcher.search(q["text"], k=10)), as_pairs(want[q["id"]]))


@pytest.mark.parametrize("backend", ["faiss", "torch"])
def test_default_knobs_find_the_exhaustive_top_hits(variant, model, data, backend):
    _, folder, _, want = variant
    searcher = AlignerSearcher(folder, encoder=model, max_candidates=50, backend=backend)
    overlap = [len({h.docid for h in searcher.search(q["text"], k=10)} & {h.docid for h in want[q["id"]]})
               for q in data[1]]
    assert np.mean(overlap) >= 9.0


def test_compressed_index_stays_close_to_fp16(variant, expected, data):
    """Whatever the store, the exhaustive top 10 stays close to the fp16 one (the codec loses little)."""
    name, _, _, want = variant
    overlap = [len({h.docid for h in want[q["id"]]} & {h.docid for h in expected[q["id"]]}) for q in data[1]]
    assert np.mean(overlap) >= {"fp16": 10.0, "fp16-pruned": 10.0, "compressed": 8.0, "default": 7.0}[name]  # PQ4


def test_searcher_loads_model_from_manifest(variant, data):
    _, folder, knobs, want = variant
    searcher = AlignerSearcher(folder, k_per_token=1000, max_candidates=N_DOCS, **knobs)
    assert str(searcher.strategy) == "top-k:1" and searcher.num_docs == N_DOCS and searcher.dimension == 128
    q = data[1][0]
    assert_same_ranking(as_pairs(searcher.search(q["text"], k=10)), as_pairs(want[q["id"]]))


@pytest.mark.parametrize("factory, exact", [("IVF16,Flat", True), ("HNSW16", False), ("IVF16,PQ16x4", False)])
def test_faiss_factory_strings(tmp_path, index_dir, model, data, expected, factory, exact):
    target = tmp_path / "idx"
    derive_index(index_dir, target, index_type=factory, progress=False, train_size=10_000)
    searcher = AlignerSearcher(target, encoder=model, k_per_token=200, max_candidates=N_DOCS)
    for q in data[1][:4]:
        got = searcher.search(q["text"], k=10)
        assert len(got) == 10 and len({h.docid for h in got}) == 10
        if exact:  # nprobe defaults to min(32, nlist): every list is probed
            assert_same_ranking(as_pairs(got), as_pairs(expected[q["id"]]))
        else:
            assert len({h.docid for h in got} & {h.docid for h in expected[q["id"]]}) >= 6


def test_pruned_index_and_refine_with_kept(tmp_path, index_dir, model, data):
    target = tmp_path / "pruned"
    derive_index(index_dir, target, doc_prune=0.5, progress=False)
    q = data[1][1]["text"]
    searcher = AlignerSearcher(target, encoder=model, k_per_token=100_000, max_candidates=N_DOCS, refine_with="kept",
                               query_prune=0.5)
    got = searcher.search(q, k=5)
    vectors, mask, _ = searcher.store.gather(np.arange(N_DOCS), kept_only=True)
    assert mask.sum(1).tolist() == [searcher.store.kept[a:b].sum() for a, b in
                                    zip(searcher.store.offsets[:-1], searcher.store.offsets[1:])]
    qv, qm, _ = pad_encoded(model.encode([q], is_query=True), 128)
    scores = alignment_scores(qv, qm, vectors, mask, MAXSIM)[0]
    best = torch.argsort(scores, descending=True, stable=True)[:5]
    assert [h.docid for h in got] == [searcher.docids[i] for i in best]
    assert np.allclose([h.score for h in got], scores[best].numpy(), atol=1e-5)


@pytest.mark.parametrize("backend", ["faiss", "torch"])
def test_strategy_knob(variant, model, data, backend):
    _, folder, knobs, _ = variant
    q = data[1][2]["text"]
    exact = ExhaustiveScorer(folder, encoder=model, strategy="top-p:0.02")
    searcher = AlignerSearcher(folder, encoder=model, strategy="top-p:0.02", k_per_token=1000, max_candidates=N_DOCS,
                               backend=backend, **knobs)
    assert_same_ranking(as_pairs(searcher.search(q, k=10)), as_pairs(exact.search(q, k=10)))
    with pytest.raises(ValueError, match="bad alignment strategy"):
        AlignerSearcher(folder, encoder=model, strategy="max")


@pytest.mark.parametrize("backend", ["faiss", "torch"])
def test_empty_query_and_return_vector(variant, model, backend):
    _, folder, _, _ = variant
    searcher = AlignerSearcher(folder, encoder=model, backend=backend)
    assert searcher.search("") == [] and searcher.search("   ") == []
    hits = searcher.batch_search(["", "vitamin D deficiency"], ["empty", "q"], k=3)
    assert hits["empty"] == [] and len(hits["q"]) == 3
    q_vectors, prf = searcher.search("vitamin D deficiency", k=3, return_vector=True)
    assert q_vectors.shape[1] == 128 and [h.docid for h in prf] == [h.docid for h in hits["q"]]
    row = searcher.store.row_of(prf[0].docid)
    assert prf[0].vectors.shape == (searcher.store.lengths[row], 128)


def test_torch_backend_refines_with_kept_tokens_like_faiss(tmp_path, index_dir, model, data):
    target = tmp_path / "pruned"
    derive_index(index_dir, target, doc_prune=0.5, progress=False)
    runs = [AlignerSearcher(target, encoder=model, k_per_token=1000, max_candidates=N_DOCS, refine_with="kept",
                            backend=backend).batch_search([q["text"] for q in data[1]], [q["id"] for q in data[1]],
                                                          k=10) for backend in ("faiss", "torch")]
    for q in data[1]:
        assert_same_ranking(as_pairs(runs[1][q["id"]]), as_pairs(runs[0][q["id"]]))


def test_backend_knob_errors(index_dir, default_index, model):
    with pytest.raises(ValueError, match="backend must be one of"):
        AlignerSearcher(index_dir, encoder=model, backend="gpu")
    with pytest.raises(ValueError, match="backend 'faiss' runs on the CPU"):
        AlignerSearcher(default_index, encoder=model, backend="faiss", device="cuda:0")
    with pytest.raises(ValueError, match="several devices, segments and nprobe need a compressed index"):
        AlignerSearcher(index_dir, encoder=model, backend="torch", nprobe=4)
    with pytest.raises(ValueError, match="ef_search tunes HNSW FAISS indexes of fp16 stores"):
        AlignerSearcher(default_index, encoder=model, ef_search=16)


def test_model_mismatch_errors(index_dir, model):
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.projection.weight.mul_(1.01)
    with pytest.raises(ValueError, match="model fingerprint mismatch: index .* was built with model aligner"):
        AlignerSearcher(index_dir, encoder=other)
    other.config.dim = 64
    other.projection = torch.nn.Linear(384, 64, bias=False)
    with pytest.raises(ValueError, match="encoder produces 64-d vectors but index .* holds 128-d vectors"):
        AlignerSearcher(index_dir, encoder=other)


def test_corrupt_or_missing_files_are_named(tmp_path, index_dir, model):
    broken = tmp_path / "broken"
    shutil.copytree(index_dir, broken)
    (seg,) = read_manifest(broken).segments
    seg_dir = broken / seg.name
    size = (seg_dir / FAISS_INDEX).stat().st_size
    assert size > SMALL_FILE  # its blocks are checked on open; without block checksums FAISS reports the damage
    (seg_dir / FAISS_INDEX).write_bytes(b"garbage".ljust(size, b"\0"))
    with pytest.raises(IndexFormatError, match=r"seg-.*/faiss\.index: checksum mismatch in bytes 0-"):
        AlignerSearcher(broken, encoder=model)
    manifest = read_manifest(broken)  # as written before block checksums
    for record in manifest.segments[0].files.values():
        record.pop("blocks", None)
    write_manifest(broken, manifest)
    with pytest.raises(IndexFormatError, match=r"seg-.*/faiss\.index: FAISS cannot read it"):
        AlignerSearcher(broken, encoder=model)
    (seg_dir / FAISS_INDEX).unlink()
    with pytest.raises(FileNotFoundError, match=r"index file missing: .*faiss\.index"):
        AlignerSearcher(broken, encoder=model)
    shutil.copy(index_dir / seg.name / FAISS_INDEX, seg_dir / FAISS_INDEX)
    with open(seg_dir / SALIENCE, "ab") as handle:
        handle.write(b"\0" * 4)
    with pytest.raises(IndexFormatError, match=r"doc_salience\.f32: \d+ bytes, the manifest implies"):
        AlignerSearcher(broken, encoder=model)
    shutil.copy(index_dir / seg.name / SALIENCE, seg_dir / SALIENCE)
    lines = (seg_dir / DOCIDS).read_text().splitlines()
    (seg_dir / DOCIDS).write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(IndexFormatError, match=r"docids\.txt: \d+ bytes, the manifest implies|docids\.txt: checksum"):
        AlignerSearcher(broken, encoder=model)


def term_overlap_candidates(query: str, docs: list[dict], n: int) -> list[tuple[str, str]]:
    """A BM25-like candidate list: the n documents sharing the most query terms (idf-weighted)."""
    terms = [set(d["contents"].lower().split()) for d in docs]
    df = Counter(t for doc_terms in terms for t in doc_terms)
    q_terms = set(query.lower().split())
    scores = [sum(np.log(len(docs) / df[t]) for t in q_terms & doc_terms) for doc_terms in terms]
    order = np.argsort(scores, kind="stable")[::-1][:n]
    return [(docs[i]["id"], docs[i]["contents"]) for i in order]


def test_reranker_reorders_candidates_with_exhaustive_scores(index_dir, model, data, exhaustive):
    docs, queries = data
    q = queries[3]["text"]
    candidates = term_overlap_candidates(q, docs, 20)
    reranker = AlignmentReranker(index_dir, encoder=model)
    reranked = reranker.rerank(q, candidates)
    full = exhaustive.scores([q])[0]
    want = sorted(((c[0], float(full[exhaustive.store.row_of(c[0])])) for c in candidates), key=lambda p: -p[1])
    assert_same_ranking(as_pairs(reranked), want)
    assert [h.docid for h in reranked] != [c[0] for c in candidates]
    assert [h.docid for h in reranker.rerank(q, [c[0] for c in candidates], k=5)] == [d for d, _ in want[:5]]

    from_text = AlignmentReranker(model).rerank(q, candidates)  # no index: every candidate encoded from its text
    assert [h.docid for h in from_text][:5] == [d for d, _ in want[:5]]
    assert np.allclose([h.score for h in from_text], [s for _, s in want], atol=2e-3)
    assert reranker.rerank("", candidates) == [] and reranker.rerank(q, []) == []


def test_reranker_mixes_stored_and_new_documents(index_dir, model, data):
    docs, queries = data
    q = queries[0]["text"]
    reranker = AlignmentReranker(index_dir, encoder=model)
    new = ("new-doc", docs[0]["contents"])  # same text as an indexed document, under an unknown docid
    hits = {h.docid: h.score for h in reranker.rerank(q, [docs[0]["id"], new, docs[1]["id"]])}
    assert set(hits) == {docs[0]["id"], "new-doc", docs[1]["id"]}
    assert abs(hits["new-doc"] - hits[docs[0]["id"]]) < 2e-3
    with pytest.raises(ValueError, match="candidate 'unknown' is not in the index and carries no text"):
        reranker.rerank(q, ["unknown"])


def test_reranker_takes_pyserini_lucene_hits(tmp_path, index_dir, model, data, exhaustive):
    from pyserini.search.lucene import LuceneSearcher

    from pyserini_aligner.bm25 import build_lucene_index
    from pyserini_aligner.data import Doc

    docs, queries = data
    build_lucene_index([Doc(d["id"], "", d["contents"]) for d in docs], tmp_path / "lucene", threads=1)
    q = queries[4]["text"]
    hits = LuceneSearcher(str(tmp_path / "lucene")).search(q, k=15)
    full = exhaustive.scores([q])[0]
    want = sorted(((h.docid, float(full[exhaustive.store.row_of(h.docid)])) for h in hits), key=lambda p: -p[1])
    assert_same_ranking(as_pairs(AlignmentReranker(index_dir, encoder=model).rerank(q, hits)), want)
    from_raw = AlignmentReranker(model, "top-k:1").rerank(q, hits)  # texts read from the hits' stored raw JSON
    assert np.allclose([h.score for h in from_raw], [s for _, s in want], atol=2e-3)


def test_pyserini_faiss_searcher_opens_aligner_index(variant, data):
    from pyserini.search.faiss import FaissSearcher

    _, folder, knobs, want = variant
    searcher = FaissSearcher(str(folder), "aligner")
    assert isinstance(searcher, AlignerSearcher)
    q = data[1][0]
    overlap = {h.docid for h in searcher.search(q["text"], k=10)} & {h.docid for h in want[q["id"]]}
    assert len(overlap) >= 9


def test_faiss_and_torch_backends_agree_on_the_default_index(default_index, model, data):
    """Default knobs on the compressed default index: both CPU backends return the same ranking, and it finds most
    of the exhaustive top 10."""
    queries, ids = [q["text"] for q in data[1]], [q["id"] for q in data[1]]
    runs = {backend: AlignerSearcher(default_index, encoder=model, backend=backend).batch_search(queries, ids, k=10)
            for backend in ("faiss", "torch")}
    want = ExhaustiveScorer(default_index, encoder=model).rank(queries, k=10)
    for qid, exact in zip(ids, want):
        assert_same_ranking(as_pairs(runs["torch"][qid]), as_pairs(runs["faiss"][qid]))
    overlap = [len({h.docid for h in runs["faiss"][qid]} & {d for d, _ in exact}) / 10 for qid, exact in zip(ids, want)]
    assert np.mean(overlap) >= 0.9


def test_two_segments_on_two_devices_rank_like_one(two_segment_index, model, data):
    """An index of two segments sharing one codec, spread over two (CPU) devices, ranks as on one device and as the
    FAISS backend does; the exhaustive scorer agrees with a deep search."""
    assert len(read_manifest(two_segment_index).segments) == 2
    queries, ids = [q["text"] for q in data[1]], [q["id"] for q in data[1]]
    two = AlignerSearcher(two_segment_index, encoder=model, backend="torch", devices=["cpu", "cpu"])
    assert two.engine.rows_held == [N_DOCS // 2, N_DOCS - N_DOCS // 2]
    runs = [two.batch_search(queries, ids, k=10)] + [
        AlignerSearcher(two_segment_index, encoder=model, backend=backend).batch_search(queries, ids, k=10)
        for backend in ("torch", "faiss")]
    for qid in ids:
        assert len(runs[0][qid]) == 10
        for other in runs[1:]:
            assert_same_ranking(as_pairs(runs[0][qid]), as_pairs(other[qid]))
    nlist = StoredIndex(two_segment_index).codec_spec.nlist
    deep = AlignerSearcher(two_segment_index, encoder=model, backend="torch", devices=["cpu", "cpu"], nprobe=nlist,
                           k_per_token=1000, max_candidates=N_DOCS).rank(queries[:4], k=10)
    for got, want in zip(deep, ExhaustiveScorer(two_segment_index, encoder=model).rank(queries[:4], k=10)):
        assert_same_ranking(got, want)
