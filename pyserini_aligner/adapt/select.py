"""Few-shot adaptation (AligneR §4.3): pick the alignment strategy, and the checkpoint, from a handful of labelled
queries.

Candidates are rescored under every strategy (no new search): over the stored document vectors, or, to compare
checkpoints, over the candidate documents' texts encoded with each checkpoint (:mod:`.checkpoints`). The baseline
(what is in use: the index's checkpoint and default strategy) is kept unless a candidate beats it clearly on the
labelled queries: a mean nDCG@10 gain of at least ``min_gain`` and a one-sided paired randomisation test (sign flips
of the per-query differences, max-T over the candidates so that picking the best of several is accounted for) with
p <= ``alpha``. The same functions evaluate adaptation in the harness: folds of ``fold_size`` test queries, each
choosing a candidate that is then scored on the remaining queries.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Hashable, Mapping, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from pyserini_aligner.alignment import Strategy, alignment_scores_many
from pyserini_aligner.metrics import per_query
from pyserini_aligner.textio import check_collection

# the paper's grid: top-k k ∈ {1, 2, 4, 6, 8} and top-p p ∈ {0.5, 1, 1.5, 2}%
CANDIDATE_STRATEGIES = (*(Strategy("top-k", k=k) for k in (1, 2, 4, 6, 8)),
                        *(Strategy("top-p", p=p) for p in (0.005, 0.01, 0.015, 0.02)))
METRIC = "ndcg@10"
ALPHA = 0.05  # significance level a candidate must reach to replace the baseline
MIN_GAIN = 0.005  # and its smallest mean gain over the baseline (0.5 point nDCG@10)
PERMUTATIONS = 10000  # random sign flips when exact enumeration would need more

Hits = dict[str, list[tuple[str, float]]]
Qrels = Mapping[str, Mapping[str, int]]
PerQuery = Mapping[Hashable, Mapping[str, float]]  # candidate (a strategy, or a Candidate) -> qid -> metric value


@dataclass(frozen=True)
class Candidate:
    """A checkpoint (a shipped checkpoint's name or a checkpoint folder) and an alignment strategy spec."""

    checkpoint: str
    strategy: str

    def __str__(self) -> str:
        return f"{self.checkpoint} {self.strategy}"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


def rescore(store, model, queries: Mapping[str, str], candidates: Mapping[str, Sequence[str]],
            strategies: Sequence[Strategy] = CANDIDATE_STRATEGIES, batch_size: int = 32,
            progress: bool = False) -> dict[str, Hits]:
    """Rank each query's candidate docids under every strategy: ``strategy -> qid -> [(docid, score)]`` best first.

    store: a ``StoredIndex``; model: the index's ``AlignerModel`` (queries are encoded once; each query's
    candidates are gathered once and scored with all their stored tokens). Equal scores go to the lower index row,
    as in ``AlignerSearcher``. A docid missing from the index raises ValueError.
    """
    specs, runs, live, encoded = _start(model, queries, candidates, strategies, batch_size)
    for qid in tqdm(live, desc="rescore", unit="query", disable=not progress):
        rows = []
        for docid in dict.fromkeys(candidates[qid]):
            row = store.row_of(docid)
            if row is None:
                raise ValueError(f"candidate {docid!r} of query {qid!r} is not in index {store.index_dir}")
            rows.append(row)
        rows = np.sort(np.asarray(rows, dtype=np.int64))
        docids = [store.docids[row] for row in rows]
        _rank(model, encoded[qid], store.gather(rows), docids, specs, runs, qid)
    return runs


def rescore_texts(model, queries: Mapping[str, str], candidates: Mapping[str, Sequence[str]],
                  texts: Mapping[str, str], strategies: Sequence[Strategy] = CANDIDATE_STRATEGIES, batch_size: int = 32,
                  maxlen: int | None = None, progress: bool = False) -> tuple[dict[str, Hits], int]:
    """As :func:`rescore`, with the candidates' ``texts`` (docid -> text) encoded by ``model`` instead of an
    index's stored vectors, as ``AlignmentReranker`` scores (docid, text) pairs. Returns (``strategy -> qid ->
    [(docid, score)]`` best first, how many documents were encoded).

    Each distinct candidate document is encoded once (``maxlen`` tokens at most, default the model's doc_maxlen),
    however many queries share it, and dropped after the last query that needs it; nothing else is encoded. Equal
    scores keep the candidate order. A candidate without text raises ValueError.
    """
    from pyserini_aligner.search.encoding import pad_encoded

    specs, runs, live, encoded = _start(model, queries, candidates, strategies, batch_size)
    lists = {q: list(dict.fromkeys(candidates[q])) for q in live}
    missing = next((d for q in live for d in lists[q] if not isinstance(texts.get(d), str)), None)
    if missing is not None:
        raise ValueError(f"no text for candidate document {missing!r}")
    last_use = {d: i for i, q in enumerate(live) for d in lists[q]}
    docs, count = {}, 0
    for i, qid in enumerate(tqdm(live, desc="rescore", unit="query", disable=not progress)):
        new = [d for d in lists[qid] if d not in docs]
        if new:
            docs.update(zip(new, model.encode([texts[d] for d in new], is_query=False, batch_size=batch_size,
                                              maxlen=maxlen)))
            count += len(new)
        _rank(model, encoded[qid], pad_encoded([docs[d] for d in lists[qid]], model.config.dim), lists[qid], specs,
              runs, qid)
        for d in lists[qid]:
            if last_use[d] == i:
                del docs[d]
    return runs, count


def _start(model, queries: Mapping[str, str], candidates: Mapping[str, Sequence[str]],
           strategies: Sequence[Strategy], batch_size: int):
    """(the strategies; empty runs keyed by their strings; the queries to score; their encodings) for
    :func:`rescore` and :func:`rescore_texts`."""
    specs = list(strategies)
    for docids in candidates.values():
        check_collection(docids, "candidates of a query")
    qids = [q for q in candidates if q in queries]
    runs: dict[str, Hits] = {str(s): {q: [] for q in qids} for s in specs}  # empty query or no candidates: no hits
    live = [q for q in qids if queries[q].strip() and len(candidates[q])]
    texts = [queries[q] for q in live]
    encoded = dict(zip(live, model.encode(texts, is_query=True, batch_size=batch_size))) if live else {}
    return specs, runs, live, encoded


def _rank(model, e, documents, docids: list[str], specs: list[Strategy], runs: dict[str, Hits], qid: str) -> None:
    """Rank ``docids`` (padded ``documents``: vectors [n, L, d], mask, salience) for encoded query ``e`` under every
    strategy into ``runs``; equal scores keep the order of ``docids``."""
    d, d_mask, d_sal = documents
    q = torch.from_numpy(e.vectors)[None]
    q_mask = torch.ones(1, len(e.vectors), dtype=torch.bool)
    q_sal = torch.from_numpy(e.salience)[None]
    use_salience = model.scores_with_salience
    every = alignment_scores_many(q, q_mask, d, d_mask, specs, q_sal if use_salience else None,
                                  d_sal if use_salience else None)
    for spec, scores in zip(specs, every):
        scores = scores[0].numpy()
        order = np.lexsort((np.arange(len(docids)), -scores))
        runs[str(spec)][qid] = [(docids[i], float(scores[i])) for i in order]


def strategy_table(qrels: Qrels, runs: Mapping[Hashable, Hits], metric: str = METRIC) -> dict:
    """``candidate -> qid -> metric`` for runs such as those of :func:`rescore` (``strategy -> run``)."""
    return {spec: per_query(qrels, run, metric) for spec, run in runs.items()}


def mean_scores(table: PerQuery, qids: Sequence[str]) -> dict:
    """Mean metric of each candidate over ``qids``."""
    if not qids:
        raise ValueError("no labelled queries to average over")
    return {spec: float(np.mean([values[q] for q in qids])) for spec, values in table.items()}


def paired_permutation_test(deltas, n_permutations: int = PERMUTATIONS, seed: int = 0) -> np.ndarray:
    """One-sided paired randomisation test that candidates beat a baseline; p-value per candidate.

    deltas: [n queries, m candidates] per-query differences (candidate − baseline); a 1-d array is one candidate.
    Under H0 each query's differences are as likely negated. Over sign vectors s ∈ {±1}^n, p_j is the share whose
    statistic max_i t_i(s) reaches candidate j's observed t_j, where t_i(s) is the paired t-statistic of
    (s_q · deltas[q, i])_q. For one candidate this is the sign-flip test of the mean difference; for several it is
    the single-step max-T test, so the best of m candidates is judged against the best that noise gives and a
    candidate that varies a lot does not drown one that wins by a little on every query. Queries whose
    differences are all 0 are skipped (their signs change nothing); every one of the remaining 2^n' sign vectors
    is enumerated when 2^n' <= ``n_permutations``, else ``n_permutations`` random ones (``seed``) with the observed
    signs counted once: (1 + hits) / (1 + draws). Returns [m] p-values in (0, 1] (all 1 when nothing differs).
    """
    d = np.asarray(deltas, dtype=np.float64)
    d = d[:, None] if d.ndim == 1 else d
    if d.ndim != 2:
        raise ValueError(f"deltas must be [queries] or [queries, candidates], got shape {d.shape}")
    n = len(d)  # the t-statistic counts every query, skipped or not
    d = d[np.any(d != 0, axis=1)]
    m = d.shape[1]
    if len(d) == 0:
        return np.ones(m)
    squares = (d ** 2).sum(axis=0)  # Σ_q (s_q d_q)² does not depend on the signs

    def t(sums: np.ndarray) -> np.ndarray:
        """t-statistic (up to a factor common to all candidates) from the signed sums [..., m]."""
        spread = np.sqrt(np.maximum(squares - sums ** 2 / n, 1e-12 * squares))
        return np.divide(sums, spread, out=np.zeros_like(sums), where=squares > 0)

    observed = t(d.sum(axis=0))
    slack = 1e-9 * np.maximum(1.0, np.abs(observed))  # float noise must not decide a tie
    if 2 ** len(d) <= n_permutations:
        signs = 1 - 2 * ((np.arange(2 ** len(d))[:, None] >> np.arange(len(d))) & 1)  # every vector in {±1}^n'
        best = t(signs @ d).max(axis=1)
        return (best[:, None] >= observed - slack).mean(axis=0)
    rng = np.random.default_rng(seed)
    hits = np.zeros(m)
    for start in range(0, n_permutations, 1024):
        signs = rng.choice((-1.0, 1.0), size=(min(1024, n_permutations - start), len(d)))
        hits += (t(signs @ d).max(axis=1)[:, None] >= observed - slack).sum(axis=0)
    return (1 + hits) / (1 + n_permutations)


def paired_t(deltas) -> np.ndarray:
    """Paired t-statistic (mean / (sample std / √n)) of each column of ``deltas`` [n queries, m candidates]; ±inf
    when every difference is the same non-zero number (or n = 1), 0 when all are 0."""
    d = np.asarray(deltas, dtype=np.float64)
    d = d[:, None] if d.ndim == 1 else d
    mean = d.mean(axis=0)
    std = d.std(axis=0, ddof=1) if len(d) > 1 else np.zeros(d.shape[1])
    spread = std / np.sqrt(len(d))
    varies = std > 1e-12 * np.abs(mean)
    t = np.where(mean > 0, np.inf, np.where(mean < 0, -np.inf, 0.0))
    return np.divide(mean, spread, out=np.where(varies, 0.0, t), where=varies & (spread > 0))


@dataclass
class Choice:
    """The candidate chosen on some labelled queries, and why."""

    chosen: Hashable  # the baseline, unless a candidate wins clearly
    baseline: Hashable
    means: dict  # candidate -> mean metric on the labelled queries
    p_values: dict  # candidate -> one-sided max-T p-value of its gain over the baseline (baseline: 1)
    queries: int  # how many labelled queries
    t_values: dict = field(default_factory=dict)  # candidate -> paired t-statistic of its gain (baseline: 0)

    @property
    def changed(self) -> bool:
        return self.chosen != self.baseline

    @property
    def best(self) -> Hashable:
        """The candidate with the best mean (ties: the baseline, then the earlier one)."""
        order = [self.baseline] + [s for s in self.means if s != self.baseline]
        return max(order, key=lambda s: (self.means[s], -order.index(s)))

    def gain(self, candidate: Hashable | None = None) -> float:
        """Mean gain of ``candidate`` (default: the best) over the baseline on the labelled queries."""
        return self.means[self.best if candidate is None else candidate] - self.means[self.baseline]


def choose(table: PerQuery, qids: Sequence[str], baseline: Hashable, alpha: float = ALPHA,
           min_gain: float = MIN_GAIN, n_permutations: int = PERMUTATIONS, seed: int = 0) -> Choice:
    """The candidate to use after seeing ``table`` (``candidate -> qid -> metric``, ``baseline`` one of its keys;
    a candidate is a strategy spec or a :class:`Candidate`) on ``qids``.

    A candidate qualifies when its mean gain over ``baseline`` is positive and >= ``min_gain`` (metric units:
    0.005 = 0.5 point) and its :func:`paired_permutation_test` p-value over the per-query differences (max-T over
    every candidate but the baseline) is <= ``alpha``; the qualifying candidate with the best mean wins (ties: the
    earlier one in ``table``), else the baseline is kept.
    """
    if baseline not in table:
        raise ValueError(f"baseline {baseline} is not among the candidates scored: {', '.join(map(str, table))}")
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    if min_gain < 0:
        raise ValueError(f"min_gain must be >= 0, got {min_gain}")
    means = mean_scores(table, qids)
    others = [s for s in table if s != baseline]
    p_values, t_values = {baseline: 1.0}, {baseline: 0.0}
    if others:
        deltas = np.array([[table[s][q] - table[baseline][q] for s in others] for q in qids])
        p_values.update(zip(others, (float(p) for p in paired_permutation_test(deltas, n_permutations, seed))))
        t_values.update(zip(others, (float(t) for t in paired_t(deltas))))
    winners = [s for s in others if (gain := means[s] - means[baseline]) > 0 and gain >= min_gain - 1e-12
               and p_values[s] <= alpha]
    chosen = max(winners, key=lambda s: (means[s], -others.index(s))) if winners else baseline
    return Choice(chosen, baseline, means, {s: p_values[s] for s in table}, len(qids),
                  {s: t_values[s] for s in table})


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
    queries: list[str]  # the labelled queries of the choice
    choice: Choice
    held_out: float  # mean metric of the chosen candidate on every other query
    held_out_baseline: float  # the baseline's on the same queries

    @property
    def chosen(self) -> Hashable:
        return self.choice.chosen

    @property
    def delta(self) -> float:
        """What the choice did on the held-out queries: held_out − held_out_baseline (0 when the baseline is kept)."""
        return self.held_out - self.held_out_baseline


@dataclass
class Adaptation:
    folds: list[Fold]
    assignment: dict  # qid -> a candidate chosen on a fold without that query
    baseline: Hashable

    @property
    def mean(self) -> float:
        """Mean of held_out over folds."""
        return float(np.mean([f.held_out for f in self.folds]))

    @property
    def std(self) -> float:
        """Population standard deviation of held_out over folds."""
        return float(np.std([f.held_out for f in self.folds]))

    @property
    def changed(self) -> list[Fold]:
        """The folds whose choice is not the baseline."""
        return [f for f in self.folds if f.choice.changed]

    @property
    def changed_delta(self) -> float | None:
        """Mean held-out gain over the baseline on the changed folds (None when no fold changed)."""
        return mean_delta(self.changed)

    def chosen_counts(self) -> dict:
        counts: dict = {}
        for fold in self.folds:
            counts[fold.chosen] = counts.get(fold.chosen, 0) + 1
        return counts

    def candidates(self) -> list:
        """The baseline and every candidate chosen on a fold or assigned to a query."""
        return list(dict.fromkeys([self.baseline, *(f.chosen for f in self.folds), *self.assignment.values()]))

    def scored(self, scores: PerQuery) -> "Adaptation":
        """The same choices with held_out recomputed from ``scores`` (``candidate -> qid -> metric`` holding
        :meth:`candidates` on every query), e.g. the per-query metric of the runs actually served."""
        qids = sorted(self.assignment)
        return replace(self, folds=[_held_out(f.queries, f.choice, scores, qids) for f in self.folds])


def mean_delta(folds: Sequence[Fold]) -> float | None:
    """Mean held-out gain over the baseline of ``folds`` (None when there are none)."""
    return float(np.mean([f.delta for f in folds])) if folds else None


def _held_out(fold_qids: list[str], choice: Choice, scores: PerQuery, qids: Sequence[str]) -> Fold:
    inside = set(fold_qids)
    rest = [q for q in qids if q not in inside]
    for key in (choice.chosen, choice.baseline):
        missing = [q for q in rest if q not in scores.get(key, {})]
        if missing:
            raise ValueError(f"no {key} scores for {len(missing)} held-out queries (e.g. {missing[0]!r})")
    means = mean_scores({s: scores[s] for s in (choice.chosen, choice.baseline)}, rest)
    return Fold(list(fold_qids), choice, means[choice.chosen], means[choice.baseline])


def few_shot_adaptation(table: PerQuery, baseline: Hashable, fold_size: int = 8, seed: int = 0, alpha: float = ALPHA,
                        min_gain: float = MIN_GAIN, n_permutations: int = PERMUTATIONS) -> Adaptation:
    """Per fold of :func:`make_folds`: :func:`choose` on the fold, scored on all other queries.

    ``table``: ``candidate -> qid -> metric`` over the same queries, ``baseline`` among them. ``assignment`` gives
    each query the candidate of the next fold (fold i → fold i+1, remainder queries → fold 0; with a single fold,
    the choice made on the other queries), so that a run built from it is never tuned on the query it ranks.
    """
    if not table:
        raise ValueError("no candidates to choose from")
    qids = sorted(next(iter(table.values())))
    for key, values in table.items():
        if sorted(values) != qids:
            raise ValueError(f"candidate {str(key)!r} is scored on other queries than {str(next(iter(table)))!r}")
    test = {"baseline": baseline, "alpha": alpha, "min_gain": min_gain, "n_permutations": n_permutations}
    folds_q = make_folds(qids, fold_size, seed)
    choices = [choose(table, fold_qids, seed=seed, **test) for fold_qids in folds_q]
    fold_of = {q: i for i, fold_qids in enumerate(folds_q) for q in fold_qids}
    assignment = {}
    for q in qids:
        i = fold_of.get(q)
        if i is None:
            assignment[q] = choices[0].chosen
        elif len(choices) > 1:
            assignment[q] = choices[(i + 1) % len(choices)].chosen
        else:
            assignment[q] = choose(table, [r for r in qids if r not in fold_of], seed=seed, **test).chosen
    folds = [_held_out(fold_qids, choice, table, qids) for fold_qids, choice in zip(folds_q, choices)]
    return Adaptation(folds, assignment, choices[0].baseline)
