"""Validation during training: exhaustive alignment scoring of small corpora on the model's device, nDCG@10.

Besides exhaustive (full-token) retrieval it estimates pruned search: per query, the β^q most salient query
tokens each take their ``k_per_token`` nearest kept doc tokens (the β^d most salient of each doc, pruned
redundancy-aware as the index builder does; exact MIPS), the docs hit become candidates and are ranked by their
full alignment score (AlignerSearcher without the FAISS approximation and without its max_candidates cap). Needs torch
and ranx only (no Pyserini, no FAISS).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from pyserini_aligner.alignment import Strategy, alignment_scores
from pyserini_aligner.metrics import evaluate as evaluate_run
from pyserini_aligner.salience import DEFAULT_PRUNE_REDUNDANCY, prune_mask


def mean_ndcg10(run: dict[str, dict[str, float]], qrels: dict[str, dict[str, int]]) -> float:
    """Mean nDCG@10 (:mod:`pyserini_aligner.metrics`) over the queries with a relevant document (0.0 when none
    has one); run: qid -> {docid: score}."""
    judged = {qid: docs for qid, docs in qrels.items() if any(r > 0 for r in docs.values())}
    return evaluate_run(judged, run, ("ndcg@10",))["ndcg@10"] if judged else 0.0


def pad_ids(rows: list[list[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """input_ids and attention_mask [B, max len] (long) on ``device``."""
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        attention[i, :len(row)] = 1
    return input_ids.to(device), attention.to(device)


@dataclass
class Encoded:
    """Padded token outputs on the model's device: vectors [N, L, d] (fp16 on CUDA), mask [N, L], salience [N, L]."""

    vectors: Tensor
    mask: Tensor
    salience: Tensor


def encode_ids(model, ids: list[list[int]], is_query: bool, batch_size: int) -> Encoded:
    """Run the model over pre-tokenised texts (length-sorted batches) and return them padded, in input order
    (vectors in float16 on a GPU)."""
    store = torch.float16 if model.device.type == "cuda" else torch.float32
    return Encoded(*model.encode_token_ids(ids, is_query, batch_size, store))


def score_all(model, queries: Encoded, docs: Encoded, strategy, chunk: int = 32) -> Tensor:
    """Exhaustive alignment scores [Q, N] (fp32) of every query against every doc."""
    use_sal = model.scores_with_salience
    rows = []
    with torch.inference_mode():
        for s in range(0, queries.vectors.shape[0], chunk):
            q = queries.vectors[s:s + chunk].float()
            rows.append(alignment_scores(q, queries.mask[s:s + chunk], docs.vectors, docs.mask, strategy,
                                         queries.salience[s:s + chunk] if use_sal else None,
                                         docs.salience if use_sal else None))
    return torch.cat(rows)


def pruned_candidates(queries: Encoded, docs: Encoded, beta_q: float, beta_d: float, k_per_token: int,
                      chunk: int = 16, redundancy: float | None = DEFAULT_PRUNE_REDUNDANCY) -> Tensor:
    """Bool [Q, N]: docs reached by the pruned token search (see module docstring); documents are pruned as the
    index builder does (redundancy-aware at cosine ``redundancy``, None: salience alone)."""
    kept_d = prune_mask(docs.salience, docs.mask, beta_d, docs.vectors, redundancy)
    tokens = docs.vectors[kept_d]  # [T, d]
    owner = torch.nonzero(kept_d)[:, 0]  # [T] doc row of each kept token
    kept_q = prune_mask(queries.salience, queries.mask, beta_q)
    n_q, n_docs = queries.vectors.shape[0], docs.vectors.shape[0]
    hit = torch.zeros(n_q, n_docs, dtype=torch.bool, device=tokens.device)
    k = min(k_per_token, tokens.shape[0])
    with torch.inference_mode():
        for s in range(0, n_q, chunk):
            sel = kept_q[s:s + chunk]
            probe = queries.vectors[s:s + chunk][sel]  # [R, d]
            which = torch.nonzero(sel)[:, 0] + s  # [R] query of each probe
            top = (probe.to(tokens.dtype) @ tokens.T).topk(k, dim=-1).indices  # [R, k]
            hit[which.unsqueeze(1).expand_as(top), owner[top]] = True
    return hit


def top_docids(scores: Tensor, qids: list[str], docids: list[str], k: int = 10) -> dict[str, dict[str, float]]:
    """Run dict of the top-k docs per query from scores [Q, N] (-inf = not retrieved)."""
    vals, idx = scores.topk(min(k, scores.shape[1]), dim=1)
    vals, idx = vals.cpu().tolist(), idx.cpu().tolist()
    return {qid: {docids[j]: v for v, j in zip(vs, js) if v != -math.inf} for qid, vs, js in zip(qids, vals, idx)}


def evaluate(model, sets: dict, corpus_ids: dict[str, list[list[int]]], corpus_docids: dict[str, list[str]],
             query_ids: dict[str, list[list[int]]], strategy: Strategy, batch_size: int = 128,
             beta_q: float = 0.5, beta_d: float = 0.2, k_per_token: int = 100,
             redundancy: float | None = DEFAULT_PRUNE_REDUNDANCY) -> dict[str, dict[str, float]]:
    """nDCG@10 (exhaustive, and pruned-search estimate) per validation set.

    sets: name -> ValidationSet; corpus_ids: corpus -> token ids per doc; corpus_docids: corpus -> docids;
    query_ids: set name -> token ids per query (in the order of ``sets[name].queries``).
    """
    results, encoded_docs = {}, {}
    for name, vset in sets.items():
        if vset.corpus not in encoded_docs:
            encoded_docs = {vset.corpus: encode_ids(model, corpus_ids[vset.corpus], False, batch_size)}
        docs, docids = encoded_docs[vset.corpus], corpus_docids[vset.corpus]
        qids = list(vset.queries)
        queries = encode_ids(model, query_ids[name], True, batch_size)
        full = score_all(model, queries, docs, strategy)
        cand = pruned_candidates(queries, docs, beta_q, beta_d, k_per_token, redundancy=redundancy)
        pruned = torch.where(cand, full, torch.full_like(full, -math.inf))
        row = {}
        for metric, scores in (("ndcg@10", full), ("ndcg@10_pruned", pruned)):
            row[metric] = mean_ndcg10(top_docids(scores, qids, docids), vset.qrels)
        row["queries"] = len(qids)
        results[name] = row
    return results
