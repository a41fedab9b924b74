"""AlignmentReranker: rescore any candidate list (BM25 hits, (docid, text) pairs) with the AligneR alignment score."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from pyserini_aligner.alignment import alignment_scores
from pyserini_aligner.index.format import MANIFEST
from pyserini_aligner.index.reader import StoredIndex, Workspace
from pyserini_aligner.model import AlignerModel
from pyserini_aligner.resolve import load_model, model_for_index
from pyserini_aligner.search.encoding import compute_threads, pad_encoded
from pyserini_aligner.search.searcher import dense_result_classes
from pyserini_aligner.strategy import Strategy, as_strategy
from pyserini_aligner.textio import check_collection, is_blank


def text_of_raw(raw: str) -> str | None:
    """``contents`` (or title + text) of a stored raw JSON document."""
    try:
        record = json.loads(raw)
    except (TypeError, ValueError):
        return raw if isinstance(raw, str) else None
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("contents"), str):
        return record["contents"]
    text = " ".join(str(record[f]) for f in ("title", "text") if record.get(f))
    return text or None


def candidate_docid(candidate) -> str:
    """Docid of a candidate: a docid string, a (docid, text) pair or an object with ``.docid`` (Pyserini hit)."""
    if isinstance(candidate, str):
        return candidate
    if isinstance(candidate, (tuple, list)) and len(candidate) == 2:
        return str(candidate[0])
    if hasattr(candidate, "docid"):
        return str(candidate.docid)
    raise TypeError(f"candidate {candidate!r:.80} is neither a docid, a (docid, text) pair nor a hit with .docid")


def candidate_text(candidate) -> str | None:
    """Text of a candidate when it carries one: (docid, text), ``.contents``/``.text``, or a Lucene hit's raw JSON."""
    if isinstance(candidate, (tuple, list)) and len(candidate) == 2:
        return candidate[1]
    for attr in ("contents", "text"):
        value = getattr(candidate, attr, None)
        if isinstance(value, str):
            return value
        if callable(value):  # pyserini.search.lucene Document
            return value()
    document = getattr(candidate, "lucene_document", None)
    if document is not None:
        raw = document.get("raw") or document.get("contents")
        return text_of_raw(raw) if raw is not None else None
    return None


class AlignmentReranker:
    """Rerank candidates for a query by AligneR score.

    source: an index folder (stored vectors are used for docids it holds; other candidates are encoded from their
    text with the index's model, or ``encoder``) or a model ("aligner", a checkpoint folder or an AlignerModel;
    every candidate is then encoded from its text). strategy: alignment strategy (default: the index's or the
    model's default).
    """

    def __init__(self, source: str | os.PathLike | AlignerModel = "aligner", strategy: str | Strategy | None = None,
                 encoder=None, device: str = "cpu", batch_size: int = 32):
        self.store = None
        if isinstance(source, (str, os.PathLike)) and (Path(source) / MANIFEST).is_file():
            self.store = StoredIndex(source)
            self.model = model_for_index(encoder, self.store.manifest, source, device)
            default = self.store.manifest.default_strategy
        else:
            if encoder is not None:
                raise ValueError("pass either an index folder with encoder=..., or a model as source; not both")
            self.model = load_model(source, device if isinstance(source, (str, os.PathLike)) else None)
            default = self.model.config.default_strategy
        self.strategy = as_strategy(strategy if strategy is not None else default)
        self.use_salience = self.model.scores_with_salience
        self.dim = self.model.config.dim
        self.batch_size = batch_size
        self._workspace = Workspace()

    def rerank(self, query: str, candidates: Sequence, k: int | None = None, threads: int = 1) -> list:
        """DenseSearchResult list of the candidates (first occurrence of each docid) sorted by AligneR score, best
        first (equal scores keep the input order); ``k`` (None or >= 1) keeps the top k. [] for an empty query or no
        candidates. ``candidates`` must be a collection: a single docid string is refused (TypeError)."""
        check_collection(candidates, "candidates")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"k must be None or an integer >= 1, got {k!r}")
        dense, _ = dense_result_classes()
        docids, seen, picked = [], set(), []
        for candidate in candidates:
            docid = candidate_docid(candidate)
            if docid not in seen:
                seen.add(docid)
                docids.append(docid)
                picked.append(candidate)
        if is_blank(query) or not docids:
            return []
        with compute_threads(threads):
            scores = self._scores(query, docids, picked)
        order = np.lexsort((np.arange(len(scores)), -scores))[:k]
        return [dense(docids[i], float(scores[i])) for i in order]

    def _scores(self, query: str, docids: list[str], candidates: list) -> np.ndarray:
        rows = [self.store.row_of(docid) if self.store is not None else None for docid in docids]
        stored = [i for i, row in enumerate(rows) if row is not None]
        fresh = [i for i, row in enumerate(rows) if row is None]
        texts = []
        for i in fresh:
            text = candidate_text(candidates[i])
            if not isinstance(text, str):
                where = "is not in the index and " if self.store is not None else ""
                raise ValueError(f"candidate {docids[i]!r} {where}carries no text; pass (docid, text) pairs")
            texts.append(text)
        q, q_mask, q_sal = pad_encoded(self.model.encode([query], is_query=True), self.dim)
        scores = np.zeros(len(docids), dtype=np.float32)
        if stored:
            order = np.argsort([rows[i] for i in stored], kind="stable")
            positions = np.asarray(stored)[order]
            d, d_mask, d_sal = self.store.gather(np.asarray([rows[i] for i in positions]), workspace=self._workspace)
            scores[positions] = self._score(q, q_mask, q_sal, d, d_mask, d_sal)
        if fresh:
            encoded = self.model.encode(texts, is_query=False, batch_size=self.batch_size)
            d, d_mask, d_sal = pad_encoded(encoded, self.dim)
            scores[fresh] = self._score(q, q_mask, q_sal, d, d_mask, d_sal)
        return scores

    def _score(self, q, q_mask, q_sal, d, d_mask, d_sal) -> np.ndarray:
        sal = self.use_salience
        return alignment_scores(q, q_mask, d, d_mask, self.strategy, q_sal if sal else None,
                                d_sal if sal else None)[0].numpy()
