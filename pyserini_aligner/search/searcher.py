"""AlignerSearcher: multi-vector AligneR retrieval over an index built by :mod:`pyserini_aligner.index`.

Per query: encode, keep the β^q most salient query tokens, FAISS-search ``k_per_token`` doc-token neighbours per
kept token, map hits to documents, keep the ``max_candidates`` best documents by a cheap proxy score, then rescore
them exactly with the alignment score over their stored tokens and return the top k. A drop-in for Pyserini's
``FaissSearcher``: ``search``/``batch_search`` return ``DenseSearchResult`` lists. With ``device="cuda"`` the same
pipeline runs as torch tensor operations (:mod:`.torch_backend`).
"""
from __future__ import annotations

import contextlib
import logging
import os
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from pyserini_aligner.alignment import Strategy, alignment_scores, parse_strategy
from pyserini_aligner.index.store import Manifest, StoredIndex, Workspace
from pyserini_aligner.model import AlignerModel, EncodedText
from pyserini_aligner.salience import prune_mask

log = logging.getLogger(__name__)

REFINE_WITH = ("all", "kept")
BACKENDS = ("faiss", "torch")
DEFAULT_MAX_CANDIDATES = 256
REFINE_CHUNK = 512  # documents scored at once during refinement (bounds the padded token tensor)
DEFAULT_NPROBE = 32
DEFAULT_EF_SEARCH = 128


@lru_cache(maxsize=None)
def dense_result_classes():
    """Pyserini's (DenseSearchResult, PrfDenseSearchResult), imported on first use (Pyserini starts a JVM)."""
    from pyserini.search.faiss._prf import PrfDenseSearchResult
    from pyserini.search.faiss._searcher import DenseSearchResult

    return DenseSearchResult, PrfDenseSearchResult


def load_model(encoder, manifest: Manifest, index_dir: str | os.PathLike, device: str = "cpu") -> AlignerModel:
    """The AlignerModel to query ``index_dir`` with: ``encoder`` (a checkpoint name/folder, an AlignerModel or an
    encoder wrapping one in ``.model``) or, when None, the model named in the manifest. Its dim and fingerprint
    must match the manifest (ValueError otherwise)."""
    if encoder is None:
        if not manifest.model_name:
            raise ValueError(f"index {index_dir} was built with an in-memory model and records no model name; "
                             "pass the encoder (checkpoint folder or AlignerModel) explicitly")
        encoder = manifest.model_name
    if isinstance(encoder, AlignerModel):
        model = encoder
    elif isinstance(getattr(encoder, "model", None), AlignerModel):
        model = encoder.model
    elif isinstance(encoder, (str, os.PathLike)):
        model = AlignerModel.from_pretrained(str(encoder), device=device)
    else:
        raise TypeError("encoder must be an AligneR checkpoint name/folder or an AlignerModel, "
                        f"got {type(encoder).__name__}")
    if model.config.dim != manifest.dim:
        raise ValueError(f"encoder produces {model.config.dim}-d vectors but index {index_dir} holds "
                         f"{manifest.dim}-d vectors")
    fingerprint = model.fingerprint()
    if fingerprint != manifest.model_fingerprint:
        raise ValueError(f"model fingerprint mismatch: index {index_dir} was built with model "
                         f"{manifest.model_name or '<in-memory>'} (fingerprint {manifest.model_fingerprint[:12]}…), "
                         f"the encoder given has fingerprint {fingerprint[:12]}…; use the index's model or rebuild "
                         "the index")
    return model


def pad_encoded(encoded: Sequence[EncodedText], dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(vectors [B, n, d] float32, mask [B, n] bool, salience [B, n] float32) from per-text encodings."""
    width = max([len(e.vectors) for e in encoded] + [1])
    vectors = torch.zeros(len(encoded), width, dim)
    salience = torch.zeros(len(encoded), width)
    mask = torch.zeros(len(encoded), width, dtype=torch.bool)
    for row, e in enumerate(encoded):
        n = len(e.vectors)
        vectors[row, :n] = torch.from_numpy(e.vectors)
        salience[row, :n] = torch.from_numpy(e.salience)
        mask[row, :n] = True
    return vectors, mask, salience


def top_rows(scores: np.ndarray, rows: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k best scores, best first; equal scores go to the lower document row."""
    order = np.lexsort((rows, -scores))
    return order[:k]


def faiss_to_gpu(index, device: str):
    """(GPU resources, ``index`` copied to CUDA device ``device``) when the installed faiss has GPU support; a
    ValueError otherwise (the faiss-cpu wheel has none: use the torch backend)."""
    import faiss

    if not hasattr(faiss, "StandardGpuResources"):
        raise ValueError(f"backend 'faiss' on {device} needs faiss built with GPU support (faiss-gpu); the installed "
                         "faiss has none: use backend 'torch' (the default on CUDA)")
    resources = faiss.StandardGpuResources()
    return resources, faiss.index_cpu_to_gpu(resources, int(str(device).partition(":")[2] or 0), index)


@contextlib.contextmanager
def compute_threads(threads: int):
    """Run FAISS (OpenMP) and torch with ``threads`` threads inside the block (torch's setting is restored)."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    try:
        import faiss

        faiss.omp_set_num_threads(threads)
    except ImportError:  # torch-only installs (the torch backend needs no FAISS)
        pass
    saved = torch.get_num_threads()
    if saved != threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if saved != threads:
            torch.set_num_threads(saved)


class AlignerSearcher:
    """Search an AligneR index; ``search``/``batch_search`` mirror Pyserini's ``FaissSearcher``.

    index_dir: folder written by ``python -m pyserini_aligner.index``. encoder: None (the model in the manifest),
    a checkpoint name/folder, an AlignerModel or an AlignerQueryEncoder. strategy: alignment strategy for
    refinement (default: the manifest's). k_per_token: FAISS neighbours per kept query token. query_prune: β^q,
    fraction of query tokens sent to FAISS (refinement always uses all). max_candidates: documents refined per
    query (at least k). refine_with: "all" stored doc tokens or only the "kept" ones. nprobe / ef_search: FAISS
    IVF / HNSW search parameters (None: min(32, nlist) and max(128, k_per_token)). device: where queries are
    encoded and, with the torch backend, searched. backend: "faiss" (FAISS candidate generation, refinement from
    the memory-mapped store; the default on CPU) or "torch" (every token decoded into device memory, candidate
    generation and refinement as tensor ops; the default on CUDA, see :mod:`.torch_backend`). Not thread-safe: use
    one searcher per thread (``threads`` parallelises inside a search).
    """

    def __init__(self, index_dir: str | os.PathLike, encoder=None, strategy: str | Strategy | None = None,
                 k_per_token: int = 100, query_prune: float = 1.0, max_candidates: int = DEFAULT_MAX_CANDIDATES,
                 refine_with: str = "all", nprobe: int | None = None, ef_search: int | None = None,
                 device: str = "cpu", batch_size: int = 32, backend: str | None = None):
        self.index_dir = Path(index_dir)
        self.store = StoredIndex(self.index_dir)
        self.manifest = self.store.manifest
        self.model = load_model(encoder, self.manifest, self.index_dir, device)
        backend = backend or ("torch" if str(device).startswith("cuda") else "faiss")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.backend = backend
        self.strategy = parse_strategy(strategy if strategy is not None else self.manifest.default_strategy)
        if k_per_token < 1 or max_candidates < 1 or batch_size < 1:
            raise ValueError("k_per_token, max_candidates and batch_size must be >= 1, got "
                             f"{k_per_token}, {max_candidates}, {batch_size}")
        if not 0.0 < query_prune <= 1.0:
            raise ValueError(f"query_prune must be in (0, 1], got {query_prune}")
        if refine_with not in REFINE_WITH:
            raise ValueError(f"refine_with must be one of {REFINE_WITH}, got {refine_with!r}")
        self.k_per_token, self.query_prune, self.max_candidates = k_per_token, query_prune, max_candidates
        self.refine_with, self.batch_size = refine_with, batch_size
        self.use_salience = self.model.scores_with_salience
        self._workspace = Workspace()
        self.index = self.tokens = self._graphed = None
        if backend == "faiss":
            self.index = self.store.faiss_index()
            self._set_faiss_params(nprobe, ef_search)
            if str(device).startswith("cuda"):
                self._gpu_resources, self.index = faiss_to_gpu(self.index, device)
        else:
            from pyserini_aligner.search.torch_backend import TorchTokenIndex

            if nprobe is not None or ef_search is not None:
                raise ValueError("nprobe / ef_search tune FAISS; the torch backend searches exactly")
            self.tokens = TorchTokenIndex(self.store, device, refine_with, with_salience=self.use_salience)
            self._graphed = self._capture_query_encoder() if self.model.device.type == "cuda" else None
        self.graphed_queries = self._graphed is not None  # one query at a time goes through a CUDA graph
        # Pyserini FaissSearcher attributes
        self.docids = self.store.docids
        self.dimension = self.manifest.dim
        self.num_docs = self.manifest.num_docs

    @classmethod
    def from_pyserini(cls, index_dir: str | os.PathLike, query_encoder=None, prebuilt_index_name: str | None = None,
                      normalize_distances: bool = False, faiss_device: str = "cpu", **kwargs) -> "AlignerSearcher":
        """Build from ``FaissSearcher``'s arguments (``query_encoder``: "aligner", a checkpoint folder or an
        AlignerQueryEncoder); ``prebuilt_index_name`` and ``normalize_distances`` are not supported."""
        if prebuilt_index_name or normalize_distances:
            raise ValueError("AligneR indexes support neither prebuilt_index_name nor normalize_distances")
        device = faiss_device if str(faiss_device).startswith("cuda") else "cpu"
        return cls(index_dir, encoder=query_encoder, device=device, **kwargs)

    def _set_faiss_params(self, nprobe: int | None, ef_search: int | None) -> None:
        import faiss

        space = faiss.ParameterSpace()
        ivf = faiss.try_extract_index_ivf(self.index)
        if ivf is not None:
            space.set_index_parameter(self.index, "nprobe", min(nprobe or DEFAULT_NPROBE, ivf.nlist))
        elif nprobe is not None:
            raise ValueError(f"nprobe given but the index ({self.manifest.index_type}) is not an IVF index")
        ef = max(ef_search or DEFAULT_EF_SEARCH, self.k_per_token)
        try:
            space.set_index_parameter(self.index, "efSearch", ef)
        except RuntimeError:
            if ef_search is not None:
                raise ValueError(f"ef_search given but the index ({self.manifest.index_type}) is not an HNSW "
                                 "index") from None

    # ------------------------------------------------------------------ public API
    def search(self, q: str, k: int = 10, threads: int = 1, remove_dups: bool = False, return_vector: bool = False):
        """Top-k documents for query text ``q`` as DenseSearchResult(docid, score), best first ([] for an empty query).

        remove_dups is accepted for Pyserini compatibility (results are unique per document already). With
        return_vector, returns (query vectors [n, d], [PrfDenseSearchResult(docid, score, doc vectors [m, d])]).
        """
        if not isinstance(q, str):
            raise TypeError(f"query must be a string, got {type(q).__name__}")
        hits = self.batch_search([q], ["q"], k=k, threads=threads, return_vector=return_vector)
        return (hits[0]["q"], hits[1]["q"]) if return_vector else hits["q"]

    def batch_search(self, queries: list[str], q_ids: list[str], k: int = 10, threads: int = 1,
                     return_vector: bool = False):
        """{q_id: [DenseSearchResult]} for many queries (batched encoding and FAISS search).

        With return_vector, returns ({q_id: query vectors [n, d]}, {q_id: [PrfDenseSearchResult]}).
        """
        if len(queries) != len(q_ids):
            raise ValueError(f"{len(queries)} queries but {len(q_ids)} q_ids")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        dense, prf = dense_result_classes()
        results, vectors = {}, {}
        with compute_threads(threads):
            for start in range(0, len(queries), self.batch_size):
                texts, ids = queries[start:start + self.batch_size], q_ids[start:start + self.batch_size]
                for qid, query_vectors, hits in zip(ids, *self._search_texts(texts, k)):
                    vectors[qid] = query_vectors
                    if return_vector:
                        results[qid] = [prf(self.docids[row], score, self._doc_vectors(row)) for row, score in hits]
                    else:
                        results[qid] = [dense(self.docids[row], score) for row, score in hits]
        return (vectors, results) if return_vector else results

    def rank(self, queries: list[str], k: int = 10, threads: int = 1) -> list[list[tuple[str, float]]]:
        """Top-k (docid, score) lists, best first, one per query: ``batch_search`` over plain data (no Pyserini
        result objects, so it also runs where Pyserini is not installed)."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        ranked = []
        with compute_threads(threads):
            for start in range(0, len(queries), self.batch_size):
                _, hits = self._search_texts(queries[start:start + self.batch_size], k)
                ranked += [[(self.docids[row], score) for row, score in query_hits] for query_hits in hits]
        return ranked

    # ------------------------------------------------------------------ pipeline
    def _search_texts(self, texts: list[str], k: int):
        """(query vectors per text, [(doc row, score)] per text)."""
        live = [i for i, text in enumerate(texts) if text.strip()]
        hits: list[list[tuple[int, float]]] = [[] for _ in texts]
        query_vectors = [np.zeros((0, self.dimension), dtype=np.float32) for _ in texts]
        if not live:
            return query_vectors, hits
        if self.tokens is not None:
            return self._search_torch([texts[i] for i in live], live, k, query_vectors, hits)
        encoded = self.model.encode([texts[i] for i in live], is_query=True, batch_size=self.batch_size)
        q, q_mask, q_sal = pad_encoded(encoded, self.dimension)
        kept = prune_mask(q_sal, q_mask, self.query_prune)
        probe = q[kept].numpy()  # [Σ kept, d], row-major over queries
        distances, labels = self.index.search(probe, self.k_per_token)
        bounds = np.concatenate([[0], np.cumsum(kept.sum(1).numpy())])
        for j, i in enumerate(live):
            query_vectors[i] = encoded[j].vectors
            rows = slice(bounds[j], bounds[j + 1])
            weights = q_sal[j][kept[j]].numpy() if self.use_salience else None
            candidates = self._candidates(distances[rows], labels[rows], weights, max(self.max_candidates, k))
            if len(candidates) < k:
                log.debug("query %d: FAISS found only %d candidate documents for k=%d (raise k_per_token)",
                          i, len(candidates), k)
            if len(candidates):
                hits[i] = self._refine(q[j:j + 1], q_mask[j:j + 1], q_sal[j:j + 1], candidates, k)
        return query_vectors, hits

    def _capture_query_encoder(self):
        from pyserini_aligner.search.torch_backend import GraphedQueryEncoder

        try:
            return GraphedQueryEncoder(self.model)
        except RuntimeError as err:  # a model whose forward pass syncs with the host cannot be captured
            log.warning("query encoding runs eagerly (CUDA graph capture failed: %s)", str(err).splitlines()[0])
            return None

    def _search_torch(self, texts: list[str], live: list[int], k: int, query_vectors: list, hits: list):
        """The torch backend: encode, prune, search and refine on the device; one transfer back per batch."""
        if len(texts) == 1 and self._graphed is not None:
            out = self._graphed(texts[0])
        else:
            out = self.model.encode_padded(texts, is_query=True, batch_size=self.batch_size)
        kept = prune_mask(out.salience, out.mask, self.query_prune)
        scores, rows = self.tokens.search(out.vectors, out.mask, out.salience, kept, k, self.k_per_token,
                                          self.max_candidates, self.strategy,
                                          out.salience if self.use_salience else None)
        scores, rows = scores.cpu().numpy(), rows.cpu().numpy()
        vectors, mask = out.vectors.cpu().numpy(), out.mask.cpu().numpy()
        for j, i in enumerate(live):
            query_vectors[i] = vectors[j][mask[j]]
            found = rows[j] >= 0
            hits[i] = list(zip(rows[j][found].tolist(), scores[j][found].tolist()))
        return query_vectors, hits

    def _candidates(self, distances: np.ndarray, labels: np.ndarray, weights: np.ndarray | None,
                    limit: int) -> np.ndarray:
        """Up to ``limit`` document rows (sorted) from FAISS hits distances/labels [r, K] of one query's kept tokens.

        Proxy score per doc: Σ over query tokens of w · (best hit similarity − that token's K-th similarity),
        i.e. a MaxSim estimate where a token's missing documents are imputed with its lowest retrieved score.
        """
        valid = labels >= 0
        if not valid.any():
            return np.zeros(0, dtype=np.int64)
        token_row, _ = np.nonzero(valid)
        sims = distances[valid]
        docs = self.store.doc_of_token(self.store.faiss_ids[labels[valid]])
        floor = np.where(valid, distances, np.inf).min(axis=1)
        floor[~np.isfinite(floor)] = 0.0
        key = token_row.astype(np.int64) * self.num_docs + docs
        order = np.lexsort((-sims, key))
        key, sims, token_row, docs = key[order], sims[order], token_row[order], docs[order]
        first = np.ones(len(key), dtype=bool)
        first[1:] = key[1:] != key[:-1]
        gain = sims[first] - floor[token_row[first]]
        if weights is not None and weights.sum() > 0:
            gain = gain * weights[token_row[first]]
        unique_docs, inverse = np.unique(docs[first], return_inverse=True)
        if len(unique_docs) <= limit:
            return unique_docs
        proxy = np.bincount(inverse, weights=gain)
        best = top_rows(proxy, unique_docs, limit)
        return np.sort(unique_docs[best])

    def _refine(self, q: torch.Tensor, q_mask: torch.Tensor, q_sal: torch.Tensor, rows: np.ndarray,
                k: int) -> list[tuple[int, float]]:
        """Exact alignment scores of documents ``rows`` (sorted) for one query q [1, n, d]; top k (row, score)."""
        sal = self.use_salience
        scores = np.empty(len(rows), dtype=np.float32)
        for start in range(0, len(rows), REFINE_CHUNK):
            chunk = rows[start:start + REFINE_CHUNK]
            vectors, mask, salience = self.store.gather(chunk, self.refine_with == "kept", self._workspace)
            scores[start:start + len(chunk)] = alignment_scores(
                q, q_mask, vectors, mask, self.strategy, q_sal if sal else None, salience if sal else None)[0].numpy()
        best = top_rows(scores, rows, k)
        return [(int(rows[b]), float(scores[b])) for b in best]

    def _doc_vectors(self, row: int) -> np.ndarray:
        start, end = self.store.offsets[row], self.store.offsets[row + 1]
        return self.store.token_vectors(np.arange(start, end)).numpy()
