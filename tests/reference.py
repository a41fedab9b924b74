"""Slow, obvious loop references (python floats, float64) for the numerics under test.

LP: max sᵀλ + εH(λ), H = −Σ λ ln λ, s.t. Σλ = k, 0 ≤ λ ≤ 1. Stationarity of the Lagrangian
s_i − ε(ln λ_i + 1) + ν − μ_i = 0 with μ_i ≥ 0 (multiplier of λ_i ≤ 1, complementary slackness) gives
λ_i = min(1, exp((s_i + a)/ε)) with a = ν − ε; a is the unique root of the increasing function
f(a) = Σ_i min(1, exp((s_i + a)/ε)) − k, found here by bisection.
"""
from __future__ import annotations

import math
from collections.abc import Sequence


def lp_bisection(scores: Sequence[float], k: float, eps: float, iters: int = 300) -> list[float]:
    """λ for one row of real scores (no padding), by bisection on the dual variable a."""
    n = len(scores)
    k = min(max(k, 0.0), float(n))
    if k == 0:
        return [0.0] * n
    if k == n:
        return [1.0] * n

    def lam(a: float) -> list[float]:
        return [math.exp(min((s + a) / eps, 0.0)) for s in scores]

    lo = -max(scores) + eps * math.log(k / n)  # f(lo) <= 0
    hi = -min(scores)  # every λ is 1: f(hi) = n - k > 0
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if sum(lam(mid)) < k:
            lo = mid
        else:
            hi = mid
    return lam(0.5 * (lo + hi))


def lp_paper_ascent(scores: Sequence[float], k: float, eps: float, n_iters: int) -> list[float]:
    """The paper's coordinate ascent, as written: a' = ε ln k − ε lse((s+b)/ε), b' = min(−s−a', 0)."""
    b = [0.0] * len(scores)
    a = 0.0
    for _ in range(n_iters):
        z = [(s + bi) / eps for s, bi in zip(scores, b)]
        top = max(z)
        a = eps * math.log(k) - eps * (top + math.log(sum(math.exp(v - top) for v in z)))
        b = [min(-s - a, 0.0) for s in scores]
    return [math.exp((s + bi + a) / eps) for s, bi in zip(scores, b)]


def hard_topk(values: Sequence[float], k: int) -> list[int]:
    """Positions of the k largest values, ties to the earlier position."""
    order = sorted(range(len(values)), key=lambda j: (-values[j], j))
    return order[:k]


def alignment_score(
    q: Sequence[Sequence[float]],
    q_mask: Sequence[bool],
    d: Sequence[Sequence[float]],
    d_mask: Sequence[bool],
    kind: str,
    k: float = 1.0,
    p: float = 0.0,
    eps: float = 0.0,
    q_sal: Sequence[float] | None = None,
    d_sal: Sequence[float] | None = None,
) -> float:
    """Σ S∘A / Σ A for one query/doc pair, A_ij = Ã_ij u^q_i u^d_j, looping over tokens."""
    qi = [i for i in range(len(q)) if q_mask[i]]
    dj = [j for j in range(len(d)) if d_mask[j]]
    num = den = 0.0
    for i in qi:
        row = [sum(float(a) * float(b) for a, b in zip(q[i], d[j])) for j in dj]
        if not row:
            continue
        if kind == "top-k":
            weights = [0.0] * len(dj)
            for pos in hard_topk(row, min(int(k), len(dj))):
                weights[pos] = 1.0
        elif kind == "top-p":
            weights = [0.0] * len(dj)
            for pos in hard_topk(row, max(math.floor(p * len(dj) + 1e-9), 1)):
                weights[pos] = 1.0
        elif kind == "da":
            weights = lp_bisection(row, k, eps)
        else:
            raise ValueError(kind)
        uq = 1.0 if q_sal is None else float(q_sal[i])
        for pos, j in enumerate(dj):
            ud = 1.0 if d_sal is None else float(d_sal[j])
            a = weights[pos] * uq * ud
            num += a * row[pos]
            den += a
    return num / den if den > 0 else 0.0


def prune(salience: Sequence[float], mask: Sequence[bool], beta: float) -> list[bool]:
    """Keep the ceil(beta·len) (>= 1) most salient real tokens, ties to the earlier position."""
    real = [j for j in range(len(mask)) if mask[j]]
    n_keep = min(len(real), max(1, math.ceil(beta * len(real) - 1e-9)))
    kept = sorted(real, key=lambda j: (-float(salience[j]), j))[:n_keep]
    return [j in kept for j in range(len(mask))]


def prune_redundant(salience: Sequence[float], mask: Sequence[bool], vectors: Sequence[Sequence[float]], beta: float,
                    threshold: float) -> list[bool]:
    """Redundancy-aware pruning: a real token with a more salient real token (higher salience, or equal and
    earlier) at cosine >= threshold ranks after every other token; then the ceil(beta·len) (>= 1) best are kept."""
    real = [j for j in range(len(mask)) if mask[j]]

    def more_salient(j: int, i: int) -> bool:
        return salience[j] > salience[i] or (salience[j] == salience[i] and j < i)

    def redundant(i: int) -> bool:
        return any(more_salient(j, i) and sum(a * b for a, b in zip(vectors[i], vectors[j])) >= threshold
                   for j in real if j != i)

    n_keep = min(len(real), max(1, math.ceil(beta * len(real) - 1e-9)))
    kept = sorted(real, key=lambda j: (redundant(j), -float(salience[j]), j))[:n_keep]
    return [j in kept for j in range(len(mask))]


def select_candidates(scores: Sequence[Sequence[float]], rows: Sequence[Sequence[int]], owner: Sequence[int],
                      batch: int, limit: int, weights: Sequence[float] | None = None) -> list[list[int]]:
    """The candidate rule, per query: proxy(doc) = Σ_probes w · (best score of doc in the probe's list − the probe's
    lowest listed score); the ``limit`` best documents (ties to the lower row), returned in ascending row order."""
    proxies: list[dict[int, float]] = [{} for _ in range(batch)]
    for r in range(len(rows)):
        listed = [j for j in range(len(rows[r])) if rows[r][j] >= 0]
        floor = min(float(scores[r][j]) for j in listed) if listed else 0.0
        best: dict[int, float] = {}
        for j in listed:
            doc = int(rows[r][j])
            best[doc] = max(best.get(doc, -math.inf), float(scores[r][j]) - floor)
        w = 1.0 if weights is None else float(weights[r])
        for doc, gain in best.items():
            proxies[owner[r]][doc] = proxies[owner[r]].get(doc, 0.0) + w * gain
    return [sorted(sorted(p, key=lambda doc: (-p[doc], doc))[:limit]) for p in proxies]
