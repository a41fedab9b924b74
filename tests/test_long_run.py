"""The exact (fp16, flat) search path: its token search equals FAISS's without calling FAISS's bundled OpenBLAS, and
a run of many long queries through the harness's search, in one process with Pyserini's JVM, completes."""
import json
import subprocess
import sys
from pathlib import Path

import faiss
import numpy as np
import pytest

from pyserini_aligner.search.flat import flat_search, flat_vectors, search_index

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("count, k", [(5000, 10), (5000, 2000), (300, 1000), (1, 3)])
def test_flat_search_equals_faiss(count, k):
    rng = np.random.default_rng(count + k)
    vectors = rng.standard_normal((count, 32)).astype(np.float32)
    probes = rng.standard_normal((70, 32)).astype(np.float32)
    index = faiss.IndexFlatIP(32)
    index.add(vectors)
    expected_scores, expected_labels = index.search(probes, k)
    scores, labels = search_index(index, probes, k)
    found = labels >= 0
    assert (found == (expected_labels >= 0)).all() and found.sum(1).tolist() == [min(k, count)] * 70
    assert np.allclose(scores[found], expected_scores[found], atol=1e-5)  # best first, as FAISS's
    exact = probes.astype(np.float64) @ vectors.T.astype(np.float64)
    for row in range(len(probes)):  # the k best (up to float rounding: another BLAS may swap near-ties)
        best = np.sort(exact[row])[::-1][:min(k, count)]
        assert np.allclose(np.sort(exact[row, labels[row, found[row]]])[::-1], best, atol=1e-5)
        assert len(set(labels[row, found[row]].tolist())) == min(k, count)
    assert np.isneginf(scores[~found]).all()
    assert flat_vectors(index).base is not None  # the index's own memory, not a copy


def test_flat_search_breaks_ties_as_faiss():
    vectors = np.ones((6, 4), dtype=np.float32)
    index = faiss.IndexFlatIP(4)
    index.add(vectors)
    probes = np.ones((2, 4), dtype=np.float32)
    assert flat_search(vectors, probes, 3)[1].tolist() == index.search(probes, 3)[1].tolist()


def test_other_faiss_indexes_are_searched_by_faiss():
    rng = np.random.default_rng(0)
    index = faiss.index_factory(16, "HNSW8", faiss.METRIC_INNER_PRODUCT)
    index.add(rng.standard_normal((200, 16)).astype(np.float32))
    probes = rng.standard_normal((3, 16)).astype(np.float32)
    assert flat_vectors(index) is None
    assert np.array_equal(search_index(index, probes, 5)[1], index.search(probes, 5)[1])


def test_long_queries_through_the_harness_search_with_the_jvm(tmp_path):
    """python -m eval.bench_long_run: 300 queries of 64 tokens, one process, the JVM running throughout."""
    done = subprocess.run([sys.executable, "-m", "eval.bench_long_run", "--queries", "300", "--hits", "100",
                           "--work", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout[done.stdout.index("{"):])
    assert report["queries"] == 300 and report["queries_without_hits"] == 0
    assert report["jvm_running"] and report["index_type"] == "Flat"


def test_compressed_probe_matches_faiss_search(tmp_path, model, monkeypatch):
    """A compressed index's probe: the coarse step on torch's BLAS, the memory-mapped lists scanned by FAISS (kept
    loaded for a small index, else a part of the probes at a time and released), as FAISS's own IndexIVFPQ.search
    over all the lists in memory gives it, also with deleted documents and with the probes split into parts."""
    import torch

    from pyserini_aligner.index import build_index, read_json_collection
    from pyserini_aligner.index.live import AlignerIndex
    from pyserini_aligner.search import AlignerSearcher
    from pyserini_aligner.search.allowed import allowed_rows, row_selector
    from pyserini_aligner.search.backends import faiss_cpu
    from pyserini_aligner.search.backends.faiss_cpu import LOADED_ENTRIES

    index_dir = tmp_path / "idx"
    build_index(read_json_collection(REPO / "examples" / "quickstart" / "corpus"), index_dir, model, progress=False,
                model_name="aligner")
    AlignerIndex(index_dir).delete(["4983"])
    probes = torch.from_numpy(np.random.default_rng(0).standard_normal((40, model.config.dim))
                              .astype(np.float32))
    for loaded in (LOADED_ENTRIES, 1):  # 1: a part of the probes at a time
        monkeypatch.setattr(faiss_cpu, "LOADED_ENTRIES", loaded)
        searcher = AlignerSearcher(index_dir, encoder=model)
        store = searcher.store
        whole = store.codec.faiss_index([(seg.ivf_offsets, np.asarray(seg.ivf_docs, dtype=np.int64) + base,
                                          seg.ivf_codes) for seg, base in zip(store.segments, store.row_base)])
        assert whole.ntotal == sum(seg.info.num_kept for seg in store.segments) > 0
        for per_token, nprobe in ((5, 1), (50, 4), (200, store.codec_spec.nlist)):
            scores, labels = searcher.engine.probe(probes, per_token, nprobe)
            params = faiss.SearchParametersIVF(nprobe=nprobe, sel=row_selector(allowed_rows(store)))
            expected_scores, expected_labels = whole.search(probes.numpy(), per_token, params=params)
            assert np.array_equal(labels.numpy(), expected_labels)
            assert np.array_equal(scores.numpy(), expected_scores)
        held = searcher.engine.index.ntotal
        assert held == searcher.engine.index.invlists.compute_ntotal() == (whole.ntotal if loaded > 1 else 0)
