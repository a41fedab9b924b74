"""Token codecs: how an index stores its token vectors, named by FAISS-style factory strings.

- ``fp16``: every token as float16 (2·d bytes); FAISS keeps its own copy of the kept tokens (``index_type``).
- ``IVF<nlist>,PQ<M>``: a residual codec in the style of PLAID. Every token stores the id of its nearest of
  ``nlist`` spherical k-means centroids (uint16; centroids stored as int8 with a per-centroid scale) and an M-byte product-quantised residual (M sub-vectors of d/M
  dims, 256 centroids each): 2 + M bytes per token. A token decodes to centroid + residual. These (centroid id,
  residual) pairs are exactly FAISS ``IndexIVFPQ`` codes, so the searcher builds its FAISS index from the codes of
  the kept tokens (the β^d most salient of each document) at load time: candidate generation and refinement read
  one store.

Training (k-means) and encoding run in torch, on the CPU or a GPU; decoding is a table lookup.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

FP16 = "fp16"
PQ_CENTROIDS = 256  # 8-bit sub-quantizer codes
_SPEC = re.compile(r"IVF(\d+),PQ(\d+)")
_CHUNK_ELEMENTS = 1 << 24  # score-matrix entries per assignment step


@dataclass(frozen=True)
class CodecSpec:
    """A parsed codec string: nlist = 0 means fp16 (no compression)."""

    nlist: int = 0
    pq_m: int = 0

    @property
    def compressed(self) -> bool:
        return self.nlist > 0

    def __str__(self) -> str:
        return f"IVF{self.nlist},PQ{self.pq_m}" if self.compressed else FP16


def parse_codec(spec: str, dim: int | None = None) -> CodecSpec:
    """Parse "fp16" or "IVF<nlist>,PQ<M>" (2 <= nlist <= 65536, M divides ``dim``); ValueError naming the problem."""
    if not isinstance(spec, str):
        raise TypeError(f"codec must be a string, got {type(spec).__name__}")
    if spec.strip().lower() == FP16:
        return CodecSpec()
    match = _SPEC.fullmatch(spec.strip())
    if not match:
        raise ValueError(f"bad codec {spec!r}: expected 'fp16' or 'IVF<nlist>,PQ<M>' (e.g. IVF4096,PQ16)")
    nlist, pq_m = int(match[1]), int(match[2])
    if not 2 <= nlist <= 65536:
        raise ValueError(f"bad codec {spec!r}: nlist must be in [2, 65536] (centroid ids are uint16), got {nlist}")
    if pq_m < 1 or (dim is not None and dim % pq_m):
        raise ValueError(f"bad codec {spec!r}: PQ{pq_m} must split the {dim}-d vectors into equal sub-vectors")
    return CodecSpec(nlist, pq_m)


def nearest(x: Tensor, centroids: Tensor, metric: str = "ip") -> Tensor:
    """Index [n] of the nearest centroid [k, d] of each row of x [n, d] by inner product ("ip") or L2 ("l2")."""
    rows = max(1, _CHUNK_ELEMENTS // max(1, len(centroids)))
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
    if len(x) < k:
        raise ValueError(f"k-means needs at least k={k} points, got {len(x)}")
    gen = torch.Generator().manual_seed(seed)
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


def quantize_centroids(centroids: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(int8 [k, d], float32 scales [k]): centroid i ≈ int8[i] · scales[i], scale = max |component| / 127."""
    scales = centroids.abs().amax(-1).clamp_min(1e-12) / 127.0
    values = torch.round(centroids / scales.unsqueeze(-1)).clamp(-127, 127)
    return values.cpu().numpy().astype(np.int8), scales.cpu().numpy().astype(np.float32)


def dequantize_centroids(values: np.ndarray, scales: np.ndarray) -> Tensor:
    """float32 [k, d] centroids from :func:`quantize_centroids` output."""
    return torch.from_numpy(values.astype(np.float32) * scales[:, None].astype(np.float32))


@dataclass
class ResidualCodec:
    """Trained parameters of an ``IVF<nlist>,PQ<M>`` codec: centroids [nlist, d], codebooks [M, 256, d/M]."""

    centroids: Tensor
    codebooks: Tensor

    @property
    def spec(self) -> CodecSpec:
        return CodecSpec(len(self.centroids), len(self.codebooks))

    @classmethod
    def train(cls, spec: CodecSpec, sample: Tensor, residual_sample: Tensor | None = None, iters: int = 10,
              seed: int = 0) -> "ResidualCodec":
        """Fit centroids on ``sample`` [n, d] (unit vectors) and PQ codebooks on the residuals of
        ``residual_sample`` (default: sample) [n', d], float32 on any device. Centroids are rounded
        as stored (int8 with a per-centroid scale)."""
        if not spec.compressed:
            raise ValueError("fp16 has nothing to train")
        dim = sample.shape[1]
        parse_codec(str(spec), dim)
        if len(sample) < spec.nlist:
            raise ValueError(f"codec {spec}: {len(sample)} training vectors for {spec.nlist} centroids; use a smaller "
                             "nlist or more documents")
        centroids = kmeans(sample, spec.nlist, iters, seed, spherical=True)
        centroids = dequantize_centroids(*quantize_centroids(centroids)).to(sample.device)
        base = sample if residual_sample is None else residual_sample
        if len(base) < PQ_CENTROIDS:
            raise ValueError(f"codec {spec}: {len(base)} residuals to train PQ{spec.pq_m} on, at least "
                             f"{PQ_CENTROIDS} needed; use more documents or a larger β^d")
        residuals = base - centroids[nearest(base, centroids)]
        parts = residuals.reshape(len(residuals), spec.pq_m, dim // spec.pq_m).transpose(0, 1)
        codebooks = torch.stack([kmeans(part.contiguous(), PQ_CENTROIDS, iters, seed + 1 + m)
                                 for m, part in enumerate(parts)])
        return cls(centroids.float(), codebooks.float())

    def encode_centroids(self, x: Tensor) -> np.ndarray:
        """uint16 [n]: nearest centroid (inner product) of each row of x [n, d]."""
        return nearest(x, self.centroids.to(x)).cpu().numpy().astype(np.uint16)

    def encode_residuals(self, x: Tensor, centroid_ids: np.ndarray) -> np.ndarray:
        """uint8 [n, M]: PQ codes of x − its centroid (x [n, d], centroid_ids [n])."""
        m, sub = self.codebooks.shape[0], self.codebooks.shape[2]
        ids = torch.from_numpy(centroid_ids.astype(np.int64)).to(x.device)
        residuals = (x - self.centroids.to(x)[ids]).reshape(len(x), m, sub)
        books = self.codebooks.to(x)
        codes = torch.stack([nearest(residuals[:, j].contiguous(), books[j], "l2") for j in range(m)], dim=1)
        return codes.cpu().numpy().astype(np.uint8)

    def decode(self, centroid_ids: np.ndarray, residual_codes: np.ndarray | None = None,
               device: str | torch.device = "cpu") -> Tensor:
        """float32 [n, d] vectors: centroid, plus the PQ residual when ``residual_codes`` [n, M] is given."""
        ids = torch.from_numpy(np.asarray(centroid_ids, dtype=np.int64)).to(device)
        out = self.centroids.to(device)[ids]
        if residual_codes is not None:
            out += self.residual_vectors(residual_codes, device)
        return out

    def residual_vectors(self, residual_codes: np.ndarray, device: str | torch.device = "cpu") -> Tensor:
        """float32 [n, d] decoded PQ residuals of codes [n, M]."""
        codes = torch.from_numpy(np.asarray(residual_codes, dtype=np.int64)).to(device)
        books = self.codebooks.to(device)
        return books[torch.arange(books.shape[0], device=device), codes].reshape(len(codes), -1)

    def faiss_codes(self, centroid_ids: np.ndarray, residual_codes: np.ndarray) -> np.ndarray:
        """uint8 [n, coarse bytes + M]: FAISS IndexIVFPQ stand-alone codes (little-endian list id, then PQ code)."""
        coarse = max(1, (int(len(self.centroids) - 1).bit_length() + 7) // 8)
        ids = np.asarray(centroid_ids, dtype="<u2").view(np.uint8).reshape(-1, 2)[:, :coarse]
        return np.ascontiguousarray(np.concatenate([ids, np.asarray(residual_codes, dtype=np.uint8)], axis=1))

    def faiss_index(self, centroid_ids: np.ndarray, residual_codes: np.ndarray, ids: np.ndarray):
        """A searchable FAISS IndexIVFPQ (inner product) holding the given codes under int64 ``ids``."""
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
        if len(ids):
            codes = self.faiss_codes(centroid_ids, residual_codes)
            if codes.shape[1] != index.sa_code_size():
                raise AssertionError(f"code size {codes.shape[1]} != FAISS sa_code_size {index.sa_code_size()}")
            index.add_sa_codes(codes, np.ascontiguousarray(ids, dtype=np.int64))
        return index
