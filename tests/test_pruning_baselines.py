"""eval.experiments.pruning_baselines on the 150-doc SciFact folder: every method × β^d derived, searched and tabulated."""
import json

import numpy as np
import pytest

from harness_support import harness_run

from pyserini_aligner.index.format import SALIENCE, VECTORS
from pyserini_aligner.index.reader import StoredIndex


def test_pruning_baselines_table(tmp_path, tmp_path_factory, scifact_small):
    from eval.experiments.pruning_baselines import main

    # the index cache of tests/harness_support.py, once the harness has built it (its full and learned-pruned
    # indexes are reused; the other methods' indexes are this test's own)
    _, cache, _ = harness_run(tmp_path_factory, scifact_small)
    out = tmp_path / "out"
    assert main(["--dataset", str(scifact_small), "--output", str(out), "--cache", str(cache), "--betas", "0.2",
                 "--query-prunes", "0.5", "--seeds", "0", "1", "--redundancy", "off", "0.9", "--quiet"]) == 0
    result = json.loads((out / "pruning_baselines.json").read_text())
    methods = [(r["beta_d"], r["redundancy"], r["method"], r["seed"]) for r in result["rows"]]
    assert methods == [(1.0, None, "full", None)] + [
        (0.2, rule, method, seed) for rule in (None, 0.9)
        for method, seed in [("learned", None), ("random", 0), ("random", 1), ("idf", None), ("first", None)]]
    for row in result["rows"]:
        assert 0.0 < row["ndcg@10 beta_q=0.5"] <= 1.0 and 0.0 < row["overlap@10 beta_q=0.5"] <= 1.0
    assert result["rows"][0]["overlap@10 beta_q=0.5"] > 0.9  # the unpruned index nearly matches exhaustive scoring
    pruned = [r for r in result["rows"] if r["beta_d"] == 0.2]
    assert len({r["faiss_bytes_per_doc"] for r in pruned}) == 1  # same kept-token count whatever the method
    assert pruned[0]["faiss_bytes_per_doc"] < result["rows"][0]["faiss_bytes_per_doc"]
    seeds = [r["ndcg@10 beta_q=0.5"] for r in pruned if r["method"] == "random" and r["redundancy"] is None]
    table = (out / "pruning_baselines.md").read_text()
    assert "| 0.2 | off | idf |" in table and "| 0.2 | 0.9 | learned |" in table and "nDCG@10 β^q=0.5" in table
    assert f"| 0.2 | off | random | {np.mean(seeds):.4f} ± {np.std(seeds, ddof=1):.4f} (2 seeds) |" in table

    work = next(p for p in cache.iterdir() if p.is_dir())
    # the cache also holds other checkpoints' exact indexes (aligner-adapted): the full index is the one the
    # baselines derived from
    full = next(p for p in work.iterdir() if p.name.startswith("aligner-") and (work / f"{p.name}-sal-idf").is_dir())
    idf = StoredIndex(work / f"{full.name}-sal-idf")
    source = StoredIndex(full)
    for seg, full_seg in zip(idf.segments, source.segments):
        assert (seg.folder / VECTORS).stat().st_ino == (full_seg.folder / VECTORS).stat().st_ino  # linked, not copied
        assert (seg.folder / SALIENCE).stat().st_ino != (full_seg.folder / SALIENCE).stat().st_ino
    assert not np.allclose(idf.token_salience(np.arange(20)), source.token_salience(np.arange(20)))
    idf.verify()  # the replaced salience files match their manifest records
    source.verify()  # and the full index's files are untouched
    first_doc = idf.token_salience(np.arange(idf.offsets[0], idf.offsets[1]))
    assert first_doc[0] == pytest.approx(0.0, abs=1e-6) and first_doc.max() > 1.0  # [CLS] is in every doc: idf 0
    assert StoredIndex(work / f"{full.name}-sal-idf-d0.2-r0.9").manifest.prune_redundancy == 0.9
    first = StoredIndex(work / f"{full.name}-sal-first-d0.2")
    kept = np.asarray(first.kept[first.offsets[0]:first.offsets[1]])
    assert kept[:kept.sum()].all() and not kept.all()  # the first tokens
    salience_bytes = sum((s.folder / SALIENCE).stat().st_size
                         for s in StoredIndex(work / f"{full.name}-sal-first").segments)
    assert salience_bytes == 4 * idf.manifest.num_tokens
