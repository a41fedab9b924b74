"""Sparse alignment scoring (AligneR): score = Σ S∘A / Σ A with A = Ã ∘ (u^q ⊗ u^d).

Ã is the pairwise alignment of query token i to doc token j chosen from S = Q·Dᵀ: top-k per query
token (k=1 is ColBERT's MaxSim), top-p (⌊p·m⌋ tokens, at least 1, m = real doc length) or
differentiable alignment "da" (each row is the entropy-regularised top-k LP of salience.py).
Padded positions are never aligned and never change a score, whatever values they hold.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from pyserini_aligner.salience import solve_entropic_lp
from pyserini_aligner.strategy import Strategy, parse_strategy

_CHUNK_ELEMENTS = 1 << 25  # similarity entries materialised at once by alignment_scores


def _per_doc_k(d_mask: Tensor, strategy: Strategy) -> tuple[Tensor | None, int]:
    """(per-doc count [...] or None for a constant count, static upper bound on the count)."""
    m = d_mask.shape[-1]
    if strategy.kind == "top-k":
        return None, min(int(strategy.k), m)
    bound = max(math.floor(strategy.p * m + 1e-9), 1)
    k_doc = torch.floor(d_mask.sum(-1).double() * strategy.p + 1e-9).clamp_min(1).long()
    return k_doc, min(bound, m)


def _topk_select(sim: Tensor, d_mask: Tensor, strategy: Strategy) -> tuple[Tensor, Tensor, Tensor]:
    """Top entries per row of sim [..., n, m] (padded columns excluded, modified in place).

    Returns (values [..., n, K], doc positions [..., n, K], kept [..., n, K] bool); values of
    entries not kept are 0.
    """
    k_doc, n_top = _per_doc_k(d_mask, strategy)
    if n_top == 0:
        empty = sim[..., :0]
        return empty, empty.long(), empty.bool()
    cols = d_mask.unsqueeze(-2).expand_as(sim)
    sim.masked_fill_(~cols, -math.inf)
    vals, idx = sim.max(dim=-1, keepdim=True) if n_top == 1 else sim.topk(n_top, dim=-1)  # max: MaxSim, faster
    kept = cols.gather(-1, idx)
    if k_doc is not None:
        rank = torch.arange(n_top, device=sim.device)
        kept = kept & (rank < k_doc.unsqueeze(-1).unsqueeze(-1))
    return torch.where(kept, vals, torch.zeros_like(vals)), idx, kept


def alignment_weights(sim: Tensor, d_mask: Tensor, strategy: Strategy) -> Tensor:
    """Pairwise alignment Ã [..., n, m] from similarities sim [..., n, m] and d_mask [..., m] (bool).

    top-k: per row the min(k, m_real) largest real entries get 1; top-p: k = max(floor(p·m_real), 1)
    per doc; da: each row = solve_entropic_lp(row, k, eps, d_mask). Padded columns are 0.
    """
    d_mask = d_mask.to(torch.bool).expand(*sim.shape[:-2], sim.shape[-1])
    if strategy.kind == "da":
        return solve_entropic_lp(sim, strategy.k, strategy.eps, d_mask.unsqueeze(-2))
    _, idx, kept = _topk_select(sim.detach().clone(), d_mask, strategy)
    return torch.zeros_like(sim).scatter(-1, idx, kept.to(sim.dtype))


def _score(sim: Tensor, q_w: Tensor, d_mask: Tensor, d_w: Tensor | None, strategy: Strategy) -> Tensor:
    """Σ S∘A / Σ A over the last two dims; returns [...].

    sim [..., n, m] (padded columns are overwritten in place), q_w [..., n] query weights (u^q, 0 at
    padding), d_mask [..., m] bool, d_w [..., m] doc weights u^d or None.
    """
    d_mask = d_mask.expand(*sim.shape[:-2], sim.shape[-1])
    if strategy.kind == "da":
        sim.masked_fill_(~d_mask.unsqueeze(-2), 0.0)
        lam = solve_entropic_lp(sim, strategy.k, strategy.eps, d_mask.unsqueeze(-2))
        if d_w is not None:
            lam = lam * d_w.unsqueeze(-2)
        num, den = (lam * sim).sum(-1), lam.sum(-1)
    else:
        vals, idx, kept = _topk_select(sim, d_mask, strategy)
        num, den = _selected_sums(vals, idx, kept, d_w, sim.shape)
    return weighted_mean(num, den, q_w)


def _selected_sums(vals: Tensor, idx: Tensor, kept: Tensor, d_w: Tensor | None,
                   shape: torch.Size) -> tuple[Tensor, Tensor]:
    """(Σ S∘A, Σ A) per query token [..., n] of the selected similarities vals [..., n, K] (0 where not kept), their
    doc positions idx and kept flags [..., n, K], with doc weights d_w [..., m] (None = 1) over similarities of
    ``shape`` [..., n, m]."""
    if d_w is None:
        return vals.sum(-1), kept.to(vals.dtype).sum(-1)
    w = d_w.unsqueeze(-2).expand(*shape).gather(-1, idx) * kept
    return (vals * w).sum(-1), w.sum(-1)


def weighted_mean(num: Tensor, den: Tensor, q_w: Tensor) -> Tensor:
    """Σ_i q_w·num / Σ_i q_w·den over the last dim (0 where the denominator is 0)."""
    num, den = (num * q_w).sum(-1), (den * q_w).sum(-1)
    ok = den > 0
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(num))


def packs_maxsim(strategy: Strategy) -> bool:
    """Whether ``strategy`` is top-k:1 (MaxSim): a document's score needs only each query token's best similarity
    over its tokens, so refinement may take that maximum over tokens packed without padding (:func:`maxsim_mean`)."""
    return strategy.kind == "top-k" and strategy.k == 1


def maxsim_mean(best: Tensor, q_w: Tensor) -> Tensor:
    """Top-k:1 scores [...] from each query token's best similarity over a document's real tokens, best [..., n]
    (−inf for a document without tokens), with query weights q_w [..., n] (0 at padding): the value :func:`_score`
    computes for top-k:1 without document weights, in the same order of operations."""
    kept = torch.isfinite(best)
    return weighted_mean(torch.where(kept, best, torch.zeros_like(best)), kept.to(best.dtype), q_w)


def _prepare(
    q: Tensor, q_mask: Tensor, d: Tensor, d_mask: Tensor, q_sal: Tensor | None, d_sal: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """Validate shapes; zero padded query tokens and saliences (padded doc columns of S are masked later)."""
    if q.dim() != 3 or d.dim() != 3 or q.shape[-1] != d.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and d {tuple(d.shape)} must be [B, len, dim] with equal dim")
    if q_mask.shape != q.shape[:2] or d_mask.shape != d.shape[:2]:
        raise ValueError(
            f"q_mask {tuple(q_mask.shape)} / d_mask {tuple(d_mask.shape)} must match "
            f"q {tuple(q.shape[:2])} / d {tuple(d.shape[:2])}"
        )
    for name, sal, ref in (("q_sal", q_sal, q_mask), ("d_sal", d_sal, d_mask)):
        if sal is not None and sal.shape != ref.shape:
            raise ValueError(f"{name} {tuple(sal.shape)} must have shape {tuple(ref.shape)}")
    q_mask, d_mask = q_mask.to(device=q.device, dtype=torch.bool), d_mask.to(device=q.device, dtype=torch.bool)
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    q = torch.where(q_mask.unsqueeze(-1), q, zero)
    q_w = q_mask.to(q.dtype) if q_sal is None else torch.where(q_mask, q_sal.to(q.dtype), zero)
    d_w = None if d_sal is None else torch.where(d_mask, d_sal.to(q.dtype), zero)
    return q, q_w, d, d_mask, d_w


def alignment_scores(
    q: Tensor,
    q_mask: Tensor,
    d: Tensor,
    d_mask: Tensor,
    strategy: Strategy,
    q_sal: Tensor | None = None,
    d_sal: Tensor | None = None,
) -> Tensor:
    """Scores [Bq, Bd] of every query q [Bq, n, dim] against every doc d [Bd, m, dim].

    Masks are bool (True = real token); q_sal [Bq, n] / d_sal [Bd, m] are unary saliences (None = 1).
    Σ A = 0 gives 0. Computed in q's dtype; docs are processed in chunks to bound memory.
    """
    q, q_w, d, d_mask, d_w = _prepare(q, q_mask, d, d_mask, q_sal, d_sal)
    per_doc = max(1, q.shape[0] * q.shape[1] * d.shape[1])
    step = max(1, _CHUNK_ELEMENTS // per_doc)
    out = []
    for start in range(0, d.shape[0], step):
        sl = slice(start, start + step)
        sim = torch.einsum("qnh,bmh->qbnm", q, d[sl].to(q.dtype))
        d_w_sl = None if d_w is None else d_w[sl].unsqueeze(0)
        out.append(_score(sim, q_w.unsqueeze(1), d_mask[sl].unsqueeze(0), d_w_sl, strategy))
    if not out:
        return q.new_zeros(q.shape[0], 0)
    return torch.cat(out, dim=1)


def alignment_scores_many(
    q: Tensor,
    q_mask: Tensor,
    d: Tensor,
    d_mask: Tensor,
    strategies: Sequence[Strategy],
    q_sal: Tensor | None = None,
    d_sal: Tensor | None = None,
) -> list[Tensor]:
    """Scores [Bq, Bd] under each of ``strategies``, as :func:`alignment_scores` gives each (arguments as there), with
    the similarities computed once and the top-k and top-p strategies read from one selection: each query token's
    K best similarities (K the largest count of any of them), of which a strategy sums its first k (top-p: its
    document's ⌊p·m⌋) in the order the single selection sums them. ``da`` strategies are scored from the same
    similarities."""
    strategies = list(strategies)
    q, q_w, d, d_mask, d_w = _prepare(q, q_mask, d, d_mask, q_sal, d_sal)
    per_doc = max(1, q.shape[0] * q.shape[1] * d.shape[1])
    step = max(1, _CHUNK_ELEMENTS // per_doc)
    out: list[list[Tensor]] = [[] for _ in strategies]
    for start in range(0, d.shape[0], step):
        sl = slice(start, start + step)
        sim = torch.einsum("qnh,bmh->qbnm", q, d[sl].to(q.dtype))
        mask = d_mask[sl].unsqueeze(0).expand(*sim.shape[:-2], sim.shape[-1])  # [Bq, b, m]
        weights = None if d_w is None else d_w[sl].unsqueeze(0)
        counts = {i: _per_doc_k(mask, s) for i, s in enumerate(strategies) if s.kind != "da"}
        widest = max((top for _, top in counts.values()), default=0)
        if widest:
            cols = mask.unsqueeze(-2).expand_as(sim)
            masked = sim.masked_fill(~cols, -math.inf)
            vals, idx = masked.max(dim=-1, keepdim=True) if widest == 1 else masked.topk(widest, dim=-1)
            real = cols.gather(-1, idx)
        else:  # documents padded to no tokens at all
            vals = sim[..., :0]
            idx, real = vals.long(), vals.bool()
        for i, strategy in enumerate(strategies):
            if strategy.kind == "da":
                out[i].append(_score(sim.clone(), q_w.unsqueeze(1), mask, weights, strategy))
                continue
            k_doc, top = counts[i]
            kept = real[..., :top]
            if k_doc is not None:
                kept = kept & (torch.arange(top, device=sim.device) < k_doc.unsqueeze(-1).unsqueeze(-1))
            picked = torch.where(kept, vals[..., :top], torch.zeros((), dtype=sim.dtype, device=sim.device))
            num, den = _selected_sums(picked, idx[..., :top], kept, weights, sim.shape)
            out[i].append(weighted_mean(num, den, q_w.unsqueeze(1)))
    if d.shape[0] == 0:
        return [q.new_zeros(q.shape[0], 0) for _ in strategies]
    return [torch.cat(parts, dim=1) for parts in out]


def alignment_scores_paired(
    q: Tensor,
    q_mask: Tensor,
    d: Tensor,
    d_mask: Tensor,
    strategy: Strategy,
    q_sal: Tensor | None = None,
    d_sal: Tensor | None = None,
) -> Tensor:
    """Scores [B] of query i (q [B, n, dim]) against doc i (d [B, m, dim]); arguments as in alignment_scores."""
    if q.shape[0] != d.shape[0]:
        raise ValueError(f"paired scoring needs as many queries as docs, got {q.shape[0]} and {d.shape[0]}")
    q, q_w, d, d_mask, d_w = _prepare(q, q_mask, d, d_mask, q_sal, d_sal)
    sim = torch.einsum("bnh,bmh->bnm", q, d.to(q.dtype))
    return _score(sim, q_w, d_mask, d_w, strategy)


def scores_from_similarity(sim: Tensor, q_mask: Tensor, d_mask: Tensor, strategy: Strategy,
                           q_sal: Tensor | None = None) -> Tensor:
    """Scores [B, C] of query i against each of its own C docs from their similarities sim [B, C, n, m] (rows of
    padded query tokens may hold anything), q_mask [B, n] bool, d_mask [B, C, m] bool, q_sal [B, n] or None."""
    q_mask = q_mask.to(device=sim.device, dtype=torch.bool)
    zero = torch.zeros((), dtype=sim.dtype, device=sim.device)
    q_w = q_mask.to(sim.dtype) if q_sal is None else torch.where(q_mask, q_sal.to(sim.dtype), zero)
    return _score(sim, q_w.unsqueeze(1), d_mask.to(device=sim.device, dtype=torch.bool), None, strategy)


def alignment_scores_grouped(
    q: Tensor,
    q_mask: Tensor,
    d: Tensor,
    d_mask: Tensor,
    strategy: Strategy,
    q_sal: Tensor | None = None,
    d_sal: Tensor | None = None,
) -> Tensor:
    """Scores [B, C] of query i (q [B, n, dim]) against each of its own C docs (d [B, C, m, dim], d_mask [B, C, m],
    d_sal [B, C, m]); other arguments as in alignment_scores. Used to refine per-query candidate lists at once."""
    if d.dim() != 4 or d.shape[0] != q.shape[0] or d_mask.shape != d.shape[:3]:
        raise ValueError(f"grouped scoring needs d [B, C, m, dim] with B = {q.shape[0]} queries and d_mask "
                         f"[B, C, m], got d {tuple(d.shape)} and d_mask {tuple(d_mask.shape)}")
    if d_sal is not None and d_sal.shape != d_mask.shape:
        raise ValueError(f"d_sal {tuple(d_sal.shape)} must have shape {tuple(d_mask.shape)}")
    batch, count = d.shape[:2]
    q, q_w, _, _, _ = _prepare(q, q_mask, d[:, 0], d_mask[:, 0], q_sal, None)
    d_mask = d_mask.to(device=q.device, dtype=torch.bool)
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    d_w = None if d_sal is None else torch.where(d_mask, d_sal.to(q.dtype), zero)
    sim = torch.einsum("bnh,bcmh->bcnm", q, d.to(q.dtype))
    if sim.dtype in (torch.float16, torch.bfloat16):  # half-precision products, float32 selection and sums
        sim, q_w = sim.float(), q_w.float()
        d_w = None if d_w is None else d_w.float()
    return _score(sim, q_w.unsqueeze(1), d_mask, d_w, strategy).reshape(batch, count)
