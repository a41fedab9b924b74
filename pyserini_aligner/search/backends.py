"""Search backends: where an index's codes or vectors live, and how a batch of encoded queries is searched there.

:class:`~pyserini_aligner.search.searcher.AlignerSearcher` encodes the queries and hands them to one backend,
chosen by :func:`open_backend` when an index generation is opened. Every backend ranks by the rule of
:mod:`.engine`: each kept query token's best indexed tokens (``probe``), the best documents by the proxy score
(:func:`.engine.select_candidates`), optionally narrowed by centroid interaction (``interaction``), rescored with
the full alignment score (``refine``), top k. The backends:

- :class:`FaissIVF`: a compressed index on the CPU. FAISS's ``IndexIVFPQ`` scans the inverted lists; interaction
  and refinement read the memory-mapped codes (one :class:`.engine.CodeShard` a segment, in parallel threads).
- :class:`FaissFlat`: an fp16 index on the CPU. Each segment's FAISS index finds the tokens; refinement scores the
  stored float16 tokens.
- :class:`TorchCodes`: a compressed index's codes on one device, every step as tensor operations; on a GPU, one
  query at a time replays its CUDA-graph plan (:class:`.static.GraphedSearch`).
- :class:`TorchTokens`: an fp16 index's tokens on one device (:class:`.torch_backend.TorchTokenIndex`).
- :class:`Exchanged` and :class:`ExchangedReplica`: one process's share of a search across the processes of a
  torchrun job (:mod:`.distributed`): consecutive segments, probes and scores combined through collectives; or a
  whole copy searching its part of every batch.
- :class:`.workers.Workers`: several devices of one machine: whole copies (a one-device searcher in this process
  for the first, in a worker process for each other), or a worker process each, a rank of a process group searching
  its segments as :class:`Exchanged` does; it encodes the texts itself.

Every backend returns the ranking one device computes over the whole index.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np
import torch
from torch import Tensor

from pyserini_aligner.alignment import Strategy, alignment_scores
from pyserini_aligner.index.store import StoredIndex, Workspace
from pyserini_aligner.search.engine import (CodeShard, allowed_entries, allowed_rows, ascending, balanced_slices,
                                            best_of_parts, held_first, merge_probes, narrow, probe_floors,
                                            query_chunks, rank_candidates, row_selector, select_candidates, top_hits)
from pyserini_aligner.search.flat import search_index

log = logging.getLogger(__name__)

BACKENDS = ("faiss", "torch")
PLACEMENTS = ("auto", "replicate", "shard")
REFINE_CHUNK = 512  # documents scored at once by the fp16 CPU refinement (bounds the padded token tensor)
DEFAULT_EF_SEARCH = 128
# device memory a search needs beside the index (a batch of 300 queries at the GPU's default depth peaks near
# 1.3 GiB), kept free when deciding whether a whole copy of the index fits on a device
WORKSPACE_BYTES = 4 << 30

Depth = tuple[int, int, int, int]  # (entries per probe K, nprobe, candidates narrowed by interaction W or 0, refined C)
Clock = Callable[[str], None]


def _no_clock(step: str) -> None:
    return None


@dataclass(frozen=True)
class Scoring:
    """What an index generation is searched with: the alignment strategy, the stored tokens refinement scores
    ("all" or "kept"), whether the model weights tokens by salience, β^q, and the token width every document pads
    to in refinement (the longest document of the index, so that scores do not depend on how it is split)."""

    strategy: Strategy
    refine_with: str
    use_salience: bool
    query_prune: float
    refine_width: int


@dataclass
class Queries:
    """A batch of encoded queries on one device: vectors [B, n, d] float32, mask [B, n] bool, salience [B, n]
    float32, probe_mask [B, n] bool (the tokens sent to candidate generation); ``weighted``: the model scores with
    salience (probes are weighted and refinement uses it)."""

    vectors: Tensor
    mask: Tensor
    salience: Tensor
    probe_mask: Tensor
    weighted: bool

    def __len__(self) -> int:
        return len(self.vectors)

    @property
    def refine_salience(self) -> Tensor | None:
        return self.salience if self.weighted else None

    def part(self, rows: slice) -> "Queries":
        return Queries(self.vectors[rows], self.mask[rows], self.salience[rows], self.probe_mask[rows], self.weighted)

    def to(self, device: torch.device, non_blocking: bool = False) -> "Queries":
        return Queries(*(t.to(device, non_blocking=non_blocking)
                         for t in (self.vectors, self.mask, self.salience, self.probe_mask)), self.weighted)


class SearchBackend(Protocol):
    """What the searcher needs of a backend."""

    device: torch.device  # where the backend merges and returns its results
    has_interaction: bool  # whether it has the centroid-interaction stage (the depth's W applies)
    placement: str  # "one" device, or several in "replicate" / "shard" placement

    def search(self, queries: Queries, depth: Depth, k: int, clock: Clock = _no_clock) -> tuple[Tensor, Tensor]:
        """(scores [B, k'] float32, global doc rows [B, k'] int64), best first, k' <= k; −inf / −1 past the
        documents found."""

    def search_one(self, text: str, depth: Depth, k: int) -> tuple[Tensor, Tensor, int] | None:
        """One query through a captured plan: (scores [k], rows [k]) on the host and its real token count (its
        vectors stay in the graphed encoder's output), or None where there is no plan."""

    def search_texts(self, texts: list[str], k: int, threads: int | None,
                     vectors: bool) -> tuple[list | None, list] | None:
        """(query vectors per text or None unless ``vectors``, [(doc row, score)] per text) of non-blank texts, for a
        backend that encodes the queries itself (``threads``: its search threads); None for the others (the
        searcher encodes and calls search)."""


class Staged:
    """A backend made of the three steps ``probe``, ``interaction`` and ``refine``; :meth:`search` runs the
    candidate rule of :mod:`.engine` over them."""

    device: torch.device
    has_interaction = True
    placement = "one"

    def probe(self, probes: Tensor, per_token: int, nprobe: int) -> tuple[Tensor, Tensor]:
        """(scores [R, K], global doc rows [R, K]) of each probe's K best indexed tokens; probes [R, d]."""
        raise NotImplementedError

    def interaction(self, q: Tensor, q_mask: Tensor, rows: Tensor, valid: Tensor) -> Tensor:
        """Centroid-interaction scores [B, C] on ``self.device`` of candidate ``rows`` [B, C] (−inf where not
        valid)."""
        raise NotImplementedError

    def refine(self, q: Tensor, q_mask: Tensor, q_sal: Tensor | None, rows: Tensor, valid: Tensor) -> Tensor:
        """Alignment scores [B, C] of candidate ``rows`` [B, C] (−inf where not valid)."""
        raise NotImplementedError

    def search(self, queries: Queries, depth: Depth, k: int, clock: Clock = _no_clock) -> tuple[Tensor, Tensor]:
        rows, valid = self.candidates(queries, depth, clock)
        _, _, wide, limit = depth
        q, q_mask = queries.vectors, queries.mask
        if wide:
            rows, valid = narrow(self.interaction(q, q_mask, rows, valid), rows.to(self.device), limit)
            clock("interaction")
        refined = self.refine(q, q_mask, queries.refine_salience, rows, valid)
        return top_hits(refined, rows.to(refined.device), k)

    def candidates(self, queries: Queries, depth: Depth, clock: Clock = _no_clock) -> tuple[Tensor, Tensor]:
        """(rows [B, W] ascending, valid [B, W]): each query's best documents by the proxy score
        (:func:`.engine.select_candidates` over :meth:`probe`), W = the depth's interaction width or else its
        refinement width."""
        per_token, nprobe, wide, limit = depth
        owner, token = queries.probe_mask.nonzero(as_tuple=True)
        probe_scores, probe_rows = self.probe(queries.vectors[owner, token], per_token, nprobe)
        clock("probe")
        weights = queries.salience[owner, token].to(probe_scores.device) if queries.weighted else None
        found = select_candidates(probe_scores, probe_rows, owner.to(probe_scores.device), len(queries),
                                  wide or limit, weights)
        clock("select")
        return found

    def search_one(self, text: str, depth: Depth, k: int) -> tuple[Tensor, Tensor, int] | None:
        return None

    def search_texts(self, texts: list[str], k: int, threads: int | None, vectors: bool) -> None:
        return None


# ---------------------------------------------------------------------------------------------------- the CPU
class SegmentCodes:
    """Every segment's memory-mapped codes (``parts``, one CPU :class:`TorchCodes` each, in segment order), scored
    at once by a thread each (tensor operations release the GIL while they run); each part scores only the
    candidates it holds and the parts' scores are combined by an element-wise maximum."""

    def __init__(self, parts: list[TorchCodes]):
        self.parts = parts
        self._pool = ThreadPoolExecutor(len(parts), thread_name_prefix="aligner-segment") if len(parts) > 1 else None

    def _each(self, step: Callable, *inputs) -> Tensor:
        if self._pool is None:
            return step(self.parts[0], *inputs)
        out = [future.result() for future in [self._pool.submit(step, part, *inputs) for part in self.parts]]
        for part in out[1:]:
            out[0] = torch.maximum(out[0], part)
        return out[0]

    def interaction(self, q, q_mask, rows, valid) -> Tensor:
        return self._each(TorchCodes.interaction, q, q_mask, rows, valid)

    def refine(self, q, q_mask, q_sal, rows, valid) -> Tensor:
        return self._each(TorchCodes.refine_held, q, q_mask, q_sal, rows, valid)


class FaissIVF(Staged):
    """A compressed index on the CPU: FAISS's IndexIVFPQ over every segment's inverted lists (labelled by global
    document row) finds each probe's best entries; interaction and refinement decode the memory-mapped codes."""

    def __init__(self, store: StoredIndex, scoring: Scoring):
        self.store, self.device = store, torch.device("cpu")
        parts = [(seg.ivf_offsets, np.asarray(seg.ivf_docs, dtype=np.int64) + base, seg.ivf_codes)
                 for seg, base in zip(store.segments, store.row_base)]
        self.index = store.codec.faiss_index(parts)
        self.codes = SegmentCodes([codes_on(store, [i], "cpu", scoring) for i in range(len(store.segments))]) \
            if store.segments else None
        allowed = allowed_rows(store)
        self._selector = None if allowed.all() else row_selector(allowed)  # FAISS skips the other rows' entries

    def probe(self, probes: Tensor, per_token: int, nprobe: int) -> tuple[Tensor, Tensor]:
        """The coarse step (each probe's nprobe nearest centroids) on torch's BLAS, then FAISS scans the chosen
        lists, skipping the entries of rows that are not allowed."""
        import faiss

        x = np.ascontiguousarray(probes.cpu().numpy(), dtype=np.float32)
        params = faiss.SearchParametersIVF(nprobe=nprobe)
        if self._selector is not None:
            params.sel = self._selector
        lists_scores, lists = search_index(self.index.quantizer, x, nprobe)
        distances = np.empty((len(x), per_token), dtype=np.float32)
        labels = np.empty((len(x), per_token), dtype=np.int64)
        self.index.search_preassigned_c(len(x), faiss.swig_ptr(x), per_token, faiss.swig_ptr(lists),
                                        faiss.swig_ptr(lists_scores), faiss.swig_ptr(distances),
                                        faiss.swig_ptr(labels), False, params)
        return torch.from_numpy(distances), torch.from_numpy(labels)

    def interaction(self, q, q_mask, rows, valid) -> Tensor:
        return self.codes.interaction(q, q_mask, rows, valid)

    def refine(self, q, q_mask, q_sal, rows, valid) -> Tensor:
        return self.codes.refine(q, q_mask, q_sal, rows, valid)


class FaissFlat(Staged):
    """An fp16 index on the CPU: each segment's FAISS index finds each probe's best tokens; refinement scores the
    candidates' stored float16 tokens. No interaction stage."""

    has_interaction = False

    def __init__(self, store: StoredIndex, scoring: Scoring, nprobe: int | None, ef_search: int | None,
                 k_per_token: int):
        self.store, self.scoring, self.device = store, scoring, torch.device("cpu")
        self.index = [(seg.faiss_index(), base) for seg, base in zip(store.segments, store.token_base)]
        allowed = allowed_rows(store)
        self._allowed = [allowed_entries(store, number, allowed) for number in range(len(store.segments))]
        self._workspace = Workspace()
        self._set_params(store, nprobe, ef_search, k_per_token)

    def _set_params(self, store: StoredIndex, nprobe: int | None, ef_search: int | None, k_per_token: int) -> None:
        import faiss

        space = faiss.ParameterSpace()
        for index, _ in self.index:
            ivf = faiss.try_extract_index_ivf(index)
            if ivf is not None:
                space.set_index_parameter(index, "nprobe", min(nprobe or 32, ivf.nlist))
            elif nprobe is not None:
                raise ValueError(f"nprobe given but the index ({store.manifest.index_type}) is not an IVF index")
            try:
                space.set_index_parameter(index, "efSearch", max(ef_search or DEFAULT_EF_SEARCH, k_per_token))
            except RuntimeError:
                if ef_search is not None:
                    raise ValueError(f"ef_search given but the index ({store.manifest.index_type}) is not an HNSW "
                                     "index") from None

    def probe(self, probes: Tensor, per_token: int, nprobe: int) -> tuple[Tensor, Tensor]:
        x = np.ascontiguousarray(probes.cpu().numpy(), dtype=np.float32)
        parts = []
        for (index, base), seg, allowed in zip(self.index, self.store.segments, self._allowed):
            distances, labels = search_index(index, x, min(per_token, max(index.ntotal, 1)), allowed)
            found = labels >= 0  # a FAISS label is a position in the segment's faiss_ids, not a token position
            positions = seg.faiss_ids[np.where(found, labels, 0)] if index.ntotal else np.zeros_like(labels)
            rows = np.where(found, self.store.doc_of_token(positions + base), -1)
            distances = np.where(rows >= 0, distances, -np.inf).astype(np.float32)
            parts.append((torch.from_numpy(distances), torch.from_numpy(rows)))
        return merge_probes(parts, per_token) if len(parts) > 1 else parts[0]

    def refine(self, q, q_mask, q_sal, rows, valid) -> Tensor:
        out = torch.full(rows.shape, -torch.inf)
        kept_only = self.scoring.refine_with == "kept"
        for b in range(len(rows)):
            picked = rows[b][valid[b]].numpy()
            for start in range(0, len(picked), REFINE_CHUNK):
                chunk = picked[start:start + REFINE_CHUNK]
                d, d_mask, d_sal = self.store.gather(chunk, kept_only, self._workspace)
                out[b, start:start + len(chunk)] = alignment_scores(
                    q[b:b + 1], q_mask[b:b + 1], d, d_mask, self.scoring.strategy,
                    None if q_sal is None else q_sal[b:b + 1], None if q_sal is None else d_sal)[0]
        return out


# ---------------------------------------------------------------------------------------------------- one device
class TorchCodes(Staged):
    """A compressed index's codes (all or some consecutive segments: ``shard``) on one device. With a graphed query
    ``encoder`` on the same CUDA device, one query at a time is encoded and searched by replaying CUDA graphs
    (:class:`.static.GraphedSearch`, captured per query width, depth and k on first use)."""

    def __init__(self, shard: CodeShard, scoring: Scoring, encoder=None):
        self.shard, self.device, self.scoring = shard, shard.device, scoring
        self.plan = None
        if encoder is not None and self.device.type == "cuda" and encoder.ids.device == self.device:
            from pyserini_aligner.search.static import GraphedSearch

            self.plan = GraphedSearch(encoder, self.shard, scoring.query_prune, scoring.strategy,
                                      scoring.use_salience)

    def probe(self, probes, per_token, nprobe):
        return self.shard.probe(probes, per_token, nprobe)

    def interaction(self, q, q_mask, rows, valid):
        return self.shard.interaction(q, q_mask, rows, valid)

    def refine(self, q, q_mask, q_sal, rows, valid):
        return self.shard.refine(q, q_mask, q_sal, rows, valid, self.scoring.strategy, self.scoring.refine_width)

    def refine_held(self, q: Tensor, q_mask: Tensor, q_sal: Tensor | None, rows: Tensor, valid: Tensor) -> Tensor:
        """:meth:`refine` of only the candidates this shard holds (the others score −inf), so that a shard of a
        split index scores its own share of the candidates rather than a padded tensor of all of them. The queries
        go in the chunks that :meth:`.engine.CodeShard.refine` makes of the whole candidate list, each chunk's held
        candidates gathered to the front: every query-dependent table is computed over the same queries as on one
        device, so the scores are those of one device to the last bit. Scores [B, C] on this device."""
        shard = self.shard
        rows, valid = rows.to(self.device), valid.to(self.device)
        q, q_mask = q.to(self.device), q_mask.to(self.device)
        held = valid & (rows >= shard.row_base) & (rows < shard.row_base + shard.num_rows)
        out = torch.full(rows.shape, -torch.inf, device=self.device)
        padded = torch.full((len(rows),), rows.shape[1] * self.scoring.refine_width, device=self.device)
        budget = shard.elements if self.device.type == "cuda" else 1 << 22  # CodeShard.refine's chunks
        for part, _ in query_chunks(q_mask.sum(1), padded, 0, budget, padded * shard.centroids.shape[1]):
            mine = held[part]
            count = int(mine.sum(1).max())
            if count == 0:
                continue
            order = held_first(mine, count)
            picked, ok = rows[part].gather(1, order), mine.gather(1, order)
            scores = self.refine(q[part], q_mask[part], None if q_sal is None else q_sal[part].to(self.device),
                                 picked, ok)
            out[part] = out[part].scatter(1, order, torch.where(ok, scores, torch.full_like(scores, -torch.inf)))
        return out

    def search_one(self, text, depth, k):
        if self.plan is None:
            return None
        try:
            return self.plan(text, depth, k)
        except RuntimeError as err:  # a strategy whose scoring reads sizes back to the host cannot be captured
            log.warning("single queries run step by step (CUDA graph capture failed: %s)", str(err).splitlines()[0])
            self.plan = None
            torch.cuda.synchronize(self.device)
            return None


class TorchTokens:
    """An fp16 index's tokens resident on one device, searched exactly by tensor operations
    (:class:`.torch_backend.TorchTokenIndex`). No interaction stage."""

    has_interaction = False
    placement = "one"

    def __init__(self, store: StoredIndex, device: str | torch.device, scoring: Scoring):
        from pyserini_aligner.search.torch_backend import TorchTokenIndex

        self.scoring = scoring
        self.tokens = TorchTokenIndex(store, device, scoring.refine_with, with_salience=scoring.use_salience)
        self.device = self.tokens.device

    def search(self, queries: Queries, depth: Depth, k: int, clock: Clock = _no_clock) -> tuple[Tensor, Tensor]:
        per_token, _, _, limit = depth
        return self.tokens.search(queries.vectors, queries.mask, queries.salience, queries.probe_mask, k, per_token,
                                  limit, self.scoring.strategy, queries.refine_salience)

    def search_one(self, text, depth, k):
        return None

    def search_texts(self, texts, k, threads, vectors):
        return None


# ---------------------------------------------------------------------------------------------------- several
QUERY_PROBES = 32  # a query's fixed work (the same depth of candidates for every query) weighs this many probes


def batch_parts(queries: Queries, count: int) -> list[slice]:
    """``count`` consecutive slices of the batch (the last ones empty when it holds fewer queries), balanced by each
    query's load: QUERY_PROBES plus its probing tokens, since most of a search's work is the same for every query;
    slice i ends with the query that takes the load past i/count of the whole."""
    return balanced_slices(queries.probe_mask.sum(1).cpu().numpy().astype(np.float64) + QUERY_PROBES, count)


def _on_host(found: tuple[Tensor, Tensor], k: int) -> tuple[Tensor, Tensor]:
    """(scores [b, k], rows [b, k]) on the CPU: ``found`` padded with −inf / −1 to k columns."""
    scores, rows = (t.cpu() for t in found)
    pad = k - scores.shape[1]
    if pad > 0:
        scores = torch.nn.functional.pad(scores, (0, pad), value=-torch.inf)
        rows = torch.nn.functional.pad(rows, (0, pad), value=-1)
    return scores, rows


def _concat(found: list[tuple[Tensor, Tensor]], k: int) -> tuple[Tensor, Tensor]:
    if not found:
        return torch.full((0, k), -torch.inf), torch.full((0, k), -1, dtype=torch.long)
    return torch.cat([s for s, _ in found]), torch.cat([r for _, r in found])


# ---------------------------------------------------------------------------------------------------- torchrun
class Exchanged(Staged):
    """This process's consecutive segments (``local``; None when it holds none) of an index split across the
    processes of a process group (a torchrun job, or :class:`.workers.Workers`), connected by ``exchange``
    (:class:`pyserini_aligner.dist.Collectives`). Every rank probes its own inverted lists; the probes' K-th scores
    over all ranks are found (each rank for a part of the probes), so that each rank computes the proxies of the
    documents it holds as one device would; each rank's best documents are gathered and the best of them are the
    candidates. Every rank ends with the ranking of the whole index. ``device``: this rank's device.

    Then, with ``split`` (default: on GPUs, where NCCL moves tensors between devices), each rank takes its part of
    the batch's queries (balanced by load, :func:`batch_parts`), fetches the tokens of those queries' candidates from
    the ranks that hold them and scores them itself, by centroid interaction and by refinement; the parts' hits are
    gathered. The work of these steps is then split evenly however the candidates fall among the shards (a query's
    best documents often lie close together in an index). Without it (on CPUs, and where a rank holds no segment)
    every rank scores the candidates it holds for every query and the scores are combined by an element-wise
    maximum: each query-dependent table is then computed over the same queries as on one device, which keeps a
    CPU's scores those of one device to the last bit."""

    placement = "shard"

    def __init__(self, local: TorchCodes | None, exchange, device: torch.device, split: bool | None = None):
        self.local, self.exchange, self.device = local, exchange, device
        self.split = exchange.on_device if split is None else split
        self._holders: list[tuple[int, int, int]] | None = None  # (first row, rows, rank), by row; [] when not split

    def search(self, queries: Queries, depth: Depth, k: int, clock: Clock = _no_clock) -> tuple[Tensor, Tensor]:
        if not self._splits():
            return super().search(queries, depth, k, clock)
        parts = batch_parts(queries, self.exchange.world_size)
        rows, valid = self.candidates(queries, depth, clock, parts)
        mine = queries.part(parts[self.exchange.rank]).to(self.device)
        q, q_mask = mine.vectors, mine.mask
        _, _, wide, limit = depth
        if wide:
            shard, local = self._fetch(rows, valid, residuals=False)
            rows, valid = narrow(shard.interaction(q, q_mask, local, valid), rows, limit)
            clock("interaction")
        shard, local = self._fetch(rows, valid, residuals=True)
        scoring = self.local.scoring
        refined = shard.refine(q, q_mask, mine.refine_salience, local, valid, scoring.strategy, scoring.refine_width)
        return self._gather_hits(*top_hits(refined, rows, k), parts, k)

    def _splits(self) -> bool:
        """Whether this search splits the queries after choosing candidates (every rank decides alike: the ranks'
        row ranges are gathered at the first search)."""
        if not self.split:
            return False
        if self._holders is None:
            held = None if self.local is None else (self.local.shard.row_base, self.local.shard.num_rows)
            every = self.exchange.all_gather(held)
            self._holders = [] if None in every else sorted((base, rows, rank)
                                                             for rank, (base, rows) in enumerate(every))
        return bool(self._holders)

    def candidates(self, queries: Queries, depth: Depth, clock: Clock = _no_clock,
                   parts: list[slice] | None = None) -> tuple[Tensor, Tensor]:
        """(rows [B, W] ascending, valid [B, W]) of every query, or with ``parts`` (one slice of the batch a rank)
        of this rank's part of the queries only."""
        per_token, nprobe, wide, limit = depth
        owner, token = queries.probe_mask.nonzero(as_tuple=True)
        probes = queries.vectors[owner, token]
        if self.local is not None:
            scores, rows = self.local.probe(probes, per_token, nprobe)
        else:  # the shape every shard returns (engine.CodeShard.probe), with nothing found
            scores = torch.full((len(probes), max(1, per_token)), -torch.inf, device=self.device)
            rows = torch.full(scores.shape, -1, dtype=torch.long, device=self.device)
        floor = self._floors(torch.where(rows >= 0, scores, torch.full_like(scores, -torch.inf)), per_token)
        clock("probe")
        weights = queries.salience[owner, token].to(self.device) if queries.weighted else None
        width = wide or limit
        proxy, found = rank_candidates(scores, rows, owner.to(self.device), len(queries), width, weights, floor)
        pad = width - found.shape[1]
        proxy = torch.nn.functional.pad(proxy, (0, pad), value=-torch.inf)
        found = torch.nn.functional.pad(found, (0, pad), value=-1)
        if parts is None:
            proxies, lists = self.exchange.all_gather_tensor(proxy), self.exchange.all_gather_tensor(found)
        else:  # each rank receives every rank's lists of its own queries
            size, mine = max(p.stop - p.start for p in parts), parts[self.exchange.rank]

            def own(t: Tensor, fill: float) -> list[Tensor]:
                sent = [torch.nn.functional.pad(t[p], (0, 0, 0, size - (p.stop - p.start)), value=fill) for p in parts]
                return [got[:mine.stop - mine.start] for got in self.exchange.all_to_all_tensor(sent)]

            proxies, lists = own(proxy, -torch.inf), own(found, -1)
        _, best = best_of_parts(proxies, lists, width)
        best = best[:, :max(1, int((best >= 0).sum(1).max()) if len(best) else 1)]  # as wide as one device's
        clock("select")
        return ascending(best)

    def _fetch(self, rows: Tensor, valid: Tensor, residuals: bool) -> tuple[CodeShard, Tensor]:
        """(a :class:`.engine.CodeShard` holding the documents of candidate ``rows`` [b, C] where ``valid``, fetched
        from the ranks that hold them; their rows in it [b, C], 0 where not valid). ``residuals``: fetch the
        residual codes too (refinement), not only the centroid ids (centroid interaction)."""
        world, shard = self.exchange.world_size, self.local.shard
        need = torch.unique(rows[valid])  # ascending
        bases = torch.tensor([base for base, _, _ in self._holders], dtype=need.dtype, device=need.device)
        cuts = torch.searchsorted(need, bases).tolist()[1:] + [len(need)]
        wanted = [need[:0]] * world
        for (_, _, rank), start, stop in zip(self._holders, [0] + cuts[:-1], cuts):
            wanted[rank] = need[start:stop]
        served = [shard.documents(asked, residuals) for asked in self.exchange.all_to_all_rows(wanted)]
        lengths = self.exchange.all_to_all_rows([parts[0] for parts in served], [len(part) for part in wanted])
        tokens = torch.stack([part.sum() for part in lengths]).tolist()  # the token rows each rank sends here
        order = [rank for _, _, rank in self._holders]  # ascending rows

        def fetched(field: int) -> Tensor | None:
            if served[0][field] is None:
                return None
            got = lengths if field == 0 else self.exchange.all_to_all_rows([parts[field] for parts in served], tokens)
            return torch.cat([got[rank] for rank in order])

        held = shard.holding(fetched(0), fetched(1), fetched(2), fetched(3))
        local = torch.searchsorted(need, rows.clamp_min(0)).clamp_max(max(len(need) - 1, 0))
        return held, torch.where(valid, local, torch.zeros_like(local))

    def _gather_hits(self, scores: Tensor, rows: Tensor, parts: list[slice], k: int) -> tuple[Tensor, Tensor]:
        """Every rank's top-k (scores, rows) of its part of the queries, [b, ≤k] here, as [B, k] of the batch."""
        size = max(p.stop - p.start for p in parts)
        pad = (0, k - scores.shape[1], 0, size - len(scores))
        every_score = self.exchange.all_gather_tensor(torch.nn.functional.pad(scores.float(), pad, value=-torch.inf))
        every_row = self.exchange.all_gather_tensor(torch.nn.functional.pad(rows, pad, value=-1))
        return (torch.cat([t[:p.stop - p.start] for t, p in zip(every_score, parts)]),
                torch.cat([t[:p.stop - p.start] for t, p in zip(every_row, parts)]))

    def _floors(self, scores: Tensor, width: int) -> Tensor:
        """Every probe's K-th best score (K = ``width``) over the entries of all ranks (:func:`.engine.probe_floors`),
        [R]: the probes are split among the ranks, each rank receives every rank's entries of its part (all-to-all)
        and the parts' floors are gathered. scores [R, K] (−inf where invalid), the same probes on every rank."""
        world = self.exchange.world_size
        bounds = [len(scores) * i // world for i in range(world + 1)]
        size = max(1, max(b - a for a, b in zip(bounds[:-1], bounds[1:])))
        parts = [torch.nn.functional.pad(scores[a:b], (0, 0, 0, size - (b - a)), value=-torch.inf)
                 for a, b in zip(bounds[:-1], bounds[1:])]
        mine = probe_floors(torch.cat(self.exchange.all_to_all_tensor(parts), dim=1), width)
        floors = self.exchange.all_gather_tensor(mine)
        return torch.cat([f[:b - a] for f, a, b in zip(floors, bounds[:-1], bounds[1:])])

    def _combine(self, mine: Tensor | None, rows: Tensor) -> Tensor:
        if mine is None:
            mine = torch.full(rows.shape, -torch.inf, device=self.device)
        return self.exchange.all_reduce_max(mine.to(self.device))

    def interaction(self, q, q_mask, rows, valid):
        return self._combine(None if self.local is None else self.local.interaction(q, q_mask, rows, valid), rows)

    def refine(self, q, q_mask, q_sal, rows, valid):
        return self._combine(None if self.local is None else self.local.refine_held(q, q_mask, q_sal, rows, valid),
                             rows)


class ExchangedReplica:
    """The whole index in every process of a torchrun job (``local``); each rank searches its consecutive part of
    every batch (balanced by load, :func:`batch_parts`) and the parts' hits are gathered on every rank (through
    ``exchange``)."""

    has_interaction = True
    placement = "replicate"

    def __init__(self, local: TorchCodes, exchange):
        self.local, self.exchange, self.device = local, exchange, local.device

    def search(self, queries: Queries, depth: Depth, k: int, clock: Clock = _no_clock) -> tuple[Tensor, Tensor]:
        part = batch_parts(queries, self.exchange.world_size)[self.exchange.rank]
        if part.start == part.stop:
            mine = _on_host((torch.zeros(0, 0), torch.zeros(0, 0, dtype=torch.long)), k)
        else:
            mine = _on_host(self.local.search(queries.part(part).to(self.local.device), depth, k), k)
        return _concat(self.exchange.all_gather(mine), k)

    def search_one(self, text, depth, k):
        return None

    def search_texts(self, texts, k, threads, vectors):
        return None


# ---------------------------------------------------------------------------------------------------- choosing
def split_devices(store: StoredIndex, devices: Sequence, numbers: Sequence[int] | None = None) -> list[list[int]]:
    """Consecutive segment numbers (of ``numbers``, default all) per device, balanced by token count (a device
    may get none)."""
    numbers = list(range(len(store.segments))) if numbers is None else list(numbers)
    tokens = np.array([store.segments[i].info.num_tokens for i in numbers], dtype=np.float64)
    bounds = np.cumsum(tokens) / max(tokens.sum(), 1) * len(devices)
    owner = np.minimum((bounds - tokens / max(tokens.sum(), 1) * len(devices) / 2).astype(int), len(devices) - 1)
    return [[numbers[i] for i in range(len(tokens)) if owner[i] == d] for d in range(len(devices))]


def resident_bytes(store: StoredIndex, numbers: Sequence[int], refine_with: str, device: torch.device) -> int:
    """Bytes a :class:`.engine.CodeShard` of segments ``numbers`` takes on ``device``: every token's centroid id and
    residual code (and kept flag with refine_with "kept"), every inverted-list entry's document and code, two
    int64 and a flag per document, and the codec's tables."""
    spec, dim = store.codec_spec, store.manifest.dim
    infos = [store.segments[i].info for i in numbers]
    tokens, docs, entries = (sum(getattr(i, name) for i in infos) for name in ("num_tokens", "num_docs", "num_kept"))
    per_token = 2 + spec.residual_m + (1 if refine_with == "kept" else 0)
    tables = (spec.nlist + 512) * dim * 4 + (65536 * dim * 4 if device.type == "cuda" else 0)
    return tokens * per_token + docs * 17 + entries * (4 + spec.pq_m) + 16 * (spec.nlist + 1) + tables


def fits_whole(store: StoredIndex, device: torch.device, refine_with: str) -> bool:
    """Whether a whole copy of the index's codes, and room to search, fit in ``device``'s free memory (a GPU)."""
    if device.type != "cuda":
        return False
    free, _ = torch.cuda.mem_get_info(device)
    return resident_bytes(store, range(len(store.segments)), refine_with, device) + WORKSPACE_BYTES <= free


def _consecutive(store: StoredIndex, segments: Sequence[int] | None) -> list[int]:
    if segments is None:
        return list(range(len(store.segments)))
    mine = list(segments)
    if mine and (mine[0] < 0 or mine[-1] >= len(store.segments) or mine != list(range(mine[0], mine[0] + len(mine)))):
        raise ValueError(f"segments must be consecutive numbers in [0, {len(store.segments)}), got {mine}")
    return mine


def check_backend(backend: str, devices: Sequence[str], placement: str, segments, exchange) -> None:
    """ValueError for a backend that cannot search on ``devices`` with these options."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if backend == "faiss" and any(str(d).startswith("cuda") for d in devices):
        raise ValueError("backend 'faiss' runs on the CPU; use backend 'torch' (the default) on CUDA")
    if backend == "faiss" and (len(devices) > 1 or segments is not None or exchange is not None):
        raise ValueError("several devices, segments and exchange need backend 'torch'")


def default_backend(device: str) -> str:
    """"torch" on CUDA, else "faiss"."""
    return "torch" if str(device).startswith("cuda") else "faiss"


def _device(name: str | torch.device) -> torch.device:
    """``name`` as a torch.device, a CUDA device with its number (plain "cuda" is the current one)."""
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def open_backend(store: StoredIndex, backend: str, devices: Sequence[str], scoring: Scoring, *, k_per_token: int,
                 nprobe: int | None = None, ef_search: int | None = None, segments: Sequence[int] | None = None,
                 exchange=None, placement: str = "auto", encoder=None, searcher_class: type | None = None,
                 options: dict | None = None) -> SearchBackend:
    """The backend that searches ``store`` (one index generation) by ``backend`` ("faiss" or "torch") on
    ``devices``. Several devices (compressed index, torch) are searched by :class:`.workers.Workers` (each device
    gets a one-device ``searcher_class`` with the keyword arguments ``options``, in a worker process of its own but
    the first replica): "replicate" puts a whole copy of the codes on each, "shard" consecutive segments on each,
    "auto" replicates when a copy and room to search fit in every device's free memory (GPUs only) and shards
    otherwise. With ``exchange`` (one device per
    process of a process group) the same choice is made across the processes, replicating only when it fits on
    every rank; ``segments`` (this process's consecutive segments) shards explicitly. ``encoder``: the graphed
    query encoder, for the one-query plan of the codes on its device. ValueError for knobs the index or backend does not take."""
    compressed = store.codec is not None
    devices = [_device(d) for d in devices]
    if ef_search is not None and compressed:
        raise ValueError("ef_search tunes HNSW FAISS indexes of fp16 stores; this index is compressed")
    if backend == "faiss":
        return FaissIVF(store, scoring) if compressed else FaissFlat(store, scoring, nprobe, ef_search, k_per_token)
    if not compressed:
        if len(devices) > 1 or nprobe is not None or segments is not None or exchange is not None:
            raise ValueError("several devices, segments and nprobe need a compressed index (codec IVF<nlist>,PQ<M>)")
        return TorchTokens(store, devices[0], scoring)
    mine = _consecutive(store, segments)
    if exchange is not None:
        return _exchanged(store, devices[0], scoring, segments, exchange, placement, encoder)
    if len(devices) == 1:
        return codes_on(store, mine, devices[0], scoring, encoder)
    if placement == "auto":
        placement = choose_placement(store, devices, scoring.refine_with)
    if placement == "shard" and sum(1 for numbers in split_devices(store, devices, mine) if numbers) < 2:
        log.info("%d segment(s) cannot be spread over %d devices: searching on %s", len(mine), len(devices),
                 devices[0])
        return codes_on(store, mine, devices[0], scoring, encoder)
    from pyserini_aligner.search.workers import Workers

    if searcher_class is None:
        raise ValueError("several devices need searcher_class, the searcher each worker process opens")
    return Workers(store.index_dir, store.manifest.generation, [str(d) for d in devices], placement, searcher_class,
                   options or {})


def codes_on(store: StoredIndex, numbers: Sequence[int], device: torch.device | str, scoring: Scoring,
             encoder=None) -> TorchCodes:
    """:class:`TorchCodes` of segments ``numbers`` of ``store`` on ``device``."""
    return TorchCodes(CodeShard(store, list(numbers), device, scoring.refine_with), scoring, encoder)


def choose_placement(store: StoredIndex, devices: Sequence[torch.device], refine_with: str) -> str:
    """What placement "auto" takes on ``devices``: "replicate" when a whole copy of the index and room to search fit
    in every device's free memory (GPUs only), else "shard"."""
    return "replicate" if all(fits_whole(store, d, refine_with) for d in devices) else "shard"


def _exchanged(store: StoredIndex, device: torch.device, scoring: Scoring, segments: Sequence[int] | None, exchange,
               placement: str, encoder) -> SearchBackend:
    """The backend of one rank of a process group (see :func:`open_backend`)."""
    if segments is not None:
        if placement == "replicate":
            raise ValueError("segments and placement 'replicate' exclude each other: a replica holds every segment")
        placement = "shard"
    if placement == "auto":  # every rank takes part, so that all decide alike
        placement = "replicate" if all(exchange.all_gather(fits_whole(store, device, scoring.refine_with))) \
            else "shard"
    if placement == "replicate":
        return ExchangedReplica(codes_on(store, range(len(store.segments)), device, scoring), exchange)
    if segments is None:
        segments = split_devices(store, range(exchange.world_size))[exchange.rank]
    mine = _consecutive(store, segments)
    return Exchanged(codes_on(store, mine, device, scoring) if mine else None, exchange, device)

