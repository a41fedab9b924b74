"""Exact candidate generation and refinement in torch for fp16 indexes (``backend="torch"``), and the CUDA-graph
query encoder shared by every GPU search.

Every stored token is loaded once into device memory ([T, d]; float16 on a GPU, float32 on the CPU) and the kept
tokens form the MIPS matrix. A batch of queries is then searched with tensors only: one matmul of the kept query
tokens against the kept doc tokens, the top ``k_per_token`` per query token, the same per-document proxy score as
the FAISS path, the best ``max_candidates`` documents, and the exact alignment score over their padded tokens.
"""
from __future__ import annotations

import itertools

import numpy as np
import torch
from torch import Tensor

from pyserini_aligner.alignment import Strategy, alignment_scores_grouped
from pyserini_aligner.index.store import StoredIndex
from pyserini_aligner.search.engine import allowed_rows

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
               max_candidates: int, strategy: Strategy, weights: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Top-k (scores [B, k] float32, doc rows [B, k] int64; row −1 and score −inf where fewer were found).

        q [B, n, d], q_mask / probe_mask [B, n] bool (probe_mask = tokens sent to candidate generation), q_sal [B, n]
        (used in the score only when the index keeps saliences), weights [B, n] token weights of the proxy score.
        """
        q = q.to(self.device, self.dtype)
        q_mask, probe_mask = q_mask.to(self.device), probe_mask.to(self.device)
        limit = min(max(max_candidates, k), self.num_docs)
        rows, valid = self._candidates(q, probe_mask, k_per_token, limit,
                                       None if weights is None else weights.to(self.device))
        scores = self._refine(q, q_mask, q_sal.to(self.device), rows, valid, strategy)
        rows, order = rows.sort(dim=1)  # ties go to the lower document row, as in the FAISS path
        scores = scores.gather(1, order).sort(dim=1, descending=True, stable=True)
        top = min(k, scores.values.shape[1])
        best_rows = rows.gather(1, scores.indices[:, :top])
        best_scores = scores.values[:, :top]
        return best_scores, torch.where(torch.isfinite(best_scores), best_rows, torch.full_like(best_rows, -1))

    def _candidates(self, q: Tensor, probe_mask: Tensor, k_per_token: int, limit: int,
                    weights: Tensor | None) -> tuple[Tensor, Tensor]:
        """(doc rows [B, limit], valid [B, limit]) ranked by Σ_tokens w · (best hit similarity − K-th similarity)."""
        batch, n = probe_mask.shape
        owner, token = probe_mask.nonzero(as_tuple=True)
        probes = q[owner, token]  # [R, d]
        gains = q.new_zeros(batch, self.num_docs, dtype=torch.float32)
        found = torch.zeros(batch, self.num_docs, dtype=torch.bool, device=self.device)
        per_token = min(k_per_token, len(self.kept_vectors))
        step = max(1, _MAX_ELEMENTS // max(len(self.kept_vectors), self.num_docs, 1))
        for start in range(0, len(probes), step):
            values, hits = (probes[start:start + step] @ self.kept_vectors.T).topk(per_token, dim=1)
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


MAX_GRAPHED_BATCH = 512  # queries a captured batch encoding takes at most


class _Captured:
    """The model's query forward pass over ``size`` rows of ``width`` token ids, captured in a CUDA graph: fill
    ``ids`` and ``attention``, replay ``graph``, read ``out``."""

    def __init__(self, model, size: int, width: int):
        device = model.device
        self.ids = torch.full((size, width), model.pad_id, dtype=torch.long, device=device)
        self.attention = torch.zeros(size, width, dtype=torch.long, device=device)
        self.attention[:, :2] = 1
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.inference_mode(), torch.cuda.stream(side):
            for _ in range(3):
                model(self.ids, self.attention, is_query=True)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(self.graph):
            self.out = model(self.ids, self.attention, is_query=True)


class GraphedQueryEncoder:
    """Queries through CUDA graphs of the model's forward pass, padded to ``maxlen`` (default the model's
    ``query_maxlen``): one query at a time (``__call__``), or a batch (``encode_batch``).

    The eager forward of a small encoder on one short query is bound by kernel launches (~4 ms); replaying a
    captured graph launches them all at once. Padding only adds masked positions, so the vectors of the real tokens
    are those of the eager pass up to floating-point rounding. Raises RuntimeError when the model cannot be captured.
    """

    def __init__(self, model, maxlen: int | None = None):
        self.model = model.eval()
        one = _Captured(model, 1, maxlen or model.config.query_maxlen)
        self.ids, self.attention, self.graph, self.out = one.ids, one.attention, one.graph, one.out
        self._batches = {1: one}

    def encode_batch(self, texts: list[str]):
        """TokenOutput (vectors [n, maxlen, dim], mask, salience) of ``texts`` (n of them), in input order, through the
        graph of the smallest power-of-two batch (at most MAX_GRAPHED_BATCH) that holds them, captured on first use;
        longer lists go in such batches one after the other. A new tensor, not a graph's buffer."""
        from pyserini_aligner.model import TokenOutput

        width = self.ids.shape[1]
        ids, truncated = self.model.tokenize(texts, is_query=True, maxlen=width)
        self.model._report_truncation("query", sum(truncated), len(ids), width)
        parts = []
        for start in range(0, len(ids), MAX_GRAPHED_BATCH):
            rows = ids[start:start + MAX_GRAPHED_BATCH]
            batch = self._batch_graph(1 << (len(rows) - 1).bit_length())
            host = np.zeros((2, batch.ids.shape[0], width), dtype=np.int64)
            host[0] = self.model.pad_id
            host[1, :, :2] = 1  # rows past the texts: two attended positions, as in the capture
            lengths = np.array([len(row) for row in rows])
            real = np.arange(width) < lengths[:, None]
            host[1, :len(rows)] = real
            host[0, :len(rows)][real] = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64,
                                                   count=int(lengths.sum()))
            host = torch.from_numpy(host).pin_memory().to(self.ids.device, non_blocking=True)
            batch.ids.copy_(host[0])
            batch.attention.copy_(host[1])
            batch.graph.replay()
            parts.append([t[:len(rows)].clone() for t in (batch.out.vectors, batch.out.mask, batch.out.salience)])
        return TokenOutput(*(torch.cat(column) for column in zip(*parts)))

    def _batch_graph(self, size: int):
        """The captured forward pass of ``size`` padded queries (captured on first use)."""
        if size not in self._batches:
            self._batches[size] = _Captured(self.model, size, self.ids.shape[1])
        return self._batches[size]

    def __call__(self, text: str):
        """TokenOutput (vectors [1, maxlen, dim], mask, salience) of ``text``, valid until the next call."""
        width = self.ids.shape[1]
        ids, truncated = self.model.tokenize([text], is_query=True, maxlen=width)
        self.model._report_truncation("query", sum(truncated), 1, width)
        self.tokens = len(ids[0])  # real tokens of the last query
        row = torch.full((2, self.ids.shape[1]), 0, dtype=torch.long)
        row[0].fill_(self.model.pad_id)
        row[0, :len(ids[0])] = torch.tensor(ids[0])
        row[1, :len(ids[0])] = 1
        row = row.to(self.ids.device, non_blocking=True)
        self.ids.copy_(row[:1])
        self.attention.copy_(row[1:])
        self.graph.replay()
        return self.out
