"""The candidate rule against slow loop references: each probe's best entries, the documents selected, a split
index's rule and the fixed-shape rule of one query."""
import numpy as np
import pytest
import torch

from pyserini_aligner.search.candidates import (ascending, best_entries, best_of_parts, descending_key,
                                                fixed_candidates, merge_probes, probe_floors, rank_candidates,
                                                select_candidates)

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


def test_best_entries_equal_a_stable_sort_of_each_row():
    """Each row's K best finite entries, best first, ties in position order: what sorting the whole row stably
    from the largest gives, with many exact ties at the K-th score, rows of fewer finite entries than K and an empty
    row."""
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
    values = torch.tensor([0.5, -0.25, float("-inf"), 3.0, -0.0, 0.0, 1e-30, -7.5, float("inf"), 0.5])
    order = torch.sort(descending_key(values), stable=True).indices
    assert order.tolist() == torch.argsort(values, descending=True, stable=True).tolist()
    assert int(descending_key(values).min()) >= 0 and int(descending_key(values).max()) < 1 << 32


@pytest.mark.parametrize("weighted", [False, True])
def test_the_fixed_shape_rule_selects_as_the_rule(weighted):
    """A batch's candidates by the rule with shapes fixed ahead (a CUDA graph's) are the rule's for each query, with
    many exact ties, probes of fewer entries than K, a query without valid probes and room for more candidates than
    were found."""
    gen = np.random.default_rng(5)
    batch, probes, width, docs = 3, 9, 6, 20
    scores = torch.from_numpy(gen.integers(0, 5, size=(batch, probes, width)).astype(np.float32))
    scores = scores.sort(dim=2, descending=True).values
    rows = torch.from_numpy(gen.integers(0, docs, size=(batch, probes, width)))
    rows[torch.from_numpy(gen.random((batch, probes, width)) < 0.2)] = -1
    rows[2] = -1  # a row of a captured batch past its texts
    scores = torch.where(rows >= 0, scores, torch.full_like(scores, -torch.inf))
    weights = torch.from_numpy(gen.integers(1, 4, size=(batch, probes)).astype(np.float32)) if weighted else None
    owner = torch.zeros(probes, dtype=torch.long)
    for count in (1, 4, docs, 2 * docs):
        got, got_ok = fixed_candidates(scores, rows, weights, count, docs)
        assert got.shape == (batch, min(count, probes * width))
        for b in range(batch):
            want, want_ok = select_candidates(scores[b], rows[b], owner, 1, count,
                                              None if weights is None else weights[b])
            assert got[b][got_ok[b]].tolist() == want[0][want_ok[0]].tolist() and (got[b][~got_ok[b]] == -1).all()
        assert not got_ok[2].any()
