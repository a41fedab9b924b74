"""A compressed index's codes on a device (CodeShard) against slow loop references: IVF probing, decoding, and
the scores of fetched documents."""
import os

import numpy as np
import pytest
import torch

from pyserini_aligner.index import StoredIndex
from pyserini_aligner.search.codes import CodeShard


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
    from pyserini_aligner.search.codes import probe_parts

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


@pytest.mark.parametrize("refine_with", ["all", "kept"])
def test_a_shard_too_large_to_keep_its_norms_refines_to_the_same_bits(two_segment_index, monkeypatch, refine_with):
    """Past NORM_CACHE_BYTES a shard computes the inverse norms of the candidates' tokens at each refinement instead
    of keeping every token's: the same scores to the last bit, and nothing kept per token."""
    from pyserini_aligner.alignment import parse_strategy
    from pyserini_aligner.search import codes

    store = StoredIndex(two_segment_index)
    kept = CodeShard(store, [0, 1], refine_with=refine_with)
    generator = torch.Generator().manual_seed(2)
    rows = torch.randint(0, kept.num_rows, (3, 9), generator=generator)
    valid = torch.rand(3, 9, generator=generator) < 0.8
    q = torch.nn.functional.normalize(torch.randn(3, 5, store.manifest.dim, generator=generator), dim=-1)
    q_mask = torch.ones(3, 5, dtype=torch.bool)
    q_mask[2, 4:] = False
    strategy = parse_strategy(store.manifest.default_strategy)
    want = kept.refine(q, q_mask, None, rows, valid, strategy, 64)
    assert kept._inverse_norms is not None
    monkeypatch.setattr(codes, "NORM_CACHE_BYTES", 0)
    computed = CodeShard(store, [0, 1], refine_with=refine_with)
    assert torch.equal(computed.refine(q, q_mask, None, rows, valid, strategy, 64), want)
    assert computed._inverse_norms is None
    positions = torch.arange(len(computed.token_ids)).view(1, -1)
    assert torch.equal(computed.inverse_norms_at(positions), kept.inverse_norms().view(1, -1))


def mapped_rss(path) -> int:
    """Resident bytes of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps", encoding="utf-8") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
                inside = fields[-1] == str(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads a Linux process's mappings")
@pytest.mark.parametrize("refine_with", ["all", "kept"])
def test_a_large_index_reads_its_candidates_from_the_files_to_the_same_bits(two_segment_index, monkeypatch,
                                                                            refine_with):
    """Past NORM_CACHE_BYTES a one-segment shard on the CPU reads its candidates' tokens from the files by position
    instead of through the maps: interaction and refinement give the same scores to the last bit, and none of the
    token files' pages becomes resident in the process (the mapped shard's reads make them resident)."""
    from pyserini_aligner.alignment import parse_strategy
    from pyserini_aligner.index.format import TOKEN_CENTROIDS, TOKEN_RESIDUALS
    from pyserini_aligner.search import codes

    generator = torch.Generator().manual_seed(3)
    q = torch.nn.functional.normalize(torch.randn(4, 6, StoredIndex(two_segment_index).manifest.dim,
                                                  generator=generator), dim=-1)
    q_mask = torch.ones(4, 6, dtype=torch.bool)
    q_mask[1, 2:] = False
    for number in (0, 1):
        monkeypatch.setattr(codes, "NORM_CACHE_BYTES", 0)
        store = StoredIndex(two_segment_index)
        reads = CodeShard(store, [number], refine_with=refine_with)
        folder = store.segments[number].folder
        rows = torch.randint(0, store.num_docs, (4, 11), generator=generator)  # some held by the other segment
        valid = torch.rand(4, 11, generator=generator) < 0.8
        strategy = parse_strategy(store.manifest.default_strategy)
        got = (reads.interaction(q, q_mask, rows, valid), reads.refine(q, q_mask, None, rows, valid, strategy, 64))
        assert reads._reads is not None
        assert mapped_rss(folder / TOKEN_RESIDUALS) == mapped_rss(folder / TOKEN_CENTROIDS) == 0
        monkeypatch.setattr(codes, "NORM_CACHE_BYTES", 1 << 40)
        mapped = CodeShard(StoredIndex(two_segment_index), [number], refine_with=refine_with)
        assert mapped._reads is None
        assert torch.equal(got[0], mapped.interaction(q, q_mask, rows, valid))
        assert torch.equal(got[1], mapped.refine(q, q_mask, None, rows, valid, strategy, 64))
        assert mapped_rss(folder / TOKEN_RESIDUALS) > 0


@pytest.mark.parametrize("refine_with", ["all", "kept"])
@pytest.mark.parametrize("salience", [False, True])
def test_packed_maxsim_refinement_equals_padded_alignment_scores(two_segment_index, refine_with, salience):
    """The GPU's top-k:1 refinement over each query's candidate tokens packed without padding
    (CodeShard.refine_packed, run here on the CPU) gives the scores of alignment_scores_grouped over the same
    decoded tokens padded to the longest document (kept tokens only with refine_with "kept", query saliences as
    weights), to float32 rounding, −inf for the candidates not held or not valid."""
    from pyserini_aligner.alignment import alignment_scores_grouped, parse_strategy

    store = StoredIndex(two_segment_index)
    shard = CodeShard(store, [1], refine_with=refine_with)
    generator = torch.Generator().manual_seed(3)
    rows = torch.randint(0, shard.row_base + shard.num_rows, (4, 11), generator=generator)  # some held elsewhere
    valid = torch.rand(4, 11, generator=generator) < 0.8
    q = torch.nn.functional.normalize(torch.randn(4, 6, store.manifest.dim, generator=generator), dim=-1)
    q_mask = torch.ones(4, 6, dtype=torch.bool)
    q_mask[0, 4:] = False
    q_sal = torch.rand(4, 6, generator=generator) if salience else None
    local, mine, lengths = shard._held(rows, valid)
    got = shard.refine_packed(q, q_mask, q_sal, local, mine, lengths, torch.full(rows.shape, -torch.inf))
    width = int(lengths.max())
    span = torch.arange(width)
    positions = (shard.offsets[local].unsqueeze(-1) + span).clamp_max(len(shard.token_ids) - 1)
    mask = (span < lengths.unsqueeze(-1)) & mine.unsqueeze(-1)
    if refine_with == "kept":
        mask &= shard.kept[positions]
    want = alignment_scores_grouped(q, q_mask, shard.decode(positions, mask), mask, parse_strategy("top-k:1"), q_sal)
    assert torch.equal(torch.isfinite(got), mine)
    assert torch.allclose(got[mine], want[mine], rtol=0, atol=1e-6)
    assert mine.sum() > 10 and (~mine).sum() > 3
