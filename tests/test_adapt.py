"""Few-shot adaptation of the checkpoint and the alignment: the choice rule on hand-made scores, the report, and the
CLI on the harness's index and on a small index of its own."""
import itertools
import shutil

import numpy as np
import pytest

from harness_support import harness_context, harness_run

from pyserini_aligner.adapt.__main__ import main
from pyserini_aligner.adapt.inputs import labelled_topics
from pyserini_aligner.data import read_qrels
from pyserini_aligner.adapt.select import (Candidate, choose, few_shot_adaptation, make_folds, paired_permutation_test,
                                           paired_t, per_query, rescore, rescore_texts, strategy_table)
from pyserini_aligner.checkpoints import SHIPPED
from pyserini_aligner.data import Dataset
from pyserini_aligner.index.commit import set_default_strategy
from pyserini_aligner.index.format import read_manifest
from pyserini_aligner.strategy import parse_strategy


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


def test_choose_keeps_the_default_when_candidates_win_by_noise():
    noise = shifted((0.2, -0.1, 0.2, -0.1, 0.2, -0.1, 0.2, -0.1))  # mean +0.05: half the queries lose
    tiny = shifted([0.001] * 8)  # wins every query, by 0.1 point
    table = {"top-k:1": BASE, "top-k:2": noise, "top-p:0.01": tiny}
    choice = choose(table, QUERIES, "top-k:1")
    assert choice.chosen == "top-k:1" and not choice.changed
    assert choice.best == "top-k:2" and choice.gain() == pytest.approx(0.05)
    assert choice.p_values["top-k:2"] > 0.3  # 92 of the 256 sign vectors reach its t-statistic
    # top-p:0.01 wins every query: as significant as 8 queries can be, but by less than 0.5 point
    assert choice.p_values["top-p:0.01"] == 1 / 256 and choice.gain("top-p:0.01") == pytest.approx(0.001)
    # picking the best mean, as without the test, would have switched
    assert choose(table, QUERIES, "top-k:1", alpha=1.0, min_gain=0.0).chosen == "top-k:2"
    same = {"top-k:1": BASE, "top-p:0.005": dict(BASE)}  # a tie never replaces the default
    assert choose(same, QUERIES, "top-k:1", alpha=1.0, min_gain=0.0).chosen == "top-k:1"
    with pytest.raises(ValueError, match="baseline top-k:4 is not among"):
        choose(table, QUERIES, "top-k:4")


def test_choose_switches_when_a_candidate_wins_clearly():
    clear = shifted((0.1, 0.05, 0.1, 0.08, 0.1, 0.06, 0.1, 0.03))  # every query, mean +0.0775
    table = {"top-k:1": BASE, "top-k:2": shifted((0.05, 0.0, 0.0, 0.02, 0.0, 0.0, 0.01, 0.0)), "top-k:4": clear}
    choice = choose(table, QUERIES, "top-k:1")
    assert choice.chosen == "top-k:4" and choice.changed
    assert choice.p_values["top-k:4"] == pytest.approx(1 / 256)  # only the observed signs reach its sum
    assert choice.gain("top-k:4") == pytest.approx(0.0775)
    assert choose(table, QUERIES, "top-k:1", min_gain=0.08).chosen == "top-k:1"
    assert choose(table, QUERIES, "top-k:1", alpha=0.001).chosen == "top-k:1"


AL, MIX, NEW = "aligner", "aligner-mix", "aligner-384"


def test_choose_over_checkpoints_and_strategies():
    """The same rule over (checkpoint, strategy) pairs: a pair that wins clearly is chosen, whatever its
    checkpoint; one that wins by a little on every query, or by noise, is not; a tie keeps the default; the p-values
    are max-T over every pair but the baseline."""
    default = Candidate(AL, "top-k:1")
    clear = Candidate(MIX, "top-p:0.01")
    marginal = Candidate(NEW, "top-k:1")
    noisy = Candidate(AL, "top-k:2")
    table = {default: BASE, noisy: shifted((0.2, -0.1, 0.2, -0.1, 0.2, -0.1, 0.2, -0.1)),
             Candidate(MIX, "top-k:1"): dict(BASE), clear: shifted((0.1, 0.05, 0.1, 0.08, 0.1, 0.06, 0.1, 0.03)),
             marginal: shifted([0.003] * 8)}
    choice = choose(table, QUERIES, default)
    assert choice.chosen == clear and choice.changed and choice.gain(clear) == pytest.approx(0.0775)
    # both win every query: significant, but the marginal pair gains 0.3 point, less than --min-gain
    assert choice.p_values[clear] <= 0.01 and choice.p_values[marginal] <= 0.01
    assert choice.gain(marginal) == pytest.approx(0.003) and choice.p_values[noisy] > 0.3
    assert choice.p_values == pytest.approx(dict(zip(table, [1.0, *paired_permutation_test(
        np.array([[table[c][q] - BASE[q] for c in list(table)[1:]] for q in QUERIES]))])))
    deltas = np.array([table[noisy][q] - BASE[q] for q in QUERIES])
    assert choice.t_values[noisy] == pytest.approx(deltas.mean() / (deltas.std(ddof=1) / np.sqrt(8)))
    assert choice.t_values[clear] > 5 and choice.t_values[default] == 0.0
    assert choice.t_values[Candidate(MIX, "top-k:1")] == 0.0 and choice.t_values[marginal] == np.inf
    # without the clear winner: the marginal pair (+0.3 point on every query) stays below --min-gain
    del table[clear]
    assert choose(table, QUERIES, default).chosen == default
    assert choose(table, QUERIES, default, min_gain=0.003).chosen == marginal
    # a tie (aligner-mix top-k:1 equals the default on every query) never replaces the default
    tie = {default: BASE, Candidate(MIX, "top-k:1"): dict(BASE)}
    assert choose(tie, QUERIES, default, alpha=1.0, min_gain=0.0).chosen == default
    # equal means among the winners: the earlier pair in the table (the index's checkpoint first)
    same = shifted([0.1] * 8)
    first = {default: BASE, Candidate(AL, "top-k:4"): same, Candidate(MIX, "top-k:4"): dict(same)}
    assert choose(first, QUERIES, default).chosen == Candidate(AL, "top-k:4")
    assert str(clear) == "aligner-mix top-p:0.01" and f"{clear:>24}" == "  aligner-mix top-p:0.01"


def test_paired_t_on_plain_data():
    deltas = np.array([[0.0, 0.1, 0.1, -0.2], [0.0, 0.1, 0.2, 0.1], [0.0, 0.1, 0.3, 0.4]])
    expected = [0.0, np.inf] + [d.mean() / (d.std(ddof=1) / np.sqrt(3)) for d in deltas.T[2:]]
    assert paired_t(deltas).tolist() == pytest.approx(expected)
    assert paired_t([-0.5]).tolist() == [-np.inf] and paired_t(np.zeros((3, 2))).tolist() == [0.0, 0.0]


def test_report_table_verdict_and_index_command():
    from pyserini_aligner.adapt.__main__ import format_table, verdict
    from pyserini_aligner.adapt.checkpoints import index_command
    from pyserini_aligner.index.format import Manifest

    default, mix = Candidate(AL, "top-k:1"), Candidate(MIX, "top-p:0.01")
    table = {default: BASE, Candidate(AL, "top-k:2"): shifted([0.0] * 8),
             mix: shifted((0.1, 0.05, 0.1, 0.08, 0.1, 0.06, 0.1, 0.03))}
    choice = choose(table, QUERIES, default)
    text = format_table(choice)
    assert text.splitlines() == [
        "checkpoint  strategy        ndcg@10     gain      t       p   (8 queries)",
        "aligner     top-k:1          0.5500                           <- current",
        "aligner     top-k:2          0.5500  +0.0000  +0.00  1.0000",
        f"aligner-mix top-p:0.01       0.6275  +0.0775  {choice.t_values[mix]:+.2f}  0.0039   <- chosen"]
    assert table_rows(text)[MIX, "top-p:0.01"]["marks"] == {"chosen"}
    assert verdict(choice, 0.05, 0.005) == (
        f"replacing aligner top-k:1: aligner-mix top-p:0.01 gains +0.0775 (t = {choice.t_values[mix]:+.2f}) with "
        "p = 0.0039 (>= 0.005 and p <= 0.05; max-T over the 2 pairs tried)")
    kept = choose(table, QUERIES, default, min_gain=0.1)
    assert table_rows(format_table(kept))[AL, "top-k:1"]["marks"] == {"current", "chosen"}
    assert verdict(kept, 0.05, 0.1).startswith("keeping aligner top-k:1: the best, aligner-mix top-p:0.01, gains "
                                               "+0.0775 (t = ")
    assert verdict(kept, 0.05, 0.1).endswith("with p = 0.0039 (needs >= 0.1 and p <= 0.05; max-T over the 2 pairs "
                                             "tried)")

    compressed = Manifest(model_name="aligner", model_fingerprint="f", dim=128, doc_prune=0.2, index_type="IVF",
                          default_strategy="top-k:1", codec="IVF256,PQ4,Refine(PQ32)", prune_redundancy=0.85)
    assert index_command(compressed, "idx-mix", "corpus", MIX, "top-k:1", "top-k:1") == [
        "python", "-m", "pyserini_aligner.index", "--corpus", "corpus", "--index", "idx-mix", "--encoder", MIX]
    # a checkpoint that scores with token saliences needs exact vectors: a compressed store keeps no saliences
    assert index_command(compressed, "idx-mix", "corpus", MIX, "top-k:1", "top-k:1", salience=True)[-2:] == [
        "--codec", "fp16"]
    exact = Manifest(model_name="aligner", model_fingerprint="f", dim=128, doc_prune=1.0, index_type="HNSW32",
                     default_strategy="top-k:2", codec="fp16", prune_redundancy=None, doc_maxlen=128)
    assert index_command(exact, "new", None, "/ckpt/x", "top-p:0.01", "top-k:1", "cuda") == [
        "python", "-m", "pyserini_aligner.index", "--corpus", "<corpus>", "--index", "new", "--encoder", "/ckpt/x",
        "--strategy", "top-p:0.01", "--codec", "fp16", "--index-type", "HNSW32", "--doc-prune", "1",
        "--prune-redundancy", "off", "--max-length", "128", "--device", "cuda"]


def test_few_shot_adaptation_on_a_hand_made_case():
    qids = [f"q{i:02d}" for i in range(20)]
    folds = make_folds(qids, 8, seed=0)
    # "A" is perfect on fold 0 only, "B" on fold 1 only, the baseline "C" scores 0.5 everywhere
    table = {"C": {q: 0.5 for q in qids},
             "A": {q: 1.0 if q in folds[0] else 0.0 for q in qids},
             "B": {q: 1.0 if q in folds[1] else 0.0 for q in qids}}
    result = few_shot_adaptation(table, "C", fold_size=8, seed=0)
    assert [f.queries for f in result.folds] == folds
    assert [f.chosen for f in result.folds] == ["A", "B"]
    assert [f.choice.means[f.chosen] for f in result.folds] == [1.0, 1.0]
    # max-T over A and B: all 8 signs kept, or all flipped (B's deltas are -0.5 on fold 0)
    assert [f.choice.p_values[f.chosen] for f in result.folds] == [2 / 256, 2 / 256]
    # A on the 12 queries outside fold 0 scores 0, as does B outside fold 1; C scores 0.5 there
    assert [(f.held_out, f.held_out_baseline, f.delta) for f in result.folds] == [(0.0, 0.5, -0.5)] * 2
    assert (result.mean, result.std) == (0.0, 0.0)
    assert len(result.changed) == 2 and result.changed_delta == -0.5
    assert result.chosen_counts() == {"A": 1, "B": 1} and result.candidates() == ["C", "A", "B"]
    remainder = set(qids) - set(folds[0]) - set(folds[1])
    for q in qids:  # never the strategy chosen on the query's own fold
        expected = "B" if q in folds[0] else "A"
        assert result.assignment[q] == expected, q
    assert len(remainder) == 4

    table["A"] = {q: 0.5 for q in qids}  # A now ties C everywhere: fold 0 keeps C
    mixed = few_shot_adaptation(table, "C", fold_size=8, seed=0)
    assert [f.chosen for f in mixed.folds] == ["C", "B"] and len(mixed.changed) == 1
    assert mixed.folds[0].delta == 0.0 and mixed.changed_delta == -0.5
    assert mixed.mean == pytest.approx(np.mean([0.5, 0.0])) and mixed.std == pytest.approx(0.25)


def test_adaptation_keeps_the_default_under_noise_and_switches_on_a_clear_gain():
    rng = np.random.default_rng(0)
    qids = [f"q{i:03d}" for i in range(40)]
    base = {q: float(v) for q, v in zip(qids, rng.uniform(0.2, 0.8, len(qids)))}
    noisy = {f"top-k:{k}": {q: base[q] + float(rng.choice((-0.1, 0.1))) for q in qids} for k in (2, 4, 6, 8)}
    table = {"top-k:1": base, **noisy}
    kept = few_shot_adaptation(table, "top-k:1")
    assert [f.chosen for f in kept.folds] == ["top-k:1"] * 5 and kept.changed_delta is None
    assert set(kept.assignment.values()) == {"top-k:1"}
    assert kept.mean == pytest.approx(np.mean([np.mean([base[q] for q in qids if q not in f.queries])
                                               for f in kept.folds]))
    # the old rule (best mean on the fold) switches on most folds, to no avail
    loose = few_shot_adaptation(table, "top-k:1", alpha=1.0, min_gain=0.0)
    assert len(loose.changed) >= 3
    table["top-p:0.01"] = {q: base[q] + 0.02 for q in qids}  # +2 points on every query
    switched = few_shot_adaptation(table, "top-k:1")
    assert [f.chosen for f in switched.folds] == ["top-p:0.01"] * 5
    assert switched.changed_delta == pytest.approx(0.02)
    # held-out numbers from other per-query scores (the runs actually served), same choices
    served = {"top-k:1": base, "top-p:0.01": {q: base[q] - 0.01 for q in qids}}
    rescored = switched.scored(served)
    assert [f.chosen for f in rescored.folds] == ["top-p:0.01"] * 5
    assert rescored.changed_delta == pytest.approx(-0.01) and switched.changed_delta == pytest.approx(0.02)
    with pytest.raises(ValueError, match="no top-p:0.01 scores"):
        switched.scored({"top-k:1": base})


def test_single_fold_assignment_is_tuned_elsewhere():
    qids = [f"q{i}" for i in range(10)]
    fold = make_folds(qids, 8)[0]
    table = {"B": {q: float(q not in fold) for q in qids}, "A": {q: float(q in fold) for q in qids}}
    result = few_shot_adaptation(table, "B", 8, alpha=1.0)
    assert result.folds[0].chosen == "A" and result.folds[0].held_out == 0.0
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
    return topics, qrels, scifact_small


def test_rescore_matches_the_searcher(adapt_index, labelled):
    from pyserini_aligner.search import AlignerSearcher

    index, model = adapt_index
    searcher = AlignerSearcher(index, encoder=model)
    queries = dict(line.split("\t", 1) for line in labelled[0].read_text().splitlines())
    found = searcher.batch_search(list(queries.values()), list(queries), k=20)
    runs = rescore(searcher.store, model, queries, {q: [h.docid for h in hits] for q, hits in found.items()},
                   [parse_strategy("top-k:1"), parse_strategy("top-p:0.01")])
    for q, hits in found.items():
        assert [d for d, _ in runs["top-k:1"][q]] == [h.docid for h in hits]
        assert [s for _, s in runs["top-k:1"][q]] == pytest.approx([h.score for h in hits], abs=1e-5)
    table = strategy_table(read_qrels(str(labelled[1])), runs)
    assert set(table) == {"top-k:1", "top-p:0.01"} and all(0 <= v <= 1 for v in table["top-k:1"].values())
    assert per_query({"a": {"d": 1}}, {"a": [("d", 1.0)]}) == {"a": 1.0}


def test_rescore_texts_matches_the_reranker_and_the_stored_vectors(adapt_index, labelled):
    """Rescoring from the candidates' texts scores as AlignmentReranker does with (docid, text) pairs, and with the
    index's model as its stored (exact) vectors do; each distinct candidate is encoded once."""
    from pyserini_aligner.index import StoredIndex
    from pyserini_aligner.search.rerank import AlignmentReranker

    index, model = adapt_index
    queries = dict(line.split("\t", 1) for line in labelled[0].read_text().splitlines()[:4])
    store = StoredIndex(index)
    candidates = {q: store.docids[i:i + 12] for i, q in enumerate(queries)}  # overlapping lists
    texts = {doc.docid: doc.contents for doc in Dataset(str(labelled[2])).docs()}
    both = [parse_strategy("top-k:1"), parse_strategy("top-p:0.01")]
    runs, encoded = rescore_texts(model, queries, candidates, texts, both, batch_size=5)
    assert encoded == len({d for docids in candidates.values() for d in docids}) == 15
    stored = rescore(store, model, queries, candidates, both)
    for spec in ("top-k:1", "top-p:0.01"):
        reranker = AlignmentReranker(model, strategy=spec)
        for q, docids in candidates.items():
            hits = reranker.rerank(queries[q], [(d, texts[d]) for d in docids])
            assert [d for d, _ in runs[spec][q]] == [h.docid for h in hits]
            assert [s for _, s in runs[spec][q]] == pytest.approx([h.score for h in hits], abs=1e-5)
            assert dict(runs[spec][q]) == pytest.approx(dict(stored[spec][q]), abs=2e-3)  # fp16 storage
    with pytest.raises(ValueError, match="no text for candidate document"):
        rescore_texts(model, {"x": "a query"}, {"x": ["nowhere"]}, texts, [parse_strategy("top-k:1")])


def test_checkpoints_share_the_lower_layers_they_have_unchanged(labelled, caplog):
    """The shipped checkpoints and the untrained initialisation have MiniLM's embeddings and first three layers:
    rescoring computes those once per candidate and scores as each checkpoint does on its own."""
    import logging

    from pyserini_aligner.adapt.checkpoints import rescore_checkpoints, shared_lower_layers
    from pyserini_aligner.backbone import part_digests, shared_depth
    from pyserini_aligner.resolve import load_model

    assert shared_depth([["e", "a", "b"], ["e", "a", "c"]]) == 1
    assert shared_depth([["e", "a"], ["f", "a"]]) == shared_depth([["e", "a"]]) == 0
    assert shared_depth([["e", "a", "b"], ["e", "a", "b"]]) == 2
    sources = ["untrained", "aligner", "aligner-mix"]
    assert shared_depth([part_digests(load_model(s).backbone) for s in sources]) == 3
    assert shared_lower_layers(sources, "cpu").depth == 3 and shared_lower_layers(sources[:1]) is None
    queries = dict(line.split("\t", 1) for line in labelled[0].read_text().splitlines()[:2])
    docids = [doc.docid for doc in Dataset(str(labelled[2])).docs()]
    candidates = {q: docids[2 * i:2 * i + 4] for i, q in enumerate(queries)}  # overlapping lists
    texts = {doc.docid: doc.contents for doc in Dataset(str(labelled[2])).docs()}
    strategies = [parse_strategy("top-k:1"), parse_strategy("top-k:2")]
    with caplog.at_level(logging.INFO, logger="pyserini_aligner.adapt.checkpoints"):
        shared = rescore_checkpoints([(s, s) for s in sources[1:]], queries, candidates, texts, strategies,
                                     batch_size=4)
    assert "states after 3 of 6 backbone layers are computed once for 2 checkpoints" in caplog.text
    for result, source in zip(shared, sources[1:]):
        alone, encoded = rescore_texts(load_model(source), queries, candidates, texts, strategies, batch_size=4)
        assert result.encoded == encoded == 6
        for spec, run in alone.items():
            for q, hits in run.items():
                assert dict(result.runs[spec][q]) == pytest.approx(dict(hits), abs=1e-5), (source, spec, q)


def table_rows(out: str) -> dict[tuple[str, str], dict]:
    """The CLI's table: (checkpoint, strategy) -> {"ndcg", "gain", "t", "p", "marks"} (gain, t and p None on the
    baseline's row)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("checkpoint "))
    rows = {}
    for line in lines[start + 1:]:
        cells, _, marks = line.partition("<-")
        tokens = cells.split()
        if len(tokens) < 3 or not tokens[1].startswith("top-"):
            break
        gain, t, p = (float(tokens[3]), tokens[4], float(tokens[5])) if len(tokens) == 6 else (None, None, None)
        rows[tokens[0], tokens[1]] = {"ndcg": float(tokens[2]), "gain": gain, "t": t, "p": p,
                                      "marks": {m.strip() for m in marks.split(",") if m.strip()}}
    return rows


def test_adapt_cli_saves_the_default_strategy(adapt_index, labelled, capsys, caplog):
    """An index that records no corpus: the strategies of its checkpoint are compared on its stored vectors (with
    a warning that other checkpoints cannot be tried), and the chosen one becomes its default strategy."""
    from pyserini.search.faiss import FaissSearcher

    from pyserini_aligner.encoders import AlignerQueryEncoder
    from pyserini_aligner.search import AlignerSearcher

    index, model = adapt_index
    topics, qrels, _ = labelled
    set_default_strategy(index, "top-k:8")
    args = ["--index", str(index), "--topics", str(topics), "--qrels", str(qrels), "--candidates", "50", "--quiet"]
    assert main(args + ["--dry-run", "--strategies", "top-k:2"]) == 0
    out = capsys.readouterr().out
    assert str(read_manifest(index).default_strategy) == "top-k:8" and "keeps default strategy top-k:8" in out
    # the index's current default is the baseline
    assert list(table_rows(out)) == [("aligner", "top-k:8"), ("aligner", "top-k:2")]
    assert "records no corpus" in caplog.text and "scored on the index's stored vectors (none encoded)" in out

    strategies = ["top-k:1", "top-k:2", "top-p:0.01"]
    generation = read_manifest(index).generation
    assert main(args + ["--strategies", *strategies]) == 0
    out = capsys.readouterr().out
    rows = {s: r for (_, s), r in table_rows(out).items()}
    assert list(rows) == ["top-k:8", *strategies] and "(10 queries)" in out
    assert rows["top-k:8"]["marks"] >= {"current"}
    chosen = [s for s, r in rows.items() if "chosen" in r["marks"]]
    assert len(chosen) == 1
    for spec in strategies:  # a strategy replaces top-k:8 only with a gain >= 0.005 and p <= 0.05
        gain, p = rows[spec]["gain"], rows[spec]["p"]
        assert gain == pytest.approx(rows[spec]["ndcg"] - rows["top-k:8"]["ndcg"], abs=2e-4) and 0 < p <= 1
        if spec == chosen[0]:
            assert gain >= 0.005 and p <= 0.05
    assert str(read_manifest(index).default_strategy) == chosen[0]
    if chosen == ["top-k:8"]:  # kept: the manifest is not rewritten
        assert "keeping aligner top-k:8" in out and read_manifest(index).generation == generation
    else:
        assert "(was top-k:8)" in out and read_manifest(index).generation == generation + 1

    # without the test (any gain counts) the best mean wins, ties going to the baseline
    assert main(args + ["--strategies", *strategies, "--alpha", "1", "--min-gain", "0"]) == 0
    rows = {s: r for (_, s), r in table_rows(capsys.readouterr().out).items()}
    means = {s: r["ndcg"] for s, r in rows.items()}
    best = max(means, key=lambda s: (means[s], -list(means).index(s)))
    assert [s for s, r in rows.items() if "chosen" in r["marks"]] == [best]
    assert str(read_manifest(index).default_strategy) == best
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
    args = ["--index", str(index), "--topics", str(labelled[0]), "--qrels", str(labelled[1])]
    assert main(args + ["--checkpoints", "aligner-mixx"]) == 2  # before any work
    assert f"--checkpoints: aligner-mixx is neither a shipped checkpoint ({', '.join(SHIPPED)})" in \
        capsys.readouterr().err
    # the harness's index records no corpus: nothing to encode other checkpoints from, nothing to build from
    assert main(args + ["--checkpoints", "aligner-mix"]) == 2
    assert "records no corpus; pass --corpus or --lucene-index" in capsys.readouterr().err
    assert main(args + ["--build-index", str(tmp_path / "new")]) == 2
    assert "--build-index needs the collection to index" in capsys.readouterr().err
    # the index command's --strategy, which the printed commands use, sets the default of an index it builds
    from pyserini_aligner.index.__main__ import main as index_main

    assert index_main(["--index", str(index), "--delete", "ids.txt", "--strategy", "top-k:2"]) == 2
    assert "--strategy goes with --corpus or --from-index" in capsys.readouterr().err
    assert index_main(["--index", str(tmp_path / "x"), "--corpus", "c", "--strategy", "top-z:2"]) == 2
    assert "argument --strategy:" in capsys.readouterr().err


@pytest.fixture(scope="module")
def untrained_index(tmp_path_factory, scifact_small):
    """The 150-document folder indexed by the index command with the untrained initialisation (exact vectors, every
    token): its manifest records the corpus."""
    from pyserini_aligner.index.__main__ import main as index_main

    target = tmp_path_factory.mktemp("untrained") / "idx"
    assert index_main(["--corpus", str(scifact_small), "--index", str(target), "--encoder", "untrained", "--codec",
                       "fp16", "--doc-prune", "1", "--quiet"]) == 0
    return target


def encoded_documents(monkeypatch) -> dict[int, int]:
    """id(model) -> documents it encodes from now on (AlignerModel.encode with is_query=False), counted around the
    real method; every model counted is kept alive, so that a model made after another was freed cannot take its
    id."""
    from pyserini_aligner.model import AlignerModel

    counts: dict[int, int] = {}
    alive: list = []
    encode = AlignerModel.encode

    def counting(self, texts, is_query, *args, **kwargs):
        if not is_query:
            if id(self) not in counts:
                alive.append(self)
            counts[id(self)] = counts.get(id(self), 0) + len(texts)
        return encode(self, texts, is_query, *args, **kwargs)

    monkeypatch.setattr(AlignerModel, "encode", counting)
    return counts


def test_adapt_chooses_a_checkpoint_and_builds_its_index(untrained_index, scifact_small, tmp_path, capsys,
                                                         monkeypatch):
    """Two real trained checkpoints against an index of the untrained initialisation: each checkpoint encodes the
    distinct candidates only; on these 18 easy queries the trained checkpoints score higher but not clearly, so the
    default rule keeps the index's; with any gain counting the best pair wins, the index is left as it is, and the
    printed index command (run by --build-index) builds the chosen checkpoint's index with the source index's
    settings and the chosen strategy."""
    import shlex

    from pyserini_aligner.index import StoredIndex

    set_default_strategy(untrained_index, "top-p:0.01")
    before = (untrained_index / "manifest.json").read_bytes()
    args = ["--index", str(untrained_index), "--topics", str(scifact_small), "--qrels", str(scifact_small),
            "--candidates", "10", "--checkpoints", "aligner", "aligner-mix", "--strategies", "top-k:8", "--quiet"]
    counts = encoded_documents(monkeypatch)
    assert main(args + ["--dry-run", "--build-index", str(tmp_path / "unbuilt")]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert list(rows) == [(c, s) for c in ("untrained", "aligner", "aligner-mix") for s in ("top-p:0.01", "top-k:8")]
    assert rows["untrained", "top-p:0.01"]["marks"] == {"current", "chosen"} and "(18 queries)" in out
    best = max(rows, key=lambda c: rows[c]["ndcg"])
    assert best[0] != "untrained" and rows[best]["gain"] > 0.005 and rows[best]["p"] > 0.05
    assert f"keeping untrained top-p:0.01: the best, {best[0]} {best[1]}, gains" in out
    assert "no index to build" in out and "keeps default strategy top-p:0.01 (unchanged)" in out
    # every checkpoint encoded the distinct candidates (10 per query), nothing else of the 150 documents
    distinct = int(next(line for line in out.splitlines() if "distinct candidate documents" in line).split()[0])
    assert sorted(counts.values()) == [distinct] * 3 and distinct < StoredIndex(untrained_index).num_docs == 150
    assert f"each of the 3 checkpoints encoded {distinct}, {distinct}, {distinct} of the 150 documents" in out

    target = tmp_path / "built"
    assert main(args + ["--alpha", "1", "--min-gain", "0", "--build-index", str(target)]) == 0
    out = capsys.readouterr().out
    assert [c for c, r in table_rows(out).items() if "chosen" in r["marks"]] == [best]
    assert f"replacing untrained top-p:0.01: {best[0]} {best[1]} gains" in out
    command = shlex.split(next(line for line in out.splitlines() if line.startswith("  python -m ")))
    assert command == ["python", "-m", "pyserini_aligner.index", "--corpus", str(scifact_small.resolve()), "--index",
                       str(target), "--encoder", best[0], "--strategy", best[1], "--codec", "fp16", "--doc-prune",
                       "1"]
    assert f"built {target}: checkpoint {best[0]}, default strategy {best[1]}" in out
    manifest = read_manifest(target)
    assert (manifest.model_name, str(manifest.default_strategy), str(manifest.codec), manifest.doc_prune) == (
        *best, "fp16", 1.0)
    assert manifest.num_docs == 150 and manifest.corpus == str(scifact_small.resolve())
    assert (untrained_index / "manifest.json").read_bytes() == before


def test_adapt_rescores_bm25_candidates_with_the_texts_lucene_stores(adapt_index, labelled, tmp_path_factory,
                                                                     scifact_small, capsys, monkeypatch):
    """--lucene-index: BM25's candidates, the texts from the Lucene index's raw documents (the AligneR index records
    no corpus); each checkpoint encodes those candidates only."""
    from pyserini_aligner.bm25 import bm25_search

    index, _ = adapt_index
    _, cache, _ = harness_run(tmp_path_factory, scifact_small)
    lucene = harness_context(scifact_small, cache).work / "lucene"
    topics, qrels, _ = labelled
    counts = encoded_documents(monkeypatch)
    assert main(["--index", str(index), "--topics", str(topics), "--qrels", str(qrels), "--lucene-index",
                 str(lucene), "--candidates", "15", "--checkpoints", "aligner-mix", "--strategies", "top-k:1",
                 "top-p:0.01", "--dry-run", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert {c for c, _ in table_rows(out)} == {"aligner", "aligner-mix"}
    queries = dict(line.split("\t", 1) for line in topics.read_text().splitlines())
    distinct = {d for hits in bm25_search(lucene, queries, k=15).values() for d, _ in hits}
    assert sorted(counts.values()) == [len(distinct)] * 2
    assert f"{len(distinct)} distinct candidate documents; each of the 2 checkpoints" in out
