"""What every search backend shares: the encoded queries (:class:`Queries`), what an index generation is searched
with (:class:`Scoring`), the backend protocol (:class:`SearchBackend`: encoded queries in, top-k rows out), the
front-end protocol the searcher calls (:class:`FrontEnd`: texts in, hits out) and the three-step search of
:class:`Staged` (probe, centroid interaction, refinement) over the candidate rule of :mod:`..candidates`.

The backends (a module per family; :mod:`.choose` picks one when an index generation is opened):

- :mod:`.faiss_cpu`: :class:`~.faiss_cpu.FaissIVF` (a compressed index on the CPU: FAISS's ``IndexIVFPQ`` scans the
  inverted lists; interaction and refinement read the memory-mapped codes) and :class:`~.faiss_cpu.FaissFlat` (an
  fp16 index on the CPU: each segment's FAISS index finds the tokens).
- :mod:`.torch_codes`: :class:`~.torch_codes.TorchCodes` (a compressed index's codes on one device, every step as
  tensor operations) and :class:`~.torch_codes.SegmentCodes` (every segment's codes scored by a thread each).
- :mod:`.tokens`: :class:`~.tokens.TorchTokens`, an fp16 index's tokens on one device.
- :mod:`.exchanged`: one process's share of a search across the processes of a torchrun job (consecutive segments,
  or a whole copy searching its part of every batch).
- :mod:`.workers`: several devices of one machine, a front end of its own (it encodes the texts itself).

Every backend returns the ranking one device computes over the whole index.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np
import torch
from torch import Tensor

from pyserini_aligner.alignment import Strategy
from pyserini_aligner.search.allowed import AllowedRows
from pyserini_aligner.search.candidates import every_candidate, narrow, select_candidates, top_hits
from pyserini_aligner.search.encoding import balanced_slices
from pyserini_aligner.search.options import Depth

Clock = Callable[[str], None]
STEP_END = "aligner step end: "  # profiler ranges marking where each timed search step ends


def no_clock(step: str) -> None:
    """A clock that times nothing."""


def step_clock(timings: dict[str, float] | None, device: torch.device) -> Clock:
    """A clock that adds the seconds since its last call to ``timings[step]`` (:func:`no_clock` unless timings is a
    dict; work on ``device`` is waited for, so profiling slows the search a little) and marks the step's end for a
    profiler (a range named STEP_END + step)."""
    if timings is None:
        return no_clock
    import time

    last = [time.perf_counter()]

    def clock(step: str) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        with torch.profiler.record_function(STEP_END + step):  # where the step ends in a profiler's trace
            pass
        now = time.perf_counter()
        timings[step] = timings.get(step, 0.0) + now - last[0]
        last[0] = now

    return clock


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

    def search(self, queries: Queries, depth: Depth, k: int, clock: Clock = no_clock,
               allowed: AllowedRows | None = None) -> tuple[Tensor, Tensor]:
        """(scores [B, k'] float32, global doc rows [B, k'] int64), best first, k' <= k; −inf / −1 past the
        documents found. ``allowed``: the only rows a filtered search may return (None: every live row); candidate
        generation skips the others (``depth.every_row``: it refines every allowed row, unprobed)."""


class FrontEnd(Protocol):
    """What the searcher calls: texts in, hits out (:mod:`.choose` assembles one per index generation: a backend
    behind a query encoder, optionally a CUDA-graphed plan for one query, or the worker processes of several
    devices)."""

    engine: Any  # the backend searched (or the worker processes)
    has_interaction: bool  # whether it has the centroid-interaction stage (the depth's W applies)

    def search_texts(self, texts: list[str], depth: Depth, k: int, threads: int | None, vectors: bool,
                     clock: Clock = no_clock, allowed: AllowedRows | None = None) -> tuple[list | None, list]:
        """(query vectors [n, d] per text, or None unless ``vectors``; [(doc row, score)] per text, best first) of
        non-blank ``texts``; ``threads``: the search threads (None: the front end's default); ``allowed``: the only
        rows a filtered search may return (None: every live row)."""


class Staged:
    """A backend made of the three steps ``probe``, ``interaction`` and ``refine``; :meth:`search` runs the
    candidate rule of :mod:`..candidates` over them."""

    device: torch.device
    has_interaction = True
    placement = "one"

    def probe(self, probes: Tensor, per_token: int, nprobe: int,
              allowed: AllowedRows | None = None) -> tuple[Tensor, Tensor]:
        """(scores [R, K], global doc rows [R, K]) of each probe's K best indexed tokens of live rows, or of
        ``allowed`` rows when given; probes [R, d]."""
        raise NotImplementedError

    def interaction(self, q: Tensor, q_mask: Tensor, rows: Tensor, valid: Tensor) -> Tensor:
        """Centroid-interaction scores [B, C] on ``self.device`` of candidate ``rows`` [B, C] (−inf where not
        valid)."""
        raise NotImplementedError

    def refine(self, q: Tensor, q_mask: Tensor, q_sal: Tensor | None, rows: Tensor, valid: Tensor) -> Tensor:
        """Alignment scores [B, C] of candidate ``rows`` [B, C] (−inf where not valid)."""
        raise NotImplementedError

    def search(self, queries: Queries, depth: Depth, k: int, clock: Clock = no_clock,
               allowed: AllowedRows | None = None) -> tuple[Tensor, Tensor]:
        rows, valid = self.candidates(queries, depth, clock, allowed=allowed)
        q, q_mask = queries.vectors, queries.mask
        if depth.interaction:
            rows, valid = narrow(self.interaction(q, q_mask, rows, valid), rows.to(self.device), depth.refined)
            clock("interaction")
        refined = self.refine(q, q_mask, queries.refine_salience, rows, valid)
        return top_hits(refined, rows.to(refined.device), k)

    def candidates(self, queries: Queries, depth: Depth, clock: Clock = no_clock,
                   allowed: AllowedRows | None = None) -> tuple[Tensor, Tensor]:
        """(rows [B, W] ascending, valid [B, W]): each query's best documents by the proxy score
        (:func:`..candidates.select_candidates` over :meth:`probe`, of ``allowed`` rows when given), W = the depth's
        interaction width or else its refinement width; with ``depth.every_row``, every allowed row."""
        if depth.every_row:
            return every_candidate(allowed.rows(self.device), len(queries))
        owner, token = queries.probe_mask.nonzero(as_tuple=True)
        probe_scores, probe_rows = self.probe(queries.vectors[owner, token], depth.per_probe, depth.nprobe,
                                              allowed)
        clock("probe")
        weights = queries.salience[owner, token].to(probe_scores.device) if queries.weighted else None
        found = select_candidates(probe_scores, probe_rows, owner.to(probe_scores.device), len(queries),
                                  depth.interaction or depth.refined, weights)
        clock("select")
        return found


QUERY_PROBES = 32  # a query's fixed work (the same depth of candidates for every query) weighs this many probes


def batch_parts(queries: Queries, count: int) -> list[slice]:
    """``count`` consecutive slices of the batch (the last ones empty when it holds fewer queries), balanced by each
    query's load: QUERY_PROBES plus its probing tokens, since most of a search's work is the same for every query;
    slice i ends with the query that takes the load past i/count of the whole."""
    return balanced_slices(queries.probe_mask.sum(1).cpu().numpy().astype(np.float64) + QUERY_PROBES, count)


def on_host(found: tuple[Tensor, Tensor], k: int) -> tuple[Tensor, Tensor]:
    """(scores [b, k], rows [b, k]) on the CPU: ``found`` padded with −inf / −1 to k columns."""
    scores, rows = (t.cpu() for t in found)
    pad = k - scores.shape[1]
    if pad > 0:
        scores = torch.nn.functional.pad(scores, (0, pad), value=-torch.inf)
        rows = torch.nn.functional.pad(rows, (0, pad), value=-1)
    return scores, rows


def concat(found: list[tuple[Tensor, Tensor]], k: int) -> tuple[Tensor, Tensor]:
    """The parts' (scores [b_i, k], rows [b_i, k]) stacked as one batch's [B, k]."""
    if not found:
        return torch.full((0, k), -torch.inf), torch.full((0, k), -1, dtype=torch.long)
    return torch.cat([s for s, _ in found]), torch.cat([r for _, r in found])
