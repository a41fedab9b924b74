"""Search under torchrun: every rank holds either its consecutive share of the index's segments (:class:`Exchanged`)
or a whole copy (:class:`ExchangedReplica`).

Per query batch the ranks' query encodings are gathered (on GPUs each rank encodes a part, on CPUs rank 0 all:
:class:`..encoding.GatheredEncoder`). Placement "shard": every rank probes its segments, each probe's K-th score over
all ranks is found (the ranks share that work), each rank ranks the documents it holds by the candidate proxy
(:func:`..candidates.rank_candidates`, as one process would over the whole index) and the best of all ranks are the
candidates; on GPUs each rank then fetches the tokens of its part of the queries' candidates and scores them itself,
on CPUs every rank scores those it holds and the scores are combined. Placement "replicate": every rank searches its
consecutive part of the batch over its copy and the hits are gathered. Either way every rank ends with the ranking a
single process computes over the whole index. A filtered search's rows (:class:`..allowed.AllowedRows`) are resolved
by every rank from the same filter, over the whole index. Collectives (:class:`pyserini_aligner.dist.Collectives`)
exchange tensors (on the GPUs under NCCL, through the host under Gloo).
"""
from __future__ import annotations

import torch
from torch import Tensor

from pyserini_aligner.search.allowed import AllowedRows
from pyserini_aligner.search.backends.base import Clock, Queries, Staged, batch_parts, concat, no_clock, on_host
from pyserini_aligner.search.backends.torch_codes import TorchCodes
from pyserini_aligner.search.candidates import (ascending, best_of_parts, every_candidate, narrow, probe_floors,
                                                rank_candidates, top_hits)
from pyserini_aligner.search.codes import CodeShard
from pyserini_aligner.search.options import Depth


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
    CPU's scores those of one device to float32 rounding (another process's BLAS may sum in another order)."""

    placement = "shard"

    def __init__(self, local: TorchCodes | None, exchange, device: torch.device, split: bool | None = None):
        self.local, self.exchange, self.device = local, exchange, device
        self.split = exchange.on_device if split is None else split
        self._holders: list[tuple[int, int, int]] | None = None  # (first row, rows, rank), by row; [] when not split

    @property
    def num_rows(self) -> int:
        """Documents (rows) this rank holds."""
        return 0 if self.local is None else self.local.num_rows

    def search(self, queries: Queries, depth: Depth, k: int, clock: Clock = no_clock,
               allowed: AllowedRows | None = None) -> tuple[Tensor, Tensor]:
        if not self._splits():
            return super().search(queries, depth, k, clock, allowed)
        parts = batch_parts(queries, self.exchange.world_size)
        rows, valid = self.candidates(queries, depth, clock, parts, allowed)
        mine = queries.part(parts[self.exchange.rank]).to(self.device)
        q, q_mask = mine.vectors, mine.mask
        if depth.interaction:
            shard, local = self._fetch(rows, valid, residuals=False)
            rows, valid = narrow(shard.interaction(q, q_mask, local, valid), rows, depth.refined)
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

    def candidates(self, queries: Queries, depth: Depth, clock: Clock = no_clock, parts: list[slice] | None = None,
                   allowed: AllowedRows | None = None) -> tuple[Tensor, Tensor]:
        """(rows [B, W] ascending, valid [B, W]) of every query, or with ``parts`` (one slice of the batch a rank)
        of this rank's part of the queries only; of ``allowed`` rows only when given (``depth.every_row``: all of
        them)."""
        if depth.every_row:
            mine = parts[self.exchange.rank] if parts is not None else slice(0, len(queries))
            return every_candidate(allowed.rows(self.device), mine.stop - mine.start)
        owner, token = queries.probe_mask.nonzero(as_tuple=True)
        probes = queries.vectors[owner, token]
        if self.local is not None:
            scores, rows = self.local.probe(probes, depth.per_probe, depth.nprobe, allowed)
        else:  # the shape every shard returns (codes.CodeShard.probe), with nothing found
            scores = torch.full((len(probes), max(1, depth.per_probe)), -torch.inf, device=self.device)
            rows = torch.full(scores.shape, -1, dtype=torch.long, device=self.device)
        floor = self._floors(torch.where(rows >= 0, scores, torch.full_like(scores, -torch.inf)), depth.per_probe)
        clock("probe")
        weights = queries.salience[owner, token].to(self.device) if queries.weighted else None
        width = depth.interaction or depth.refined
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
        """(a :class:`..codes.CodeShard` holding the documents of candidate ``rows`` [b, C] where ``valid``, fetched
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
        """Every probe's K-th best score (K = ``width``) over the entries of all ranks (:func:`..candidates.probe_floors`),
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
        self.num_rows = local.num_rows

    def search(self, queries: Queries, depth: Depth, k: int, clock: Clock = no_clock,
               allowed: AllowedRows | None = None) -> tuple[Tensor, Tensor]:
        part = batch_parts(queries, self.exchange.world_size)[self.exchange.rank]
        if part.start == part.stop:
            mine = on_host((torch.zeros(0, 0), torch.zeros(0, 0, dtype=torch.long)), k)
        else:
            mine = on_host(self.local.search(queries.part(part).to(self.local.device), depth, k, allowed=allowed), k)
        return concat(self.exchange.all_gather(mine), k)
