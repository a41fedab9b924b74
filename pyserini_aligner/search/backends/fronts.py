"""Front ends of one process's backend (:class:`~.base.FrontEnd`): :class:`Encoded` encodes a batch of texts and
hands it to the backend; :class:`Graphed` searches a batch by replaying CUDA graphs of its encoding and search
(:class:`..graphs.GraphedSearch`) and leaves larger batches to an :class:`Encoded`. The front end of several
devices is :class:`.workers.Workers`."""
from __future__ import annotations

import logging
from typing import Callable

import torch

from pyserini_aligner.salience import prune_mask
from pyserini_aligner.search.allowed import AllowedRows
from pyserini_aligner.search.backends.base import Clock, Queries, Scoring, SearchBackend, no_clock
from pyserini_aligner.search.encoding import Encoded as EncodedQueries
from pyserini_aligner.search.encoding import compute_threads
from pyserini_aligner.search.options import Depth

log = logging.getLogger(__name__)


def found_hits(scores, rows) -> list[tuple[int, float]]:
    """[(doc row, score)] of one query's ``scores`` / ``rows`` [k] (numpy, −1 rows past the documents found)."""
    ok = rows >= 0
    return list(zip(rows[ok].tolist(), scores[ok].tolist()))


class Encoded:
    """``engine`` (a :class:`~.base.SearchBackend`) behind ``encode`` (texts -> encoded queries, :mod:`..encoding`);
    the search steps run with ``threads`` torch/FAISS threads unless a search names its own."""

    def __init__(self, engine: SearchBackend, encode: Callable[[list[str]], EncodedQueries], scoring: Scoring,
                 threads: int):
        self.engine, self.encode, self.scoring, self.threads = engine, encode, scoring, threads
        self.has_interaction = engine.has_interaction

    def search_texts(self, texts: list[str], depth: Depth, k: int, threads: int | None, vectors: bool,
                     clock: Clock = no_clock, allowed: AllowedRows | None = None) -> tuple[list | None, list]:
        q, q_mask, q_sal = self.encode(texts)
        clock("encode")
        queries = Queries(q, q_mask, q_sal, prune_mask(q_sal, q_mask, self.scoring.query_prune),
                          self.scoring.use_salience)
        with compute_threads(self.threads if threads is None else threads):
            scores, rows = self.engine.search(queries, depth, k, clock, allowed)
            scores, rows = scores.cpu().numpy(), rows.cpu().numpy()
        clock("refine")
        host = None
        if vectors:  # read back only for callers that take them
            host_vectors, mask = q.cpu().numpy(), q_mask.cpu().numpy()
            host = [host_vectors[j][mask[j]] for j in range(len(texts))]
        return host, [found_hits(scores[j], rows[j]) for j in range(len(texts))]


class Graphed:
    """Batches through ``plan`` (a :class:`..graphs.GraphedSearch`: encoding and search replayed from CUDA graphs,
    captured per batch bucket, query width, depth and k on first use, a filtered search's rows copied into the buffer
    its probes read), so that a small batch costs what the device does; batches larger than one replay takes,
    filtered searches that refine every match (``depth.every_row``), and every batch once the plan cannot be
    captured, through ``rest``."""

    def __init__(self, plan, rest: Encoded):
        self.plan, self.rest = plan, rest
        self.engine, self.has_interaction = rest.engine, rest.has_interaction

    def search_texts(self, texts: list[str], depth: Depth, k: int, threads: int | None, vectors: bool,
                     clock: Clock = no_clock, allowed: AllowedRows | None = None) -> tuple[list | None, list]:
        if self.plan is not None and not depth.every_row and len(texts) <= self.plan.largest_batch(depth, k):
            shard = self.plan.shard
            rows_of = None if allowed is None else \
                allowed.on(shard.device)[shard.row_base:shard.row_base + shard.num_rows]
            try:
                scores, rows, tokens, query_vectors = self.plan(texts, depth, k, rows_of)
            except RuntimeError as err:  # a strategy whose scoring reads sizes back to the host cannot be captured
                log.warning("batches run step by step (CUDA graph capture failed: %s)", str(err).splitlines()[0])
                self.plan = None
                torch.cuda.synchronize(self.engine.device)
            else:
                host = None
                if vectors:
                    host_vectors = query_vectors.float().cpu().numpy()
                    host = [host_vectors[j, :tokens[j]] for j in range(len(texts))]
                scores, rows = scores.numpy(), rows.numpy()
                clock("search")
                return host, [found_hits(scores[j], rows[j]) for j in range(len(texts))]
        return self.rest.search_texts(texts, depth, k, threads, vectors, clock, allowed)
