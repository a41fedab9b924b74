"""The fixed-shape batch plan (what a CUDA graph replays) ranks exactly as the step-by-step search."""
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
from pyserini_aligner.search.graphs import StaticPlan, batch_bucket, width_bucket

N_QUERIES = 8


@pytest.fixture(scope="module")
def queries() -> list[str]:
    with zipfile.ZipFile(Path(os.environ["PYSERINI_ALIGNER_BEIR_DIR"]) / "scifact.zip") as archive:
        lines = archive.read("scifact/queries.jsonl").decode().splitlines()[:N_QUERIES]
    return [json.loads(line)["text"] for line in lines]


def static_rankings(searcher: AlignerSearcher, texts: list[str], k: int, filter=None,
                    spare: int = 1) -> list[list[tuple[str, float]]]:
    """``texts`` searched as one batch through a StaticPlan over one shard holding every segment, padded to the
    width bucket of the longest and to ``spare`` more rows of no real token (as a captured batch's rows past its
    texts); restricted by ``filter`` (docids): the plan's probes read the live rows it matches."""
    store = searcher.store
    shard = CodeShard(store, list(range(len(store.segments))), "cpu", searcher.refine_with)
    out = searcher.model.encode_padded(texts, is_query=True)
    width = width_bucket(out.vectors.shape[1], searcher.model.config.query_maxlen)
    pad = (0, width - out.vectors.shape[1], 0, spare)
    q = torch.nn.functional.pad(out.vectors.float(), (0, 0) + pad)
    q_mask = torch.nn.functional.pad(out.mask, pad)
    q_sal = torch.nn.functional.pad(out.salience.float(), pad, value=1.0)
    wanted = set(filter or ())
    allowed = None if filter is None else torch.tensor([d in wanted for d in store.docids]) & shard.allowed
    plan = StaticPlan(shard, len(q), width, searcher.depth(k, filter), k, searcher.query_prune, searcher.strategy,
                      searcher.use_salience, allowed)
    scores, rows = plan.run(q, q_mask, q_sal)
    assert (rows[len(texts):] == -1).all() and torch.isinf(scores[len(texts):]).all()
    return [[(store.docids[r], s) for r, s in zip(row.tolist(), score.tolist()) if r >= 0]
            for row, score in zip(rows[:len(texts)], scores[:len(texts)])]


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
        for got, want in zip(static_rankings(searcher, queries, k), searcher.rank(queries, k=k)):
            assert len(got) == len(want) > 0
            assert_same(got, want)
    # one query alone (the plan of a batch of one, padded to its own width) ranks as in the batch
    for text, want in zip(queries[:2], searcher.rank(queries[:2], k=5)):
        assert_same(static_rankings(searcher, [text], 5, spare=0)[0], want)


def test_static_plan_over_segments_with_deletions(two_segment_index, model, queries, tmp_path):
    """Two segments in one shard, and deleted documents (which the engine never returns) among the best hits."""
    folder = tmp_path / "index"
    shutil.copytree(two_segment_index, folder)
    searcher = AlignerSearcher(folder, encoder=model, backend="torch", interaction_candidates=64, max_candidates=16)
    gone = {hits[0][0] for hits in searcher.rank(queries, k=1)}
    AlignerIndex(folder, encoder=model).delete(sorted(gone))
    assert searcher.reopen()
    assert not StoredIndex(folder).live.all()
    for got, want in zip(static_rankings(searcher, queries, 10), searcher.rank(queries, k=10)):
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
        for got, want in zip(static_rankings(searcher, queries, k, chosen), searcher.rank(queries, k=k, filter=chosen)):
            assert len(got) == k and {d for d, _ in got} <= set(chosen)
            assert_same(got, want)


@pytest.mark.parametrize("refine_with", ["all", "kept"])
def test_plan_refines_through_the_kernel_as_padded(default_index, monkeypatch, refine_with):
    """The plan's top-k:1 refinement through the fused kernel (each candidate's own tokens) scores real candidates
    as the padded decoding and alignment_scores_grouped do, to float32 rounding, with and without saliences, and
    as the kernel's plain-torch reference does; a candidate not valid scores −inf."""
    pytest.importorskip("triton")
    from pyserini_aligner import kernels
    from pyserini_aligner.search.options import Depth
    from pyserini_aligner.strategy import parse_strategy

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        monkeypatch.setenv("PYSERINI_ALIGNER_TRITON", "interpret")
    kernels._refine_kernel.cache_clear()
    shard = CodeShard(StoredIndex(default_index), [0], device, refine_with)
    gen = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(3, 24, shard.centroids.shape[1], generator=gen), dim=-1)
    q_mask = torch.arange(24) < torch.tensor([[7], [24], [13]])
    q_sal = torch.rand(3, 24, generator=gen)
    rows = torch.randint(0, shard.num_rows, (3, 20), generator=gen) + shard.row_base
    valid = torch.rand(3, 20, generator=gen) > 0.1
    args = [t.to(device) for t in (q, q_mask, q_sal, rows, valid)]
    plan = StaticPlan(shard, 3, 24, Depth(10, 4, 0, 20), 5, 0.5, parse_strategy("top-k:1"), True)
    for sal in (None, args[2]):
        fused = plan._refine(args[0], args[1], sal, args[3], args[4]).cpu()
        monkeypatch.setenv("PYSERINI_ALIGNER_TRITON", "0")
        kernels._triton.cache_clear()
        try:
            padded = plan._refine(args[0], args[1], sal, args[3], args[4]).cpu()
        finally:
            monkeypatch.setenv("PYSERINI_ALIGNER_TRITON", "interpret" if device == "cpu" else "1")
            kernels._triton.cache_clear()
        kept = None if shard.kept is None else shard.kept.cpu()
        want = kernels.refine_maxsim_reference(q, q_mask, None if sal is None else q_sal, rows - shard.row_base,
                                               valid, shard.offsets.cpu(), kept, shard.token_ids.cpu(),
                                               shard.token_codes.cpu(), shard.centroids.cpu(), shard.token_books.cpu())
        assert torch.equal(torch.isinf(fused), ~valid) and torch.equal(torch.isinf(padded), ~valid)
        assert torch.allclose(fused[valid], padded[valid], rtol=0, atol=1e-6)
        assert torch.allclose(fused[valid], want[valid], rtol=0, atol=1e-6)
    kernels._refine_kernel.cache_clear()


def test_width_bucket():
    assert [width_bucket(n, 64) for n in (1, 16, 17, 24, 25, 32, 33, 48, 49, 64, 80)] == \
        [16, 16, 24, 24, 32, 32, 48, 48, 64, 64, 64]
    assert width_bucket(40, 40) == 40


def test_batch_bucket():
    assert [batch_bucket(n) for n in range(1, 14)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16]
    assert [batch_bucket(n) for n in (75, 96, 97, 300, 512)] == [96, 96, 128, 384, 512]
    assert all(batch_bucket(n) >= n and (batch_bucket(n) - n) * 3 < batch_bucket(n) + 3 for n in range(1, 600))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graphed_batches_rank_as_the_step_by_step_search_on_a_gpu(default_index, queries):
    """On a GPU, batches of 1, 3 and 8 queries, and a filtered batch, go through the captured plans: the same
    documents as the step-by-step search behind them (float16 products summed in another order may swap near-ties:
    scores of the documents both find agree to 2e-3)."""
    from pyserini_aligner.search.backends.fronts import Graphed

    searcher = AlignerSearcher(default_index, device="cuda", backend="torch")
    front = searcher.front
    assert isinstance(front, Graphed) and front.plan.largest_batch(searcher.depth(10, None), 10) >= len(queries)
    chosen = searcher.docids[::3]
    cases = [(queries[:1], None), (queries[:3], None), (queries, None), (queries[:3], chosen)]
    graphed = [searcher.rank(texts, k=10, filter=flt) for texts, flt in cases]
    assert {key[0] for key in front.plan.graphs} == {1, 3, 8}  # the batch buckets captured
    searcher.front = front.rest
    for (texts, flt), got in zip(cases, graphed):
        for mine, theirs in zip(got, searcher.rank(texts, k=10, filter=flt)):
            scores = dict(theirs)
            assert len(mine) == len(theirs) == 10 and len(set(scores) & {d for d, _ in mine}) >= 9
            assert all(abs(score - scores[d]) < 2e-3 for d, score in mine if d in scores)
            assert flt is None or {d for d, _ in mine} <= set(flt)
