"""ExhaustiveScorer: scores every indexed document exactly with the alignment score (the searcher's quality ceiling)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from pyserini_aligner.alignment import Strategy, alignment_scores, parse_strategy
from pyserini_aligner.index.store import StoredIndex, Workspace
from pyserini_aligner.search.searcher import compute_threads, dense_result_classes, load_model, pad_encoded


class ExhaustiveScorer:
    """Brute-force AligneR ranking over all stored tokens of every document (no FAISS, no pruning).

    Same model and strategy rules as AlignerSearcher; ``doc_batch`` documents are scored at a time.
    """

    def __init__(self, index_dir: str | os.PathLike, encoder=None, strategy: str | Strategy | None = None,
                 device: str = "cpu", batch_size: int = 32, doc_batch: int = 512, progress: bool = False):
        self.index_dir = Path(index_dir)
        self.store = StoredIndex(self.index_dir)
        self.manifest = self.store.manifest
        self.model = load_model(encoder, self.manifest, self.index_dir, device)
        self.strategy = parse_strategy(strategy if strategy is not None else self.manifest.default_strategy)
        self.use_salience = self.model.scores_with_salience
        self.batch_size, self.doc_batch, self.progress = batch_size, doc_batch, progress
        self.docids = self.store.docids
        self._workspace = Workspace()

    def scores(self, queries: list[str]) -> torch.Tensor:
        """Scores [len(queries), num_docs] of every query against every document (0 for empty queries)."""
        out = torch.zeros(len(queries), self.store.num_docs)
        live = [i for i, text in enumerate(queries) if text.strip()]
        if not live:
            return out
        encoded = self.model.encode([queries[i] for i in live], is_query=True, batch_size=self.batch_size)
        q, q_mask, q_sal = pad_encoded(encoded, self.manifest.dim)
        starts = range(0, self.store.num_docs, self.doc_batch)
        for start in tqdm(starts, desc="exhaustive", unit="batch", disable=not self.progress):
            rows = np.arange(start, min(start + self.doc_batch, self.store.num_docs))
            d, d_mask, d_sal = self.store.gather(rows, workspace=self._workspace)
            out[live, start:start + len(rows)] = alignment_scores(
                q, q_mask, d, d_mask, self.strategy, q_sal if self.use_salience else None,
                d_sal if self.use_salience else None)
        return out

    def search(self, q: str, k: int = 10, threads: int = 1) -> list:
        """Top-k DenseSearchResult for one query ([] for an empty query)."""
        return self.batch_search([q], ["q"], k=k, threads=threads)["q"]

    def batch_search(self, queries: list[str], q_ids: list[str], k: int = 10, threads: int = 1) -> dict[str, list]:
        """{q_id: top-k DenseSearchResult}; equal scores go to the lower document row (as in AlignerSearcher)."""
        if len(queries) != len(q_ids):
            raise ValueError(f"{len(queries)} queries but {len(q_ids)} q_ids")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        dense, _ = dense_result_classes()
        rows = np.arange(self.store.num_docs)
        results = {}
        with compute_threads(threads):
            for start in range(0, len(queries), self.batch_size):
                texts = queries[start:start + self.batch_size]
                scores = self.scores(texts).numpy()
                for qid, text, row_scores in zip(q_ids[start:start + self.batch_size], texts, scores):
                    if not text.strip():
                        results[qid] = []
                        continue
                    best = np.lexsort((rows, -row_scores))[:k]
                    results[qid] = [dense(self.docids[b], float(row_scores[b])) for b in best]
        return results
