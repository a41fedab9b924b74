"""AlignerSearcher: multi-vector AligneR retrieval over an index built by :mod:`pyserini_aligner.index`.

Per query: encode, keep the β^q most salient query tokens, take each kept token's ``k_per_token`` best indexed
document tokens (probing ``nprobe`` inverted lists of a compressed index), keep the ``max_candidates`` best documents
by a proxy score (:func:`.engine.select_candidates`), rescore them with the full alignment score and return the top
k. A drop-in for Pyserini's ``FaissSearcher``: ``search``/``batch_search`` return ``DenseSearchResult`` lists.

The searcher encodes the queries; a backend (:mod:`.backends`), opened with each index generation, searches them:
"faiss" (CPU: FAISS finds the entries, refinement decodes the memory-mapped codes) or "torch" (codes resident on one
or more devices, every step as tensor operations; see :mod:`.engine`). On several GPUs each device holds a copy of
the codes (a batch split across the copies: the first searched in this process, the others by worker processes) or a
worker process holds a share of the segments on each (each step on all devices at once).
A searcher is safe to share across threads (one search runs at a time) and keeps serving the index generation it
opened until :meth:`AlignerSearcher.reopen`.
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

from pyserini_aligner.alignment import Strategy, parse_strategy
from pyserini_aligner.index.store import StoredIndex
from pyserini_aligner.model import EncodedText
from pyserini_aligner.resolve import model_for_index
from pyserini_aligner.salience import prune_mask
from pyserini_aligner.search.backends import Queries, Scoring, check_backend, default_backend, open_backend
from pyserini_aligner.search.defaults import DEFAULT_QUERY_PRUNE
from pyserini_aligner.search.workers import text_parts
from pyserini_aligner.textio import check_collection, check_unique_ids, is_blank

log = logging.getLogger(__name__)

REFINE_WITH = ("all", "kept")
# Candidate-generation defaults (k_per_token, nprobe, max_candidates, interaction_candidates) per kind of device,
# chosen with python -m eval.bench_scale.sweep on synthetic passages (docs/scaling.md): a GPU affords a wide
# centroid-interaction stage and refines 256 candidates (at 1M passages, 1.8 more points of the exact top 10 than
# 128); a CPU refines 128 candidates straight from the probes (SciFact test: nDCG@10 within half a point of
# exhaustive scoring of the same index).
DEPTH_DEFAULTS = {"cuda": (3000, 8, 256, 12288), "cpu": (100, 8, 128, 0)}
DEEP_FACTOR = 2  # entries per probe and documents refined per hit asked for (chosen on NFCorpus dev at 1000 hits)
STEP_END = "aligner step end: "  # profiler ranges marking where each timed search step ends


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
    tokens; 0: off; the default is 0 on the CPU). refine_with: "all" stored doc tokens or only the "kept" ones.
    nprobe: inverted lists probed per query token (compressed indexes; raised when the lists hold fewer than
    k_per_token entries); ef_search: HNSW search depth (fp16 indexes). device: where queries are encoded and, with
    the torch backend, searched. backend: "faiss" (default on the CPU) or "torch" (default on CUDA).

    devices (torch backend, compressed index): several devices (e.g. ["cuda:0", "cuda:1"]) (:mod:`.workers`),
    placed by ``placement``: "replicate" holds a whole copy of the codes on each device and splits every batch of
    query texts across the copies, each encoding and searching its part (the first copy in this process, the others
    in a worker process each; one query is searched by the first, through its CUDA-graph plan), "shard" spreads
    consecutive segments over the devices and runs each search step on all of them at once, "auto" (default)
    replicates when a copy and room to search fit in every device's free memory (GPUs) and shards otherwise; the
    choice is made again at :meth:`reopen`. Every placement ranks as one device (a replica's scores may differ in the
    last bit: it encodes its part of a batch alone).

    segments and exchange (torch backend, compressed index; one process of a torchrun job, see :mod:`.distributed`):
    ``exchange`` (a :class:`pyserini_aligner.dist.Collectives`) connects the processes, which encode their parts of
    each batch on GPUs. With placement "shard" each holds its consecutive share of the segments (``segments``, or its
    share by tokens), ranks the candidates it holds, and the candidates are scored by parts of the batch (GPUs) or by
    the ranks that hold them (CPUs: :class:`.backends.Exchanged`); with
    "replicate" each holds the whole index and searches its part of every batch; "auto" replicates when the index fits
    on every rank. Every process returns the ranking of the whole index. query_max_length: tokens per query, special
    tokens included (default: the model's query_maxlen; at most the backbone's positions).
    """

    def __init__(self, index_dir: str | os.PathLike, encoder=None, strategy: str | Strategy | None = None,
                 k_per_token: int | None = None, query_prune: float = DEFAULT_QUERY_PRUNE,
                 max_candidates: int | None = None, refine_with: str = "all", nprobe: int | None = None,
                 ef_search: int | None = None, device: str = "cpu", batch_size: int = 32, backend: str | None = None,
                 interaction_candidates: int | None = None, query_max_length: int | None = None,
                 devices: Sequence[str] | None = None, segments: Sequence[int] | None = None, exchange=None,
                 placement: str = "auto"):
        self.index_dir = Path(index_dir)
        self.devices = list(devices) if devices else [device]
        device = self.devices[0] if devices else device
        self.device = device
        backend = backend or default_backend(device)
        check_backend(backend, self.devices, placement, segments, exchange)
        self.backend, self.placement = backend, placement
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
        self.interaction_candidates = default_w if interaction_candidates is None else interaction_candidates
        self._default_nprobe = default_nprobe
        self._strategy_arg, self._encoder_arg = strategy, encoder
        self.segments, self.exchange = None if segments is None else list(segments), exchange
        self.timings: dict[str, float] | None = None  # set to {} to add up seconds per search step
        self._lock = threading.RLock()
        self.encode_threads = torch.get_num_threads()  # torch's setting when the searcher was made
        self._graphed = None
        self._load(StoredIndex(self.index_dir), encoder)
        self.graphed_queries = self._graphed is not None  # one query at a time goes through a CUDA graph

    def _load(self, store: StoredIndex, encoder) -> None:
        """Open the backend for ``store`` (one index generation)."""
        if encoder is not None or not hasattr(self, "model"):
            model = model_for_index(encoder, store.manifest, self.index_dir, self.device)
        elif self.model.fingerprint() != store.manifest.model_fingerprint:
            model = model_for_index(None, store.manifest, self.index_dir, self.device)
        else:
            model = self.model
        positions = getattr(model.backbone.config, "max_position_embeddings", None)
        if self.query_max_length is not None and positions is not None and self.query_max_length > positions:
            raise ValueError(f"query_max_length {self.query_max_length} exceeds the model's {positions} positions")
        strategy = parse_strategy(self._strategy_arg if self._strategy_arg is not None
                                  else store.manifest.default_strategy)
        graphed = self._graphed if model is getattr(self, "model", None) else None
        if model.device.type == "cuda" and graphed is None:
            graphed = self._capture_query_encoder(model)
        scoring = Scoring(strategy, self.refine_with, model.scores_with_salience, self.query_prune,
                          int(store.lengths.max()) if store.num_docs else 1)  # documents pad to it in every shard
        previous = getattr(self, "engine", None)
        self.engine = open_backend(store, self.backend, self.devices, scoring, k_per_token=self.k_per_token,
                                   nprobe=self.nprobe, ef_search=self.ef_search, segments=self.segments,
                                   exchange=self.exchange, placement=self.placement, encoder=graphed,
                                   searcher_class=type(self), options=self._device_options())
        if previous is not None and hasattr(previous, "close"):  # worker processes of the last generation
            previous.close()
        self.model, self._graphed = model, graphed
        self.store, self.manifest = store, store.manifest
        self.strategy, self.use_salience = strategy, scoring.use_salience
        # Pyserini FaissSearcher attributes
        self.docids = store.docids
        self.dimension = self.manifest.dim
        self.num_docs = self.manifest.num_docs

    def _device_options(self) -> dict:
        """The keyword arguments of a one-device searcher with this searcher's settings (for worker processes)."""
        return dict(encoder=self._encoder_arg, strategy=self._strategy_arg, k_per_token=self.k_per_token,
                    query_prune=self.query_prune, max_candidates=self.max_candidates, refine_with=self.refine_with,
                    nprobe=self.nprobe, batch_size=self.batch_size,
                    interaction_candidates=self.interaction_candidates, query_max_length=self.query_max_length)

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
        check_unique_ids(q_ids, "q_ids")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        dense, prf = dense_result_classes()
        results, vectors = {}, {}
        check_threads(threads if threads is not None else 1)
        with self._lock:
            for start in range(0, len(queries), self.batch_size):
                texts, ids = queries[start:start + self.batch_size], q_ids[start:start + self.batch_size]
                for qid, query_vectors, hits in zip(ids, *self._search_texts(texts, k, threads, return_vector)):
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
                _, hits = self._search_texts(queries[start:start + self.batch_size], k, threads, vectors=False)
                ranked += [[(self.docids[row], score) for row, score in query_hits] for query_hits in hits]
        return ranked

    # ------------------------------------------------------------------ pipeline
    def _depth(self, k: int) -> tuple[int, int, int, int]:
        """(entries per probe K, nprobe, candidates narrowed by centroid interaction (0: none), candidates refined)
        for a top-k search: K and the refined count are at least ``DEEP_FACTOR``·k, so that a deep search (hybrid
        and reranking pipelines take 1000 hits) finds what exhaustive scoring finds."""
        live = max(self.store.num_live, 1)
        limit = min(max(self.max_candidates, DEEP_FACTOR * k), live)
        staged = self.interaction_candidates and self.engine.has_interaction
        wide = min(max(self.interaction_candidates, 4 * k), live) if staged else 0
        wide = wide if wide > limit else 0
        per_token = max(self.k_per_token, DEEP_FACTOR * k)
        nprobe = self.nprobe or self._default_nprobe
        if self.store.codec is not None:
            nlist = self.store.codec_spec.nlist
            mean_list = max(self.manifest.num_kept / max(nlist, 1), 1.0)
            nprobe = min(nlist, max(nprobe, math.ceil(2 * per_token / mean_list)))
        return per_token, nprobe, wide, limit

    def _search_texts(self, texts: list[str], k: int, threads: int | None = None, vectors: bool = True):
        """(query vectors per text, [(doc row, score)] per text). Queries are encoded with torch's thread setting
        of when the searcher was made (as Pyserini's encoders use torch's); ``threads`` threads (default: the same
        number) run the search (FAISS and the tensor steps). ``vectors``: whether the caller reads the query vectors
        (a backend of worker processes then sends them back)."""
        live = [i for i, text in enumerate(texts) if not is_blank(text)]
        hits: list[list[tuple[int, float]]] = [[] for _ in texts]
        query_vectors = [np.zeros((0, self.dimension), dtype=np.float32) for _ in texts]
        if not live or self.store.num_live == 0:
            return query_vectors, hits
        k = min(k, self.store.num_live)  # no more hits than live documents: a huge k must not size the buffers
        clock = self._clock()
        found = self.engine.search_texts([texts[i] for i in live], k, threads, vectors)
        if found is not None:
            live_vectors, live_hits = found
            for j, i in enumerate(live):
                hits[i] = live_hits[j]
                if live_vectors is not None:
                    query_vectors[i] = live_vectors[j]
            clock("search")
            return query_vectors, hits
        if len(live) == 1:
            found = self.engine.search_one(texts[live[0]], self._depth(k), k)
            if found is not None:
                scores, rows, tokens = found
                query_vectors[live[0]] = self._graphed.out.vectors[0, :tokens].float().cpu().numpy()
                ok = rows >= 0
                hits[live[0]] = list(zip(rows[ok].tolist(), scores[ok].tolist()))
                clock("search")
                return query_vectors, hits
        if self.exchange is None:
            out = self._encode([texts[i] for i in live])
            q, q_mask, q_sal = out.vectors.float(), out.mask, out.salience
        else:
            q, q_mask, q_sal = self._encode_together([texts[i] for i in live])
        clock("encode")
        queries = Queries(q, q_mask, q_sal, prune_mask(q_sal, q_mask, self.query_prune), self.use_salience)
        with compute_threads(self.encode_threads if threads is None else threads):
            scores, rows = self.engine.search(queries, self._depth(k), k, clock)
            scores, rows = scores.cpu().numpy(), rows.cpu().numpy()
        clock("refine")
        if vectors:  # read back only for callers that take them
            host_vectors, mask = q.cpu().numpy(), q_mask.cpu().numpy()
            for j, i in enumerate(live):
                query_vectors[i] = host_vectors[j][mask[j]]
        for j, i in enumerate(live):
            found = rows[j] >= 0
            hits[i] = list(zip(rows[j][found].tolist(), scores[j][found].tolist()))
        return query_vectors, hits

    def _encode(self, texts: list[str]):
        """TokenOutput of non-blank ``texts``: through the captured CUDA graphs where there are some (one query, or a
        batch), else the model's eager pass with the searcher's encoding threads."""
        if self._graphed is not None:
            return self._graphed(texts[0]) if len(texts) == 1 else self._graphed.encode_batch(texts)
        with compute_threads(self.encode_threads):  # the same threads in every calling thread: same vectors
            return self.model.encode_padded(texts, is_query=True, batch_size=self.batch_size,
                                            maxlen=self.query_max_length)

    def _encode_together(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(vectors [B, n, d] float32, mask [B, n] bool, salience [B, n]) of ``texts`` on every process of the group:
        on GPUs each process encodes its consecutive part (balanced by load, :func:`.workers.text_parts`) and the
        parts are gathered; on CPUs, whose vectors of a text can differ in the last bit with the batch around it, the
        first process encodes all."""
        exchange, device = self.exchange, self.model.device
        if exchange.on_device:
            mine = texts[text_parts(texts, exchange.world_size)[exchange.rank]]
        else:
            mine = texts if exchange.rank == 0 else []
        out = self._encode(mine) if mine else None
        shapes = exchange.all_gather(None if out is None else (*out.vectors.shape, str(out.salience.dtype)))
        found = [shape for shape in shapes if shape is not None]
        rows, width, dim = max(s[0] for s in found), max(s[1] for s in found), found[0][2]
        if out is None:
            parts = [torch.zeros(0, width, dim, device=device), torch.zeros(0, width, dtype=torch.uint8, device=device),
                     torch.zeros(0, width, device=device)]
        else:  # salience travels as float32 and comes back in its own type
            parts = [out.vectors.float(), out.mask.to(torch.uint8), out.salience.float()]
        gathered = []
        for t in parts:
            pad = [0, 0] * (t.dim() - 2) + [0, width - t.shape[1], 0, rows - t.shape[0]]
            every = exchange.all_gather_tensor(torch.nn.functional.pad(t, pad))
            gathered.append(torch.cat([g[:s[0]] for g, s in zip(every, shapes) if s is not None]).to(device))
        salience_type = getattr(torch, found[0][3].split(".")[-1])
        return gathered[0], gathered[1].bool(), gathered[2].to(salience_type)

    def _clock(self):
        """A function that adds the seconds since its last call to ``self.timings[step]`` (a no-op unless timings
        is a dict; device work is waited for, so profiling slows the search a little) and marks the step's end for
        a profiler (a range named STEP_END + step)."""
        if self.timings is None:
            return lambda step: None
        import time

        last = [time.perf_counter()]

        def clock(step: str) -> None:
            if self.model.device.type == "cuda":
                torch.cuda.synchronize(self.model.device)
            with torch.profiler.record_function(STEP_END + step):  # where the step ends in a profiler's trace
                pass
            now = time.perf_counter()
            self.timings[step] = self.timings.get(step, 0.0) + now - last[0]
            last[0] = now

        return clock

    def _capture_query_encoder(self, model):
        from pyserini_aligner.search.torch_backend import GraphedQueryEncoder

        try:
            return GraphedQueryEncoder(model, self.query_max_length)
        except RuntimeError as err:  # a model whose forward pass syncs with the host cannot be captured
            log.warning("query encoding runs eagerly (CUDA graph capture failed: %s)", str(err).splitlines()[0])
            return None

    def _doc_vectors(self, row: int) -> np.ndarray:
        start, end = self.store.offsets[row], self.store.offsets[row + 1]
        return self.store.token_vectors(np.arange(start, end)).numpy()
