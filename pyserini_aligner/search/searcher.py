"""AlignerSearcher: multi-vector AligneR retrieval over an index built by :mod:`pyserini_aligner.index`.

Per query: encode, keep the β^q most salient query tokens, take each kept token's ``k_per_token`` best indexed
document tokens (probing ``nprobe`` inverted lists of a compressed index), keep the ``max_candidates`` best documents
by a proxy score (:func:`.candidates.select_candidates`), rescore them with the full alignment score and return the top
k. A drop-in for Pyserini's ``FaissSearcher``: ``search``/``batch_search`` return ``DenseSearchResult`` lists.

Every setting is a field of :class:`.options.SearchOptions`. A backend and its front end (:mod:`.backends`, chosen by
:mod:`.backends.choose` with each index generation) encode and search the queries: "faiss" (CPU: FAISS finds the
entries, refinement decodes the memory-mapped codes) or "torch" (codes resident on one or more devices, every step as
tensor operations; see :mod:`.codes`). On several GPUs each device holds a copy of
the codes (a batch split across the copies: the first searched in this process, the others by worker processes) or a
worker process holds a share of the segments on each (each step on all devices at once).
A searcher is safe to share across threads (one search runs at a time) and keeps serving the index generation it
opened until :meth:`AlignerSearcher.reopen`.

A search may be restricted by a filter (:class:`pyserini_aligner.filters.Filter`, or a collection of docids): it is
resolved against the open generation (its live matching rows, kept for the last FILTER_CACHE filters) and applied
inside candidate generation by every backend, so that a search returns k hits whenever k documents match, ranked as
a search of the matching documents alone; when few match, all of them are refined (:func:`.options.filtered_depth`).
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path
from typing import Collection

import numpy as np
import torch

from pyserini_aligner.dist import DistContext
from pyserini_aligner.filters import Filter
from pyserini_aligner.index.format import read_manifest
from pyserini_aligner.index.reader import StoredIndex
from pyserini_aligner.resolve import model_for_index
from pyserini_aligner.search.allowed import AllowedRows, matching_rows
from pyserini_aligner.search.backends.base import Scoring, step_clock
from pyserini_aligner.search.backends.choose import close_backend, front_end, open_backend
from pyserini_aligner.search.encoding import check_threads, graphed_query_encoder
from pyserini_aligner.search.options import Depth, SearchOptions, pyserini_device, search_options
from pyserini_aligner.textio import check_collection, check_unique_ids, is_blank

# options read at each search (the depth, the batch): changed by configure without reopening the backend
SEARCH_TIME = frozenset({"max_candidates", "interaction_candidates", "batch_size"})
FILTER_CACHE = 8  # filters whose resolved rows a searcher keeps (per index generation)
Filtering = Filter | Collection[str] | None  # what a search is restricted by: a Filter, docids, or nothing


@lru_cache(maxsize=None)
def dense_result_classes():
    """Pyserini's (DenseSearchResult, PrfDenseSearchResult), imported on first use (Pyserini starts a JVM)."""
    from pyserini.search.faiss._prf import PrfDenseSearchResult
    from pyserini.search.faiss._searcher import DenseSearchResult

    return DenseSearchResult, PrfDenseSearchResult


class AlignerSearcher:
    """Search an AligneR index; ``search``/``batch_search`` mirror Pyserini's ``FaissSearcher``.

    index_dir: folder written by ``python -m pyserini_aligner.index``. encoder: None (the model in the manifest),
    a checkpoint name/folder, an AlignerModel or an AlignerQueryEncoder. options: a :class:`.options.SearchOptions`
    (default: the defaults), with ``changes`` (its fields as keyword arguments: strategy, k_per_token, query_prune,
    max_candidates, refine_with, nprobe, ef_search, device, batch_size, backend, interaction_candidates,
    query_max_length, devices, segments, exchange, placement; see SearchOptions); TypeError naming the fields for
    any other keyword.

    devices (torch backend, compressed index): several devices (e.g. ["cuda:0", "cuda:1"]) (:mod:`.backends.workers`),
    placed by ``placement``: "replicate" holds a whole copy of the codes on each device and splits every batch of
    query texts across the copies, each encoding and searching its part (the first copy in this process, the others
    in a worker process each; one query is searched by the first, through its CUDA-graph plan), "shard" spreads
    consecutive segments over the devices and runs each search step on all of them at once, "auto" (default)
    replicates when a copy and room to search fit in every device's free memory (GPUs) and shards otherwise; the
    choice is made again at :meth:`reopen`. Every placement ranks as one device (a replica's scores may differ in the
    last bit: it encodes its part of a batch alone).

    segments and exchange (torch backend, compressed index; one process of a torchrun job, see
    :func:`distributed_searcher`): ``exchange`` (a :class:`pyserini_aligner.dist.Collectives`) connects the
    processes, which encode their parts of each batch on GPUs. With placement "shard" each holds its consecutive share
    of the segments (``segments``, or its share by tokens), ranks the candidates it holds, and the candidates are
    scored by parts of the batch (GPUs) or by the ranks that hold them (CPUs: :class:`.backends.exchanged.Exchanged`);
    with "replicate" each holds the whole index and searches its part of every batch; "auto" replicates when the
    index fits on every rank. Every process returns the ranking of the whole index.
    """

    def __init__(self, index_dir: str | os.PathLike, encoder=None, options: SearchOptions | None = None, **changes):
        self.index_dir = Path(index_dir)
        self.options = search_options(options, **changes).resolved()  # the settings searched with (see configure)
        self.encoder_arg = encoder
        self.timings: dict[str, float] | None = None  # set to {} to add up seconds per search step
        self._lock = threading.RLock()
        self._filters: OrderedDict = OrderedDict()  # (generation, Filter) -> AllowedRows, the most recent last
        self.encode_threads = torch.get_num_threads()  # torch's setting when the searcher was made
        self.model = self.graphed = self.engine = self.front = None
        self._open(StoredIndex(self.index_dir), encoder, self.options)
        self.graphed_queries = self.graphed is not None  # queries are encoded through CUDA graphs

    def _open(self, store: StoredIndex, encoder, options: SearchOptions) -> None:
        """Open the backend and its front end for ``store`` (one index generation) with resolved ``options``."""
        if encoder is not None or self.model is None:
            model = model_for_index(encoder, store.manifest, self.index_dir, options.device)
        elif self.model.fingerprint() != store.manifest.model_fingerprint:
            model = model_for_index(None, store.manifest, self.index_dir, options.device)
        else:
            model = self.model
        positions = getattr(model.backbone.config, "max_position_embeddings", None)
        if options.query_max_length is not None and positions is not None and options.query_max_length > positions:
            raise ValueError(f"query_max_length {options.query_max_length} exceeds the model's {positions} positions")
        strategy = options.strategy or store.manifest.default_strategy  # the index's own
        graphed = graphed_query_encoder(model, options.query_max_length, self.graphed)
        width = int(store.lengths[store.live].max()) if store.num_live else 1  # the longest live document
        scoring = Scoring(strategy, options.refine_with, model.scores_with_salience, options.query_prune,
                          width)  # documents pad to it in every shard
        previous = self.engine
        engine = open_backend(store, options, scoring, searcher_class=type(self), encoder=self.encoder_arg)
        close_backend(previous)  # worker processes of the last generation
        self.engine, self.front = engine, front_end(engine, options, scoring, model, graphed, self.encode_threads)
        self._filters.clear()  # rows of the last generation (and forms made for its backend)
        self.model, self.graphed, self.scoring, self.options = model, graphed, scoring, options
        self.store, self.manifest = store, store.manifest
        self.strategy, self.use_salience = strategy, scoring.use_salience
        # Pyserini FaissSearcher attributes
        self.docids = store.docids
        self.dimension = self.manifest.dim
        self.num_docs = self.manifest.num_docs

    def configure(self, **changes) -> None:
        """Search with ``changes`` to the options (SearchOptions fields, e.g. ``strategy`` as a Strategy or a string,
        ``max_candidates``, ``batch_size``) from the next search on; the index generation stays open. Changes to the
        depth and batch size apply at once; others reopen the backend on the current generation."""
        with self._lock:
            options = self.options.replace(**changes).resolved()
            if options == self.options:
                return
            changed = {name for name in changes if getattr(options, name) != getattr(self.options, name)}
            if not changed <= SEARCH_TIME:
                self._open(self.store, None, options)
                return
            self.options = options  # read by the depth of each search
            if "batch_size" in changed:  # the same backend; the front end's encoder takes the batch size
                self.front = front_end(self.engine, options, self.scoring, self.model, self.graphed,
                                       self.encode_threads)

    def reopen(self) -> bool:
        """Switch to the index's newest committed generation if it changed; returns whether it did. Searches in
        flight finish on the old generation."""
        if read_manifest(self.index_dir).generation == self.manifest.generation:
            return False
        fresh = StoredIndex(self.index_dir)
        with self._lock:
            self._open(fresh, None, self.options)
        return True

    @classmethod
    def from_pyserini(cls, index_dir: str | os.PathLike, query_encoder=None, prebuilt_index_name: str | None = None,
                      normalize_distances: bool = False, faiss_device: str = "cpu", **kwargs) -> "AlignerSearcher":
        """Build from ``FaissSearcher``'s arguments (``query_encoder``: "aligner", a checkpoint folder or an
        AlignerQueryEncoder); ``prebuilt_index_name`` and ``normalize_distances`` are not supported."""
        if prebuilt_index_name or normalize_distances:
            raise ValueError("AligneR indexes support neither prebuilt_index_name nor normalize_distances")
        return cls(index_dir, encoder=query_encoder, device=pyserini_device(faiss_device), **kwargs)

    # ------------------------------------------------------------------ settings (read-only: see configure)
    @property
    def device(self) -> str:
        return self.options.device

    @property
    def devices(self) -> list[str]:
        return list(self.options.all_devices)

    @property
    def backend(self) -> str:
        return self.options.backend

    @property
    def placement(self) -> str:
        return self.options.placement

    @property
    def k_per_token(self) -> int:
        return self.options.k_per_token

    @property
    def query_prune(self) -> float:
        return self.options.query_prune

    @property
    def max_candidates(self) -> int:
        return self.options.max_candidates

    @property
    def interaction_candidates(self) -> int:
        return self.options.interaction_candidates

    @property
    def refine_with(self) -> str:
        return self.options.refine_with

    @property
    def batch_size(self) -> int:
        return self.options.batch_size

    @property
    def nprobe(self) -> int | None:
        return self.options.nprobe

    @property
    def ef_search(self) -> int | None:
        return self.options.ef_search

    @property
    def query_max_length(self) -> int | None:
        return self.options.query_max_length

    @property
    def num_rows(self) -> int:
        """Documents (rows) the backend holds (a rank's share of the index, or all of it)."""
        return self.engine.num_rows

    def depth(self, k: int, filter: Filtering = None) -> Depth:
        """The depth of a top-k search of the open index generation (:meth:`.options.SearchOptions.depth`),
        restricted by ``filter`` (see :meth:`search`) when given."""
        with self._lock:
            allowed = self._allowed(filter)
            return self.options.depth(k, self.store, self.front.has_interaction,
                                      None if allowed is None else allowed.count)

    def matching(self, filter: Filtering) -> int:
        """How many live documents of the open index generation ``filter`` (see :meth:`search`; None: every one)
        matches."""
        with self._lock:
            allowed = self._allowed(filter)
            return self.store.num_live if allowed is None else allowed.count

    def _allowed(self, filter: Filtering | AllowedRows) -> AllowedRows | None:
        """The rows ``filter`` (None, a Filter, a collection of docids, or rows already resolved against this
        generation) allows, resolved once per generation and filter."""
        if filter is None:
            return None
        if isinstance(filter, AllowedRows):
            if len(filter) != self.store.num_docs:
                raise ValueError(f"allowed rows for {len(filter)} documents; the index has {self.store.num_docs}")
            return filter
        filter = as_filter(filter)
        key = (self.manifest.generation, filter)
        if key in self._filters:
            self._filters.move_to_end(key)
        else:
            self._filters[key] = matching_rows(self.store, filter)
            while len(self._filters) > FILTER_CACHE:
                self._filters.popitem(last=False)
        return self._filters[key]

    # ------------------------------------------------------------------ public API
    def search(self, q: str, k: int = 10, threads: int | None = None, remove_dups: bool = False,
               return_vector: bool = False, filter: Filtering = None):
        """Top-k documents for query text ``q`` as DenseSearchResult(docid, score), best first ([] for an empty query).
        ``threads`` run the search steps (default: torch's thread count when the searcher was made). ``filter``:
        only documents it matches are returned (a :class:`pyserini_aligner.filters.Filter`, or a collection of
        docids; a single string is a TypeError); k of them whenever k match, none when none does.

        remove_dups is accepted for Pyserini compatibility (results are unique per document already). With
        return_vector, returns (query vectors [n, d], [PrfDenseSearchResult(docid, score, doc vectors [m, d])]).
        """
        if not isinstance(q, str):
            raise TypeError(f"query must be a string, got {type(q).__name__}")
        hits = self.batch_search([q], ["q"], k=k, threads=threads, return_vector=return_vector, filter=filter)
        return (hits[0]["q"], hits[1]["q"]) if return_vector else hits["q"]

    def batch_search(self, queries: list[str], q_ids: list[str], k: int = 10, threads: int | None = None,
                     return_vector: bool = False, filter: Filtering = None):
        """{q_id: [DenseSearchResult]} for many queries (batched encoding and search), restricted by ``filter``
        (see :meth:`search`).

        With return_vector, returns ({q_id: query vectors [n, d]}, {q_id: [PrfDenseSearchResult]}).
        """
        check_collection(queries, "queries")
        check_collection(q_ids, "q_ids")
        if len(queries) != len(q_ids):
            raise ValueError(f"{len(queries)} queries but {len(q_ids)} q_ids")
        check_unique_ids(q_ids, "q_ids")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        filter = as_filter(filter)
        dense, prf = dense_result_classes()
        results, vectors = {}, {}
        check_threads(threads if threads is not None else 1)
        with self._lock:
            for start in range(0, len(queries), self.batch_size):
                texts, ids = queries[start:start + self.batch_size], q_ids[start:start + self.batch_size]
                for qid, query_vectors, hits in zip(ids, *self.search_texts(texts, k, threads, return_vector,
                                                                            filter)):
                    vectors[qid] = query_vectors
                    if return_vector:
                        results[qid] = [prf(self.docids[row], score, self._doc_vectors(row)) for row, score in hits]
                    else:
                        results[qid] = [dense(self.docids[row], score) for row, score in hits]
        return (vectors, results) if return_vector else results

    def rank(self, queries: list[str], k: int = 10, threads: int | None = None,
             filter: Filtering = None) -> list[list[tuple[str, float]]]:
        """Top-k (docid, score) lists, best first, one per query: ``batch_search`` over plain data (no Pyserini
        result objects, so it also runs where Pyserini is not installed), restricted by ``filter`` (see
        :meth:`search`)."""
        check_collection(queries, "queries")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        filter = as_filter(filter)
        ranked = []
        check_threads(threads if threads is not None else 1)
        with self._lock:
            for start in range(0, len(queries), self.batch_size):
                _, hits = self.search_texts(queries[start:start + self.batch_size], k, threads, vectors=False,
                                            filter=filter)
                ranked += [[(self.docids[row], score) for row, score in query_hits] for query_hits in hits]
        return ranked

    def search_texts(self, texts: list[str], k: int, threads: int | None = None, vectors: bool = True,
                     filter: Filtering | AllowedRows = None):
        """(query vectors [n, d] per text, [(doc row, score)] per text, best first) of one batch of texts (blank
        texts get no hits). Queries are encoded with torch's thread setting of when the searcher was made (as
        Pyserini's encoders use torch's); ``threads`` threads (default: the same number) run the search (FAISS and
        the tensor steps). ``vectors``: whether the caller reads the query vectors (worker processes then send them
        back; else they are empty). ``filter``: see :meth:`search` (or an :class:`.allowed.AllowedRows` of this
        generation)."""
        with self._lock:
            allowed = self._allowed(filter)
            live = [i for i, text in enumerate(texts) if not is_blank(text)]
            hits: list[list[tuple[int, float]]] = [[] for _ in texts]
            query_vectors = [np.zeros((0, self.dimension), dtype=np.float32) for _ in texts]
            found = self.store.num_live if allowed is None else allowed.count  # documents a search may return
            if not live or found == 0:
                return query_vectors, hits
            k = min(k, found)  # no more hits than allowed documents: a huge k must not size the buffers
            depth = self.options.depth(k, self.store, self.front.has_interaction, None if allowed is None
                                       else allowed.count)
            clock = step_clock(self.timings, self.model.device)
            live_vectors, live_hits = self.front.search_texts([texts[i] for i in live], depth, k, threads, vectors,
                                                              clock, allowed)
            for j, i in enumerate(live):
                hits[i] = live_hits[j]
                if live_vectors is not None:
                    query_vectors[i] = live_vectors[j]
            return query_vectors, hits

    def _doc_vectors(self, row: int) -> np.ndarray:
        start, end = self.store.offsets[row], self.store.offsets[row + 1]
        return self.store.token_vectors(np.arange(start, end)).numpy()


def as_filter(filter: Filtering | AllowedRows) -> Filter | AllowedRows | None:
    """``filter`` as a search takes it: None, a Filter or resolved rows as they are, any other collection as docids
    (:meth:`.filters.Filter.docids`: TypeError for a single string)."""
    if filter is None or isinstance(filter, (Filter, AllowedRows)):
        return filter
    return Filter.docids(filter)


def distributed_searcher(index_dir: str | os.PathLike, ctx: DistContext, encoder=None,
                         options: SearchOptions | None = None, **changes) -> AlignerSearcher:
    """An AlignerSearcher (torch backend) of rank ``ctx.rank`` of a torchrun job, searching in lockstep with the
    other ranks (:mod:`.backends.exchanged`); device "cuda" means cuda:LOCAL_RANK. placement: "shard" (this rank's
    share of the segments), "replicate" (the whole index) or "auto" (replicate when the index fits on every rank's
    GPU). Every rank must call it, and then search, with the same arguments."""
    return AlignerSearcher(index_dir, encoder, search_options(options, **changes).on_rank(ctx))
