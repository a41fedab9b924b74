"""Few-shot alignment adaptation: the fold logic on hand-made scores, and the CLI on the harness's index."""
import shutil

import numpy as np
import pytest

from harness_support import harness_context, harness_run

from pyserini_aligner.adapt.__main__ import main
from pyserini_aligner.adapt.inputs import labelled_topics
from pyserini_aligner.data import read_qrels
from pyserini_aligner.adapt.select import (choose_strategy, few_shot_adaptation, make_folds, per_query, rescore,
                                           strategy_table)
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


def test_choose_strategy_breaks_ties_by_order():
    table = {"top-k:2": {"a": 0.5, "b": 0.5}, "top-k:1": {"a": 1.0, "b": 0.0}, "top-k:4": {"a": 0.0, "b": 0.9}}
    assert choose_strategy(table, ["a", "b"]) == ("top-k:2", {"top-k:2": 0.5, "top-k:1": 0.5, "top-k:4": 0.45})
    assert choose_strategy(table, ["a"])[0] == "top-k:1"


def test_few_shot_adaptation_on_a_hand_made_case():
    qids = [f"q{i:02d}" for i in range(20)]
    folds = make_folds(qids, 8, seed=0)
    # "A" is perfect on fold 0 only, "B" on fold 1 only, "C" scores 0.5 everywhere
    table = {"A": {q: 1.0 if q in folds[0] else 0.0 for q in qids},
             "B": {q: 1.0 if q in folds[1] else 0.0 for q in qids},
             "C": {q: 0.5 for q in qids}}
    result = few_shot_adaptation(table, fold_size=8, seed=0)
    assert [f.queries for f in result.folds] == folds
    assert [f.strategy for f in result.folds] == ["A", "B"]
    assert [f.tuning for f in result.folds] == [1.0, 1.0]
    # A on the 12 queries outside fold 0 scores 0, as does B outside fold 1
    assert [f.held_out for f in result.folds] == [0.0, 0.0]
    assert (result.mean, result.std) == (0.0, 0.0)
    assert result.chosen_counts() == {"A": 1, "B": 1}
    remainder = set(qids) - set(folds[0]) - set(folds[1])
    for q in qids:  # never the strategy chosen on the query's own fold
        expected = "B" if q in folds[0] else "A"
        assert result.assignment[q] == expected, q
    assert len(remainder) == 4

    table["C"] = {q: 0.9 if q in folds[0] else 0.6 for q in qids}  # still below A on fold 0, B on fold 1
    mixed = few_shot_adaptation(table, fold_size=8, seed=0)
    assert [f.strategy for f in mixed.folds] == ["A", "B"]
    table["A"] = {q: 0.0 for q in qids}  # now C wins fold 0 and scores 0.6 on the other 12 queries
    mixed = few_shot_adaptation(table, fold_size=8, seed=0)
    assert mixed.folds[0].strategy == "C" and mixed.folds[0].held_out == pytest.approx(0.6)
    assert mixed.mean == pytest.approx(np.mean([0.6, 0.0]))
    assert mixed.std == pytest.approx(0.3)


def test_single_fold_assignment_is_tuned_elsewhere():
    qids = [f"q{i}" for i in range(10)]
    fold = make_folds(qids, 8)[0]
    table = {"A": {q: float(q in fold) for q in qids}, "B": {q: float(q not in fold) for q in qids}}
    result = few_shot_adaptation(table, 8)
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


def test_adapt_cli_saves_the_default_strategy(adapt_index, labelled, capsys):
    from pyserini.search.faiss import FaissSearcher

    from pyserini_aligner.encoders import AlignerQueryEncoder
    from pyserini_aligner.search import AlignerSearcher

    index, model = adapt_index
    topics, qrels = labelled
    set_default_strategy(index, "top-k:8")
    args = ["--index", str(index), "--topics", str(topics), "--qrels", str(qrels), "--candidates", "50", "--quiet"]
    assert main(args + ["--dry-run"]) == 0
    assert read_manifest(index).default_strategy == "top-k:8"
    capsys.readouterr()
    assert main(args + ["--strategies", "top-k:2", "top-p:0.01", "top-k:1"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: float(line.split()[1]) for line in out.splitlines()[1:4]}
    assert set(rows) == {"top-k:2", "top-p:0.01", "top-k:1"} and "(10 queries)" in out
    chosen = max(rows, key=lambda s: (rows[s], -list(rows).index(s)))
    assert [line.split()[0] for line in out.splitlines() if line.endswith("<- chosen")] == [chosen]
    assert read_manifest(index).default_strategy == chosen
    assert AlignerSearcher(index, encoder=model).strategy.__str__() == chosen
    assert str(FaissSearcher(str(index), AlignerQueryEncoder(model)).strategy) == chosen


def test_adapt_cli_errors(adapt_index, labelled, tmp_path, capsys):
    index, _ = adapt_index
    bad = tmp_path / "qrels.txt"
    bad.write_text("1 0 d1 x\n")
    assert main(["--index", str(index), "--topics", str(labelled[0]), "--qrels", str(bad)]) == 2
    assert "qrels.txt, line 1" in capsys.readouterr().err
    assert main(["--index", str(tmp_path / "nowhere"), "--topics", str(labelled[0]), "--qrels",
                 str(labelled[1])]) == 2
    assert "nowhere" in capsys.readouterr().err
