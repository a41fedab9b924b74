"""Few-shot alignment adaptation (AligneR §4.3): pick the alignment strategy from a handful of labelled queries.

Candidates are rescored with every strategy over the stored document vectors (no new search); the strategy with
the best mean nDCG@10 on the labelled queries wins (ties: the earlier strategy in the candidate list). The same
functions evaluate adaptation in the harness: folds of ``fold_size`` test queries, each choosing a strategy that is
then scored on the remaining queries.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from pyserini_aligner.alignment import alignment_scores, parse_strategy
from pyserini_aligner.metrics import per_query

# the paper's grid: top-k k ∈ {1, 2, 4, 6, 8} and top-p p ∈ {0.5, 1, 1.5, 2}%
CANDIDATE_STRATEGIES = ("top-k:1", "top-k:2", "top-k:4", "top-k:6", "top-k:8",
                        "top-p:0.005", "top-p:0.01", "top-p:0.015", "top-p:0.02")
METRIC = "ndcg@10"

Hits = dict[str, list[tuple[str, float]]]
Qrels = Mapping[str, Mapping[str, int]]
PerQuery = Mapping[str, Mapping[str, float]]  # strategy -> qid -> metric value


def rescore(store, model, queries: Mapping[str, str], candidates: Mapping[str, Sequence[str]],
            strategies: Sequence[str] = CANDIDATE_STRATEGIES, batch_size: int = 32,
            progress: bool = False) -> dict[str, Hits]:
    """Rank each query's candidate docids under every strategy: ``strategy -> qid -> [(docid, score)]`` best first.

    store: a ``StoredIndex``; model: the index's ``AlignerModel`` (queries are encoded once; each query's
    candidates are gathered once and scored with all their stored tokens). Equal scores go to the lower index row,
    as in ``AlignerSearcher``. A docid missing from the index raises ValueError.
    """
    specs = [str(parse_strategy(s)) for s in strategies]
    qids = [q for q in candidates if q in queries]
    runs: dict[str, Hits] = {s: {q: [] for q in qids} for s in specs}  # empty query or no candidates: no hits
    live = [q for q in qids if queries[q].strip() and len(candidates[q])]
    if not live:
        return runs
    encoded = dict(zip(live, model.encode([queries[q] for q in live], is_query=True, batch_size=batch_size)))
    use_salience = model.scores_with_salience
    for qid in tqdm(live, desc="rescore", unit="query", disable=not progress):
        rows = []
        for docid in dict.fromkeys(candidates[qid]):
            row = store.row_of(docid)
            if row is None:
                raise ValueError(f"candidate {docid!r} of query {qid!r} is not in index {store.index_dir}")
            rows.append(row)
        rows = np.sort(np.asarray(rows, dtype=np.int64))
        d, d_mask, d_sal = store.gather(rows)
        e = encoded[qid]
        q = torch.from_numpy(e.vectors)[None]
        q_mask = torch.ones(1, len(e.vectors), dtype=torch.bool)
        q_sal = torch.from_numpy(e.salience)[None]
        for spec in specs:
            scores = alignment_scores(q, q_mask, d, d_mask, spec, q_sal if use_salience else None,
                                      d_sal if use_salience else None)[0].numpy()
            order = np.lexsort((rows, -scores))
            runs[spec][qid] = [(store.docids[rows[i]], float(scores[i])) for i in order]
    return runs


def strategy_table(qrels: Qrels, runs: Mapping[str, Hits], metric: str = METRIC) -> dict[str, dict[str, float]]:
    """``strategy -> qid -> metric`` for the runs of :func:`rescore`."""
    return {spec: per_query(qrels, run, metric) for spec, run in runs.items()}


def mean_scores(table: PerQuery, qids: Sequence[str]) -> dict[str, float]:
    """Mean metric of each strategy over ``qids``."""
    if not qids:
        raise ValueError("no labelled queries to average over")
    return {spec: float(np.mean([values[q] for q in qids])) for spec, values in table.items()}


def choose_strategy(table: PerQuery, qids: Sequence[str]) -> tuple[str, dict[str, float]]:
    """(best strategy on ``qids``, mean metric of every strategy); ties go to the earlier strategy in ``table``."""
    means = mean_scores(table, qids)
    best = max(means, key=lambda spec: (means[spec], -list(means).index(spec)))
    return best, means


def make_folds(qids: Sequence[str], fold_size: int = 8, seed: int = 0) -> list[list[str]]:
    """The queries (sorted, then shuffled with ``seed``) cut into folds of exactly ``fold_size``; the remainder
    (fewer than ``fold_size``) forms no fold. ValueError when fewer than ``fold_size + 1`` queries remain
    (a fold needs other queries to be evaluated on)."""
    if fold_size < 1:
        raise ValueError(f"fold_size must be >= 1, got {fold_size}")
    order = sorted(set(qids))
    if len(order) <= fold_size:
        raise ValueError(f"few-shot adaptation needs more than fold_size={fold_size} queries, got {len(order)}")
    random.Random(seed).shuffle(order)
    return [order[i:i + fold_size] for i in range(0, len(order) - fold_size + 1, fold_size)]


@dataclass
class Fold:
    queries: list[str]
    strategy: str  # chosen on ``queries``
    tuning: float  # its mean metric on ``queries``
    held_out: float  # its mean metric on every other query


@dataclass
class Adaptation:
    folds: list[Fold]
    mean: float  # mean of held_out over folds
    std: float  # population standard deviation of held_out over folds
    assignment: dict[str, str]  # qid -> a strategy chosen on a fold without that query

    def chosen_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for fold in self.folds:
            counts[fold.strategy] = counts.get(fold.strategy, 0) + 1
        return counts


def few_shot_adaptation(table: PerQuery, fold_size: int = 8, seed: int = 0) -> Adaptation:
    """Per fold of :func:`make_folds`: choose the best strategy on the fold, score it on all other queries.

    ``table``: ``strategy -> qid -> metric`` over the same queries. ``assignment`` gives each query the strategy of
    the next fold (fold i → fold i+1, remainder queries → fold 0; with a single fold, the choice made on the other
    queries), so that a run built from it is never tuned on the query it ranks.
    """
    if not table:
        raise ValueError("no strategies to choose from")
    qids = sorted(next(iter(table.values())))
    for spec, values in table.items():
        if sorted(values) != qids:
            raise ValueError(f"strategy {spec!r} is scored on other queries than {next(iter(table))!r}")
    folds_q = make_folds(qids, fold_size, seed)
    folds = []
    for fold_qids in folds_q:
        inside = set(fold_qids)
        rest = [q for q in qids if q not in inside]
        best, means = choose_strategy(table, fold_qids)
        folds.append(Fold(fold_qids, best, means[best], mean_scores({best: table[best]}, rest)[best]))
    held_out = np.array([f.held_out for f in folds])
    fold_of = {q: i for i, fold_qids in enumerate(folds_q) for q in fold_qids}
    assignment = {}
    for q in qids:
        i = fold_of.get(q)
        if i is None:
            assignment[q] = folds[0].strategy
        elif len(folds) > 1:
            assignment[q] = folds[(i + 1) % len(folds)].strategy
        else:
            assignment[q] = choose_strategy(table, [r for r in qids if r not in fold_of])[0]
    return Adaptation(folds, float(held_out.mean()), float(held_out.std()), assignment)
