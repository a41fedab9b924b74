"""The code-search engine's steps against slow loop references: the candidate rule and IVF probing."""
import numpy as np
import pytest
import torch

from pyserini_aligner.index import StoredIndex
from pyserini_aligner.search.engine import (CodeShard, ascending, best_of_parts, merge_probes, probe_floors,
                                            rank_candidates, select_candidates)

import reference


@pytest.mark.parametrize("weighted", [False, True])
def test_select_candidates_matches_loop_reference(weighted):
    gen = np.random.default_rng(0)
    probes, width, batch, docs = 14, 6, 3, 9
    scores = gen.integers(0, 5, size=(probes, width)).astype(np.float32)  # small integers: many exact ties
    rows = gen.integers(0, docs, size=(probes, width))
    rows[gen.random((probes, width)) < 0.2] = -1  # fewer entries than K
    scores[rows < 0] = -np.inf
    rows[4] = -1  # a probe that found nothing
    scores[4] = -np.inf
    owner = np.sort(gen.integers(0, batch, size=probes))
    owner[-1] = batch - 1
    weights = gen.integers(1, 4, size=probes).astype(np.float32) if weighted else None
    for limit in (1, 3, docs):
        got, valid = select_candidates(torch.from_numpy(scores), torch.from_numpy(rows), torch.from_numpy(owner),
                                       batch, limit, None if weights is None else torch.from_numpy(weights))
        want = reference.select_candidates(scores.tolist(), rows.tolist(), owner.tolist(), batch, limit,
                                           None if weights is None else weights.tolist())
        assert [got[b][valid[b]].tolist() for b in range(batch)] == want
        assert (got[~valid] == -1).all()


@pytest.mark.parametrize("weighted", [False, True])
def test_shards_ranking_their_own_documents_find_the_merged_candidates(weighted):
    """A split index's rule (each shard ranks the documents it holds, with every probe's K-th score over all
    shards, and the shards' best are merged) selects what the rule selects over the merged probes."""
    gen = np.random.default_rng(1)
    probes, width, batch, docs, shards = 40, 8, 4, 60, 3
    owner = torch.from_numpy(np.sort(gen.integers(0, batch, size=probes)))
    weights = torch.from_numpy(gen.integers(1, 4, size=probes).astype(np.float32)) if weighted else None
    bounds = [0, 17, 18, docs]  # consecutive rows a shard, one shard holding a single document
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:]):  # each shard's K best entries a probe, distinct scores
        rows = torch.from_numpy(gen.integers(a, b, size=(probes, width)))
        scores = torch.from_numpy(gen.permutation(probes * width * 4)[:probes * width].reshape(probes, width)
                                  .astype(np.float32) / 7).sort(dim=1, descending=True).values
        rows[torch.from_numpy(gen.random((probes, width)) < 0.3)] = -1  # fewer entries than K
        parts.append((torch.where(rows >= 0, scores, torch.full_like(scores, -torch.inf)), rows))
    merged = merge_probes(parts, width)
    floor = probe_floors(torch.cat([s for s, _ in parts], dim=1), width)
    for limit in (1, 5, docs):
        want, want_ok = select_candidates(*merged, owner, batch, limit, weights)
        ranked = [rank_candidates(s, r, owner, batch, limit, weights, floor) for s, r in parts]
        best = best_of_parts([p for p, _ in ranked], [r for _, r in ranked], limit)[1]
        got, got_ok = ascending(best[:, :want.shape[1]])
        assert got.tolist() == want.tolist() and got_ok.tolist() == want_ok.tolist()


def test_code_shard_probe_matches_numpy_loop(two_segment_index):
    """Every entry of each probe's nprobe nearest lists scored as q·c + q·r (r: the decoded residual), top K, over
    one shard holding both segments (their inverted lists merged)."""
    store = StoredIndex(two_segment_index)
    shard = CodeShard(store, [0, 1])
    centroids, books = store.codec.centroids.double().numpy(), store.codec.codebooks.double().numpy()
    probes = torch.nn.functional.normalize(torch.randn(5, store.manifest.dim, generator=torch.Generator()
                                                       .manual_seed(0)), dim=-1)
    nprobe, k = 3, 40
    scores, rows = shard.probe(probes, k, nprobe)
    for p, q in enumerate(probes.double().numpy()):
        found = []
        for c in np.argsort(-(centroids @ q), kind="stable")[:nprobe]:
            for number, seg in enumerate(store.segments):
                for e in range(int(seg.ivf_offsets[c]), int(seg.ivf_offsets[c + 1])):
                    residual = np.concatenate([books[m, code] for m, code in enumerate(seg.ivf_codes[e])])
                    row = int(seg.ivf_docs[e]) + int(store.row_base[number])
                    found.append((float(q @ centroids[c] + q @ residual), row))
        found.sort(key=lambda pair: -pair[0])
        want_scores = [s for s, _ in found[:k]]
        assert np.allclose(scores[p, :len(want_scores)].numpy(), want_scores, atol=1e-4)
        assert sorted(rows[p].tolist()) == sorted(r for _, r in found[:k])


def test_code_shard_probe_in_parts_equals_one_part(two_segment_index):
    """Probes split into parts of like entry counts (most entries first, written back in place) give each probe
    the same rows as all probes in one padded part, and the same scores to float32 rounding (a part's look-up tables
    are one matrix product over its probes, and a CPU's products can differ in the last bit with the rows around
    them)."""
    from pyserini_aligner.search.engine import probe_parts

    shard = CodeShard(StoredIndex(two_segment_index), [0, 1])
    probes = torch.nn.functional.normalize(torch.randn(23, shard.centroids.shape[1], generator=torch.Generator()
                                                       .manual_seed(1)), dim=-1)
    whole = shard.probe(probes, 30, 3)
    cidx = (probes @ shard.centroids.T).topk(3, dim=1).indices
    entries = shard.ivf_lengths[cidx].sum(1).numpy()
    shard.elements = 4 * 3 * int(entries.max())  # parts of at most three probes of the most entries
    parts = list(probe_parts(entries, shard.elements // 4))
    assert len(parts) > 3 and sorted(np.concatenate([p for p, _ in parts]).tolist()) == list(range(23))
    assert all(span == entries[p].max() and len(p) * span <= shard.elements // 4 for p, span in parts)
    split = shard.probe(probes, 30, 3)
    assert torch.equal(split[1], whole[1]) and torch.equal(torch.isfinite(split[0]), torch.isfinite(whole[0]))
    assert torch.allclose(split[0], whole[0], rtol=0, atol=1e-6)


def test_best_entries_equal_a_stable_sort_of_each_row():
    """Each row's K best finite entries, best first, ties in position order: what sorting the whole row stably
    from the largest gives, with many exact ties at the K-th score, rows of fewer finite entries than K and an empty
    row."""
    from pyserini_aligner.search.engine import best_entries

    gen = np.random.default_rng(3)
    scores = torch.from_numpy(gen.integers(0, 6, size=(7, 50)).astype(np.float32))  # small integers: ties
    scores[torch.from_numpy(gen.random((7, 50)) < 0.3)] = -torch.inf
    scores[2, 4:] = -torch.inf  # four entries
    scores[5] = -torch.inf  # none
    docs = torch.from_numpy(gen.integers(0, 1000, size=(7, 50)).astype(np.int32))
    for width in (1, 9, 50, 60):
        got_scores, got_docs = best_entries(scores, docs, width)
        assert got_scores.shape == (7, width) and got_docs.dtype == torch.long
        for row in range(7):
            values = scores[row].numpy()
            order = [i for i in np.argsort(-values, kind="stable") if np.isfinite(values[i])][:width]
            want_scores = scores[row, order].tolist() + [-np.inf] * (width - len(order))
            want_docs = docs[row, order].tolist() + [-1] * (width - len(order))
            assert got_scores[row].tolist() == want_scores and got_docs[row].tolist() == want_docs


def test_descending_key_orders_floats_from_largest():
    from pyserini_aligner.search.engine import descending_key

    values = torch.tensor([0.5, -0.25, float("-inf"), 3.0, -0.0, 0.0, 1e-30, -7.5, float("inf"), 0.5])
    order = torch.sort(descending_key(values), stable=True).indices
    assert order.tolist() == torch.argsort(values, descending=True, stable=True).tolist()
    assert int(descending_key(values).min()) >= 0 and int(descending_key(values).max()) < 1 << 32


def test_decoding_by_pairs_and_under_a_mask_equals_the_codebooks(default_index):
    """Refinement's decoding: one table per two sub-quantisers (the GPU's) and decoding only the unmasked tokens give
    the vectors of the codebooks themselves (centroid + each sub-quantiser's codeword, read from the store, at unit
    length); the CPU's look-up tables score them as their inner products."""
    store = StoredIndex(default_index)
    shard = CodeShard(store, [0], "cpu")
    assert shard.token_m == 32 and shard.m == 4  # auto's two tiers at this size
    positions = torch.arange(3 * 50).view(3, 50)
    ids, codes = store.token_codes(positions.reshape(-1).numpy())
    books = store.codec.refine_books
    want = torch.stack([store.codec.centroids[int(c)] + torch.cat([books[m, int(code[m])] for m in range(32)])
                        for c, code in zip(ids, codes)]).view(3, 50, -1)
    want = want / want.norm(dim=-1, keepdim=True)
    assert torch.allclose(shard.decode(positions), want, atol=1e-6)
    q = torch.nn.functional.normalize(torch.randn(3, 5, want.shape[-1], generator=torch.Generator().manual_seed(1)),
                                      dim=-1)
    table = shard.similarity(q, positions.view(3, 1, 50))  # [3, 1, 5, 50]
    assert torch.allclose(table[:, 0], q @ want.transpose(1, 2), atol=1e-5)
    shard.pair_tables(True)
    assert torch.allclose(shard.decode(positions), want, atol=1e-6)
    mask = torch.rand(3, 50, generator=torch.Generator().manual_seed(0)) < 0.6
    masked = shard.decode(positions, mask)
    assert torch.equal(masked[~mask], torch.zeros_like(masked[~mask]))
    assert torch.allclose(masked[mask], want[mask], atol=1e-6)


@pytest.mark.parametrize("refine_with", ["all", "kept"])
def test_a_shard_of_fetched_documents_scores_them_as_their_own_shard(two_segment_index, refine_with):
    """What one shard sends (CodeShard.documents) makes, on another (CodeShard.holding), a shard whose centroid
    interaction and refinement of those documents equal the holding shard's own, to the last bit."""
    from pyserini_aligner.alignment import parse_strategy

    store = StoredIndex(two_segment_index)
    shard = CodeShard(store, [1], refine_with=refine_with)
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(shard.row_base, shard.row_base + shard.num_rows, (3, 7), generator=generator)
    valid = torch.rand(3, 7, generator=generator) < 0.8
    need = torch.unique(rows[valid])
    fetched = shard.documents(need, residuals=True)
    assert fetched[0].tolist() == shard.lengths[need - shard.row_base].tolist()
    assert (fetched[3] is None) == (refine_with == "all")
    holder = CodeShard(store, [0], refine_with=refine_with)
    assert len(holder.inverse_norms()) == len(holder.token_ids)  # the holder's own tokens' norms are not reused
    other = holder.holding(*fetched)
    local = torch.where(valid, torch.searchsorted(need, rows), torch.zeros_like(rows))
    q = torch.nn.functional.normalize(torch.randn(3, 5, store.manifest.dim, generator=generator), dim=-1)
    q_mask = torch.ones(3, 5, dtype=torch.bool)
    q_mask[1, 3:] = False
    strategy = parse_strategy(store.manifest.default_strategy)
    assert torch.equal(other.interaction(q, q_mask, local, valid), shard.interaction(q, q_mask, rows, valid))
    assert torch.equal(other.refine(q, q_mask, None, local, valid, strategy, 64),
                       shard.refine(q, q_mask, None, rows, valid, strategy, 64))
    ids_only = other.holding(*shard.documents(need, residuals=False))
    assert torch.equal(ids_only.interaction(q, q_mask, local, valid), shard.interaction(q, q_mask, rows, valid))
