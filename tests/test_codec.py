"""The residual codec: parsing, k-means and PQ against slow loop references, and FAISS IndexIVFPQ compatibility."""
import math

import numpy as np
import pytest
import torch

from pyserini_aligner.index.codec import (HIERARCHY_MIN_NLIST, CentroidSearch, ResidualCodec, coarse_count,
                                          dequantize_centroids, kmeans, nearest, quantize_centroids, share_centroids,
                                          two_level_kmeans)
from pyserini_aligner.index.codec_spec import (FINE_CODE_TOKENS, CodecSpec, choose_nlist, choose_refine_m,
                                               default_max_bytes_per_token, parse_codec, resolve_codec)


def unit_vectors(n: int, d: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(n, d, generator=gen), dim=-1)


@pytest.fixture(scope="module")
def codec_and_data():
    x = unit_vectors(3000, 32, 0)
    return ResidualCodec.train(CodecSpec(16, 8), x, iters=5, seed=0), x


@pytest.mark.parametrize("spec, parsed, text", [
    ("fp16", CodecSpec(), "fp16"), ("FP16", CodecSpec(), "fp16"), ("IVF4096,PQ16", CodecSpec(4096, 16), None),
    (" IVF2,PQ1 ", CodecSpec(2, 1), "IVF2,PQ1"), ("IVF4096,PQ4,Refine(PQ32)", CodecSpec(4096, 4, 32), None)])
def test_parse_codec(spec, parsed, text):
    assert parse_codec(spec, 128) == parsed
    assert str(parsed) == (text or spec)
    assert parsed.residual_m == (parsed.refine_m or parsed.pq_m)


@pytest.mark.parametrize("spec, message", [("PQ16", "expected 'auto', 'fp16', 'IVF<nlist>,PQ<M>'"),
                                           ("IVF1,PQ16", "nlist must be in"), ("IVF70000,PQ16", "nlist must be in"),
                                           ("IVF64,PQ7", "must split the 128-d vectors"),
                                           ("IVF64,PQ4,Refine(PQ12)", "PQ12 must split the 128-d vectors"),
                                           ("IVF64,PQ8,Refine(PQ8)", "must be finer than PQ8"),
                                           ("IVF64,PQ4,Refine(SQ8)", "expected")])
def test_parse_codec_rejects(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_codec(spec, 128)


def test_auto_chooses_residual_bytes_from_the_corpus_size_and_budget():
    """2 bits a dimension (at least 32 bytes) for a small corpus, at least 64 bytes from FINE_CODE_TOKENS tokens,
    whatever the corpus's codes weigh; a budget caps the residual."""
    small, large = FINE_CODE_TOKENS - 1, FINE_CODE_TOKENS
    assert choose_refine_m(128, 1_500_000) == default_max_bytes_per_token(128) - 2 == 32
    assert choose_refine_m(128, small) == 32 and choose_refine_m(128, large) == 64
    assert choose_refine_m(384, 1_500_000) == default_max_bytes_per_token(384) - 2 == 96  # 2 bits a dimension
    assert choose_refine_m(384, large) == 96 and choose_refine_m(64, large) == 64  # 64 bytes: 8 bits a dimension
    assert [choose_refine_m(128, t) for t in (250_000_000, 900_000_000, 10 ** 10)] == [64, 64, 64]  # no memory cap
    assert choose_refine_m(128, 1_500_000, max_bytes_per_token=66) == 64
    assert choose_refine_m(128, 1_500_000, max_bytes_per_token=20) == 16
    assert choose_refine_m(128, 10 ** 9, max_bytes_per_token=34) == 32
    assert choose_refine_m(384, 1_500_000, max_bytes_per_token=130) == 128  # the largest even divisor that fits
    assert choose_refine_m(384, 1_500_000, max_bytes_per_token=34) == 32
    with pytest.raises(ValueError, match="max_bytes_per_token must be >= 6"):
        choose_refine_m(128, 1000, max_bytes_per_token=5)
    assert resolve_codec("auto", 128, 1_500_000) == CodecSpec(choose_nlist(1_500_000), 4, 32)
    assert resolve_codec("auto", 128, 72_000_000) == CodecSpec(65536, 4, 64)
    assert resolve_codec("auto", 384, 1_500_000) == CodecSpec(choose_nlist(1_500_000), 4, 96)
    assert str(resolve_codec("auto", 128, 1_500_000, max_bytes_per_token=6)) == f"IVF{choose_nlist(1_500_000)},PQ4"
    assert resolve_codec("IVF64,PQ8", 128, 10 ** 9) == CodecSpec(64, 8)  # an explicit string is kept


def test_tiny_corpora_get_few_centroids():
    """At least 32 tokens per centroid: k-means has points to fit (498 tokens: 8 centroids, not 256)."""
    assert choose_nlist(498) == 8 and choose_nlist(64) == 2 and choose_nlist(10) == 2
    assert choose_nlist(1_300_000) == 16384 and choose_nlist(20_000_000) == 65536


def test_refinement_tier_against_a_slow_reference():
    """IVF,PQ4,Refine(PQ16): list codes are the nearest codewords of the coarse books, token codes of the fine
    ones; decoding reads the fine codes; a look-up-table score equals the decoded vector's inner product."""
    x = unit_vectors(3000, 32, 4)
    codec = ResidualCodec.train(CodecSpec(16, 4, 16), x, iters=5, seed=0)
    assert codec.spec == CodecSpec(16, 4, 16) and codec.codebooks.shape == (4, 256, 8)
    assert codec.refine_books.shape == (16, 256, 2) and codec.token_books is codec.refine_books
    ids = codec.encode_centroids(x[:12])
    fine = codec.encode_residuals(x[:12], ids)
    coarse = codec.encode_list_codes(x[:12], ids, fine)
    assert fine.shape == (12, 16) and coarse.shape == (12, 4)
    for i in range(12):
        residual = x[i] - codec.centroids[int(ids[i])]
        for books, codes in ((codec.codebooks, coarse), (codec.refine_books, fine)):
            sub = books.shape[2]
            for m in range(books.shape[0]):
                dists = [float(((residual[sub * m:sub * (m + 1)] - books[m, c]) ** 2).sum()) for c in range(256)]
                assert dists[codes[i, m]] == pytest.approx(min(dists), abs=1e-6)
    decoded = codec.decode(ids, fine)
    loop = torch.stack([codec.centroids[int(ids[i])] + torch.cat([codec.refine_books[m, int(fine[i, m])]
                                                                  for m in range(16)]) for i in range(12)])
    norms = [math.sqrt(sum(float(v) ** 2 for v in row)) for row in loop]
    assert torch.allclose(decoded, loop / torch.tensor(norms).unsqueeze(1))  # centroid + residual, unit length
    assert torch.allclose(decoded.norm(dim=1), torch.ones(12))
    q = unit_vectors(3, 32, 5)
    lut = torch.einsum("nms,mks->nmk", q.view(3, 16, 2), codec.refine_books)  # [n, R, 256]
    table = [[(float(q[j] @ codec.centroids[int(ids[i])]) + sum(float(lut[j, m, int(fine[i, m])]) for m in range(16)))
              / norms[i] for i in range(12)] for j in range(3)]
    np.testing.assert_allclose(np.array(table), (q @ decoded.T).numpy(), atol=1e-5)
    error = lambda d: float(((d - x[:12]) ** 2).sum(1).mean())  # noqa: E731
    plain = ResidualCodec(codec.centroids, codec.codebooks)
    assert error(decoded) < 0.5 * error(plain.decode(ids, coarse))
    assert np.array_equal(plain.encode_list_codes(x[:12], ids, coarse), coarse)  # one tier: the same codes


def test_nearest_matches_loop_reference():
    x, c = unit_vectors(50, 6, 1), torch.randn(7, 6, generator=torch.Generator().manual_seed(2))
    ip = [max(range(7), key=lambda j: float(x[i] @ c[j])) for i in range(50)]
    l2 = [min(range(7), key=lambda j: float(((x[i] - c[j]) ** 2).sum())) for i in range(50)]
    assert nearest(x, c, "ip").tolist() == ip and nearest(x, c, "l2").tolist() == l2


@pytest.mark.parametrize("spherical", [False, True])
def test_kmeans_reaches_a_lloyd_fixed_point(spherical):
    """After convergence each centroid is the (normalised) mean of the points nearest to it."""
    gen = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(40, 4, generator=gen) * 0.05 + shift for shift in (-2.0, 0.0, 2.0)])
    if spherical:
        x = torch.nn.functional.normalize(x + torch.tensor([0.0, 1.0, 0.0, 0.0]), dim=-1)
    centroids = kmeans(x, 3, iters=30, seed=0, spherical=spherical)
    assign = nearest(x, centroids, "ip" if spherical else "l2")
    for j in range(3):
        members = [x[i] for i in range(len(x)) if assign[i] == j]
        mean = torch.stack(members).mean(0)
        want = mean / mean.norm() if spherical else mean
        assert torch.allclose(centroids[j], want, atol=1e-5)


def test_kmeans_with_fewer_points_than_centroids():
    """Every point becomes a centroid; the rest repeat points (a tiny corpus still gets a codec)."""
    x = unit_vectors(4, 2, 5)
    centroids = kmeans(x, 6)
    assert centroids.shape == (6, 2) and torch.equal(centroids[:4], x)
    assert all(any(torch.equal(c, p) for p in x) for c in centroids[4:])
    with pytest.raises(ValueError, match="k-means needs at least one point"):
        kmeans(torch.zeros(0, 2), 5)


def test_residual_codes_are_nearest_codewords(codec_and_data):
    codec, x = codec_and_data
    ids = codec.encode_centroids(x[:20])
    codes = codec.encode_residuals(x[:20], ids)
    assert codes.shape == (20, 8) and codes.dtype == np.uint8
    for i in range(20):
        assert ids[i] == max(range(16), key=lambda j: float(x[i] @ codec.centroids[j]))
        residual = x[i] - codec.centroids[int(ids[i])]
        for m in range(8):
            part = residual[4 * m:4 * m + 4]
            dists = [float(((part - codec.codebooks[m, c]) ** 2).sum()) for c in range(256)]
            assert dists[codes[i, m]] == pytest.approx(min(dists), abs=1e-6)
    decoded = codec.decode(ids, codes)
    assert decoded.shape == (20, 32)
    raw = codec.centroids[int(ids[3])] + torch.cat([codec.codebooks[m, int(codes[3, m])] for m in range(8)])
    assert torch.allclose(decoded[3], raw / raw.norm())
    assert torch.allclose(codec.decode(ids), codec.centroids[torch.from_numpy(ids.astype(np.int64))])


def test_codec_reduces_error(codec_and_data):
    codec, x = codec_and_data
    ids = codec.encode_centroids(x)
    coarse = (codec.decode(ids) - x).norm(dim=1).mean()
    fine = (codec.decode(ids, codec.encode_residuals(x, ids)) - x).norm(dim=1).mean()
    assert fine < 0.6 * coarse


def test_faiss_ivfpq_reads_the_same_codes(codec_and_data):
    """FAISS decodes our codes to our vectors before they are scaled to unit length (centroid + residual), and its
    IVF-PQ search over them equals brute force on those."""
    import faiss

    codec, x = codec_and_data
    ids = codec.encode_centroids(x)
    codes = codec.encode_residuals(x, ids)
    order = np.argsort(ids, kind="stable")
    offsets = np.concatenate([[0], np.cumsum(np.bincount(ids, minlength=16))])
    half = len(order) // 2  # two parts (segments) of inverted lists, appended in order
    parts = []
    for keep in (order[:half], order[half:]):
        sub = np.argsort(ids[keep], kind="stable")
        parts.append((np.concatenate([[0], np.cumsum(np.bincount(ids[keep], minlength=16))]), keep[sub] * 7,
                      codes[keep[sub]]))
    index = codec.faiss_index(parts)
    assert index.ntotal == len(x) and [index.invlists.list_size(c) for c in range(16)] == np.diff(offsets).tolist()
    decoded = (codec.decode(ids) + codec.residual_vectors(codes)).numpy()
    for c in (0, 5, 15):
        for j in range(min(3, index.invlists.list_size(c))):
            label = index.invlists.get_single_id(c, j)
            recons = np.zeros(32, dtype=np.float32)
            index.reconstruct_from_offset(c, j, faiss.swig_ptr(recons))
            np.testing.assert_allclose(recons, decoded[label // 7], atol=1e-5)
    index.nprobe = 16  # every list
    queries = unit_vectors(5, 32, 9).numpy()
    scores, found = index.search(queries, 5)
    exact = queries @ decoded.T
    np.testing.assert_array_equal(found // 7, np.argsort(-exact, axis=1, kind="stable")[:, :5])
    np.testing.assert_allclose(scores, np.sort(exact, axis=1)[:, ::-1][:, :5], atol=1e-4)


def test_centroid_quantization_is_tight():
    c = unit_vectors(100, 64, 4)
    values, scales = quantize_centroids(c)
    assert values.dtype == np.int8 and scales.shape == (100,)
    error = (dequantize_centroids(values, scales) - c).abs().max(dim=1).values
    assert torch.all(error <= torch.from_numpy(scales) / 2 + 1e-7)


def test_training_on_few_vectors_and_errors():
    """Fewer training vectors than centroids still give a codec (each vector is then nearly exact)."""
    x = unit_vectors(10, 8, 0)
    codec = ResidualCodec.train(CodecSpec(64, 4), x)
    assert codec.spec == CodecSpec(64, 4)
    ids = codec.encode_centroids(x)
    assert torch.allclose(codec.decode(ids, codec.encode_residuals(x, ids)), x, atol=0.02)
    with pytest.raises(ValueError, match="fp16 has nothing to train"):
        ResidualCodec.train(CodecSpec(), x)
    with pytest.raises(ValueError, match="PQ3 must split the 8-d vectors"):
        ResidualCodec.train(CodecSpec(4, 3), x)


def clustered_unit_vectors(n: int, d: int, clusters: int, seed: int) -> torch.Tensor:
    """Unit vectors around ``clusters`` random directions (token vectors are clustered, not uniform)."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(clusters, d, generator=gen)
    pick = torch.randint(clusters, (n,), generator=gen)
    return torch.nn.functional.normalize(centres[pick] + 0.6 * torch.randn(n, d, generator=gen), dim=-1)


def restricted_reference(x: torch.Tensor, search: CentroidSearch) -> list[int]:
    """The restricted search spelled out: per vector, its ``probes`` best group centres, then the best centroid
    among those groups' members (lowest id on ties)."""
    group = {int(cid): g for g in range(len(search.centres))
             for cid in search.order[int(search.bounds[g]):int(search.bounds[g + 1])]}
    found = []
    for row in x:
        centre_scores = [float(row @ c) for c in search.centres]
        probed = sorted(range(len(centre_scores)), key=lambda g: -centre_scores[g])[:search.probes]
        members = [cid for cid in range(len(search.centroids)) if group[cid] in probed]
        found.append(max(members, key=lambda cid: (float(row @ search.centroids[cid]), -cid)))
    return found


@pytest.mark.parametrize("counts, k, want", [([10, 10, 10, 10], 8, [2, 2, 2, 2]), ([30, 10], 5, [4, 1]),
                                             ([1, 100, 3], 20, [0, 19, 1]), ([2, 2, 50], 54, [2, 2, 50]),
                                             ([0, 5, 5], 3, [0, 2, 1]), ([3, 1], 10, [3, 1])])
def test_share_centroids(counts, k, want):
    """Proportional to the counts (largest remainder first, ties to the lower index), never above a count."""
    share = share_centroids(np.array(counts), k)
    assert share.tolist() == want
    assert share.sum() == min(k, sum(counts)) and np.all(share <= counts)


def test_two_level_kmeans_is_deterministic_and_close_to_one_level():
    x = clustered_unit_vectors(6000, 16, 40, 0)
    centroids = two_level_kmeans(x, 256, seed=0)
    assert centroids.shape == (256, 16) and torch.allclose(centroids.norm(dim=1), torch.ones(256), atol=1e-5)
    assert torch.equal(centroids, two_level_kmeans(x, 256, seed=0))
    assert not torch.equal(centroids, two_level_kmeans(x, 256, seed=1))
    # the within-cluster cosine of the two-level centroids is within 1% of one k-means of 256 centroids
    one_level = kmeans(x, 256, seed=0, spherical=True)
    def mean_cosine(c):
        return float((x @ c.T).max(1).values.mean())
    assert mean_cosine(centroids) > 0.99 * mean_cosine(one_level)
    tiny = x[:100]  # no more points than centroids: each point is a centroid
    assert torch.equal(two_level_kmeans(tiny, 128)[:100], tiny)


@pytest.mark.parametrize("probes", [1, 3])
def test_centroid_search_matches_slow_reference(probes):
    x = clustered_unit_vectors(300, 12, 10, 1)
    centroids = two_level_kmeans(clustered_unit_vectors(3000, 12, 10, 2), 64, seed=0)
    search = CentroidSearch(centroids, probes=probes)
    assert len(search.centres) == coarse_count(4 * 64) == 16
    assert search(x).tolist() == restricted_reference(x, search)


def test_centroid_search_over_every_group_is_brute_force():
    x = clustered_unit_vectors(5000, 16, 30, 3)
    centroids = dequantize_centroids(*quantize_centroids(two_level_kmeans(clustered_unit_vectors(8000, 16, 30, 4),
                                                                          400, seed=0)))
    exact = nearest(x, centroids)
    search = CentroidSearch(centroids, probes=coarse_count(4 * 400))
    assert torch.equal(search(x), exact)
    # restricted to a few groups: nearly always the nearest, and a near-tie when not
    few = CentroidSearch(centroids, probes=4)(x)
    assert (few == exact).float().mean() > 0.9
    scores = x @ centroids.T
    lost = scores.max(1).values - scores.gather(1, few[:, None])[:, 0]
    assert lost.min() >= 0 and lost.mean() < 0.01


def test_large_codec_on_cpu_assigns_through_the_centroid_search():
    """From HIERARCHY_MIN_NLIST centroids a CPU codec trains by two-level k-means and encodes through its
    CentroidSearch; the codes reconstruct nearly as well as with brute-force assignment."""
    x = clustered_unit_vectors(12000, 16, 64, 5)
    codec = ResidualCodec.train(CodecSpec(HIERARCHY_MIN_NLIST, 4), x[:8000], iters=5, seed=0)
    held_out = x[8000:]
    ids = codec.encode_centroids(held_out)
    assert codec._search is not None and len(codec._search.centres) == coarse_count(4 * HIERARCHY_MIN_NLIST)
    assert np.array_equal(ids, codec._search(held_out).numpy())
    exact = nearest(held_out, codec.centroids).numpy()
    assert (ids == exact).mean() > 0.9
    def error(assigned):
        decoded = codec.decode(assigned, codec.encode_residuals(held_out, assigned))
        return float(((decoded - held_out) ** 2).sum(1).mean())
    assert error(ids) < 1.02 * error(exact.astype(np.uint16))
    loaded = ResidualCodec(*[torch.from_numpy(t.numpy().copy()) for t in (codec.centroids, codec.codebooks)])
    assert np.array_equal(loaded.encode_centroids(held_out), ids)  # a fresh copy groups its centroids the same


@pytest.mark.parametrize("m", [4, 32])  # sub-vectors of 32 dims (batched products) and of 4 (FAISS)
def test_pq_codes_are_the_nearest_codewords(m):
    """Each sub-vector's code is its nearest codeword by squared distance (the slow definition), up to float
    rounding between near-equal codewords."""
    from pyserini_aligner.index.codec import pq_encode

    generator = torch.Generator().manual_seed(3)
    x = torch.randn(500, 128, generator=generator) * 0.2
    books = torch.randn(m, 256, 128 // m, generator=generator) * 0.2
    encoded = pq_encode(x, books)
    assert encoded.dtype == np.uint8 and encoded.shape == (500, m)
    codes = torch.from_numpy(encoded).long()
    parts = x.reshape(len(x), m, -1).double()
    distances = ((parts.unsqueeze(2) - books.double().unsqueeze(0)) ** 2).sum(-1)  # [n, m, 256]
    chosen = distances.gather(2, codes.unsqueeze(2)).squeeze(2)
    assert torch.allclose(chosen, distances.min(2).values, atol=1e-5)
    assert (codes == distances.argmin(2)).float().mean() > 0.999
    import faiss

    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        assert np.array_equal(pq_encode(x, books), encoded)  # the same codes whatever the threads
    finally:
        faiss.omp_set_num_threads(threads)
