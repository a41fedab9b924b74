"""The candidate rule: which documents of an index each query refines, from each probe's best entries.

A probe (a kept query token) keeps its ``K`` best (score, document) entries (:func:`best_entries`); a document's
proxy for a query is Σ over the query's probes of w · (its best entry score − that probe's K-th score)
(:func:`probe_gains`), a MaxSim estimate in which a probe's missing documents get its K-th score; the best ``limit``
documents (ties to the lower row) are the candidates (:func:`rank_candidates`, :func:`select_candidates`). Every
backend ranks by these functions; :func:`fixed_candidates` is the same rule for a batch with tensor shapes fixed
ahead (no host synchronisation, for a CUDA graph: :mod:`.graphs`). Optionally a larger candidate set is narrowed
(:func:`narrow`) before refinement, and the refined scores give the top hits (:func:`top_hits`).
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

def best_entries(scores: Tensor, docs: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """(scores [R, K] float32, docs [R, K] int64; −inf / −1 past the entries found) of the K = ``width`` best finite
    entries of each row of ``scores`` [R, W], best first, ties in position order: the first K of a stable sort of
    each row from the largest. docs [R, W]. Only the entries at or above a row's K-th largest score are sorted."""
    r, w = scores.shape
    if r == 0 or w == 0 or width == 0:
        return (torch.full((r, width), -torch.inf, device=scores.device),
                torch.full((r, width), -1, dtype=torch.long, device=scores.device))
    keep = torch.isfinite(scores)
    if w > width:
        keep &= scores >= scores.topk(width, dim=1, sorted=False).values.amin(1, keepdim=True)
    owner, at = keep.nonzero(as_tuple=True)  # by row, then position
    value = scores[owner, at]
    order = torch.sort(owner * (1 << 32) + descending_key(value), stable=True).indices
    owner, at, value = owner[order], at[order], value[order]
    per_row = torch.zeros(r, dtype=torch.long, device=scores.device).index_add_(0, owner, torch.ones_like(owner))
    rank = torch.arange(len(owner), device=scores.device) - (torch.cumsum(per_row, 0) - per_row)[owner]
    return (ranked_into(owner, rank, value.float(), r, width, -torch.inf),
            ranked_into(owner, rank, docs[owner, at].long(), r, width, -1))


def ranked_into(rows: Tensor, ranks: Tensor, values: Tensor, count: int, width: int, fill: float) -> Tensor:
    """[count, width] of ``values`` [N] at (``rows``, ``ranks``) where the rank is below ``width``, ``fill``
    elsewhere; (row, rank) pairs are distinct. Written without a host round trip: what ranks past the width goes to a
    spare column, dropped."""
    out = torch.full((count, width + 1), fill, dtype=values.dtype, device=values.device)
    out[rows, torch.where(ranks < width, ranks, width)] = values
    return out[:, :width]


def descending_key(values: Tensor) -> Tensor:
    """int64 keys in [0, 2^32) that sort float32 ``values`` from the largest to the smallest (−inf last)."""
    bits = (values.float() + 0.0).contiguous().view(torch.int32).long()  # + 0.0 turns −0.0 into 0.0
    ascending = torch.where(bits >= 0, bits + (1 << 31), (1 << 31) - 1 - (bits + (1 << 31)))
    return (1 << 32) - 1 - ascending


def merge_probes(parts: list[tuple[Tensor, Tensor]], width: int) -> tuple[Tensor, Tensor]:
    """The K=``width`` best entries per probe over several shards' :meth:`CodeShard.probe` outputs (same probes)."""
    if len(parts) == 1:
        return parts[0]
    device = parts[0][0].device
    scores = torch.cat([s.to(device) for s, _ in parts], dim=1)
    rows = torch.cat([r.to(device) for _, r in parts], dim=1)
    values, index = scores.topk(min(width, scores.shape[1]), dim=1)
    return values, torch.where(torch.isfinite(values), rows.gather(1, index), torch.full_like(index, -1))


def probe_gains(scores: Tensor, rows: Tensor, weights: Tensor | None,
                floor: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(valid [R, K], gain [R, K]) of each probe's entries: w · (score − the probe's K-th valid score), the terms of
    the candidate proxy. scores / rows [R, K] (−1 rows invalid); weights [R] or None; floor [R]: each probe's K-th
    score when it is known from elsewhere (the probe's entries over every shard), entries below it invalid."""
    valid = rows >= 0
    if floor is None:
        floor = torch.where(valid, scores, torch.full_like(scores, torch.inf)).min(dim=1).values
        floor = torch.where(torch.isfinite(floor), floor, torch.zeros_like(floor))
    else:
        floor = floor.to(scores.device)
        valid = valid & (scores >= floor.unsqueeze(1))
    gain = scores - floor.unsqueeze(1)
    if weights is not None:
        gain = gain * weights.to(scores.device).unsqueeze(1)
    return valid, gain


def probe_floors(scores: Tensor, width: int) -> Tensor:
    """Each probe's K-th best score (K = ``width``; the worst finite one when fewer exist, 0 when none) over entries
    ``scores`` [R, E] (−inf where invalid): the floor :func:`probe_gains` computes from a probe's K best."""
    top = scores.topk(min(width, scores.shape[1]), dim=1).values if scores.shape[1] else scores
    floor = torch.where(torch.isfinite(top), top, torch.full_like(top, torch.inf)).min(dim=1).values
    return torch.where(torch.isfinite(floor), floor, torch.zeros_like(floor))


def rank_candidates(scores: Tensor, rows: Tensor, owner: Tensor, batch: int, limit: int,
                    weights: Tensor | None = None, floor: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The candidate rule's ranking: (proxy [B, W] float64, rows [B, W]) of each query's ``limit`` best documents,
    best first (ties to the lower row), −inf / −1 past the documents found; W = min(limit, most found).

    scores / rows [R, K]: each probe's best entries (−1 rows invalid); owner [R]: the query of each probe; weights
    [R] or None; floor [R] or None (see :func:`probe_gains`). Proxy of (query, doc) = Σ_probes w · (best score of
    doc − the probe's K-th score).
    """
    device = scores.device
    valid, gain = probe_gains(scores, rows, weights, floor)
    probe, at = valid.nonzero(as_tuple=True)  # by probe, then position
    doc, gain = rows[probe, at], gain[probe, at]
    span = int(rows.max()) + 1 if len(doc) else 1
    pair, inverse = torch.unique(probe * span + doc, return_inverse=True)
    best = torch.full((len(pair),), -torch.inf, device=device).scatter_reduce(0, inverse, gain, "amax")
    pair_doc = pair % span
    key, inverse = torch.unique(owner.to(device)[pair // span] * span + pair_doc, return_inverse=True)
    proxy = torch.zeros(len(key), device=device, dtype=torch.float64).index_add_(0, inverse, best.double())
    query, doc = key // span, key % span
    order = torch.argsort(-proxy, stable=True)  # key is sorted by (query, doc): ties keep the lower doc first
    order = order[torch.argsort(query[order], stable=True)]
    query, doc, proxy = query[order], doc[order], proxy[order]
    counts = torch.bincount(query, minlength=batch)
    rank = torch.arange(len(query), device=device) - (torch.cumsum(counts, 0) - counts)[query]
    width = max(1, min(limit, int(counts.max()) if len(counts) else 1))
    return ranked_into(query, rank, proxy, batch, width, -torch.inf), ranked_into(query, rank, doc, batch, width, -1)


def every_candidate(rows: Tensor, batch: int) -> tuple[Tensor, Tensor]:
    """(rows [B, M], valid [B, M]): every one of ``rows`` [M] (ascending) a candidate of each of ``batch`` queries
    (a filtered search that refines all the rows it matches)."""
    rows = rows.unsqueeze(0).expand(batch, -1).contiguous()
    return rows, torch.ones_like(rows, dtype=torch.bool)


def ascending(rows: Tensor) -> tuple[Tensor, Tensor]:
    """(rows [B, W] sorted ascending with −1 last, valid [B, W]) of candidate ``rows`` (−1 where none)."""
    out = torch.where(rows >= 0, rows, torch.full_like(rows, np.iinfo(np.int64).max)).sort(dim=1).values
    ok = out != np.iinfo(np.int64).max
    return torch.where(ok, out, torch.full_like(out, -1)), ok


def select_candidates(scores: Tensor, rows: Tensor, owner: Tensor, batch: int, limit: int,
                      weights: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The candidate rule: (rows [B, limit] sorted ascending, valid [B, limit]) per query: the ``limit`` best
    documents of :func:`rank_candidates` (same arguments), each probe's floor its own K-th score."""
    return ascending(rank_candidates(scores, rows, owner, batch, limit, weights)[1])


def best_of_parts(values: list[Tensor], rows: list[Tensor], limit: int) -> tuple[Tensor, Tensor]:
    """The ``limit`` best (value, row) per query over parts that each list a disjoint, ascending range of rows, in
    part order, best first with ties to the lower row (as each part's own list): (values [B, ≤limit], rows).
    values / rows: [B, W_i] per part, −inf / −1 past what a part found."""
    values, rows = torch.cat(values, dim=1), torch.cat(rows, dim=1)
    order = torch.sort(values, dim=1, descending=True, stable=True).indices[:, :limit]
    return values.gather(1, order), rows.gather(1, order)


def narrow(scores: Tensor, rows: Tensor, limit: int) -> tuple[Tensor, Tensor]:
    """The ``limit`` best candidate rows per query by ``scores`` [B, C] (ties to the lower row), as (rows [B, limit]
    sorted ascending, valid [B, limit])."""
    values, picked = top_hits(scores, rows, limit)
    picked = torch.where(torch.isfinite(values), picked, torch.full_like(picked, np.iinfo(np.int64).max))
    picked = picked.sort(dim=1).values
    ok = picked != np.iinfo(np.int64).max
    return torch.where(ok, picked, torch.full_like(picked, -1)), ok


def top_hits(scores: Tensor, rows: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-k (scores [B, k], rows [B, k]) of refined ``scores`` [B, C] over candidate ``rows`` [B, C] (sorted
    ascending, so equal scores keep the lower row); −inf / −1 past the candidates found."""
    best = scores.sort(dim=1, descending=True, stable=True)
    top = min(k, scores.shape[1])
    values, picked = best.values[:, :top], rows.gather(1, best.indices[:, :top])
    return values, torch.where(torch.isfinite(values), picked, torch.full_like(picked, -1))


def fixed_candidates(scores: Tensor, rows: Tensor, weights: Tensor | None, count: int,
                     sentinel: int) -> tuple[Tensor, Tensor]:
    """The candidate rule of :func:`select_candidates` for a batch of queries with shapes fixed by its arguments (no
    host synchronisation): (rows [B, C] ascending with −1 last, valid [B, C]), C = min(count, R·K), ties to the
    lower row. scores, rows [B, R, K]: each query's R probes' best entries (a query's unused probes −1 rows);
    weights [B, R] or None; sentinel: a row past every row of the index."""
    device = scores.device
    b, r, width = rows.shape
    valid, gain = probe_gains(scores.reshape(b * r, width), rows.reshape(b * r, width),
                              None if weights is None else weights.reshape(-1))
    valid, gain = valid.view(b, -1), torch.where(valid, gain, torch.zeros_like(gain)).view(b, -1)
    probe = torch.arange(r, device=device).view(1, r, 1).expand(b, r, width).reshape(b, -1)
    key = torch.where(valid, rows.reshape(b, -1), torch.full_like(probe, sentinel)) * r + probe
    order = gain.sort(dim=1, descending=True, stable=True).indices  # within a (doc, probe) pair the best first
    order = order.gather(1, key.gather(1, order).sort(dim=1, stable=True).indices)
    key, gain = key.gather(1, order), gain.gather(1, order).double()
    first = torch.ones_like(key, dtype=torch.bool)
    first[:, 1:] = key[:, 1:] != key[:, :-1]
    doc = torch.div(key, r, rounding_mode="floor")
    new_doc = torch.ones_like(first)
    new_doc[:, 1:] = doc[:, 1:] != doc[:, :-1]
    group = torch.cumsum(new_doc.long(), 1) - 1
    proxy = torch.zeros(key.shape, dtype=torch.float64, device=device).scatter_add_(
        1, group, torch.where(first, gain, torch.zeros_like(gain)))
    owner = torch.full_like(key, sentinel).scatter_(1, group, doc)
    proxy = torch.where(owner < sentinel, proxy, torch.full_like(proxy, -math.inf))
    best = proxy.sort(dim=1, descending=True, stable=True)  # groups are in ascending row order: ties keep the lower
    picked = owner.gather(1, best.indices[:, :count])
    return ascending(torch.where(torch.isfinite(best.values[:, :count]), picked, torch.full_like(picked, -1)))
