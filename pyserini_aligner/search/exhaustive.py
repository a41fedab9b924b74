"""ExhaustiveScorer: scores every indexed document exactly with the alignment score (the searcher's quality ceiling)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

from pyserini_aligner.alignment import alignment_scores
from pyserini_aligner.index.reader import StoredIndex, Workspace
from pyserini_aligner.search.codes import CodeShard
from pyserini_aligner.resolve import model_for_index
from pyserini_aligner.search.encoding import compute_threads
from pyserini_aligner.search.searcher import dense_result_classes
from pyserini_aligner.strategy import Strategy, as_strategy
from pyserini_aligner.textio import check_collection, check_unique_ids, is_blank

_BLOCK_ELEMENTS = 1 << 26  # similarity entries per block (query tokens × document tokens)


class ExhaustiveScorer:
    """Brute-force AligneR ranking over all stored tokens of every live document (no candidate generation, no
    pruning). Same model and strategy rules as AlignerSearcher; runs on ``device`` in blocks of documents, so it
    scales to any index whose codes fit there."""

    def __init__(self, index_dir: str | os.PathLike, encoder=None, strategy: str | Strategy | None = None,
                 device: str = "cpu", batch_size: int = 32, doc_batch: int = 512, progress: bool = False):
        self.index_dir = Path(index_dir)
        self.store = StoredIndex(self.index_dir)
        self.manifest = self.store.manifest
        self.device = torch.device(device)
        self.model = model_for_index(encoder, self.manifest, self.index_dir, str(device))
        self.strategy = as_strategy(strategy) if strategy is not None else self.manifest.default_strategy
        self.use_salience = self.model.scores_with_salience
        self.batch_size, self.doc_batch, self.progress = batch_size, doc_batch, progress
        self.docids = self.store.docids
        self._workspace = Workspace()
        self.shards = ([CodeShard(self.store, [i], self.device) for i in range(len(self.store.segments))]
                       if self.store.codec is not None else [])

    def _blocks(self, query_tokens: int) -> Iterator[tuple[np.ndarray, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(rows [b], vectors [b, m, d], mask [b, m], salience [b, m]) over every document, on the device."""
        width = max(int(self.store.lengths.max()) if self.store.num_docs else 1, 1)
        step = max(1, min(self.doc_batch * 8 if self.shards else self.doc_batch,
                          _BLOCK_ELEMENTS // max(query_tokens * width, 1)))
        spans = ([(s.row_base, s.row_base + s.num_rows, s) for s in self.shards] if self.shards
                 else [(0, self.store.num_docs, None)])
        blocks = [(shard, start, min(start + step, end)) for begin, end, shard in spans
                  for start in range(begin, end, step)]
        for shard, start, end in tqdm(blocks, desc="exhaustive", unit="block", disable=not self.progress):
            rows = np.arange(start, end)
            if shard is not None:
                local = torch.from_numpy(rows - shard.row_base).to(self.device)
                lengths = shard.lengths[local]
                span = torch.arange(max(int(lengths.max()), 1), device=self.device)
                positions = (shard.offsets[local].unsqueeze(-1) + span).clamp_max(max(len(shard.token_ids) - 1, 0))
                mask = span < lengths.unsqueeze(-1)
                yield rows, shard.decode(positions), mask, mask.float()
            else:
                d, d_mask, d_sal = self.store.gather(rows, workspace=self._workspace)
                yield rows, d.to(self.device), d_mask.to(self.device), d_sal.to(self.device)

    def _scores_blocks(self, queries: list[str]) -> Iterator[tuple[np.ndarray, torch.Tensor]]:
        """(rows [b], scores [len(queries), b]) per block; dead rows and blank queries score −inf."""
        live = [i for i, text in enumerate(queries) if not is_blank(text)]
        if not live:
            return
        out = self.model.encode_padded([queries[i] for i in live], is_query=True, batch_size=self.batch_size)
        dtype = torch.float32  # as in the searcher's refinement
        q, q_mask, q_sal = out.vectors.to(self.device, dtype), out.mask.to(self.device), out.salience.to(self.device)
        index = torch.tensor(live, device=self.device)
        for rows, d, d_mask, d_sal in self._blocks(q.shape[0] * q.shape[1]):
            block = torch.full((len(queries), len(rows)), -torch.inf, device=self.device)
            block[index] = alignment_scores(q, q_mask, d.to(dtype), d_mask, self.strategy,
                                            q_sal if self.use_salience else None,
                                            d_sal if self.use_salience else None).float()
            dead = torch.from_numpy(~self.store.live[rows]).to(self.device)
            yield rows, block.masked_fill(dead.unsqueeze(0), -torch.inf)

    def scores(self, queries: list[str]) -> torch.Tensor:
        """Scores [len(queries), num_docs] of every query against every document row (0 for blank queries, −inf
        for deleted documents)."""
        check_collection(queries, "queries")
        out = torch.zeros(len(queries), self.store.num_docs)
        blank = torch.tensor([is_blank(text) for text in queries])
        for rows, block in self._scores_blocks(queries):
            out[:, torch.from_numpy(rows)] = torch.where(blank.unsqueeze(1), torch.zeros(()), block.cpu())
        return out

    def rank(self, queries: list[str], k: int = 10) -> list[list[tuple[str, float]]]:
        """Top-k (docid, score) per query, best first (equal scores to the lower row), keeping only a running top-k
        per block (never [queries, documents] in memory)."""
        check_collection(queries, "queries")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        best_scores = torch.full((len(queries), 0), -torch.inf, device=self.device)
        best_rows = torch.zeros((len(queries), 0), dtype=torch.long, device=self.device)
        for rows, block in self._scores_blocks(queries):
            rows_t = torch.from_numpy(rows).to(self.device).expand(len(queries), -1)
            scores = torch.cat([best_scores, block], dim=1)
            all_rows = torch.cat([best_rows, rows_t], dim=1)
            top = scores.sort(dim=1, descending=True, stable=True).indices[:, :k]
            best_scores, best_rows = scores.gather(1, top), all_rows.gather(1, top)
        ranked = []
        for scores, rows in zip(best_scores.cpu().tolist(), best_rows.cpu().tolist()):
            ranked.append([(self.docids[r], s) for r, s in zip(rows, scores) if s != -float("inf")])
        return ranked

    def search(self, q: str, k: int = 10, threads: int = 1) -> list:
        """Top-k DenseSearchResult for one query ([] for an empty query)."""
        return self.batch_search([q], ["q"], k=k, threads=threads)["q"]

    def batch_search(self, queries: list[str], q_ids: list[str], k: int = 10, threads: int = 1) -> dict[str, list]:
        """{q_id: top-k DenseSearchResult}; equal scores go to the lower document row (as in AlignerSearcher)."""
        check_collection(queries, "queries")
        check_collection(q_ids, "q_ids")
        if len(queries) != len(q_ids):
            raise ValueError(f"{len(queries)} queries but {len(q_ids)} q_ids")
        check_unique_ids(q_ids, "q_ids")
        dense, _ = dense_result_classes()
        results = {}
        with compute_threads(threads):
            for start in range(0, len(queries), self.batch_size):
                texts = queries[start:start + self.batch_size]
                for qid, hits in zip(q_ids[start:start + self.batch_size], self.rank(texts, k)):
                    results[qid] = [dense(docid, score) for docid, score in hits]
        return results
