"""eval.sweeps on the 150-document SciFact folder (reusing the harness's cache) and derive_pruned_index."""
import json

import numpy as np
import pytest

from harness_support import harness_context, harness_run

from eval.sweeps.__main__ import main
from eval.sweeps.run import index_bytes
from pyserini_aligner.index.derive import derive_pruned_index
from pyserini_aligner.index.reader import StoredIndex
from pyserini_aligner.salience import keep_count


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory, scifact_small):
    _, cache, results = harness_run(tmp_path_factory, scifact_small)
    output = tmp_path_factory.mktemp("sweeps")
    # a reduced grid; the alignment sweep reuses the harness's aligner run and rescored runs from the cache
    assert main(["--dataset", str(scifact_small), "--output", str(output), "--cache", str(cache), "--quiet",
                 "--doc-prunes", "1", "0.2", "--query-prunes", "1", "0.5"]) == 0
    return output, json.loads((output / "sweeps.json").read_text()), results


def test_sweep_outputs(sweeps):
    output, data, harness = sweeps
    ndcg = data["alignment"]["ndcg@10"]
    assert list(ndcg) == ["top-k:1", "top-k:2", "top-k:4", "top-k:6", "top-k:8",
                          "top-p:0.005", "top-p:0.01", "top-p:0.015", "top-p:0.02"]
    assert ndcg["top-k:1"] == harness["systems"]["aligner"]["ndcg@10"]
    assert ndcg == harness["systems"]["aligner-adapted"]["scores"]["aligner"]
    rows = {(r["doc_prune"], r["query_prune"]): r for r in data["pruning"]}
    assert set(rows) == {(1.0, 1.0), (1.0, 0.5), (0.2, 1.0), (0.2, 0.5)}
    assert data["pruning_hits"] == 100 and all(0.5 < r["ndcg@10"] <= 1.0 for r in rows.values())
    full, pruned = rows[(1.0, 1.0)], rows[(0.2, 1.0)]
    assert pruned["num_kept"] < 0.25 * full["num_kept"]
    assert pruned["faiss_bytes_per_doc"] < 0.25 * full["faiss_bytes_per_doc"]
    assert pruned["store_bytes_per_doc"] == full["store_bytes_per_doc"]  # refinement keeps every token
    manifest_bytes = full["total_bytes_per_doc"] - full["faiss_bytes_per_doc"] - full["store_bytes_per_doc"]
    assert 0 < manifest_bytes < 0.001 * full["total_bytes_per_doc"]  # the rest is the manifest
    md = (output / "sweeps.md").read_text()
    assert "| top-k 1 |" in md and "top-p 1.5%" in md and "| 0.2 | 0.5 |" in md
    assert (output / "sweeps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_derive_pruned_index(tmp_path_factory, scifact_small):
    from eval.beir.aligner import full_index

    _, cache, _ = harness_run(tmp_path_factory, scifact_small)
    source = StoredIndex(full_index(harness_context(scifact_small, cache)))
    target = tmp_path_factory.mktemp("derived") / "d0.4"
    manifest = derive_pruned_index(source.index_dir, target, 0.4, prune_redundancy=None)
    derived = StoredIndex(target)
    assert manifest.doc_prune == 0.4 and derived.manifest.num_kept == manifest.num_kept
    assert manifest.prune_redundancy is None
    assert manifest.model_fingerprint == source.manifest.model_fingerprint
    kept_per_doc = np.add.reduceat(np.asarray(derived.kept, dtype=np.int64), derived.offsets[:-1])
    assert kept_per_doc.tolist() == [keep_count(int(n), 0.4) for n in derived.lengths]
    for row in range(3):  # each document keeps its most salient tokens
        doc = np.arange(derived.offsets[row], derived.offsets[row + 1])
        salience, kept = derived.token_salience(doc), derived.kept[doc]
        assert kept.any() and (kept.all() or salience[kept].min() >= salience[~kept].max())
    assert len(derived.segments) == len(source.segments)
    for mine, theirs in zip(derived.segments, source.segments):
        assert np.array_equal(mine.vectors, theirs.vectors)  # not re-encoded
    assert sum(segment.faiss_index().ntotal for segment in derived.segments) == manifest.num_kept
    assert not any(p.name.startswith(".") for p in target.parent.iterdir())  # no temporary folder left
    with pytest.raises(ValueError, match="doc_prune"):
        derive_pruned_index(source.index_dir, target.parent / "bad", 0.0)
    with pytest.raises(FileExistsError):
        derive_pruned_index(source.index_dir, target, 0.2)


def test_index_bytes(tmp_path):
    (tmp_path / "faiss.index").write_bytes(b"x" * 100)
    (tmp_path / "faiss_ids.i64").write_bytes(b"x" * 8)
    (tmp_path / "seg-000001-0a0b0c0d").mkdir()
    (tmp_path / "seg-000001-0a0b0c0d" / "doc_vectors.f16").write_bytes(b"x" * 50)
    (tmp_path / "manifest.json").write_bytes(b"x" * 7)  # in the total only
    assert index_bytes(tmp_path) == {"faiss": 108, "store": 50, "total": 165}
