"""The fixed-shape single-query plan (what a CUDA graph replays) ranks exactly as the step-by-step search."""
from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from pyserini_aligner.index.live import AlignerIndex
from pyserini_aligner.index.reader import StoredIndex
from pyserini_aligner.search import AlignerSearcher
from pyserini_aligner.search.codes import CodeShard
from pyserini_aligner.search.graphs import StaticPlan, width_bucket

N_QUERIES = 8


@pytest.fixture(scope="module")
def queries() -> list[str]:
    with zipfile.ZipFile(Path(os.environ["PYSERINI_ALIGNER_BEIR_DIR"]) / "scifact.zip") as archive:
        lines = archive.read("scifact/queries.jsonl").decode().splitlines()[:N_QUERIES]
    return [json.loads(line)["text"] for line in lines]


def static_ranking(searcher: AlignerSearcher, text: str, k: int, filter=None) -> list[tuple[str, float]]:
    """``text`` searched through a StaticPlan over one shard holding every segment, padded to its width bucket;
    restricted by ``filter`` (docids): the plan's probes read the live rows it matches."""
    store = searcher.store
    shard = CodeShard(store, list(range(len(store.segments))), "cpu", searcher.refine_with)
    out = searcher.model.encode_padded([text], is_query=True)
    width = width_bucket(out.vectors.shape[1], searcher.model.config.query_maxlen)
    pad = width - out.vectors.shape[1]
    q = torch.nn.functional.pad(out.vectors[0].float(), (0, 0, 0, pad))
    q_mask = torch.nn.functional.pad(out.mask[0], (0, pad))
    q_sal = torch.nn.functional.pad(out.salience[0].float(), (0, pad))
    wanted = set(filter or ())
    allowed = None if filter is None else torch.tensor([d in wanted for d in store.docids]) & shard.allowed
    plan = StaticPlan(shard, width, searcher.depth(k, filter), k, searcher.query_prune, searcher.strategy,
                      searcher.use_salience, allowed)
    scores, rows = plan.run(q, q_mask, q_sal)
    return [(store.docids[r], s) for r, s in zip(rows.tolist(), scores.tolist()) if r >= 0]


def assert_same(got: list[tuple[str, float]], want: list[tuple[str, float]]) -> None:
    assert [d for d, _ in got] == [d for d, _ in want]
    assert np.allclose([s for _, s in got], [s for _, s in want], atol=1e-5)


@pytest.mark.parametrize("knobs", [
    {"k_per_token": 20, "nprobe": 4, "max_candidates": 16, "interaction_candidates": 64},
    {"k_per_token": 50, "nprobe": 2, "max_candidates": 30, "interaction_candidates": 0},
    {"k_per_token": 10, "nprobe": 8, "max_candidates": 8, "interaction_candidates": 40, "strategy": "top-p:0.02"},
    {"k_per_token": 20, "nprobe": 4, "max_candidates": 16, "interaction_candidates": 64, "refine_with": "kept",
     "query_prune": 1.0},
])
def test_static_plan_ranks_as_the_engine(default_index, model, queries, knobs):
    searcher = AlignerSearcher(default_index, encoder=model, backend="torch", **knobs)
    for k in (5, 40):
        for text, want in zip(queries, searcher.rank(queries, k=k)):
            got = static_ranking(searcher, text, k)
            assert len(got) == len(want) > 0
            assert_same(got, want)


def test_static_plan_over_segments_with_deletions(two_segment_index, model, queries, tmp_path):
    """Two segments in one shard, and deleted documents (which the engine never returns) among the best hits."""
    folder = tmp_path / "index"
    shutil.copytree(two_segment_index, folder)
    searcher = AlignerSearcher(folder, encoder=model, backend="torch", interaction_candidates=64, max_candidates=16)
    gone = {hits[0][0] for hits in searcher.rank(queries, k=1)}
    AlignerIndex(folder, encoder=model).delete(sorted(gone))
    assert searcher.reopen()
    assert not StoredIndex(folder).live.all()
    for text, want in zip(queries, searcher.rank(queries, k=10)):
        got = static_ranking(searcher, text, 10)
        assert not gone & {d for d, _ in got}
        assert_same(got, want)


def test_static_plan_probes_a_filter_as_the_engine(default_index, model, queries):
    """A filtered search that probes (its matches outnumber the depth it refines) ranks through the plan, the
    filter's rows in the plan's buffer, as step by step; its hits are the filter's."""
    searcher = AlignerSearcher(default_index, encoder=model, backend="torch", k_per_token=20, max_candidates=8,
                               interaction_candidates=40)
    chosen = searcher.docids[::2]
    for k in (1, 5):
        assert not searcher.depth(k, chosen).every_row
        for text, want in zip(queries, searcher.rank(queries, k=k, filter=chosen)):
            got = static_ranking(searcher, text, k, chosen)
            assert len(got) == k and {d for d, _ in got} <= set(chosen)
            assert_same(got, want)


def test_width_bucket():
    assert [width_bucket(n, 64) for n in (1, 16, 17, 32, 33, 64, 80)] == [16, 16, 32, 32, 64, 64, 64]
