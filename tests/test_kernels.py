"""Triton kernels against their plain-torch references, through Triton's CPU interpreter (skipped without Triton)."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")


@pytest.fixture()
def interpreted(monkeypatch):
    from pyserini_aligner import kernels

    if not torch.cuda.is_available():
        monkeypatch.setenv("PYSERINI_ALIGNER_TRITON", "interpret")
    kernels._interaction_kernel.cache_clear()
    kernels._nearest_kernel.cache_clear()
    kernels._probe_kernel.cache_clear()
    kernels._decode_kernel.cache_clear()
    kernels._refine_kernel.cache_clear()
    yield kernels
    kernels._interaction_kernel.cache_clear()
    kernels._nearest_kernel.cache_clear()
    kernels._probe_kernel.cache_clear()
    kernels._decode_kernel.cache_clear()
    kernels._refine_kernel.cache_clear()


def test_interaction_kernel_matches_reference(interpreted):
    kernels = interpreted
    torch.manual_seed(0)
    batch, nlist, npad, docs = 3, 50, 16, 40
    lengths = torch.randint(0, 9, (docs,))
    lengths[3] = 0  # a document without tokens scores −inf
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    token_ids = torch.randint(0, nlist, (int(offsets[-1]),), dtype=torch.int16)
    table = torch.randn(batch, nlist, npad).half()
    rows = torch.randint(0, docs, (batch, 37))
    rows[0, 0] = 3
    valid = torch.rand(batch, 37) > 0.2
    valid[0, 0] = True
    q_mask = torch.zeros(batch, npad, dtype=torch.bool)
    q_mask[:, :5] = True
    q_mask[1, :12] = True
    got = kernels.interaction(table, rows, valid, offsets, token_ids, q_mask, block=8)
    want = kernels.interaction_reference(table, rows, valid, offsets, token_ids, q_mask)
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and bool(torch.isinf(got[0, 0]))
    assert torch.allclose(got[torch.isfinite(got)], want[torch.isfinite(want)], atol=1e-5)


def test_nearest_kernel_matches_reference(interpreted):
    """The fused nearest-centroid kernel picks the reference's centroid: over several blocks of rows and of
    centroids, a ragged last block of each, and a tie (two equal centroids: the lower index wins)."""
    kernels = interpreted
    torch.manual_seed(0)
    x = torch.nn.functional.normalize(torch.randn(70, 32), dim=-1)
    centroids = torch.nn.functional.normalize(torch.randn(45, 32), dim=-1)
    centroids[30] = centroids[7]
    x[3] = centroids[7]
    got = kernels.nearest(x, centroids, block_n=16, block_k=16)
    want = kernels.nearest_reference(x, centroids)
    assert got.dtype == torch.int64 and int(got[3]) == 7
    scores = x.half().float() @ centroids.half().float().T
    picked = scores.gather(1, got[:, None])[:, 0]
    assert torch.all(picked >= scores.max(1).values - 1e-3)  # float32 sums in another order: near-ties may differ
    assert (got == want).float().mean() > 0.95


def test_probe_kernel_matches_reference(interpreted):
    """Entry scores of the probed lists, packed list after list, equal the reference's to the bit: an empty list, a
    dead document, a probe that is not valid, probes with more entries than the width and with fewer."""
    kernels = interpreted
    torch.manual_seed(1)
    nlist, m, docs = 6, 4, 30
    lengths = torch.tensor([5, 0, 12, 3, 9, 20])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    codes = torch.randint(0, 256, (int(offsets[-1]), m), dtype=torch.uint8)
    ivf_docs = torch.randint(0, docs, (int(offsets[-1]),), dtype=torch.int32)
    live = torch.ones(docs, dtype=torch.bool)
    live[int(ivf_docs[0])] = False
    lut = torch.randn(4, m * 256)
    cval = torch.randn(4, 3)
    cidx = torch.tensor([[2, 1, 5], [5, 4, 3], [0, 1, 2], [1, 3, 0]])  # 32, 32, 17 (not valid) and 8 entries
    valid = torch.tensor([True, True, False, True])
    for width in (40, 20):
        got = kernels.probe_entries(lut, cval, cidx, offsets, codes, ivf_docs, live, valid, width, block=8)
        want = kernels.probe_entries_reference(lut, cval, cidx, offsets, codes, ivf_docs, live, valid, width)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert int(torch.isfinite(want[0]).sum()) > 40
        assert not bool(torch.isfinite(got[0][2]).any())  # the probe that is not valid finds nothing
    assert torch.equal(got[0][0, :12], want[0][0, :12]) and bool(torch.isfinite(got[0][0, 12:17]).all())
    assert not bool(torch.isfinite(got[0][3, 8:]).any())  # past the probe's last entry


def test_decode_kernel_matches_reference(interpreted):
    """Decoded tokens equal the reference's (centroid ids past 32,767 stored as negative int16): centroid + residual
    at unit length, zeros where not kept, at a width that is not a power of two."""
    kernels = interpreted
    torch.manual_seed(2)
    nlist, r, sub, n = 40000, 6, 4, 50
    centroids = torch.randn(nlist, r * sub)
    books = torch.randn(r, 256, sub)
    ids = torch.randint(0, nlist, (n,)).to(torch.int16)  # stored as uint16: wraps past 32,767
    ids[0] = torch.tensor(39999).to(torch.int16)
    codes = torch.randint(0, 256, (n, r), dtype=torch.uint8)
    positions = torch.randint(0, n, (70,))
    positions[0] = 0
    keep = torch.rand(70) > 0.3
    keep[0] = True
    got = kernels.decode_tokens(positions, keep, ids, codes, centroids, books, block=16)
    want = kernels.decode_tokens_reference(positions, keep, ids, codes, centroids, books)
    assert torch.allclose(got, want, rtol=0, atol=1e-6) and torch.equal(got[~keep], torch.zeros_like(got[~keep]))
    raw = centroids[39999] + books[torch.arange(r), codes[0].long()].reshape(-1)
    assert torch.allclose(got[0], raw / raw.norm(), rtol=0, atol=1e-6)


def test_refine_kernel_matches_reference(interpreted):
    """MaxSim scores of candidates decoded token by token equal the reference's: documents of lengths around and
    past the block (none a multiple of it but 16), one without tokens (0) and one whose tokens are all dropped by
    ``kept`` (0), candidates not valid (−inf), with and without saliences, queries of more tokens than the lanes
    taken at once (a width that is not a multiple of them) and a query of none (0), at a dimension that is not a
    power of two."""
    kernels = interpreted
    torch.manual_seed(3)
    nlist, r, sub = 40000, 6, 4
    centroids, books = torch.randn(nlist, r * sub), torch.randn(r, 256, sub)
    lengths = torch.tensor([0, 1, 15, 16, 17, 33, 5, 40, 3, 31])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    ids = torch.randint(0, nlist, (int(offsets[-1]),)).to(torch.int16)  # stored as uint16: wraps past 32,767
    codes = torch.randint(0, 256, (int(offsets[-1]), r), dtype=torch.uint8)
    kept = torch.rand(int(offsets[-1])) > 0.3
    kept[offsets[8]:offsets[9]] = False
    q = torch.nn.functional.normalize(torch.randn(4, 20, r * sub), dim=-1)
    q_mask = torch.zeros(4, 20, dtype=torch.bool)
    q_mask[0, :5], q_mask[1], q_mask[2, :17] = True, True, True
    q_sal = torch.rand(4, 20)
    rows = torch.randint(0, len(lengths), (4, 9))
    rows[0, :3] = torch.tensor([0, 8, 7])
    valid = torch.rand(4, 9) > 0.2
    valid[0, :3], valid[3, 0] = True, True
    for keep in (None, kept):
        for sal in (None, q_sal):
            got = kernels.refine_maxsim(q, q_mask, sal, rows, valid, offsets, keep, ids, codes, centroids, books,
                                        block=16, lanes=16)
            want = kernels.refine_maxsim_reference(q, q_mask, sal, rows, valid, offsets, keep, ids, codes, centroids,
                                                   books)
            assert torch.equal(torch.isinf(got), ~valid) and torch.equal(torch.isinf(want), ~valid)
            assert torch.allclose(got[valid], want[valid], rtol=0, atol=1e-6)
            assert float(got[0, 0]) == 0.0 and (keep is None or float(got[0, 1]) == 0.0)
            assert torch.equal(got[3][valid[3]], torch.zeros_like(got[3][valid[3]]))  # a query of no real token
            assert bool((got[:3][valid[:3]] != 0).sum() > valid[:3].sum() // 2)


def test_code_shard_decodes_alike_with_and_without_the_kernel(default_index, interpreted, monkeypatch):
    """CodeShard.decode through the kernel equals its torch operations (to rounding: the two sum a vector's squares
    in different orders to scale it to unit length), with and without a mask."""
    from pyserini_aligner.index.reader import StoredIndex
    from pyserini_aligner.search.codes import CodeShard

    shard = CodeShard(StoredIndex(default_index), [0], "cpu")
    positions = torch.randint(0, len(shard.token_ids), (4, 30), generator=torch.Generator().manual_seed(0))
    mask = torch.rand(4, 30, generator=torch.Generator().manual_seed(1)) < 0.7
    with_kernel = shard.decode(positions), shard.decode(positions, mask)
    monkeypatch.setenv("PYSERINI_ALIGNER_TRITON", "0")
    interpreted._triton.cache_clear()
    try:
        plain = shard.decode(positions), shard.decode(positions, mask)
    finally:
        interpreted._triton.cache_clear()
    for kernel_out, plain_out in zip(with_kernel, plain):
        assert torch.allclose(kernel_out, plain_out, rtol=0, atol=1e-6)
    assert torch.equal(with_kernel[1][~mask], torch.zeros_like(with_kernel[1][~mask]))


def test_engine_ranks_alike_with_and_without_kernels(default_index, model, interpreted, monkeypatch):
    """The torch backend's centroid-interaction stage through the kernel ranks as through plain torch."""
    from pyserini_aligner.search import AlignerSearcher

    queries = ["coronavirus transmission in hospitals", "gene expression of tumour cells", "vitamin D deficiency"]
    knobs = dict(encoder=model, backend="torch", k_per_token=20, nprobe=4, max_candidates=16, interaction_candidates=64)
    with_kernel = AlignerSearcher(default_index, **knobs).rank(queries, k=10)
    monkeypatch.setenv("PYSERINI_ALIGNER_TRITON", "0")
    interpreted._triton.cache_clear()
    try:
        plain = AlignerSearcher(default_index, **knobs).rank(queries, k=10)
    finally:
        interpreted._triton.cache_clear()
    for got, want in zip(with_kernel, plain):
        assert [d for d, _ in got] == [d for d, _ in want]



@pytest.mark.parametrize("refine_with, salience", [("all", False), ("kept", True)])
def test_static_plan_ranks_alike_with_and_without_kernels(default_index, model, interpreted, monkeypatch,
                                                          refine_with, salience):
    """The batch plan's probe scoring, interaction and top-k:1 refinement through the kernels rank as through torch
    operations: every token of the candidates, or only the kept ones with query saliences weighting the score."""
    from test_graphs import assert_same, static_rankings

    from pyserini_aligner.search import AlignerSearcher

    knobs = dict(encoder=model, backend="torch", k_per_token=20, nprobe=4, max_candidates=16, interaction_candidates=64,
                 refine_with=refine_with)
    searcher = AlignerSearcher(default_index, **knobs)
    searcher.use_salience = salience  # what the plan weights its scores with
    queries = ["coronavirus transmission in hospitals", "vitamin D and bone density in older women"]
    with_kernels = static_rankings(searcher, queries, 10)
    monkeypatch.setenv("PYSERINI_ALIGNER_TRITON", "0")
    interpreted._triton.cache_clear()
    try:
        plain = static_rankings(searcher, queries, 10)
    finally:
        interpreted._triton.cache_clear()
    for got, want in zip(with_kernels, plain):
        assert len(want) == 10
        assert_same(got, want)


def test_a_shard_scores_its_share_of_the_candidates_as_the_whole_list(interpreted, two_segment_index):
    """A shard holding a share of the candidates gathers them to the front before the interaction kernel: every
    score equals the kernel's over the uncompacted list, to the last bit."""
    from pyserini_aligner.index import StoredIndex
    from pyserini_aligner.search.codes import CodeShard

    store = StoredIndex(two_segment_index)
    shard = CodeShard(store, [0])
    gen = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(3, 6, store.manifest.dim, generator=gen), dim=-1)
    q_mask = torch.ones(3, 6, dtype=torch.bool)
    q_mask[2, 4:] = False
    first = shard.num_rows  # rows of the shard's segment; a quarter of the candidates are drawn from them
    rows = torch.where(torch.rand(3, 24, generator=gen) < 0.25, torch.randint(0, first, (3, 24), generator=gen),
                       torch.randint(first, store.manifest.num_docs, (3, 24), generator=gen)).sort(dim=1).values
    valid = torch.rand(3, 24, generator=gen) > 0.1
    local, mine, _ = shard._held(rows, valid)
    assert 0 < int(mine.sum(1).max()) <= rows.shape[1] // 2  # a share: the compacted path
    got = shard.interaction(q, q_mask, rows, valid)
    want = shard._interaction_blocks(q, q_mask, local, mine)
    assert torch.equal(got, want) and bool(torch.isinf(got[~mine]).all()) and bool(torch.isfinite(got[mine]).all())
