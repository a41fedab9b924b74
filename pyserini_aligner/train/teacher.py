"""Teachers for label-free adaptation: BM25 over a corpus's wordpiece ids, and the z-score fusion of scorers.

The fused teacher (``anchor: fusion``) ranks a pseudo-query's candidates by the mean of per-query z-scores of the
starting model, the untrained backbone's token MaxSim and BM25: three views that err differently, so the fusion is
usually a better ranker of the target corpus than any one of them (measured by the cross-domain experiment), and
the student is trained towards it. Needs torch only.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Iterable, Sequence

import torch
from torch import Tensor


class WordpieceBM25:
    """BM25 (Lucene's form: idf = ln(1 + (N − df + 0.5) / (df + 0.5)), term weight idf·tf / (tf + k1·(1 − b +
    b·dl/avgdl))) over token-id lists, with ``skip`` ids (special tokens) left out of every text."""

    def __init__(self, corpus: Sequence[Sequence[int]], skip: Iterable[int] = (), k1: float = 0.9, b: float = 0.4):
        if not corpus:
            raise ValueError("WordpieceBM25 needs a non-empty corpus")
        self.skip, self.k1, self.b = frozenset(skip), k1, b
        df: Counter[int] = Counter()
        total = 0
        for row in corpus:
            terms = [t for t in row if t not in self.skip]
            df.update(set(terms))
            total += len(terms)
        n = len(corpus)
        self.avgdl = max(total / n, 1e-9)
        self.column = {t: c for c, t in enumerate(sorted(df))}
        self.idf = [math.log(1.0 + (n - df[t] + 0.5) / (df[t] + 0.5)) for t in sorted(df)]  # per column

    def doc_weights(self, docs: Sequence[Sequence[int]]) -> Tensor:
        """Sparse [D, V] float32: each doc's BM25 term weights (V = the corpus's distinct terms)."""
        rows, cols, vals = [], [], []
        for r, row in enumerate(docs):
            tf = Counter(t for t in row if t not in self.skip)
            norm = self.k1 * (1.0 - self.b + self.b * sum(tf.values()) / self.avgdl)
            for t, count in tf.items():
                c = self.column.get(t)
                if c is not None:
                    rows.append(r)
                    cols.append(c)
                    vals.append(self.idf[c] * count / (count + norm))
        with torch.sparse.check_sparse_tensor_invariants():  # explicit opt-in: torch warns otherwise
            return torch.sparse_coo_tensor(torch.tensor([rows, cols], dtype=torch.long).reshape(2, -1),
                                           torch.tensor(vals, dtype=torch.float32), (len(docs), len(self.column)))

    def query_counts(self, queries: Sequence[Sequence[int]]) -> Tensor:
        """Dense [Q, V] float32: how often each corpus term occurs in each query (other terms score nothing)."""
        out = torch.zeros(len(queries), len(self.column))
        for r, row in enumerate(queries):
            for t in row:
                c = self.column.get(t)
                if c is not None:
                    out[r, c] += 1.0
        return out

    def scores(self, queries: Sequence[Sequence[int]], docs: Sequence[Sequence[int]] | Tensor,
               chunk: int = 256) -> Tensor:
        """[Q, D] float32 BM25 scores of every query against every doc (``docs`` as id lists or doc_weights)."""
        weights = docs if isinstance(docs, Tensor) else self.doc_weights(docs)
        out = [torch.sparse.mm(weights, self.query_counts(queries[s:s + chunk]).T).T
               for s in range(0, len(queries), chunk)]
        return torch.cat(out) if out else torch.zeros(0, weights.shape[0])


def _row_stats(x: Tensor, allowed: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row mean and (population) standard deviation [Q, 1] of ``x`` [Q, C] over the allowed columns."""
    count = allowed.sum(-1, keepdim=True).clamp(min=1)
    x = x.float().masked_fill(~allowed, 0.0)
    mean = x.sum(-1, keepdim=True) / count
    return mean, (((x - mean) ** 2).masked_fill(~allowed, 0.0).sum(-1, keepdim=True) / count).sqrt()


def _all(like: Tensor) -> Tensor:
    return torch.ones(like.shape, dtype=torch.bool, device=like.device)


def zscore_fusion(scores: Sequence[Tensor], allowed: Tensor | None = None) -> Tensor:
    """Mean over scorers of each row's z-scores, taken over the row's allowed columns: [Q, C] each in, [Q, C] out
    (disallowed columns 0). A scorer whose row is constant adds 0 to that row."""
    if not scores:
        raise ValueError("zscore_fusion needs at least one score matrix")
    allowed = _all(scores[0]) if allowed is None else allowed
    fused = torch.zeros(scores[0].shape, device=scores[0].device)
    for s in scores:
        mean, std = _row_stats(s, allowed)
        fused += torch.where(std > 0, (s.float() - mean) / std.clamp(min=1e-12), torch.zeros_like(fused))
    return (fused / len(scores)).masked_fill(~allowed, 0.0)


def in_units_of(fused: Tensor, reference: Tensor, allowed: Tensor | None = None) -> Tensor:
    """``fused`` z-scores [Q, C] rescaled to ``reference``'s per-row mean and spread over the allowed columns, so
    that a softmax temperature set for ``reference``'s scores applies to the fusion too."""
    mean, std = _row_stats(reference, _all(reference) if allowed is None else allowed)
    return fused * std + mean
