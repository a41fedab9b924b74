"""Evaluation over plain data with ranx: qrels and runs are ``qid -> {docid: value}`` dicts."""
from __future__ import annotations

import warnings
from typing import Mapping

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

