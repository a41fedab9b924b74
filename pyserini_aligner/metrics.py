"""Retrieval metrics over plain dicts: qrels ``qid -> {docid: relevance}``, runs ``qid -> {docid: score}`` or
``qid -> [(docid, score), ...]`` (hit lists, best first).

nDCG@k and recall@k are small pure functions by ranx's rules, which the tests hold equal to ranx: every metric is
averaged over the queries of the qrels; a query missing from the run, or without hits, scores 0, and so does a
judged query without a relevant document; linear gain and log2 discount for nDCG, as trec_eval; equal scores keep
the run's order. They load nothing: ranx loads its compiled kernels and types its arrays in every process (seconds
each). The t-test and fusion are ranx's own (:func:`significance`, :func:`to_ranx_run`); Fisher's randomisation
test is :func:`fisher_randomization` (ranx's definition, seeded here: ranx draws its permutations in parallel
threads whose random streams its seed does not fix, so its p-values differ from run to run).
"""
from __future__ import annotations

import math
import warnings
from typing import Iterable, Mapping, Sequence

METRICS = ("ndcg@10", "recall@100", "recall@1000")

Qrels = Mapping[str, Mapping[str, int]]
Run = Mapping[str, Mapping[str, float] | Iterable]


def as_run(run: Run) -> dict[str, dict[str, float]]:
    """``qid -> {docid: score}`` from a run of score dicts or of hit lists (``(docid, score)`` pairs or Pyserini
    hits with ``.docid``/``.score``); a docid listed twice keeps its first (best) score."""
    out = {}
    for qid, hits in run.items():
        if isinstance(hits, Mapping):
            out[qid] = {str(d): float(s) for d, s in hits.items()}
            continue
        docs: dict[str, float] = {}
        for hit in hits:
            docid, score = (hit.docid, hit.score) if hasattr(hit, "docid") else hit
            docs.setdefault(str(docid), float(score))
        out[qid] = docs
    return out


# numba types ranx's docid arrays by their width in characters and compiles its kernels again for every new width;
# ranx sizes them to the longest docid, so docids are held at the next of these widths instead (warm_up compiles the
# first two, the widths of the tests' docids)
DOCID_WIDTHS = (8, 16, 32, 64, 128, 256)
# ranx's TREC file readers keep exact docid widths: warm_up compiles those of the TREC files that the tests read with
# ranx (the longest docid of the quick start's run and qrels has 7 characters, of the fusion recipe's runs 6)
FILE_DOCID_WIDTHS = (6, 7)


def _ranx_object(cls, data: Mapping[str, Mapping[str, float]], dtype: type, name: str | None = None):
    """A ranx ``Qrels`` (dtype int) or ``Run`` (float) of ``data`` (qid -> {docid: value}), built as ranx's own
    constructor builds it but with docids in arrays of a DOCID_WIDTHS width."""
    import numpy as np
    from numba.typed import List as TypedList
    from ranx.data_structures.common import create_and_sort

    longest = max((len(d) for docs in data.values() for d in docs), default=0)
    if not longest:
        return cls(dict(data), name=name)  # ranx's own error for a mapping without any docid
    width = next((w for w in DOCID_WIDTHS if longest <= w), longest)
    obj = cls(name=name)
    table = create_and_sort(TypedList(list(data)),
                            TypedList([np.array(list(docs), dtype=f"<U{width}") for docs in data.values()]),
                            TypedList([np.array(list(docs.values()), dtype=dtype) for docs in data.values()]))
    setattr(obj, "qrels" if dtype is int else "run", table)
    obj.sorted = True
    return obj


def to_ranx_run(run: Run, name: str = "run"):
    """``run`` as a ranx ``Run`` (queries without hits left out: ranx rejects empty result lists)."""
    from ranx import Run as RRun

    return _ranx_object(RRun, {q: d for q, d in as_run(run).items() if d}, float, name=name)


def per_query(qrels: Qrels, run: Run, metric: str = "ndcg@10") -> dict[str, float]:
    """``metric`` (``ndcg@k`` or ``recall@k``) of every query of the qrels."""
    name, _, cut = metric.partition("@")
    if name not in ("ndcg", "recall") or not cut.isdigit() or int(cut) < 1:
        raise ValueError(f"metric {metric!r}: expected ndcg@k or recall@k (k >= 1)")
    k, ranked, out = int(cut), as_run(run), {}
    for qid, judged in qrels.items():
        hits = sorted(ranked.get(qid, {}).items(), key=lambda item: -item[1])[:k]
        gains = [judged.get(docid, 0) for docid, _ in hits]
        relevant = sorted((r for r in judged.values() if r > 0), reverse=True)
        if not relevant:
            out[qid] = 0.0
        elif name == "recall":
            out[qid] = sum(g > 0 for g in gains) / len(relevant)
        else:
            dcg = sum(g / math.log2(i + 2) for i, g in enumerate(gains) if g > 0)
            out[qid] = dcg / sum(g / math.log2(i + 2) for i, g in enumerate(relevant[:k]))
    return out


def evaluate(qrels: Qrels, run: Run, metrics: Sequence[str] = METRICS) -> dict[str, float]:
    """Mean of each metric over the qrels' queries."""
    if not qrels:
        raise ValueError("no judged queries to evaluate")
    return {m: sum(values.values()) / len(values) for m in metrics for values in [per_query(qrels, run, m)]}



SIGNIFICANCE_METRICS = ("ndcg@10", "recall@100")
TESTS = {"student": "two-sided paired Student's t-test", "fisher": "Fisher's randomization test (two-sided)"}


def significance(qrels: Qrels, runs: Mapping[str, Run], baselines: Sequence[str],
                 metrics: Sequence[str] = SIGNIFICANCE_METRICS, n_permutations: int = 10000, max_p: float = 0.05,
                 seed: int = 42) -> dict:
    """Every run against each of ``baselines``, both tests of TESTS: ranx ``compare``'s t-test (make_comparable=True)
    and :func:`fisher_randomization` over ranx's per-query scores.

    Returns {"tests", "metrics", "max_p", "n_permutations", "pairs": {system: {baseline: {metric: {"delta",
    "p_student", "p_fisher", "win", "tie", "loss"}}}}}; win/tie/loss count queries where the system beats, ties or
    loses to the baseline. Baselines missing from ``runs`` are skipped.
    """
    import numpy as np
    from ranx import compare, evaluate as ranx_evaluate

    names = list(runs)
    present = [b for b in baselines if b in runs]
    out = {"tests": dict(TESTS), "metrics": list(metrics), "max_p": max_p, "n_permutations": n_permutations,
           "baselines": present, "pairs": {}}
    if not present or len(names) < 2:
        return out
    from ranx import Qrels as RQrels

    rq = _ranx_object(RQrels, qrels, int)
    rruns = [to_ranx_run(runs[name], name=name) for name in names]  # a query with no hits: 0 (make_comparable)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        student = compare(rq, rruns, list(metrics), stat_test="student", max_p=max_p,
                          make_comparable=True).to_dict()
        per_query = {name: {m: np.asarray(ranx_evaluate(rq, run, [m], return_mean=False, make_comparable=True))
                            for m in metrics} for name, run in zip(names, rruns)}
    for name in names:
        rows = {}
        for base in present:
            if base == name or (name in present and present.index(name) < present.index(base)):
                continue  # a baseline is compared with the baselines listed before it only
            rows[base] = {}
            for metric in metrics:
                wtl = student[name]["win_tie_loss"][base][metric]
                rows[base][metric] = {
                    "delta": round(student[name]["scores"][metric] - student[base]["scores"][metric], 4),
                    "p_student": _p_value(student[name]["comparisons"][base][metric]),
                    "p_fisher": _p_value(fisher_randomization(per_query[base][metric], per_query[name][metric],
                                                              n_permutations, seed)),
                    "win": wtl["W"], "tie": wtl["T"], "loss": wtl["L"]}
        if rows:
            out["pairs"][name] = rows
    return out


def fisher_randomization(control, treatment, n_permutations: int = 10000, seed: int = 42) -> float:
    """Two-sided Fisher randomisation test of paired per-query scores (control, treatment: [n] each), as ranx
    defines it: the share of ``n_permutations`` random relabellings (each query's two scores swapped with
    probability 1/2, drawn from ``seed``) whose |difference of means| reaches the observed one (to float rounding).
    The same arguments give the same p on every machine."""
    import numpy as np

    d = np.asarray(treatment, dtype=np.float64) - np.asarray(control, dtype=np.float64)
    if d.ndim != 1 or len(d) == 0:
        raise ValueError(f"per-query scores must be two equal non-empty vectors, got differences of shape {d.shape}")
    observed = abs(d.sum())
    slack = 1e-9 * max(1.0, observed)  # float noise must not decide a tie
    rng = np.random.default_rng(seed)
    hits = 0
    for start in range(0, n_permutations, 1024):
        signs = rng.choice((-1.0, 1.0), size=(min(1024, n_permutations - start), len(d)))
        hits += int((np.abs(signs @ d) >= observed - slack).sum())
    return hits / n_permutations


def _p_value(value) -> float | None:
    """Rounded p-value; None where the test is undefined (a t-test over identical per-query scores)."""
    value = float(value)
    return None if math.isnan(value) else round(value, 4)


def warm_up(widths: Sequence[int] = (8, 16)) -> None:
    """Compile ranx's numba kernels (numba caches them in the environment, so later processes load them instead of
    compiling; ``make test`` runs this before its test workers start): for docids held at ``widths``
    (DOCID_WIDTHS) characters both significance tests (and the metrics they compute) and RRF and min-max fusion;
    TREC file reading, evaluation, fusion and writing (the README's and the fusion recipe's ranx lines) for docids of
    FILE_DOCID_WIDTHS characters."""
    import tempfile

    from ranx import Qrels as RQrels, Run as RRun, evaluate as ranx_evaluate, fuse

    for width in widths:
        def doc(i: int) -> str:
            return str(i).rjust(width, "d")

        qrels = {"a": {doc(1): 1, doc(3): 2}, "b": {doc(2): 1}, "c": {doc(3): 0}}
        runs = {n: {"a": [(doc(1), s), (doc(2), 1.0)], "b": [(doc(2), 2.0), (doc(1), s)]}
                for n, s in (("x", 2.0), ("y", 0.5))}
        significance(qrels, runs, ["x"], n_permutations=10)
        first, second = (to_ranx_run(runs[n], name=n) for n in ("x", "y"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fuse([first, second], norm=None, method="rrf", params={"k": 60})
            fuse([first, second], norm="min-max", method="wsum", params={"weights": [0.5, 0.5]})
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qrels_file, run_file = f"{folder}/qrels.txt", f"{folder}/run.trec"
        for width in FILE_DOCID_WIDTHS:  # ranx's file readers size docids to the longest one
            docs = [str(i).rjust(width, "d") for i in range(1, 4)]
            with open(qrels_file, "w", encoding="utf-8") as out:
                out.writelines(f"q 0 {d} {r}\n" for d, r in zip(docs, (1, 0, 2)))
            with open(run_file, "w", encoding="utf-8") as out:
                out.writelines(f"q Q0 {d} {rank} {1.0 / rank} x\n" for rank, d in enumerate(docs, 1))
            run = RRun.from_file(run_file, kind="trec")
            ranx_evaluate(RQrels.from_file(qrels_file, kind="trec"), run, "ndcg@10", make_comparable=True)
            fuse([run, RRun.from_file(run_file, kind="trec")], method="rrf").save(run_file, kind="trec")
