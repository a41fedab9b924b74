"""AlignerSearcher: multi-vector AligneR retrieval over an index built by :mod:`pyserini_aligner.index`.

Per query: encode, keep the β^q most salient query tokens, take each kept token's ``k_per_token`` best indexed
document tokens (probing ``nprobe`` inverted lists of a compressed index), keep the ``max_candidates`` best documents
by a proxy score (:func:`.engine.select_candidates`), rescore them with the full alignment score and return the top
k. A drop-in for Pyserini's ``FaissSearcher``: ``search``/``batch_search`` return ``DenseSearchResult`` lists.

Backends share that rule: "faiss" (CPU: FAISS finds the entries, refinement decodes the memory-mapped codes) and
"torch" (codes resident on one or more devices, every step as tensor operations; see :mod:`.engine`). A searcher
is safe to share across threads (one search runs at a time) and keeps serving the index generation it opened until
:meth:`AlignerSearcher.reopen`.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from pyserini_aligner.alignment import Strategy, alignment_scores, parse_strategy
from pyserini_aligner.index.store import StoredIndex, Workspace
from pyserini_aligner.model import EncodedText
from pyserini_aligner.resolve import model_for_index
from pyserini_aligner.salience import prune_mask
from pyserini_aligner.search.defaults import DEFAULT_QUERY_PRUNE
from pyserini_aligner.search.engine import CodeShard, merge_probes, narrow, select_candidates, top_hits
from pyserini_aligner.search.flat import search_index
from pyserini_aligner.textio import check_collection, is_blank

log = logging.getLogger(__name__)

REFINE_WITH = ("all", "kept")
BACKENDS = ("faiss", "torch")
# Candidate-generation defaults (k_per_token, nprobe, max_candidates, interaction_candidates) per kind of device,
# chosen with python -m eval.bench_scale.sweep on synthetic passages (docs/scaling.md): a GPU affords a wide
# centroid-interaction stage; a CPU refines 128 candidates straight from the probes (SciFact test: nDCG@10 within
# half a point of exhaustive scoring of the same index).
DEPTH_DEFAULTS = {"cuda": (3000, 8, 128, 12288), "cpu": (100, 8, 128, 0)}
DEEP_FACTOR = 2  # entries per probe and documents refined per hit asked for (chosen on NFCorpus dev at 1000 hits)
REFINE_CHUNK = 512  # documents scored at once during refinement (bounds the padded token tensor)
DEFAULT_EF_SEARCH = 128


def split_devices(store: StoredIndex, devices: Sequence, numbers: Sequence[int] | None = None) -> list[list[int]]:
    """Consecutive segment numbers (of ``numbers``, default all) per device, balanced by token count (a device
    may get none)."""
    numbers = list(range(len(store.segments))) if numbers is None else list(numbers)
    tokens = np.array([store.segments[i].info.num_tokens for i in numbers], dtype=np.float64)
    bounds = np.cumsum(tokens) / max(tokens.sum(), 1) * len(devices)
    owner = np.minimum((bounds - tokens / max(tokens.sum(), 1) * len(devices) / 2).astype(int), len(devices) - 1)
    return [[numbers[i] for i in range(len(tokens)) if owner[i] == d] for d in range(len(devices))]


def _on_device(device: torch.device, step, shard):
    """``step(shard)`` with ``device`` as the current CUDA device (so that its kernels go to its own stream)."""
    if device.type != "cuda":
        return step(shard)
    with torch.cuda.device(device):
        return step(shard)


@lru_cache(maxsize=None)
def dense_result_classes():
    """Pyserini's (DenseSearchResult, PrfDenseSearchResult), imported on first use (Pyserini starts a JVM)."""
    from pyserini.search.faiss._prf import PrfDenseSearchResult
    from pyserini.search.faiss._searcher import DenseSearchResult

    return DenseSearchResult, PrfDenseSearchResult


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


def check_threads(threads: int) -> None:
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")


@contextlib.contextmanager
def compute_threads(threads: int):
    """Run FAISS (OpenMP) and torch with ``threads`` threads inside the block; both settings are restored (read
    first: FAISS and torch may share one OpenMP runtime)."""
    check_threads(threads)
    saved = torch.get_num_threads()
    try:
        import faiss
    except ImportError:  # torch-only installs (the torch backend needs no FAISS)
        faiss = None
    faiss_saved = faiss.omp_get_max_threads() if faiss is not None else None
    if faiss is not None:
        faiss.omp_set_num_threads(threads)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if faiss is not None:
            faiss.omp_set_num_threads(faiss_saved)
        if torch.get_num_threads() != saved:
            torch.set_num_threads(saved)


class AlignerSearcher:
    """Search an AligneR index; ``search``/``batch_search`` mirror Pyserini's ``FaissSearcher``.

    index_dir: folder written by ``python -m pyserini_aligner.index``. encoder: None (the model in the manifest),
    a checkpoint name/folder, an AlignerModel or an AlignerQueryEncoder. strategy: alignment strategy for
    refinement (default: the manifest's). k_per_token: indexed document tokens taken per kept query token (raised to
    2k for deep searches). k_per_token, nprobe, max_candidates and interaction_candidates default to
    ``DEPTH_DEFAULTS`` for the device. query_prune: β^q, fraction of query tokens probed (refinement always uses all).
    max_candidates: documents refined per query (at least 2k). interaction_candidates: compressed indexes only,
    documents first narrowed to max_candidates by centroid interaction (MaxSim over the centroids of all their
    tokens; 0: off; only the torch backend has this stage). refine_with: "all" stored doc tokens or only the
    "kept" ones. nprobe: inverted lists probed per query token (compressed indexes; raised when the lists hold fewer
    than k_per_token entries); ef_search: HNSW search depth (fp16 indexes). device: where queries are encoded and,
    with the torch backend, searched; devices: several devices (e.g. ["cuda:0", "cuda:1"]) over which the segments
    are spread and searched in parallel, with the same ranking as one device. backend: "faiss" (default on the CPU)
    or "torch" (default on CUDA). segments and exchange (torch backend, compressed index): this searcher holds only
    the consecutive segments ``segments`` and combines probes and refinement scores with the processes holding the
    others through ``exchange`` (``broadcast(obj)`` from the first process, ``all_gather(obj)``; see
    :mod:`.distributed`), so that every process returns the ranking of the whole index. query_max_length: tokens per
    query, special tokens included (default: the model's query_maxlen; at most the backbone's positions).
    """

    def __init__(self, index_dir: str | os.PathLike, encoder=None, strategy: str | Strategy | None = None,
                 k_per_token: int | None = None, query_prune: float = DEFAULT_QUERY_PRUNE,
                 max_candidates: int | None = None, refine_with: str = "all", nprobe: int | None = None,
                 ef_search: int | None = None, device: str = "cpu", batch_size: int = 32, backend: str | None = None,
                 interaction_candidates: int | None = None, query_max_length: int | None = None,
                 devices: Sequence[str] | None = None, segments: Sequence[int] | None = None, exchange=None):
        self.index_dir = Path(index_dir)
        self.devices = list(devices) if devices else [device]
        device = self.devices[0] if devices else device
        self.device = device
        backend = backend or ("torch" if str(device).startswith("cuda") else "faiss")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "faiss" and str(device).startswith("cuda"):
            raise ValueError("backend 'faiss' runs on the CPU; use backend 'torch' (the default) on CUDA")
        self.backend = backend
        kind = "cuda" if str(device).startswith("cuda") else "cpu"
        default_k, default_nprobe, default_c, default_w = DEPTH_DEFAULTS[kind]
        k_per_token = default_k if k_per_token is None else k_per_token
        max_candidates = default_c if max_candidates is None else max_candidates
        if k_per_token < 1 or max_candidates < 1 or batch_size < 1:
            raise ValueError("k_per_token, max_candidates and batch_size must be >= 1, got "
                             f"{k_per_token}, {max_candidates}, {batch_size}")
        if not 0.0 < query_prune <= 1.0:
            raise ValueError(f"query_prune must be in (0, 1], got {query_prune}")
        if refine_with not in REFINE_WITH:
            raise ValueError(f"refine_with must be one of {REFINE_WITH}, got {refine_with!r}")
        for name, value in (("nprobe", nprobe), ("ef_search", ef_search)):
            if name == "nprobe" and interaction_candidates is not None and interaction_candidates < 0:
                raise ValueError(f"interaction_candidates must be >= 0, got {interaction_candidates}")
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if query_max_length is not None and query_max_length < 3:
            raise ValueError(f"query_max_length must be >= 3 (two special tokens and one word), got {query_max_length}")
        self.query_max_length = query_max_length
        self.k_per_token, self.query_prune, self.max_candidates = k_per_token, query_prune, max_candidates
        self.refine_with, self.batch_size, self.nprobe, self.ef_search = refine_with, batch_size, nprobe, ef_search
        self.interaction_candidates = (interaction_candidates if interaction_candidates is not None
                                       else default_w if backend == "torch" else 0)
        self._default_nprobe = default_nprobe
        self._strategy_arg, self._encoder_arg = strategy, encoder
        if (segments is not None or exchange is not None) and backend != "torch":
            raise ValueError("segments and exchange need backend 'torch'")
        self.segments, self.exchange = None if segments is None else list(segments), exchange
        self.timings: dict[str, float] | None = None  # set to {} to add up seconds per search step
        self._lock = threading.RLock()
        self.encode_threads = torch.get_num_threads()  # torch's setting when the searcher was made
        self._pool = None
        self._graphed = None
        self._load(StoredIndex(self.index_dir), encoder)
        self.graphed_queries = self._graphed is not None  # one query at a time goes through a CUDA graph

    def _load(self, store: StoredIndex, encoder) -> None:
        """Open the engines for ``store`` (one index generation)."""
        self.store = store
        self.manifest = store.manifest
        if encoder is not None or not hasattr(self, "model"):
            self.model = model_for_index(encoder, self.manifest, self.index_dir, self.device)
        elif self.model.fingerprint() != self.manifest.model_fingerprint:
            self.model = model_for_index(None, self.manifest, self.index_dir, self.device)
        positions = getattr(self.model.backbone.config, "max_position_embeddings", None)
        if self.query_max_length is not None and positions is not None and self.query_max_length > positions:
            raise ValueError(f"query_max_length {self.query_max_length} exceeds the model's {positions} positions")
        self.strategy = parse_strategy(self._strategy_arg if self._strategy_arg is not None
                                       else self.manifest.default_strategy)
        self.use_salience = self.model.scores_with_salience
        self._refine_width = int(store.lengths.max()) if store.num_docs else 1  # documents pad to it in every shard
        self._workspace = Workspace()
        self.index = self.tokens = None
        self.shards: list[CodeShard] = []
        compressed = store.codec is not None
        if self.ef_search is not None and compressed:
            raise ValueError("ef_search tunes HNSW FAISS indexes of fp16 stores; this index is compressed")
        if self.backend == "faiss":
            if compressed:
                self.index = self._faiss_ivf(store)
                self.shards = [CodeShard(store, [i], "cpu", self.refine_with) for i in range(len(store.segments))]
            else:
                self.index = [(seg.faiss_index(), base) for seg, base in zip(store.segments, store.token_base)]
                self._set_faiss_params()
        elif compressed:
            mine = self.segments
            if mine and (mine[0] < 0 or mine[-1] >= len(store.segments)
                         or mine != list(range(mine[0], mine[0] + len(mine)))):
                raise ValueError(f"segments must be consecutive numbers in [0, {len(store.segments)}), got {mine}")
            self.shards = [CodeShard(store, numbers, dev, self.refine_with)
                           for dev, numbers in zip(self.devices, split_devices(store, self.devices, mine)) if numbers]
        else:
            from pyserini_aligner.search.torch_backend import TorchTokenIndex

            if len(self.devices) > 1 or self.nprobe is not None or self.segments is not None:
                raise ValueError("several devices, segments and nprobe need a compressed index (codec "
                                 "IVF<nlist>,PQ<M>)")
            self.tokens = TorchTokenIndex(store, self.device, self.refine_with, with_salience=self.use_salience)
        if self.backend == "torch" and self.model.device.type == "cuda" and self._graphed is None:
            self._graphed = self._capture_query_encoder()
        self._single = None  # one query at a time: encoding and search replayed from CUDA graphs
        if (self._graphed is not None and len(self.shards) == 1 and self.exchange is None
                and self.shards[0].device.type == "cuda"):
            from pyserini_aligner.search.static import GraphedSearch

            self._single = GraphedSearch(self._graphed, self.shards[0], self.query_prune, self.strategy,
                                         self.use_salience)
        # Pyserini FaissSearcher attributes
        self.docids = store.docids
        self.dimension = self.manifest.dim
        self.num_docs = self.manifest.num_docs

    def reopen(self) -> bool:
        """Switch to the index's newest committed generation if it changed; returns whether it did. Searches in
        flight finish on the old generation."""
        from pyserini_aligner.index.store import read_manifest

        if read_manifest(self.index_dir).generation == self.manifest.generation:
            return False
        fresh = StoredIndex(self.index_dir)
        with self._lock:
            self._load(fresh, None)
        return True

    @classmethod
    def from_pyserini(cls, index_dir: str | os.PathLike, query_encoder=None, prebuilt_index_name: str | None = None,
                      normalize_distances: bool = False, faiss_device: str = "cpu", **kwargs) -> "AlignerSearcher":
        """Build from ``FaissSearcher``'s arguments (``query_encoder``: "aligner", a checkpoint folder or an
        AlignerQueryEncoder); ``prebuilt_index_name`` and ``normalize_distances`` are not supported."""
        if prebuilt_index_name or normalize_distances:
            raise ValueError("AligneR indexes support neither prebuilt_index_name nor normalize_distances")
        device = faiss_device if str(faiss_device).startswith("cuda") else "cpu"
        return cls(index_dir, encoder=query_encoder, device=device, **kwargs)

    def _faiss_ivf(self, store: StoredIndex):
        """FAISS IndexIVFPQ over every segment's inverted lists, labelled by global document row."""
        parts = [(seg.ivf_offsets, np.asarray(seg.ivf_docs, dtype=np.int64) + base, seg.ivf_codes)
                 for seg, base in zip(store.segments, store.row_base)]
        return store.codec.faiss_index(parts)

    def _set_faiss_params(self) -> None:
        import faiss

        space = faiss.ParameterSpace()
        for index, _ in self.index:
            ivf = faiss.try_extract_index_ivf(index)
            if ivf is not None:
                space.set_index_parameter(index, "nprobe", min(self.nprobe or 32, ivf.nlist))
            elif self.nprobe is not None:
                raise ValueError(f"nprobe given but the index ({self.manifest.index_type}) is not an IVF index")
            try:
                space.set_index_parameter(index, "efSearch", max(self.ef_search or DEFAULT_EF_SEARCH,
                                                                 self.k_per_token))
            except RuntimeError:
                if self.ef_search is not None:
                    raise ValueError(f"ef_search given but the index ({self.manifest.index_type}) is not an HNSW "
                                     "index") from None

    # ------------------------------------------------------------------ public API
    def search(self, q: str, k: int = 10, threads: int | None = None, remove_dups: bool = False,
               return_vector: bool = False):
        """Top-k documents for query text ``q`` as DenseSearchResult(docid, score), best first ([] for an empty query).
        ``threads`` run the search steps (default: torch's thread count when the searcher was made).

        remove_dups is accepted for Pyserini compatibility (results are unique per document already). With
        return_vector, returns (query vectors [n, d], [PrfDenseSearchResult(docid, score, doc vectors [m, d])]).
        """
        if not isinstance(q, str):
            raise TypeError(f"query must be a string, got {type(q).__name__}")
        hits = self.batch_search([q], ["q"], k=k, threads=threads, return_vector=return_vector)
        return (hits[0]["q"], hits[1]["q"]) if return_vector else hits["q"]

    def batch_search(self, queries: list[str], q_ids: list[str], k: int = 10, threads: int | None = None,
                     return_vector: bool = False):
        """{q_id: [DenseSearchResult]} for many queries (batched encoding and search).

        With return_vector, returns ({q_id: query vectors [n, d]}, {q_id: [PrfDenseSearchResult]}).
        """
        check_collection(queries, "queries")
        check_collection(q_ids, "q_ids")
        if len(queries) != len(q_ids):
            raise ValueError(f"{len(queries)} queries but {len(q_ids)} q_ids")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        dense, prf = dense_result_classes()
        results, vectors = {}, {}
        check_threads(threads if threads is not None else 1)
        with self._lock:
            for start in range(0, len(queries), self.batch_size):
                texts, ids = queries[start:start + self.batch_size], q_ids[start:start + self.batch_size]
                for qid, query_vectors, hits in zip(ids, *self._search_texts(texts, k, threads)):
                    vectors[qid] = query_vectors
                    if return_vector:
                        results[qid] = [prf(self.docids[row], score, self._doc_vectors(row)) for row, score in hits]
                    else:
                        results[qid] = [dense(self.docids[row], score) for row, score in hits]
        return (vectors, results) if return_vector else results

    def rank(self, queries: list[str], k: int = 10, threads: int | None = None) -> list[list[tuple[str, float]]]:
        """Top-k (docid, score) lists, best first, one per query: ``batch_search`` over plain data (no Pyserini
        result objects, so it also runs where Pyserini is not installed)."""
        check_collection(queries, "queries")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        ranked = []
        check_threads(threads if threads is not None else 1)
        with self._lock:
            for start in range(0, len(queries), self.batch_size):
                _, hits = self._search_texts(queries[start:start + self.batch_size], k, threads)
                ranked += [[(self.docids[row], score) for row, score in query_hits] for query_hits in hits]
        return ranked

    # ------------------------------------------------------------------ pipeline
    def _depth(self, k: int) -> tuple[int, int, int, int]:
        """(entries per probe K, nprobe, candidates narrowed by centroid interaction (0: none), candidates refined)
        for a top-k search: K and the refined count are at least ``DEEP_FACTOR``·k, so that a deep search (hybrid
        and reranking pipelines take 1000 hits) finds what exhaustive scoring finds."""
        live = max(self.store.num_live, 1)
        limit = min(max(self.max_candidates, DEEP_FACTOR * k), live)
        staged = self.interaction_candidates and (self.shards or self.exchange is not None)
        wide = min(max(self.interaction_candidates, 4 * k), live) if staged else 0
        wide = wide if wide > limit else 0
        per_token = max(self.k_per_token, DEEP_FACTOR * k)
        nprobe = self.nprobe or self._default_nprobe
        if self.store.codec is not None:
            nlist = self.store.codec_spec.nlist
            mean_list = max(self.manifest.num_kept / max(nlist, 1), 1.0)
            nprobe = min(nlist, max(nprobe, math.ceil(2 * per_token / mean_list)))
        return per_token, nprobe, wide, limit

    def _search_texts(self, texts: list[str], k: int, threads: int | None = None):
        """(query vectors per text, [(doc row, score)] per text). Queries are encoded with torch's thread setting
        of when the searcher was made (as Pyserini's encoders use torch's); ``threads`` threads (default: the same
        number) run the search (FAISS and the tensor steps)."""
        live = [i for i, text in enumerate(texts) if not is_blank(text)]
        hits: list[list[tuple[int, float]]] = [[] for _ in texts]
        query_vectors = [np.zeros((0, self.dimension), dtype=np.float32) for _ in texts]
        if not live or self.store.num_live == 0:
            return query_vectors, hits
        clock = self._clock()
        if len(live) == 1 and self._single is not None:
            found = self._search_graphed(texts[live[0]], k)
            if found is not None:
                query_vectors[live[0]], hits[live[0]] = found
                clock("search")
                return query_vectors, hits
        if len(live) == 1 and self._graphed is not None:
            out = self._graphed(texts[live[0]])
        else:
            with compute_threads(self.encode_threads):  # the same threads in every calling thread: same vectors
                out = self.model.encode_padded([texts[i] for i in live], is_query=True, batch_size=self.batch_size,
                                               maxlen=self.query_max_length)
        q, q_mask, q_sal = out.vectors.float(), out.mask, out.salience
        if self.exchange is not None:  # every process searches the first one's encoding
            q, q_mask, q_sal = (t.to(self.model.device) for t in self.exchange.broadcast(
                (q.cpu(), q_mask.cpu(), q_sal.cpu())))
        clock("encode")
        with compute_threads(self.encode_threads if threads is None else threads):
            self._search_encoded(q, q_mask, q_sal, live, k, clock, query_vectors, hits)
        return query_vectors, hits

    def _search_encoded(self, q, q_mask, q_sal, live: list[int], k: int, clock, query_vectors: list, hits: list):
        """Fill ``query_vectors`` and ``hits`` at the positions ``live`` from encoded queries q [B, n, d]."""
        probe_mask = prune_mask(q_sal, q_mask, self.query_prune)
        owner, token = probe_mask.nonzero(as_tuple=True)
        weights = q_sal[owner, token] if self.use_salience else None
        per_token, nprobe, wide, limit = self._depth(k)
        if self.tokens is not None:
            scores, rows = self.tokens.search(q, q_mask, q_sal, probe_mask, k, per_token, limit, self.strategy,
                                              q_sal if self.use_salience else None)
        else:
            probe_scores, probe_rows = self._probe(q[owner, token], per_token, nprobe)
            clock("probe")
            rows, valid = select_candidates(probe_scores, probe_rows, owner.to(probe_scores.device), len(live),
                                            wide or limit, None if weights is None else weights.to(probe_scores.device))
            clock("select")
            if wide:
                rows, valid = narrow(self._combine(self._each_shard(
                    lambda shard: shard.interaction(q, q_mask, rows, valid))), rows.to(self.device), limit)
                clock("interaction")
            refined = self._refine(q, q_mask, q_sal if self.use_salience else None, rows, valid)
            scores, rows = top_hits(refined, rows.to(refined.device), k)
        scores, rows = scores.cpu().numpy(), rows.cpu().numpy()
        clock("refine")
        vectors, mask = q.cpu().numpy(), q_mask.cpu().numpy()
        for j, i in enumerate(live):
            query_vectors[i] = vectors[j][mask[j]]
            found = rows[j] >= 0
            hits[i] = list(zip(rows[j][found].tolist(), scores[j][found].tolist()))

    def _search_graphed(self, text: str, k: int):
        """(query vectors [n, d], [(doc row, score)]) of one query through :class:`.static.GraphedSearch`, or None
        when its plan cannot be captured (a strategy whose scoring reads sizes back to the host): the engine's
        steps then run as usual, and every later query too."""
        try:
            scores, rows, tokens = self._single(text, self._depth(k), k)
        except RuntimeError as err:
            log.warning("single queries run step by step (CUDA graph capture failed: %s)", str(err).splitlines()[0])
            self._single = None
            torch.cuda.synchronize(self.shards[0].device)
            return None
        found = rows >= 0
        vectors = self._graphed.out.vectors[0, :tokens].float().cpu().numpy()
        return vectors, list(zip(rows[found].tolist(), scores[found].tolist()))

    def _clock(self):
        """A function that adds the seconds since its last call to ``self.timings[step]`` (a no-op unless timings
        is a dict; device work is waited for, so profiling slows the search a little)."""
        if self.timings is None:
            return lambda step: None
        import time

        last = [time.perf_counter()]

        def clock(step: str) -> None:
            if self.model.device.type == "cuda":
                torch.cuda.synchronize(self.model.device)
            now = time.perf_counter()
            self.timings[step] = self.timings.get(step, 0.0) + now - last[0]
            last[0] = now

        return clock

    def _probe(self, probes: torch.Tensor, per_token: int, nprobe: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores [R, K], global doc rows [R, K]) of each probe's best indexed tokens (step 1 of .engine)."""
        if self.backend == "torch":
            parts = self._each_shard(lambda shard: shard.probe(probes, per_token, nprobe))
            if self.exchange is not None:
                parts = [part for held in self.exchange.all_gather([(s.cpu(), r.cpu()) for s, r in parts])
                         for part in held]
            return merge_probes(parts, per_token)
        x = np.ascontiguousarray(probes.cpu().numpy(), dtype=np.float32)
        if self.store.codec is not None:
            import faiss

            params = faiss.SearchParametersIVF(nprobe=nprobe)
            if not self.store.live.all():
                params.sel = self._live_selector()
            lists_scores, lists = search_index(self.index.quantizer, x, nprobe)  # the coarse step, on torch's BLAS
            distances = np.empty((len(x), per_token), dtype=np.float32)
            labels = np.empty((len(x), per_token), dtype=np.int64)
            self.index.search_preassigned_c(len(x), faiss.swig_ptr(x), per_token, faiss.swig_ptr(lists),
                                            faiss.swig_ptr(lists_scores), faiss.swig_ptr(distances),
                                            faiss.swig_ptr(labels), False, params)
            return torch.from_numpy(distances), torch.from_numpy(labels)
        parts = []
        for (index, base), seg in zip(self.index, self.store.segments):
            distances, labels = search_index(index, x, min(per_token, max(index.ntotal, 1)))
            found = labels >= 0  # a FAISS label is a position in the segment's faiss_ids, not a token position
            positions = seg.faiss_ids[np.where(found, labels, 0)] if index.ntotal else np.zeros_like(labels)
            rows = np.where(found, self.store.doc_of_token(positions + base), -1)
            rows = np.where((rows >= 0) & self.store.live[np.maximum(rows, 0)], rows, -1)
            distances = np.where(rows >= 0, distances, -np.inf).astype(np.float32)
            parts.append((torch.from_numpy(distances), torch.from_numpy(rows)))
        return merge_probes(parts, per_token) if len(parts) > 1 else parts[0]

    def _live_selector(self):
        import faiss

        if getattr(self, "_selector_for", None) is not self.store:
            self._bitmap = np.packbits(self.store.live, bitorder="little")
            self._selector = faiss.IDSelectorBitmap(len(self.store.live), faiss.swig_ptr(self._bitmap))
            self._selector_for = self.store
        return self._selector

    def _each_shard(self, step) -> list:
        """``step(shard)`` for every shard, in parallel threads when there are several (device work and most
        tensor operations release the GIL), in shard order."""
        if len(self.shards) < 2:
            return [step(shard) for shard in self.shards]
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(len(self.shards), thread_name_prefix="aligner-shard")
        return list(self._pool.map(lambda shard: _on_device(shard.device, step, shard), self.shards))

    def _combine(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Per-candidate scores from the shards (each −inf for rows it does not hold), also across processes."""
        if self.exchange is not None:
            parts = [part for held in self.exchange.all_gather([p.cpu() for p in parts]) for part in held]
        out = parts[0]
        for part in parts[1:]:
            out = torch.maximum(out, part.to(out.device))
        return out

    def _refine(self, q, q_mask, q_sal, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Alignment scores [B, C] of the candidate rows (−inf where not valid)."""
        if self.shards or self.exchange is not None:
            return self._combine(self._each_shard(
                lambda shard: shard.refine(q, q_mask, q_sal, rows, valid, self.strategy, self._refine_width)))
        out = torch.full(rows.shape, -torch.inf)
        for b in range(len(rows)):
            picked = rows[b][valid[b]].numpy()
            for start in range(0, len(picked), REFINE_CHUNK):
                chunk = picked[start:start + REFINE_CHUNK]
                d, d_mask, d_sal = self.store.gather(chunk, self.refine_with == "kept", self._workspace)
                out[b, start:start + len(chunk)] = alignment_scores(
                    q[b:b + 1], q_mask[b:b + 1], d, d_mask, self.strategy,
                    None if q_sal is None else q_sal[b:b + 1], None if q_sal is None else d_sal)[0]
        return out

    def _capture_query_encoder(self):
        from pyserini_aligner.search.torch_backend import GraphedQueryEncoder

        try:
            return GraphedQueryEncoder(self.model, self.query_max_length)
        except RuntimeError as err:  # a model whose forward pass syncs with the host cannot be captured
            log.warning("query encoding runs eagerly (CUDA graph capture failed: %s)", str(err).splitlines()[0])
            return None

    def _doc_vectors(self, row: int) -> np.ndarray:
        start, end = self.store.offsets[row], self.store.offsets[row + 1]
        return self.store.token_vectors(np.arange(start, end)).numpy()
