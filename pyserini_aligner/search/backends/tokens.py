"""The fp16 backend in torch (``backend="torch"`` on an fp16 index): :class:`TorchTokens` over a
:class:`TorchTokenIndex`, exact candidate generation and refinement.

Every stored token is loaded once into device memory ([T, d]; float16 on a GPU, float32 on the CPU) and the kept
tokens form the MIPS matrix. A batch of queries is then searched with tensors only: one matmul of the kept query
tokens against the kept doc tokens, the top ``k_per_token`` per query token, the same per-document proxy score as
the FAISS path, the best ``max_candidates`` documents, and the exact alignment score over their padded tokens.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from pyserini_aligner.alignment import Strategy, alignment_scores_grouped
from pyserini_aligner.index.reader import StoredIndex
from pyserini_aligner.search.backends.base import Clock, Queries, Scoring, no_clock
from pyserini_aligner.search.options import Depth
from pyserini_aligner.search.allowed import AllowedRows, allowed_rows
from pyserini_aligner.search.candidates import every_candidate

_DECODE_CHUNK = 1 << 18  # tokens decoded at once when loading
_MAX_ELEMENTS = 1 << 27  # bound on the largest intermediate tensor (similarities, padded candidate tokens)


class TorchTokenIndex:
    """The tokens of ``store`` resident on ``device``. refine_with: "all" tokens or only the "kept" ones.
    with_salience: keep the stored token saliences too (for models that score with them)."""

    def __init__(self, store: StoredIndex, device: str | torch.device = "cuda", refine_with: str = "all",
                 with_salience: bool = False, dtype: torch.dtype | None = None):
        self.device = torch.device(device)
        self.dtype = dtype or (torch.float16 if self.device.type == "cuda" else torch.float32)
        total = store.manifest.num_tokens
        vectors = torch.empty(total, store.manifest.dim, dtype=self.dtype, device=self.device)
        for start in range(0, total, _DECODE_CHUNK):
            positions = np.arange(start, min(start + _DECODE_CHUNK, total))
            vectors[start:start + len(positions)] = store.token_vectors(positions, self.device).to(self.dtype)
        offsets = torch.from_numpy(np.asarray(store.offsets, dtype=np.int64)).to(self.device)
        kept = np.asarray(store.faiss_ids, dtype=np.int64)
        kept = torch.from_numpy(kept[allowed_rows(store)[store.doc_of_token(kept)]]).to(self.device)  # probed rows only
        self.num_docs = store.num_docs
        self.kept_vectors = vectors if len(kept) == total else vectors[kept]
        self.kept_docs = torch.searchsorted(offsets, kept, right=True) - 1  # doc row of each kept token
        salience = torch.from_numpy(store.token_salience(np.arange(total))).to(self.device) if with_salience else None
        if refine_with == "kept":
            counts = torch.bincount(self.kept_docs, minlength=self.num_docs)
            offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
            vectors = self.kept_vectors
            salience = None if salience is None else salience[kept]
        self.vectors, self.offsets, self.salience = vectors, offsets, salience
        self.lengths = offsets[1:] - offsets[:-1]

    def search(self, q: Tensor, q_mask: Tensor, q_sal: Tensor, probe_mask: Tensor, k: int, k_per_token: int,
               max_candidates: int, strategy: Strategy, weights: Tensor | None = None,
               allowed: AllowedRows | None = None) -> tuple[Tensor, Tensor]:
        """Top-k (scores [B, k] float32, doc rows [B, k] int64; row −1 and score −inf where fewer were found).

        q [B, n, d], q_mask / probe_mask [B, n] bool (probe_mask = tokens sent to candidate generation), q_sal [B, n]
        (used in the score only when the index keeps saliences), weights [B, n] token weights of the proxy score.
        allowed: the only rows a filtered search may return (None: every live row); with k_per_token 0 every one of
        them is refined (:attr:`..options.Depth.every_row`).
        """
        q = q.to(self.device, self.dtype)
        q_mask, probe_mask = q_mask.to(self.device), probe_mask.to(self.device)
        limit = min(max(max_candidates, k), self.num_docs)
        if k_per_token == 0:
            rows, valid = every_candidate(allowed.rows(self.device), len(q))
        else:
            rows, valid = self._candidates(q, probe_mask, k_per_token, limit,
                                           None if weights is None else weights.to(self.device),
                                           None if allowed is None else allowed.on(self.device)[self.kept_docs])
        scores = self._refine(q, q_mask, q_sal.to(self.device), rows, valid, strategy)
        rows, order = rows.sort(dim=1)  # ties go to the lower document row, as in the FAISS path
        scores = scores.gather(1, order).sort(dim=1, descending=True, stable=True)
        top = min(k, scores.values.shape[1])
        best_rows = rows.gather(1, scores.indices[:, :top])
        best_scores = scores.values[:, :top]
        return best_scores, torch.where(torch.isfinite(best_scores), best_rows, torch.full_like(best_rows, -1))

    def _candidates(self, q: Tensor, probe_mask: Tensor, k_per_token: int, limit: int,
                    weights: Tensor | None, tokens: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(doc rows [B, limit], valid [B, limit]) ranked by Σ_tokens w · (best hit similarity − K-th similarity);
        tokens [kept tokens] (bool) or None: only these kept tokens are searched (a filtered search's)."""
        batch, n = probe_mask.shape
        owner, token = probe_mask.nonzero(as_tuple=True)
        probes = q[owner, token]  # [R, d]
        gains = q.new_zeros(batch, self.num_docs, dtype=torch.float32)
        found = torch.zeros(batch, self.num_docs, dtype=torch.bool, device=self.device)
        per_token = min(k_per_token, len(self.kept_vectors) if tokens is None else int(tokens.sum()))
        step = max(1, _MAX_ELEMENTS // max(len(self.kept_vectors), self.num_docs, 1))
        for start in range(0, len(probes), step):
            similarity = probes[start:start + step] @ self.kept_vectors.T
            if tokens is not None:
                similarity.masked_fill_(~tokens, -torch.inf)
            values, hits = similarity.topk(per_token, dim=1)
            values, docs = values.float(), self.kept_docs[hits]
            gain = values - values[:, -1:]
            if weights is not None:
                gain = gain * weights[owner[start:start + step], token[start:start + step]].unsqueeze(1)
            best = gain.new_zeros(len(docs), self.num_docs).scatter_reduce_(1, docs, gain, "amax")
            gains.index_add_(0, owner[start:start + step], best)
            found[owner[start:start + step].unsqueeze(1).expand_as(docs), docs] = True
        gains.masked_fill_(~found, -torch.inf)
        values, rows = gains.topk(limit, dim=1)
        return rows, torch.isfinite(values)

    def _refine(self, q: Tensor, q_mask: Tensor, q_sal: Tensor, rows: Tensor, valid: Tensor,
                strategy: Strategy) -> Tensor:
        """Alignment scores [B, C] of each query's candidate rows (−inf where not valid)."""
        lengths = torch.where(valid, self.lengths[rows], torch.zeros_like(rows))
        width = max(int(lengths.max()), 1)
        span = torch.arange(width, device=self.device)
        out = torch.full(rows.shape, -torch.inf, device=self.device)
        step = max(1, _MAX_ELEMENTS // (rows.shape[1] * width * self.vectors.shape[1]))
        for start in range(0, len(rows), step):
            part = slice(start, start + step)
            positions = (self.offsets[rows[part]].unsqueeze(-1) + span).clamp_max(max(len(self.vectors) - 1, 0))
            mask = span < lengths[part].unsqueeze(-1)
            d = self.vectors[positions]
            d_sal = None if self.salience is None else self.salience[positions]
            scores = alignment_scores_grouped(q[part], q_mask[part], d, mask, strategy,
                                              None if self.salience is None else q_sal[part], d_sal)
            out[part] = torch.where(valid[part], scores.float(), out[part])
        return out


class TorchTokens:
    """An fp16 index's tokens resident on one device, searched exactly by tensor operations
    (:class:`TorchTokenIndex`). No interaction stage."""

    has_interaction = False
    placement = "one"

    def __init__(self, store: StoredIndex, device: str | torch.device, scoring: Scoring):
        self.scoring = scoring
        self.tokens = TorchTokenIndex(store, device, scoring.refine_with, with_salience=scoring.use_salience)
        self.device = self.tokens.device
        self.num_rows = store.num_docs

    def search(self, queries: Queries, depth: Depth, k: int, clock: Clock = no_clock,
               allowed: AllowedRows | None = None) -> tuple[Tensor, Tensor]:
        return self.tokens.search(queries.vectors, queries.mask, queries.salience, queries.probe_mask, k,
                                  depth.per_probe, depth.refined, self.scoring.strategy, queries.refine_salience,
                                  allowed)
