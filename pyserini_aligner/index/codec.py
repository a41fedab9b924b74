"""Token codecs: how an index stores its token vectors, named by FAISS-style factory strings.

- ``fp16``: every token as float16 (2·d bytes); FAISS keeps its own copy of the kept tokens (``index_type``).
- ``IVF<nlist>,PQ<M>``: a residual codec in the style of PLAID. Every token stores the id of its nearest of
  ``nlist`` spherical k-means centroids (uint16; centroids stored as int8 with a per-centroid scale) and an M-byte
  product-quantised residual (M sub-vectors of d/M dims, 256 centroids each): 2 + M bytes per token. A token
  decodes to centroid + residual, scaled to unit length as the model's tokens are (:func:`unit_rows`). These
  (centroid id, residual) pairs are exactly FAISS ``IndexIVFPQ`` codes, so the searcher builds its FAISS index from
  the codes of the kept tokens (the β^d most salient of each document) at load time: candidate generation and
  refinement read one store.
- ``IVF<nlist>,PQ<M>,Refine(PQ<R>)``: two tiers, as FAISS's ``IndexRefine``. The inverted lists of the kept tokens
  carry M-byte codes of a coarse product quantiser (what candidate generation reads, cheap to scan); every token
  stores an R-byte code of a finer one (what refinement decodes): 2 + R bytes a token plus 4 + M bytes a list
  entry. ``auto`` chooses R from the corpus size and a byte budget (:func:`choose_refine_m`).

Training (k-means) and encoding run in torch, on the CPU or a GPU; decoding is a table lookup. On a CPU, a codec
of many centroids (``HIERARCHY_MIN_NLIST`` and up) trains them by two-level k-means (:func:`two_level_kmeans`) and
assigns each token to its nearest centroid among the groups of centroids nearest to it (:class:`CentroidSearch`);
brute force costs ``nlist · d`` multiply-adds per token there. On a GPU both stay brute force, through a fused
Triton kernel where Triton is installed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from pyserini_aligner import kernels
from pyserini_aligner.index.codec_spec import PQ_CENTROIDS, CodecSpec

_CHUNK_ELEMENTS = 1 << 24  # score-matrix entries per assignment step
HIERARCHY_MIN_NLIST = 1024  # from this many centroids a CPU codec trains and assigns through a coarse level
SEARCH_PROBES = 10  # groups of centroids (of 2·sqrt(nlist)) searched per token by CentroidSearch
COARSE_POINTS = 256  # points per coarse centroid that train the first level of two_level_kmeans
_SEARCH_ROWS = 1 << 17  # tokens per CentroidSearch call


def nearest(x: Tensor, centroids: Tensor, metric: str = "ip") -> Tensor:
    """Index [n] of the nearest centroid [k, d] of each row of x [n, d] by inner product ("ip") or L2 ("l2"). By
    inner product on a GPU with Triton, a fused kernel in float16 (:func:`pyserini_aligner.kernels.nearest`);
    elsewhere chunked matmuls."""
    if metric == "ip" and x.device.type == "cuda" and kernels.nearest_supported(x, centroids):
        return kernels.nearest(x, centroids)
    budget = _CHUNK_ELEMENTS * (4 if x.device.type == "cuda" else 1)
    rows = max(1, budget // max(1, len(centroids)))
    bias = -0.5 * (centroids * centroids).sum(-1) if metric == "l2" else None
    out = torch.empty(len(x), dtype=torch.long, device=x.device)
    for start in range(0, len(x), rows):
        scores = x[start:start + rows] @ centroids.T
        if bias is not None:
            scores += bias
        out[start:start + rows] = scores.argmax(-1)
    return out


def kmeans(x: Tensor, k: int, iters: int = 10, seed: int = 0, spherical: bool = False) -> Tensor:
    """Lloyd's k-means: centroids [k, d] of x [n, d] (n >= k), in x's dtype and device.

    spherical: unit-norm centroids and inner-product assignment (for L2-normalised x); else L2. Empty clusters are
    re-seeded with random points. Deterministic for a given seed on a given device.
    """
    if len(x) == 0:
        raise ValueError("k-means needs at least one point")
    gen = torch.Generator().manual_seed(seed)
    if len(x) <= k:  # no more points than centroids: every point is a centroid, the rest repeat points
        pick = torch.cat([torch.arange(len(x)), torch.randint(len(x), (k - len(x),), generator=gen)])
        return x[pick.to(x.device)].clone()
    if x.device.type == "cpu" and _faiss_kmeans_available():
        return _faiss_kmeans(x, k, iters, seed, spherical)
    centroids = x[torch.randperm(len(x), generator=gen)[:k].to(x.device)].clone()
    metric = "ip" if spherical else "l2"
    for _ in range(iters):
        assign = nearest(x, centroids, metric)
        sums = torch.zeros_like(centroids).index_add_(0, assign, x)
        counts = torch.bincount(assign, minlength=k)
        empty = counts == 0
        centroids = sums / counts.clamp_min(1).unsqueeze(1).to(x.dtype)
        if empty.any():
            refill = torch.randint(len(x), (int(empty.sum()),), generator=gen).to(x.device)
            centroids[empty] = x[refill]
        if spherical:
            centroids = torch.nn.functional.normalize(centroids, dim=-1)
    return centroids


def coarse_count(k: int) -> int:
    """Coarse clusters above ``k`` centroids in two-level k-means: round(sqrt(k)), at least 1 (CentroidSearch groups
    them finer: coarse_count(4·k) groups)."""
    return max(1, int(round(k ** 0.5)))


def share_centroids(counts: np.ndarray, k: int) -> np.ndarray:
    """Centroids per coarse cluster: int64 [len(counts)] proportional to the clusters' point ``counts`` (largest
    remainders first, ties to the lower index), at most a cluster's count, summing to min(k, counts.sum())."""
    counts = np.asarray(counts, dtype=np.int64)
    k = min(k, int(counts.sum()))
    quota = k * counts / max(int(counts.sum()), 1)
    share = np.minimum(np.floor(quota).astype(np.int64), counts)
    while (missing := k - int(share.sum())) > 0:
        gap = np.where(share < counts, quota - share, -np.inf)
        share[np.argsort(-gap, kind="stable")[:min(missing, int((share < counts).sum()))]] += 1
    return share


def two_level_kmeans(x: Tensor, k: int, iters: int = 10, seed: int = 0, refine: int = 1) -> Tensor:
    """Spherical k-means in two levels: ``coarse_count(k)`` clusters (trained on up to COARSE_POINTS points each) of
    x [n, d] (unit rows, CPU), then k-means inside each cluster with centroids in proportion to its size
    (:func:`share_centroids`), then ``refine`` Lloyd steps over all k centroids with :class:`CentroidSearch`
    assignment (they move the centroids that a cluster border cut off); [k, d] unit centroids. About sqrt(k) times
    fewer multiply-adds than one k-means of k centroids on the same points."""
    if len(x) <= k:
        return kmeans(x, k, iters, seed, spherical=True)
    gen = torch.Generator().manual_seed(seed)
    first = torch.randperm(len(x), generator=gen)[:COARSE_POINTS * coarse_count(k)]
    coarse = kmeans(x[first], coarse_count(k), iters, seed, spherical=True)
    assign = nearest(x, coarse)
    counts = torch.bincount(assign, minlength=len(coarse)).numpy()
    share = share_centroids(counts, k)
    order = torch.argsort(assign, stable=True)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    centroids = torch.cat([kmeans(x[order[bounds[c]:bounds[c + 1]]], int(share[c]), iters, seed + 1 + int(c),
                                  spherical=True) for c in np.flatnonzero(share)])
    for _ in range(refine):
        assign = CentroidSearch(centroids, seed=seed)(x)
        sums = torch.zeros_like(centroids).index_add_(0, assign, x)
        filled = torch.bincount(assign, minlength=k) > 0  # an emptied centroid stays where it was
        centroids = torch.where(filled[:, None], torch.nn.functional.normalize(sums, dim=-1), centroids)
    return centroids


class CentroidSearch:
    """Nearest centroid by inner product, searched among the centroids of the ``probes`` groups nearest each vector.

    The centroids [k, d] are grouped by a seeded spherical k-means of the centroids themselves into
    ``coarse_count(4·k)`` (2·sqrt(k)) groups, so a codec loaded from disk groups them as the one that wrote it. A
    vector scores the group centres, then the centroids of its ``probes`` best groups (about probes / (2·sqrt(k)) of
    all), in a FAISS IndexIVFFlat whose lists are the groups. probes >= the number of groups searches every
    centroid: exact.
    """

    def __init__(self, centroids: Tensor, probes: int = SEARCH_PROBES, seed: int = 0):
        import faiss

        if probes < 1:
            raise ValueError(f"probes must be >= 1, got {probes}")
        self.centroids = centroids.detach().float().cpu().contiguous()
        self.centres = kmeans(self.centroids, coarse_count(4 * len(centroids)), 10, seed, spherical=True)
        group = nearest(self.centroids, self.centres)
        self.order = torch.argsort(group, stable=True)  # centroid ids, group by group (ascending within a group)
        self.bounds = np.concatenate([[0], np.cumsum(torch.bincount(group, minlength=len(self.centres)).numpy())])
        self.probes = min(probes, len(self.centres))
        dim = self.centroids.shape[1]
        quantizer = faiss.IndexFlatIP(dim)
        quantizer.add(np.ascontiguousarray(self.centres.numpy()))
        index = faiss.IndexIVFFlat(quantizer, dim, len(self.centres), faiss.METRIC_INNER_PRODUCT)
        index.own_fields = True
        quantizer.this.disown()
        labels = np.ascontiguousarray(self.order.numpy().astype(np.int64))
        codes = np.ascontiguousarray(self.centroids[self.order].numpy()).view(np.uint8)  # [k, 4·d] bytes
        for g in np.flatnonzero(np.diff(self.bounds)):
            a, b = int(self.bounds[g]), int(self.bounds[g + 1])
            index.invlists.add_entries(int(g), b - a, faiss.swig_ptr(labels[a:b]), faiss.swig_ptr(codes[a:b]))
        index.ntotal, index.is_trained, index.nprobe = len(labels), True, self.probes
        self.index = index

    def __call__(self, x: Tensor) -> Tensor:
        """Index [n] (int64) of the nearest centroid found for each row of x [n, d] (CPU)."""
        found = torch.empty(len(x), dtype=torch.long)
        for start in range(0, len(x), _SEARCH_ROWS):
            part = x[start:start + _SEARCH_ROWS].detach().float()
            _, ids = self.index.search(np.ascontiguousarray(part.numpy()), 1)
            ids = torch.from_numpy(ids[:, 0])
            lost = ids < 0  # every probed group empty (a group centre no centroid is nearest to)
            if lost.any():
                ids[lost] = nearest(part[lost], self.centroids)
            found[start:start + _SEARCH_ROWS] = ids
        return found


def _faiss_kmeans_available() -> bool:
    try:
        import faiss  # noqa: F401
    except ImportError:
        return False
    return True


def _faiss_kmeans(x: Tensor, k: int, iters: int, seed: int, spherical: bool) -> Tensor:
    """FAISS's k-means on the CPU (the same Lloyd iterations, in optimised C++), on one thread: on a busy machine
    its threads wait on each other at every step for far longer than they save (the result is the same)."""
    import faiss

    data = np.ascontiguousarray(x.detach().float().numpy())
    km = faiss.Kmeans(data.shape[1], k, niter=iters, seed=seed + 1, spherical=spherical,
                      max_points_per_centroid=max(256, (len(data) + k - 1) // k), min_points_per_centroid=1,
                      verbose=False)
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        km.train(data)
    finally:
        faiss.omp_set_num_threads(threads)
    return torch.from_numpy(np.array(km.centroids)).to(x.dtype)


def train_pq(residuals: Tensor, m: int, iters: int = 10, seed: int = 0) -> Tensor:
    """float32 codebooks [m, 256, d/m]: k-means of each of the m sub-vectors of ``residuals`` [n, d]."""
    parts = residuals.reshape(len(residuals), m, residuals.shape[1] // m).transpose(0, 1)
    return torch.stack([kmeans(part.contiguous(), PQ_CENTROIDS, iters, seed + 1 + j)
                        for j, part in enumerate(parts)]).float()


def pq_encode(residuals: Tensor, books: Tensor) -> np.ndarray:
    """uint8 [n, m]: nearest codeword (L2) of each of the m sub-vectors of ``residuals`` [n, d] in ``books``
    [m, 256, d/m]. Sub-vectors of fewer than 16 dims on the CPU go through FAISS's ``ProductQuantizer`` where FAISS
    is installed: it finds each one's nearest codeword on its own, never writing the [n, m, 256] distances (about
    12 times faster for 4 dims), and, unlike its BLAS path for longer sub-vectors, with the same sums whatever the
    threads, so every process of a build gives a token the same code. Else batched products."""
    m, sub = books.shape[0], books.shape[2]
    if residuals.device.type == "cpu" and sub < 16 and _faiss_kmeans_available():
        return _faiss_pq_encode(residuals, books)
    parts = residuals.reshape(len(residuals), m, sub).transpose(0, 1)  # [m, n, sub]
    books = books.to(residuals)
    bias = (books * books).sum(-1).unsqueeze(1)  # [m, 1, 256]: |c|², so that |c|² − 2 x·c orders by distance
    rows = max(1, _CHUNK_ELEMENTS * (4 if residuals.device.type == "cuda" else 1) // (m * books.shape[1]))
    codes = torch.empty(m, len(residuals), dtype=torch.uint8, device=residuals.device)
    for start in range(0, len(residuals), rows):  # every sub-quantiser in one batched product per block of rows
        part = parts[:, start:start + rows]
        codes[:, start:start + rows] = torch.baddbmm(bias, part, books.transpose(1, 2), alpha=-2.0).argmin(-1)
    return codes.T.contiguous().cpu().numpy()


def _faiss_pq_encode(residuals: Tensor, books: Tensor) -> np.ndarray:
    import faiss

    m, sub = books.shape[0], books.shape[2]
    pq = faiss.ProductQuantizer(m * sub, m, 8)
    faiss.copy_array_to_vector(np.ascontiguousarray(books.detach().float().numpy().ravel()), pq.centroids)
    return pq.compute_codes(np.ascontiguousarray(residuals.detach().float().numpy()))


def row_norms(x: Tensor) -> Tensor:
    """float32 [...]: the length of every row of x [..., d], summed in float64 so that a row's length does not
    depend on the rows decoded with it (vectorised float32 sums order their terms by position)."""
    return torch.linalg.vector_norm(x, dim=-1, dtype=torch.float64).float()


def unit_rows(x: Tensor) -> Tensor:
    """x [..., d] float32 with every row scaled to unit length (zero rows stay zero). A token's decoded vector,
    centroid plus residual, is scaled so: the model's tokens are unit vectors, and the scaling removes the part of
    the coding error along the token's own direction, the part that moves its best-match scores most."""
    return x / row_norms(x).clamp_min(1e-12).unsqueeze(-1)


def quantize_centroids(centroids: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(int8 [k, d], float32 scales [k]): centroid i ≈ int8[i] · scales[i], scale = max |component| / 127."""
    scales = centroids.abs().amax(-1).clamp_min(1e-12) / 127.0
    values = torch.round(centroids / scales.unsqueeze(-1)).clamp(-127, 127)
    return values.cpu().numpy().astype(np.int8), scales.cpu().numpy().astype(np.float32)


def dequantize_centroids(values: np.ndarray, scales: np.ndarray) -> Tensor:
    """float32 [k, d] centroids from :func:`quantize_centroids` output."""
    return torch.from_numpy(values.astype(np.float32) * scales[:, None].astype(np.float32))


def restricted_search(nlist: int, device: str | torch.device) -> bool:
    """Whether a codec of ``nlist`` centroids on ``device`` trains by two-level k-means and assigns through
    :class:`CentroidSearch` (large codecs on a CPU) instead of brute force."""
    return torch.device(device).type == "cpu" and nlist >= HIERARCHY_MIN_NLIST


@dataclass
class ResidualCodec:
    """Trained parameters of an ``IVF<nlist>,PQ<M>[,Refine(PQ<R>)]`` codec: centroids [nlist, d], codebooks
    [M, 256, d/M] (the inverted lists' codes), refine_books [R, 256, d/R] (every token's residual code; None: the
    tokens store codes of ``codebooks``)."""

    centroids: Tensor
    codebooks: Tensor
    refine_books: Tensor | None = None
    _search: CentroidSearch | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def spec(self) -> CodecSpec:
        return CodecSpec(len(self.centroids), len(self.codebooks),
                         0 if self.refine_books is None else len(self.refine_books))

    @property
    def token_books(self) -> Tensor:
        """Codebooks [R, 256, d/R] of every token's residual code."""
        return self.codebooks if self.refine_books is None else self.refine_books

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_search": None}  # the FAISS search is rebuilt where it is needed

    def to(self, device: str | torch.device) -> "ResidualCodec":
        """This codec with its tensors on ``device``."""
        return ResidualCodec(self.centroids.to(device), self.codebooks.to(device),
                             None if self.refine_books is None else self.refine_books.to(device))

    @classmethod
    def train(cls, spec: CodecSpec, sample: Tensor, residual_sample: Tensor | None = None, iters: int = 10,
              seed: int = 0) -> "ResidualCodec":
        """Fit centroids on ``sample`` [n, d] (unit vectors) and the PQ codebooks (and the refinement's) on the
        residuals of ``residual_sample`` (default: sample) [n', d], float32 on any device. Centroids are rounded
        as stored (int8 with a per-centroid scale); residuals are taken as :meth:`encode_centroids` assigns."""
        if not spec.compressed:
            raise ValueError("fp16 has nothing to train")
        dim = sample.shape[1]
        spec.check(dim)
        if restricted_search(spec.nlist, sample.device):
            centroids = two_level_kmeans(sample, spec.nlist, iters, seed)
        else:
            centroids = kmeans(sample, spec.nlist, iters, seed, spherical=True)
        centroids = dequantize_centroids(*quantize_centroids(centroids)).to(sample.device)
        base = sample if residual_sample is None else residual_sample
        codec = cls(centroids.float(), centroids.new_zeros(spec.pq_m, PQ_CENTROIDS, dim // spec.pq_m))
        ids = torch.from_numpy(codec.encode_centroids(base).astype(np.int64))
        residuals = base - codec.centroids[ids.to(base.device)]
        codec.codebooks = train_pq(residuals, spec.pq_m, iters, seed)
        if spec.refine_m:
            codec.refine_books = train_pq(residuals, spec.refine_m, iters, seed + spec.pq_m)
        return codec

    def encode_centroids(self, x: Tensor) -> np.ndarray:
        """uint16 [n]: nearest centroid (inner product) of each row of x [n, d]: brute force (on a GPU the fused
        kernel of :func:`nearest`, else TF32 matmuls), or through a :class:`CentroidSearch` for a large codec on a CPU (built once per codec, seeded)."""
        if restricted_search(len(self.centroids), x.device):
            if self._search is None:
                self._search = CentroidSearch(self.centroids.cpu())
            return self._search(x.float()).numpy().astype(np.uint16)
        saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = x.device.type == "cuda"
        try:
            return nearest(x, self.centroids.to(x)).cpu().numpy().astype(np.uint16)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = saved

    def encode_residuals(self, x: Tensor, centroid_ids: np.ndarray) -> np.ndarray:
        """uint8 [n, R]: every token's residual code (of :attr:`token_books`) of x − its centroid (x [n, d],
        centroid_ids [n])."""
        return pq_encode(x - self._centroids_of(x, centroid_ids), self.token_books)

    def encode_list_codes(self, x: Tensor, centroid_ids: np.ndarray, residual_codes: np.ndarray) -> np.ndarray:
        """uint8 [n, M]: the inverted-list codes (of :attr:`codebooks`) of tokens x [n, d] whose token codes are
        ``residual_codes`` [n, R] (the same codes where the codec has no refinement tier)."""
        if self.refine_books is None:
            return np.ascontiguousarray(residual_codes)
        return pq_encode(x - self._centroids_of(x, centroid_ids), self.codebooks)

    def _centroids_of(self, x: Tensor, centroid_ids: np.ndarray) -> Tensor:
        ids = torch.from_numpy(np.asarray(centroid_ids, dtype=np.int64)).to(x.device)
        return self.centroids.to(x)[ids]

    def decode(self, centroid_ids: np.ndarray, residual_codes: np.ndarray | None = None,
               device: str | torch.device = "cpu") -> Tensor:
        """float32 [n, d] vectors: the centroid alone, or, given the token codes ``residual_codes`` [n, R], the
        token: centroid plus residual scaled to unit length (:func:`unit_rows`)."""
        ids = torch.from_numpy(np.asarray(centroid_ids, dtype=np.int64)).to(device)
        out = self.centroids.to(device)[ids]
        if residual_codes is None:
            return out
        return unit_rows(out + self.residual_vectors(residual_codes, device))

    def residual_vectors(self, residual_codes: np.ndarray, device: str | torch.device = "cpu") -> Tensor:
        """float32 [n, d] decoded residuals of token codes [n, R]."""
        codes = torch.from_numpy(np.asarray(residual_codes, dtype=np.int64)).to(device)
        books = self.token_books.to(device)
        return books[torch.arange(books.shape[0], device=device), codes].reshape(len(codes), -1)

    def faiss_index(self, parts=()):
        """A searchable FAISS IndexIVFPQ (inner product, by residual) over this codec, holding the inverted lists
        ``parts``: (ivf_offsets [nlist+1] int64, labels [K] int64, codes [K, M] uint8) per segment, appended in order."""
        import faiss

        centroids = np.ascontiguousarray(self.centroids.cpu().numpy(), dtype=np.float32)
        dim, m = centroids.shape[1], len(self.codebooks)
        quantizer = faiss.IndexFlatIP(dim)
        quantizer.add(centroids)
        index = faiss.IndexIVFPQ(quantizer, dim, len(centroids), m, 8, faiss.METRIC_INNER_PRODUCT)
        index.own_fields = True
        quantizer.this.disown()
        faiss.copy_array_to_vector(np.ascontiguousarray(self.codebooks.cpu().numpy().ravel(), dtype=np.float32),
                                   index.pq.centroids)
        index.is_trained = True
        total = 0
        for offsets, labels, codes in parts:
            labels = np.ascontiguousarray(labels, dtype=np.int64)
            codes = np.ascontiguousarray(codes, dtype=np.uint8)
            for c in np.flatnonzero(np.diff(offsets)):
                a, b = int(offsets[c]), int(offsets[c + 1])
                index.invlists.add_entries(int(c), b - a, faiss.swig_ptr(labels[a:b]), faiss.swig_ptr(codes[a:b]))
            total += len(labels)
        index.ntotal = total
        return index
