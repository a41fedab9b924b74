"""Few-shot alignment adaptation: the fold logic on hand-made scores, and the CLI on the harness's index."""
import itertools
import shutil

import numpy as np
import pytest

from harness_support import harness_context, harness_run

from pyserini_aligner.adapt.__main__ import main
from pyserini_aligner.adapt.inputs import labelled_topics
from pyserini_aligner.data import read_qrels
from pyserini_aligner.adapt.select import (choose_strategy, few_shot_adaptation, make_folds,
                                           paired_permutation_test, per_query, rescore, strategy_table)
from pyserini_aligner.data import Dataset
from pyserini_aligner.index.store import read_manifest, set_default_strategy


def test_make_folds_is_seeded_and_drops_the_remainder():
    qids = [f"q{i}" for i in range(20)]
    folds = make_folds(qids, 8, seed=0)
    assert [len(f) for f in folds] == [8, 8]
    assert len(set(folds[0]) | set(folds[1])) == 16
    assert folds == make_folds(list(reversed(qids)), 8, seed=0)  # input order does not matter
    assert folds != make_folds(qids, 8, seed=1)
    with pytest.raises(ValueError, match="more than fold_size=8"):
        make_folds(qids[:8], 8)


def sign_flip_reference(deltas: np.ndarray) -> list[float]:
    """Max-T one-sided p-values by listing every sign vector: the share of them whose largest paired t-statistic
    (mean / (sample std / √n)) over the candidates reaches each candidate's observed one."""
    def t(x: np.ndarray) -> float:
        return float(x.mean() / (x.std(ddof=1) / np.sqrt(len(x))))

    observed = [t(deltas[:, j]) for j in range(deltas.shape[1])]
    flips = [max(t(np.asarray(s) * deltas[:, j]) for j in range(deltas.shape[1]))
             for s in itertools.product((1, -1), repeat=len(deltas))]
    return [float(np.mean([f >= o - 1e-9 for f in flips])) for o in observed]


def test_paired_permutation_test_matches_exact_enumeration():
    assert paired_permutation_test([0.1, 0.1, 0.1]).tolist() == [1 / 8]  # only the observed signs reach it
    assert paired_permutation_test([0.2, -0.2]).tolist() == [3 / 4]  # sums 0.4, 0, 0, -0.4 against 0
    assert paired_permutation_test([0.3, -0.1, 0.2]).tolist() == [2 / 8]  # sums ≥ 0.4: 0.6 and 0.4 (+0.3 −0.1 +0.2)
    assert paired_permutation_test([0.0, 0.0]).tolist() == [1.0]
    rng = np.random.default_rng(7)
    for n, m in ((5, 1), (7, 3), (9, 8)):
        deltas = rng.normal(0.05, 0.2, size=(n, m))
        deltas[rng.random(size=(n, m)) < 0.3] = 0.0  # ties are common between strategies
        assert paired_permutation_test(deltas) == pytest.approx(sign_flip_reference(deltas), abs=1e-12)
    deltas = np.vstack([deltas, np.zeros((3, 8))])  # queries where no strategy differs: skipped, still counted
    assert paired_permutation_test(deltas) == pytest.approx(sign_flip_reference(deltas), abs=1e-12)
    # the best of several candidates is judged against the best that noise gives: a larger p than alone
    best = int(np.argmax(deltas.sum(axis=0)))
    assert paired_permutation_test(deltas)[best] > paired_permutation_test(deltas[:, best])[0]


def test_paired_permutation_test_samples_when_enumeration_is_too_long():
    rng = np.random.default_rng(3)
    deltas = rng.normal(0.1, 0.3, size=(14, 2))
    exact = paired_permutation_test(deltas, n_permutations=2 ** 14)
    sampled = paired_permutation_test(deltas, n_permutations=4000, seed=1)
    assert sampled == pytest.approx(exact, abs=0.03) and not np.array_equal(sampled, exact)
    assert np.array_equal(sampled, paired_permutation_test(deltas, n_permutations=4000, seed=1))
    assert paired_permutation_test(np.full(30, 0.1), n_permutations=999).tolist() == [1 / 1000]
    with pytest.raises(ValueError, match="deltas must be"):
        paired_permutation_test(np.zeros((2, 2, 2)))


QUERIES = [f"q{i:02d}" for i in range(8)]
BASE = dict(zip(QUERIES, (0.2, 0.9, 0.5, 0.4, 0.7, 0.3, 0.6, 0.8)))


def shifted(deltas) -> dict[str, float]:
    return {q: BASE[q] + d for q, d in zip(QUERIES, deltas)}


def test_choose_strategy_keeps_the_default_when_candidates_win_by_noise():
    noise = shifted((0.2, -0.1, 0.2, -0.1, 0.2, -0.1, 0.2, -0.1))  # mean +0.05: half the queries lose
    tiny = shifted([0.001] * 8)  # wins every query, by 0.1 point
    table = {"top-k:1": BASE, "top-k:2": noise, "top-p:0.01": tiny}
    choice = choose_strategy(table, QUERIES, "top-k:1")
    assert choice.strategy == "top-k:1" and not choice.changed
    assert choice.best == "top-k:2" and choice.gain() == pytest.approx(0.05)
    assert choice.p_values["top-k:2"] > 0.3  # 92 of the 256 sign vectors reach its t-statistic
    # top-p:0.01 wins every query: as significant as 8 queries can be, but by less than 0.5 point
    assert choice.p_values["top-p:0.01"] == 1 / 256 and choice.gain("top-p:0.01") == pytest.approx(0.001)
    # picking the best mean, as without the test, would have switched
    assert choose_strategy(table, QUERIES, "top-k:1", alpha=1.0, min_gain=0.0).strategy == "top-k:2"
    same = {"top-k:1": BASE, "top-p:0.005": dict(BASE)}  # a tie never replaces the default
    assert choose_strategy(same, QUERIES, "top-k:1", alpha=1.0, min_gain=0.0).strategy == "top-k:1"
    with pytest.raises(ValueError, match="baseline strategy top-k:4 is not among"):
        choose_strategy(table, QUERIES, "top-k:4")


def test_choose_strategy_switches_when_a_candidate_wins_clearly():
    clear = shifted((0.1, 0.05, 0.1, 0.08, 0.1, 0.06, 0.1, 0.03))  # every query, mean +0.0775
    table = {"top-k:1": BASE, "top-k:2": shifted((0.05, 0.0, 0.0, 0.02, 0.0, 0.0, 0.01, 0.0)), "top-k:4": clear}
    choice = choose_strategy(table, QUERIES, "top-k:1")
    assert choice.strategy == "top-k:4" and choice.changed
    assert choice.p_values["top-k:4"] == pytest.approx(1 / 256)  # only the observed signs reach its sum
    assert choice.gain("top-k:4") == pytest.approx(0.0775)
    assert choose_strategy(table, QUERIES, "top-k:1", min_gain=0.08).strategy == "top-k:1"
    assert choose_strategy(table, QUERIES, "top-k:1", alpha=0.001).strategy == "top-k:1"


def test_few_shot_adaptation_on_a_hand_made_case():
    qids = [f"q{i:02d}" for i in range(20)]
    folds = make_folds(qids, 8, seed=0)
    # "A" is perfect on fold 0 only, "B" on fold 1 only, the baseline "C" scores 0.5 everywhere
    table = {"C": {q: 0.5 for q in qids},
             "A": {q: 1.0 if q in folds[0] else 0.0 for q in qids},
             "B": {q: 1.0 if q in folds[1] else 0.0 for q in qids}}
    result = few_shot_adaptation(table, "C", fold_size=8, seed=0)
    assert [f.queries for f in result.folds] == folds
    assert [f.strategy for f in result.folds] == ["A", "B"]
    assert [f.choice.means[f.strategy] for f in result.folds] == [1.0, 1.0]
    # max-T over A and B: all 8 signs kept, or all flipped (B's deltas are -0.5 on fold 0)
    assert [f.choice.p_values[f.strategy] for f in result.folds] == [2 / 256, 2 / 256]
    # A on the 12 queries outside fold 0 scores 0, as does B outside fold 1; C scores 0.5 there
    assert [(f.held_out, f.held_out_baseline, f.delta) for f in result.folds] == [(0.0, 0.5, -0.5)] * 2
    assert (result.mean, result.std) == (0.0, 0.0)
    assert len(result.changed) == 2 and result.changed_delta == -0.5
    assert result.chosen_counts() == {"A": 1, "B": 1} and result.strategies() == ["C", "A", "B"]
    remainder = set(qids) - set(folds[0]) - set(folds[1])
    for q in qids:  # never the strategy chosen on the query's own fold
        expected = "B" if q in folds[0] else "A"
        assert result.assignment[q] == expected, q
    assert len(remainder) == 4

    table["A"] = {q: 0.5 for q in qids}  # A now ties C everywhere: fold 0 keeps C
    mixed = few_shot_adaptation(table, "C", fold_size=8, seed=0)
    assert [f.strategy for f in mixed.folds] == ["C", "B"] and len(mixed.changed) == 1
    assert mixed.folds[0].delta == 0.0 and mixed.changed_delta == -0.5
    assert mixed.mean == pytest.approx(np.mean([0.5, 0.0])) and mixed.std == pytest.approx(0.25)


def test_adaptation_keeps_the_default_under_noise_and_switches_on_a_clear_gain():
    rng = np.random.default_rng(0)
    qids = [f"q{i:03d}" for i in range(40)]
    base = {q: float(v) for q, v in zip(qids, rng.uniform(0.2, 0.8, len(qids)))}
    noisy = {f"top-k:{k}": {q: base[q] + float(rng.choice((-0.1, 0.1))) for q in qids} for k in (2, 4, 6, 8)}
    table = {"top-k:1": base, **noisy}
    kept = few_shot_adaptation(table, "top-k:1")
    assert [f.strategy for f in kept.folds] == ["top-k:1"] * 5 and kept.changed_delta is None
    assert set(kept.assignment.values()) == {"top-k:1"}
    assert kept.mean == pytest.approx(np.mean([np.mean([base[q] for q in qids if q not in f.queries])
                                               for f in kept.folds]))
    # the old rule (best mean on the fold) switches on most folds, to no avail
    loose = few_shot_adaptation(table, "top-k:1", alpha=1.0, min_gain=0.0)
    assert len(loose.changed) >= 3
    table["top-p:0.01"] = {q: base[q] + 0.02 for q in qids}  # +2 points on every query
    switched = few_shot_adaptation(table, "top-k:1")
    assert [f.strategy for f in switched.folds] == ["top-p:0.01"] * 5
    assert switched.changed_delta == pytest.approx(0.02)
    # held-out numbers from other per-query scores (the runs actually served), same choices
    served = {"top-k:1": base, "top-p:0.01": {q: base[q] - 0.01 for q in qids}}
    rescored = switched.scored(served)
    assert [f.strategy for f in rescored.folds] == ["top-p:0.01"] * 5
    assert rescored.changed_delta == pytest.approx(-0.01) and switched.changed_delta == pytest.approx(0.02)
    with pytest.raises(ValueError, match="no top-p:0.01 scores"):
        switched.scored({"top-k:1": base})


def test_single_fold_assignment_is_tuned_elsewhere():
    qids = [f"q{i}" for i in range(10)]
    fold = make_folds(qids, 8)[0]
    table = {"B": {q: float(q not in fold) for q in qids}, "A": {q: float(q in fold) for q in qids}}
    result = few_shot_adaptation(table, "B", 8, alpha=1.0)
    assert result.folds[0].strategy == "A" and result.folds[0].held_out == 0.0
    assert all(result.assignment[q] == ("B" if q in fold else "A") for q in qids)


def test_read_qrels_formats(tmp_path):
    trec = tmp_path / "qrels.txt"
    trec.write_text("1 0 d1 1\n1 0 d2 0\n2 Q0 d3 2\n")
    beir = tmp_path / "qrels.tsv"
    beir.write_text("query-id\tcorpus-id\tscore\n1\td1\t1\n2\td3\t2\n")
    assert read_qrels(str(trec)) == {"1": {"d1": 1, "d2": 0}, "2": {"d3": 2}}
    assert read_qrels(str(beir)) == {"1": {"d1": 1}, "2": {"d3": 2}}
    (tmp_path / "bad.txt").write_text("1 0 d1 1\n1 0 d2 x\n")
    with pytest.raises(ValueError, match="bad.txt, line 2"):
        read_qrels(str(tmp_path / "bad.txt"))
    with pytest.raises(FileNotFoundError):
        read_qrels(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="positive judgement"):
        labelled_topics({"9": "text"}, read_qrels(str(trec)))
    assert list(labelled_topics({"1": "a", "2": "b", "3": "c"}, read_qrels(str(trec)), sample=1)) in (["1"], ["2"])


@pytest.fixture(scope="module")
def adapt_index(tmp_path_factory, scifact_small):
    """A copy of the harness's AligneR index (adaptation rewrites its manifest)."""
    from eval.beir.aligner import full_index

    _, cache, _ = harness_run(tmp_path_factory, scifact_small)
    ctx = harness_context(scifact_small, cache)
    target = tmp_path_factory.mktemp("adapt") / "index"
    shutil.copytree(full_index(ctx), target)
    return target, ctx.model


@pytest.fixture(scope="module")
def labelled(tmp_path_factory, scifact_small):
    dataset = Dataset(str(scifact_small))
    folder = tmp_path_factory.mktemp("labelled")
    topics, qrels = folder / "topics.tsv", folder / "qrels.txt"
    queries = dataset.queries()
    topics.write_text("".join(f"{q}\t{text}\n" for q, text in list(queries.items())[:10]))
    qrels.write_text("".join(f"{q} 0 {d} {r}\n" for q, docs in dataset.qrels().items() for d, r in docs.items()))
    return topics, qrels


def test_rescore_matches_the_searcher(adapt_index, labelled):
    from pyserini_aligner.search import AlignerSearcher

    index, model = adapt_index
    searcher = AlignerSearcher(index, encoder=model)
    queries = dict(line.split("\t", 1) for line in labelled[0].read_text().splitlines())
    found = searcher.batch_search(list(queries.values()), list(queries), k=20)
    runs = rescore(searcher.store, model, queries, {q: [h.docid for h in hits] for q, hits in found.items()},
                   ["top-k:1", "top-p:0.01"])
    for q, hits in found.items():
        assert [d for d, _ in runs["top-k:1"][q]] == [h.docid for h in hits]
        assert [s for _, s in runs["top-k:1"][q]] == pytest.approx([h.score for h in hits], abs=1e-5)
    table = strategy_table(read_qrels(str(labelled[1])), runs)
    assert set(table) == {"top-k:1", "top-p:0.01"} and all(0 <= v <= 1 for v in table["top-k:1"].values())
    assert per_query({"a": {"d": 1}}, {"a": [("d", 1.0)]}) == {"a": 1.0}


def table_rows(out: str) -> dict[str, list[str]]:
    """The CLI's table: strategy -> [ndcg@10, gain, p, ...] ('' cells dropped)."""
    return {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:] if line.split()[0].startswith("top-")}


def test_adapt_cli_saves_the_default_strategy(adapt_index, labelled, capsys):
    from pyserini.search.faiss import FaissSearcher

    from pyserini_aligner.encoders import AlignerQueryEncoder
    from pyserini_aligner.search import AlignerSearcher

    index, model = adapt_index
    topics, qrels = labelled
    set_default_strategy(index, "top-k:8")
    args = ["--index", str(index), "--topics", str(topics), "--qrels", str(qrels), "--candidates", "50", "--quiet"]
    assert main(args + ["--dry-run", "--strategies", "top-k:2"]) == 0
    out = capsys.readouterr().out
    assert read_manifest(index).default_strategy == "top-k:8" and "keeps default strategy top-k:8" in out
    assert list(table_rows(out)) == ["top-k:8", "top-k:2"]  # the index's current default is the baseline

    strategies = ["top-k:1", "top-k:2", "top-p:0.01"]
    generation = read_manifest(index).generation
    assert main(args + ["--strategies", *strategies]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert list(rows) == ["top-k:8", *strategies] and "(10 queries)" in out
    means = {s: float(r[0]) for s, r in rows.items()}
    chosen = [s for s, r in rows.items() if r[-1] == "chosen"]
    assert len(chosen) == 1
    for spec in strategies:  # a strategy replaces top-k:8 only with a gain >= 0.005 and p <= 0.05
        gain, p = float(rows[spec][1]), float(rows[spec][2])
        assert gain == pytest.approx(means[spec] - means["top-k:8"], abs=2e-4) and 0 < p <= 1
        if spec == chosen[0]:
            assert gain >= 0.005 and p <= 0.05
    assert read_manifest(index).default_strategy == chosen[0]
    if chosen == ["top-k:8"]:  # kept: the manifest is not rewritten
        assert "keeping top-k:8" in out and read_manifest(index).generation == generation
    else:
        assert "(was top-k:8)" in out and read_manifest(index).generation == generation + 1

    # without the test (any gain counts) the best mean wins, ties going to the baseline
    assert main(args + ["--strategies", *strategies, "--alpha", "1", "--min-gain", "0"]) == 0
    rows = table_rows(capsys.readouterr().out)
    means = {s: float(r[0]) for s, r in rows.items()}
    best = max(means, key=lambda s: (means[s], -list(means).index(s)))
    assert [s for s, r in rows.items() if r[-1] == "chosen"] == [best]
    assert read_manifest(index).default_strategy == best
    assert AlignerSearcher(index, encoder=model).strategy.__str__() == best
    assert str(FaissSearcher(str(index), AlignerQueryEncoder(model)).strategy) == best


@pytest.mark.parametrize("flag,value,message", [("--alpha", "0", "expected a number in (0, 1]"),
                                                ("--alpha", "1.5", "expected a number in (0, 1]"),
                                                ("--min-gain", "-0.1", "expected a number >= 0"),
                                                ("--permutations", "0", "expected an integer >= 1")])
def test_adapt_cli_test_flags_are_checked(flag, value, message, capsys):
    assert main(["--index", "x", "--topics", "y", "--qrels", "z", flag, value]) == 2
    assert f"argument {flag}: {message}" in capsys.readouterr().err


def test_adapt_cli_errors(adapt_index, labelled, tmp_path, capsys):
    index, _ = adapt_index
    bad = tmp_path / "qrels.txt"
    bad.write_text("1 0 d1 x\n")
    assert main(["--index", str(index), "--topics", str(labelled[0]), "--qrels", str(bad)]) == 1
    assert "qrels.txt, line 1" in capsys.readouterr().err
    assert main(["--index", str(tmp_path / "nowhere"), "--topics", str(labelled[0]), "--qrels",
                 str(labelled[1])]) == 1
    assert "nowhere" in capsys.readouterr().err
