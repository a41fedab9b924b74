"""The 384-d checkpoint end to end: ``aligner-384`` (the backbone's own token space) builds an index with the
defaults (codec auto with 96-byte residuals, β^d pruning), both CPU backends search it as exhaustive scoring of the
same index does, live additions and deletions rank as a rebuild, and torchrun builds the same index as one
process."""
import shutil
from pathlib import Path

import numpy as np
import pytest

from pyserini_aligner.index import StoredIndex, build_index, read_json_collection, read_manifest
from pyserini_aligner.index.live import AlignerIndex
from pyserini_aligner.model import AlignerModel
from pyserini_aligner.search import AlignerSearcher, ExhaustiveScorer

from conftest import assert_same_ranking
from test_distributed import same_index, torchrun
from test_index import short_records, write_jsonl

N_DOCS, N_ADDED, WORDS = 48, 8, 40
QUERIES = ["protein folding in cells", "cancer risk and diet", "gene expression of neurons",
           "bacterial infection treatment", "vitamin D and bone density"]


@pytest.fixture(scope="module")
def wide() -> AlignerModel:
    model = AlignerModel.from_pretrained("aligner-384")
    assert model.config.dim == 384
    return model


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return short_records(N_DOCS + N_ADDED, words=WORDS)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, records) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("wide") / "docs.jsonl", records[:N_DOCS])


@pytest.fixture(scope="module")
def wide_index(tmp_path_factory, wide, corpus) -> Path:
    """The corpus indexed with build_index's defaults by the 384-d checkpoint."""
    target = tmp_path_factory.mktemp("wide_index") / "idx"
    build_index(read_json_collection(corpus), target, wide, progress=False, model_name="aligner-384")
    return target


def ranking(index: Path, model: AlignerModel, **knobs) -> dict[str, list[tuple[str, float]]]:
    """Each query's top 10 as (docid, score) through the searcher, every list probed and every document a
    candidate."""
    nlist = StoredIndex(index).codec_spec.nlist
    searcher = AlignerSearcher(index, encoder=model, k_per_token=1000, max_candidates=N_DOCS + N_ADDED, nprobe=nlist,
                               **knobs)
    hits = searcher.batch_search(QUERIES, [f"q{i}" for i in range(len(QUERIES))], k=10)
    return {qid: [(h.docid, h.score) for h in found] for qid, found in hits.items()}


def exhaustive(index: Path, model: AlignerModel) -> dict[str, list[tuple[str, float]]]:
    hits = ExhaustiveScorer(index, encoder=model).batch_search(QUERIES, [f"q{i}" for i in range(len(QUERIES))], k=10)
    return {qid: [(h.docid, h.score) for h in found] for qid, found in hits.items()}


def test_the_defaults_store_two_bits_a_dimension(wide_index):
    manifest = read_manifest(wide_index)
    stored = StoredIndex(wide_index)
    assert manifest.model_name == "aligner-384" and manifest.dim == 384 and manifest.num_docs == N_DOCS
    assert stored.codec_spec.refine_m == 96 and str(manifest.codec).endswith("PQ4,Refine(PQ96)")
    assert 0 < stored.kept.sum() < stored.offsets[-1]  # pruned: β^d keeps a share of the tokens


@pytest.mark.parametrize("backend", ["faiss", "torch"])
def test_search_equals_exhaustive_scoring_of_the_same_index(wide_index, wide, backend):
    got, want = ranking(wide_index, wide, backend=backend), exhaustive(wide_index, wide)
    assert list(got) == list(want)
    for qid in want:
        assert_same_ranking(got[qid], want[qid], atol=1e-5, rtol=1e-5)


def test_live_additions_and_deletions_rank_as_a_rebuild(tmp_path, wide_index, wide, records):
    index = tmp_path / "live"
    shutil.copytree(wide_index, index)
    added = [(r["id"], r["contents"]) for r in records[N_DOCS:]]
    gone = [r["id"] for r in records[:N_DOCS:6]]
    live = AlignerIndex(index, encoder=wide)
    live.add(added)
    report = live.delete(gone)
    assert (report.deleted, report.unknown) == (len(gone), [])
    reference = tmp_path / "reference"
    build_index([(r["id"], r["contents"]) for r in records if r["id"] not in gone], reference, wide, progress=False,
                model_name="aligner-384", codec_from=wide_index)
    ours, theirs = ranking(index, wide), ranking(reference, wide)
    assert ours == theirs
    assert not any(docid in gone for hits in ours.values() for docid, _ in hits)
    found = AlignerSearcher(index, encoder=wide).search(added[0][1], k=1)
    assert found[0].docid == added[0][0]  # an added passage is its own best match


def test_torchrun_builds_the_index_of_one_process(tmp_path, wide_index, corpus, wide):
    target = tmp_path / "dist"
    result = torchrun("pyserini_aligner.index", "--corpus", corpus, "--index", target, "--encoder", "aligner-384",
                      "--codec-from", wide_index, "--dist-timeout", "60")
    assert result.returncode == 0, result.stderr[-6000:]
    assert [s.num_docs for s in read_manifest(target).segments] == [N_DOCS // 2, N_DOCS // 2]
    same_index(wide_index, target)
    assert ranking(target, wide) == ranking(wide_index, wide)
    assert np.array_equal(StoredIndex(target).kept, StoredIndex(wide_index).kept)
