"""pyserini_aligner.metrics against slow, obvious definitions of the metrics and against ranx."""
import math
import random

import pytest

from pyserini_aligner.metrics import as_run, evaluate, per_query


def ranked(docs: dict[str, float]) -> list[str]:
    """Best first (the runs below have no equal scores: ranx's order among ties is its own)."""
    return sorted(docs, key=docs.get, reverse=True)


def slow_ndcg(run: dict, qrels: dict, k: int) -> dict[str, float]:
    out = {}
    for qid, judged in qrels.items():
        gains = [max(judged.get(d, 0), 0) for d in ranked(run.get(qid, {}))[:k]]
        dcg = sum(g / math.log2(rank + 2) for rank, g in enumerate(gains))
        ideal = sorted((r for r in judged.values() if r > 0), reverse=True)[:k]
        idcg = sum(g / math.log2(rank + 2) for rank, g in enumerate(ideal))
        out[qid] = dcg / idcg if idcg else 0.0
    return out


def slow_recall(run: dict, qrels: dict, k: int) -> dict[str, float]:
    out = {}
    for qid, judged in qrels.items():
        relevant = {d for d, r in judged.items() if r > 0}
        found = set(ranked(run.get(qid, {}))[:k]) & relevant
        out[qid] = len(found) / len(relevant) if relevant else 0.0
    return out


@pytest.fixture(scope="module")
def data():
    rng = random.Random(7)
    docs = [f"d{i:07d}" for i in range(120)]  # 8 characters: ranx's kernels for that width compile at install
    qrels = {f"q{q}": {d: rng.choice([0, 1, 1, 2, 3]) for d in rng.sample(docs, rng.randint(1, 15))}
             for q in range(40)}
    qrels["q0"] = {docs[1]: 0, docs[2]: 0}  # judged, nothing relevant
    run = {qid: {d: rng.random() + 0.3 * qrels[qid].get(d, 0) for d in rng.sample(docs, rng.randint(1, 110))}
           for qid in list(qrels)[:36]}  # relevant documents tend to rank higher  # four judged queries have no run
    run["q5"] = {}
    return qrels, run


@pytest.mark.parametrize("metric, slow, k", [("ndcg@10", slow_ndcg, 10), ("ndcg@3", slow_ndcg, 3),
                                             ("recall@100", slow_recall, 100), ("recall@5", slow_recall, 5)])
def test_metrics_equal_their_definitions_and_ranx(data, metric, slow, k):
    """The metrics equal the slow definitions, and ranx's evaluate on the same qrels and run."""
    from ranx import Qrels, Run, evaluate as ranx_evaluate

    qrels, run = data
    reference = slow(run, qrels, k)
    assert per_query(qrels, run, metric) == pytest.approx(reference, abs=1e-12)
    mean = sum(reference.values()) / len(qrels)
    assert 0.05 < mean < 0.95
    assert evaluate(qrels, run, (metric,)) == {metric: pytest.approx(mean, abs=1e-12)}
    rq = Qrels(qrels)
    theirs = ranx_evaluate(rq, Run({q: d for q, d in run.items() if d}), metric, return_mean=False,
                           make_comparable=True)
    assert per_query(qrels, run, metric) == pytest.approx(dict(zip(rq.keys(), map(float, theirs))), abs=1e-12)


def test_unknown_metrics_are_refused(data):
    qrels, run = data
    for bad in ("map@10", "ndcg", "ndcg@0", "recall@x"):
        with pytest.raises(ValueError, match="expected ndcg@k or recall@k"):
            per_query(qrels, run, bad)


def test_hit_lists_are_runs(data):
    qrels, run = data
    hits = {q: sorted(docs.items(), key=lambda h: -h[1]) for q, docs in run.items()}
    assert evaluate(qrels, hits) == evaluate(qrels, run)
    assert as_run({"q": [("a", 2.0), ("b", 1.0), ("a", 0.5)]}) == {"q": {"a": 2.0, "b": 1.0}}  # first score wins
    with pytest.raises(ValueError, match="no judged queries"):
        evaluate({}, run)


def test_ranx_objects_equal_ranx_constructors():
    """Docids held at a fixed width (so numba reuses its compiled kernels) give ranx's own Qrels and Run."""
    from ranx import Qrels, Run

    from pyserini_aligner.metrics import DOCID_WIDTHS, _ranx_object

    qrels = {"q1": {"MED-10": 2, "MED-3": 0}, "q2": {"x": 1}}
    run = {"q1": {"MED-3": 0.5, "MED-10": 0.9, "long-" + "y" * 11: 0.1}, "q2": {"x": 1.0}}  # longest: 16 characters
    for ours, theirs in ((_ranx_object(Qrels, qrels, int), Qrels(qrels)),
                         (_ranx_object(Run, run, float, name="r"), Run(run, name="r"))):
        assert ours.to_dict() == theirs.to_dict() and ours.sorted and ours.name == theirs.name
    assert DOCID_WIDTHS == tuple(sorted(DOCID_WIDTHS))


def exact_fisher(control: list[float], treatment: list[float]) -> float:
    """Two-sided randomisation p over every one of the 2^n relabellings (each query's scores swapped or not)."""
    n = len(control)
    observed = abs(sum(treatment) - sum(control))
    hits = 0
    for mask in range(2 ** n):
        diff = sum((c - t) if mask >> i & 1 else (t - c) for i, (c, t) in enumerate(zip(control, treatment)))
        hits += abs(diff) >= observed - 1e-12
    return hits / 2 ** n


def test_fisher_randomization_estimates_the_exact_test_and_repeats_itself():
    from pyserini_aligner.metrics import fisher_randomization

    rng = random.Random(3)
    control = [rng.random() for _ in range(10)]
    treatment = [c + rng.gauss(0.1, 0.2) for c in control]
    p = fisher_randomization(control, treatment, n_permutations=100_000, seed=5)
    assert abs(p - exact_fisher(control, treatment)) < 0.01  # the estimate's standard error is under 0.002
    assert fisher_randomization(control, treatment, 5000, 1) == fisher_randomization(control, treatment, 5000, 1)
    assert fisher_randomization(treatment, control, 5000, 1) == fisher_randomization(control, treatment, 5000, 1)
    assert fisher_randomization(control, control, 1000) == 1.0  # nothing differs: every relabelling ties
    with pytest.raises(ValueError, match="per-query scores"):
        fisher_randomization([], [])


def test_significance_gives_the_same_p_values_with_any_number_of_threads(data):
    import numba

    from pyserini_aligner.metrics import significance

    qrels, run = data
    other = {q: {d: s * (1.3 if i % 3 else 0.7) for i, (d, s) in enumerate(docs.items())} for q, docs in run.items()}
    runs = {"a": run, "b": other}
    before = numba.get_num_threads()
    try:
        reports = []
        for threads in (1, before):
            numba.set_num_threads(threads)
            reports.append(significance(qrels, runs, ["a"], n_permutations=2000))
    finally:
        numba.set_num_threads(before)
    assert reports[0] == reports[1]
    cell = reports[0]["pairs"]["b"]["a"]["ndcg@10"]
    assert 0.0 <= cell["p_fisher"] <= 1.0 and cell["win"] + cell["tie"] + cell["loss"] == len(qrels)
