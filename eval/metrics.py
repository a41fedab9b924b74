"""Evaluation over plain data with ranx: qrels and runs are ``qid -> {docid: value}`` dicts."""
from __future__ import annotations

import math
import warnings
from typing import Mapping, Sequence

METRICS = ("ndcg@10", "recall@100", "recall@1000")

Qrels = Mapping[str, Mapping[str, int]]
RunDict = Mapping[str, Mapping[str, float]]


def _ranx(qrels: Qrels, run: RunDict, name: str = "run"):
    from ranx import Qrels as RQrels, Run as RRun

    # ranx rejects empty result lists; a query with no hits scores 0 through make_comparable
    return RQrels({q: dict(d) for q, d in qrels.items()}), RRun({q: dict(d) for q, d in run.items() if d}, name=name)


def evaluate(qrels: Qrels, run: RunDict, metrics: tuple[str, ...] = METRICS) -> dict[str, float]:
    """Mean of each metric over the qrels' queries (missing queries score 0)."""
    from ranx import evaluate as ranx_evaluate

    rq, rr = _ranx(qrels, run)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # numba's uint64 cast notice inside ranx
        scores = ranx_evaluate(rq, rr, list(metrics), make_comparable=True)
    if len(metrics) == 1:
        scores = {metrics[0]: scores}
    return {name: float(value) for name, value in scores.items()}



SIGNIFICANCE_METRICS = ("ndcg@10", "recall@100")
TESTS = {"student": "two-sided paired Student's t-test", "fisher": "Fisher's randomization test (two-sided)"}


def significance(qrels: Qrels, runs: Mapping[str, RunDict], baselines: Sequence[str],
                 metrics: Sequence[str] = SIGNIFICANCE_METRICS, n_permutations: int = 10000, max_p: float = 0.05,
                 seed: int = 42) -> dict:
    """Every run against each of ``baselines`` with ranx ``compare`` (make_comparable=True), both tests of TESTS.

    Returns {"tests", "metrics", "max_p", "n_permutations", "pairs": {system: {baseline: {metric: {"delta",
    "p_student", "p_fisher", "win", "tie", "loss"}}}}}; win/tie/loss count queries where the system beats, ties or
    loses to the baseline. Baselines missing from ``runs`` are skipped.
    """
    from ranx import compare

    names = list(runs)
    present = [b for b in baselines if b in runs]
    out = {"tests": dict(TESTS), "metrics": list(metrics), "max_p": max_p, "n_permutations": n_permutations,
           "baselines": present, "pairs": {}}
    if not present or len(names) < 2:
        return out
    from ranx import Qrels as RQrels

    rq = RQrels({q: dict(d) for q, d in qrels.items()})
    rruns = [_ranx(qrels, runs[name], name=name)[1] for name in names]
    reports = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for test in TESTS:
            reports[test] = compare(rq, rruns, list(metrics), stat_test=test, n_permutations=n_permutations,
                                    max_p=max_p, random_seed=seed, make_comparable=True).to_dict()
    for name in names:
        rows = {}
        for base in present:
            if base == name or (name in present and present.index(name) < present.index(base)):
                continue  # a baseline is compared with the baselines listed before it only
            rows[base] = {}
            for metric in metrics:
                wtl = reports["student"][name]["win_tie_loss"][base][metric]
                rows[base][metric] = {
                    "delta": round(reports["student"][name]["scores"][metric]
                                   - reports["student"][base]["scores"][metric], 4),
                    **{f"p_{test}": _p_value(reports[test][name]["comparisons"][base][metric]) for test in TESTS},
                    "win": wtl["W"], "tie": wtl["T"], "loss": wtl["L"]}
        if rows:
            out["pairs"][name] = rows
    return out


def _p_value(value) -> float | None:
    """Rounded p-value; None where the test is undefined (a t-test over identical per-query scores)."""
    value = float(value)
    return None if math.isnan(value) else round(value, 4)


def rrf_fuse(runs: Sequence[Mapping[str, Sequence[tuple[str, float]]]], k: int = 1000,
             rrf_k: int = 60) -> dict[str, list[tuple[str, float]]]:
    """Reciprocal rank fusion with ranx ``fuse(method="rrf")``: Σ 1/(rrf_k + rank); ``qid -> [(docid, score)]``
    top ``k``. A query with hits in only some runs is fused over those."""
    from ranx import Run as RRun, fuse

    qids = list(dict.fromkeys(q for run in runs for q in run))
    full = [q for q in qids if all(run.get(q) for run in runs)]
    fused: dict[str, dict[str, float]] = {}
    if full:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = fuse([RRun({q: dict(run[q]) for q in full}) for run in runs], norm=None, method="rrf",
                          params={"k": rrf_k})
        fused = {q: dict(result[q]) for q in full}
    for q in qids:
        if q not in fused:
            scores: dict[str, float] = {}
            for run in runs:
                for rank, (docid, _) in enumerate(sorted(run.get(q, []), key=lambda h: -h[1]), 1):
                    scores[docid] = scores.get(docid, 0.0) + 1.0 / (rrf_k + rank)
            fused[q] = scores
    return {q: sorted(((d, float(s)) for d, s in fused[q].items()), key=lambda h: (-h[1], h[0]))[:k] for q in qids}
