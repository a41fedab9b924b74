"""Entropy-regularised top-k LP, unary token salience and salience-based pruning.

The LP (AligneR, Qian et al. 2023) is

    max_λ  sᵀλ + ε·H(λ)   s.t.  Σλ = k,  0 ≤ λ ≤ 1,     H(λ) = −Σ λ ln λ.

Its KKT conditions give λ_i = min(1, exp((s_i + a)/ε)) with one dual variable a fixed by Σλ = k; this
is the fixed point of the paper's coordinate ascent (a' = ε ln k − ε logsumexp((s+b)/ε),
b' = min(−s−a', 0)). That ascent moves a by at most ε·ln k per step, so for ε = 0.002 it needs
hundreds of steps; here a is found exactly instead. With t = a/ε, x = s/ε, sorted x_(1) ≥ x_(2) ≥ …,
capping the c largest entries gives t_c = ln(k − c) − logsumexp(x_(c+1), …), and since
Σ min(1, e^{x+t}) ≤ c + Σ_{i>c} e^{x_(i)+t} for every c, the solution is t* = max_{c<k} t_c.
The gradient comes from re-evaluating t_{c*} at the optimal active set, which is the exact
implicit-function gradient of the LP solution.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

_MODES = ("lp", "relu", "hard")


def _count_rule(length: Tensor, beta: float) -> Tensor:
    """ceil(beta·length) clamped to [1, length] (0 for empty rows); float64 with slack for rounding."""
    k = torch.ceil(length.double() * beta - 1e-9).clamp_min(1)
    return torch.minimum(k, length.double()).long()


def keep_count(length: int, beta: float) -> int:
    """Number of tokens pruning keeps from a sequence of ``length`` real tokens: ceil(beta·length), at least 1."""
    if not 0.0 < beta <= 1.0:
        raise ValueError(f"beta must be in (0, 1], got {beta}")
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    return min(length, max(1, math.ceil(length * beta - 1e-9)))


def solve_entropic_lp(
    scores: Tensor, k: float | Tensor, eps: float, mask: Tensor | None = None
) -> Tensor:
    """λ maximising sᵀλ + εH(λ) s.t. Σλ = k, 0 ≤ λ ≤ 1 along the last dimension.

    scores [..., n]; k a number or a tensor broadcastable to [...] (clamped to [0, #real entries]);
    eps > 0 in score units; mask [..., n] bool (True = real; broadcastable to scores), masked entries
    get exactly 0. Returns λ [..., n] in the dtype of scores (half precision is solved in float32).
    Exact (no iterations), differentiable w.r.t. scores, finite for any finite scores and eps.
    """
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    out_dtype = scores.dtype
    if scores.dtype in (torch.float16, torch.bfloat16):
        scores = scores.float()
    n = scores.shape[-1]
    if mask is None:
        mask = torch.ones_like(scores, dtype=torch.bool)
    else:
        mask = mask.to(device=scores.device, dtype=torch.bool).expand_as(scores)
    if n == 0:
        return scores.clone().to(out_dtype)
    fill = torch.finfo(scores.dtype).min / 4  # finite "minus infinity": keeps every gradient finite
    scores = torch.where(mask, scores, torch.zeros_like(scores))
    n_real = mask.sum(-1).to(scores.dtype)
    k_t = torch.as_tensor(k, dtype=scores.dtype, device=scores.device)
    k_t = torch.minimum(k_t.clamp_min(0), n_real)
    full = k_t >= n_real  # every real entry is 1 (includes empty rows)
    zero = k_t <= 0
    k_safe = torch.where(full | zero, torch.full_like(k_t, 0.5), k_t)
    n_top = n if isinstance(k, Tensor) else min(n, max(1, math.ceil(float(k))))

    def scaled(pivot: Tensor) -> Tensor:  # (s - pivot)/ε: exact differences near the pivot
        return torch.where(mask, (scores - pivot) / eps, torch.full_like(scores, fill))

    with torch.no_grad():
        x = scaled(scores.masked_fill(~mask, -math.inf).amax(-1, keepdim=True).clamp_min(fill))
        top, idx = x.topk(n_top, dim=-1)
        rest = torch.logsumexp(x.scatter(-1, idx, fill), dim=-1, keepdim=True)
        tail = torch.logaddexp(torch.logcumsumexp(top.flip(-1), dim=-1).flip(-1), rest)
        c = torch.arange(n_top, device=x.device, dtype=x.dtype)
        room = k_safe.unsqueeze(-1) - c
        t_c = torch.where(room > 0, torch.log(room.clamp_min(1e-30)) - tail, torch.full_like(tail, -math.inf))
        n_capped = t_c.argmax(-1, keepdim=True)
        capped = torch.zeros_like(mask).scatter(-1, idx, torch.arange(n_top, device=x.device) < n_capped)
        pivot = scores.gather(-1, idx.gather(-1, n_capped))  # largest uncapped score

    # one differentiable dual step at the optimal active set (exact gradient of t*), pivoted at the
    # largest uncapped score so that fractional λ are computed from small, exact differences
    x = scaled(pivot)
    t = torch.log(k_safe - n_capped.squeeze(-1).to(x.dtype)) - torch.logsumexp(
        torch.where(capped, torch.full_like(x, fill), x), dim=-1
    )
    lam = torch.exp(torch.clamp(x + t.unsqueeze(-1), max=0.0))
    lam = torch.where(full.unsqueeze(-1), torch.ones_like(lam), lam)
    lam = torch.where(mask & ~zero.unsqueeze(-1), lam, torch.zeros_like(lam))
    return lam.to(out_dtype)


def _hard_topk_mask(values: Tensor, mask: Tensor, k: Tensor) -> Tensor:
    """Bool [B, L]: the k[b] largest real entries of each row; ties go to the earlier position."""
    keyed = values.detach().masked_fill(~mask, -math.inf)
    order = keyed.sort(dim=-1, descending=True, stable=True).indices
    rank_kept = torch.arange(values.shape[-1], device=values.device) < k.unsqueeze(-1)
    return torch.zeros_like(mask).scatter(-1, order, rank_kept) & mask


def unary_salience(
    logits: Tensor, mask: Tensor, alpha: float | None, eps: float = 0.002, mode: str = "lp"
) -> Tensor:
    """Unary salience u [B, L] from salience-head logits [B, L] and mask [B, L] (True = real token).

    s = ReLU(logits). mode "lp": u = λ·s, λ = solve_entropic_lp(s, k=max(alpha·len, 1), eps);
    "relu": u = s; "hard": u = s on the max(round(alpha·len), 1) largest s, else 0.
    alpha=None means no sparsity (u = s) in every mode. Masked positions are 0.
    """
    if mode not in _MODES:
        raise ValueError(f"salience mode must be one of {_MODES}, got {mode!r}")
    if alpha is not None and not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1] or None, got {alpha}")
    if logits.shape != mask.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and mask {tuple(mask.shape)} differ in shape")
    mask = mask.to(torch.bool)
    s = torch.relu(logits).masked_fill(~mask, 0.0)
    if alpha is None or mode == "relu":
        return s
    length = mask.sum(-1)
    if mode == "lp":
        k = (length.to(s.dtype) * alpha).clamp_min(1.0)
        return solve_entropic_lp(s, k, eps, mask) * s
    k = torch.round(length.double() * alpha).clamp_min(1).long()
    return s * _hard_topk_mask(s, mask, k)


DEFAULT_PRUNE_REDUNDANCY = 0.85  # cosine; chosen on validation queries (docs/results.md, "Redundancy-aware pruning")


def redundant_tokens(salience: Tensor, mask: Tensor, vectors: Tensor, threshold: float, chunk: int = 256) -> Tensor:
    """Bool [B, L]: real tokens with a more salient real token of the same row at cosine >= ``threshold``.

    salience [B, L], mask [B, L] bool, vectors [B, L, d] L2-normalised (cosine = inner product). "More salient"
    is a higher salience, or an equal one at an earlier position. Rows are processed ``chunk`` at a time.
    """
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"redundancy threshold must be in (0, 1], got {threshold}")
    if vectors.shape[:2] != mask.shape or salience.shape != mask.shape:
        raise ValueError(f"vectors {tuple(vectors.shape)}, salience {tuple(salience.shape)} and mask "
                         f"{tuple(mask.shape)} do not match")
    mask = mask.to(torch.bool)
    out = torch.zeros_like(mask)
    pos = torch.arange(mask.shape[1], device=mask.device)
    earlier = pos[None, :] < pos[:, None]  # [L, L]: j before i
    for s in range(0, mask.shape[0], chunk):
        sal, m = salience[s:s + chunk].float(), mask[s:s + chunk]
        v = vectors[s:s + chunk].double()  # float64: the same decision whatever the batch composition
        near = torch.einsum("bid,bjd->bij", v, v) >= threshold
        above = (sal[:, None, :] > sal[:, :, None]) | ((sal[:, None, :] == sal[:, :, None]) & earlier)
        out[s:s + chunk] = (near & above & m[:, None, :]).any(-1) & m
    return out


def prune_mask(salience: Tensor, mask: Tensor, beta: float, vectors: Tensor | None = None,
               redundancy: float | None = None) -> Tensor:
    """Bool [B, L]: the ceil(beta·len) (at least 1) most salient real tokens of each row.

    salience [B, L], mask [B, L] bool. beta=1 returns mask. Ties are broken by position (earlier kept).
    With ``redundancy`` (a cosine threshold) and the token ``vectors`` [B, L, d], tokens that
    :func:`redundant_tokens` flags rank after every other token of their row (still by salience among
    themselves), so a near-duplicate is kept only when the distinct tokens do not fill the budget.
    """
    if not 0.0 < beta <= 1.0:
        raise ValueError(f"beta must be in (0, 1], got {beta}")
    if salience.shape != mask.shape:
        raise ValueError(f"salience {tuple(salience.shape)} and mask {tuple(mask.shape)} differ in shape")
    mask = mask.to(torch.bool)
    if beta == 1.0:
        return mask.clone()
    count = _count_rule(mask.sum(-1), beta)
    if redundancy is None:
        return _hard_topk_mask(salience, mask, count)
    if vectors is None:
        raise ValueError("redundancy-aware pruning needs the token vectors")
    redundant = redundant_tokens(salience, mask, vectors, redundancy)
    order = salience.detach().float().masked_fill(~mask, -math.inf).argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(mask.shape[1], device=mask.device)
                                            .expand_as(order).contiguous())
    key = -(rank + redundant.long() * mask.shape[1]).double()  # distinct tokens first, by salience
    return _hard_topk_mask(key, mask, count)
