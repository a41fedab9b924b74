"""eval.beir end to end on the 150-document SciFact folder: every system, results.json schema, significance."""
import json
import math

import numpy as np
import pytest

from harness_support import SYSTEMS, harness_context, harness_run

from eval.beir.aligner import full_index, rescored_runs
from eval.beir.hybrid import DEFAULT_ALPHA, fuse, tuning_split
from eval.beir.fusion import rrf_fuse
from pyserini_aligner.checkpoints import SHIPPED
from pyserini_aligner.metrics import METRICS
from pyserini_aligner.data import Dataset
from pyserini_aligner.trec import read_run


@pytest.fixture(scope="module")
def harness(tmp_path_factory, scifact_small):
    return harness_run(tmp_path_factory, scifact_small)


def test_every_system_runs_with_a_stable_schema(harness, scifact_small):
    output, _, results = harness
    queries = set(Dataset(str(scifact_small)).queries())
    assert results["dataset"] == f"{scifact_small.name}/test"
    assert list(results["systems"]) == list(SYSTEMS)
    for name, row in results["systems"].items():
        for metric in METRICS:
            assert 0.0 <= row[metric] <= 1.0, (name, metric)
        assert row["run"] == str(output / f"run.{name}.trec")
        run = read_run(row["run"])
        assert set(run) == queries, name
        assert all(qid not in hits for qid, hits in run.items()), f"{name} returns the query id as a hit"
    md = (output / "results.md").read_text()
    for name in SYSTEMS:
        assert f"| {name} |" in md
    # the small folder's test queries are fully judged inside its 150 documents: every system finds them all
    assert all(row["recall@100"] == 1.0 for row in results["systems"].values())
    assert results["systems"]["bm25"]["ndcg@10"] > 0.5 and results["systems"]["aligner"]["ndcg@10"] > 0.5


def test_system_extras(harness):
    systems = harness[2]["systems"]
    assert systems["aligner"]["strategy"] == systems["aligner-exact"]["strategy"] == "top-k:1"
    assert systems["aligner"]["codec"].endswith(",PQ4,Refine(PQ32)") and systems["aligner"]["doc_prune"] == 0.2
    assert abs(systems["aligner"]["ndcg@10"] - systems["aligner-exact"]["ndcg@10"]) < 0.05  # compression's cost
    assert (systems["aligner-pruned"]["doc_prune"], systems["aligner-pruned"]["query_prune"]) == (0.2, 0.5)
    hybrid = systems["hybrid"]
    assert hybrid["alpha"] == DEFAULT_ALPHA and hybrid["alpha_source"].startswith("default")
    adapted = systems["aligner-adapted"]
    assert adapted["folds"] == 2 and adapted["fold_size"] == 8  # 18 queries: two folds of 8
    # two folds: std = |a - b| / 2 and mean = (a + b) / 2 of held-out scores a, b in [0, 1]
    assert 0 <= adapted["ndcg@10_std"] <= min(adapted["ndcg@10"], 1 - adapted["ndcg@10"]) + 1e-4
    assert "ndcg@10_run" in adapted
    assert sum(adapted["chosen"].values()) == 2
    assert (adapted["baseline"], adapted["alpha"], adapted["min_gain"]) == ("aligner top-k:1", 0.05, 0.005)
    assert adapted["checkpoints"] == list(SHIPPED)  # the default's first, then every other shipped one
    assert len(adapted["fold_choices"]) == 2 and adapted["search_hits"] == 1000
    for fold in adapted["fold_choices"]:
        assert len(fold["queries"]) == 8
        assert fold["changed"] == ((fold["checkpoint"], fold["strategy"]) != ("aligner", "top-k:1"))
        assert fold["changed"] == (fold["gain"] >= 0.005 and fold["p"] <= 0.05)
        assert fold["switch"] == (None if not fold["changed"] else
                                  "strategy" if fold["checkpoint"] == "aligner" else "checkpoint")
        assert fold["delta"] == pytest.approx(fold["held_out"] - fold["held_out_baseline"], abs=2e-4)
        if not fold["changed"]:
            assert fold["delta"] == 0.0
    assert adapted["changed_folds"] == sum(f["changed"] for f in adapted["fold_choices"])
    assert adapted["changed_folds"] == sum(cell["folds"] for cell in adapted["switched"].values())
    assert (adapted["changed_delta"] is None) == (adapted["changed_folds"] == 0)
    if adapted["changed_queries"] == 0:  # every query kept the default: aligner-exact's own search
        assert adapted["ndcg@10_run"] == systems["aligner-exact"]["ndcg@10"]
    assert list(adapted["scores"]) == list(SHIPPED)
    for scores in adapted["scores"].values():
        assert list(scores) == ["top-k:1", "top-k:2", "top-k:4", "top-k:6", "top-k:8", "top-p:0.005", "top-p:0.01",
                                "top-p:0.015", "top-p:0.02"]
    # rescoring aligner-exact's candidates with its own strategy keeps its ranking
    assert adapted["scores"]["aligner"]["top-k:1"] == systems["aligner-exact"]["ndcg@10"]


def test_significance_against_both_baselines(harness, scifact_small):
    sig = harness[2]["significance"]
    n_queries = len(Dataset(str(scifact_small)).queries())
    assert set(sig["tests"]) == {"student", "fisher"} and sig["baselines"] == ["bm25", "dense"]
    assert "bm25" not in sig["pairs"] and set(sig["pairs"]["dense"]) == {"bm25"}
    for name in SYSTEMS[2:]:
        assert set(sig["pairs"][name]) == {"bm25", "dense"}
        for base, per_metric in sig["pairs"][name].items():
            assert set(per_metric) == set(sig["metrics"])
            for cell in per_metric.values():
                assert cell["win"] + cell["tie"] + cell["loss"] == n_queries
                for test in ("student", "fisher"):
                    p = cell[f"p_{test}"]
                    assert p is None or 0.0 <= p <= 1.0
    json.dumps(sig, allow_nan=False)  # strict JSON: undefined p-values are null
    assert "Significance" in (harness[0] / "results.md").read_text()


def test_rescoring_reproduces_the_searcher(harness, scifact_small):
    _, cache, results = harness
    ctx = harness_context(scifact_small, cache)
    aligner = read_run(results["systems"]["aligner-exact"]["run"])
    candidates = {q: sorted(h.items(), key=lambda x: -x[1]) for q, h in aligner.items()}
    rescored = rescored_runs(ctx, candidates, ["top-k:1"])["top-k:1"]
    for qid, hits in rescored.items():
        for docid, score in hits:
            assert math.isclose(score, aligner[qid][docid], abs_tol=1e-5)
    assert full_index(ctx).name == f"aligner-{ctx.fingerprint[:8]}{ctx.dtype_suffix}"


def test_rrf_fuse_matches_the_formula():
    a = {"q1": [("x", 3.0), ("y", 2.0)], "q2": [("z", 1.0)]}
    b = {"q1": [("y", 9.0), ("w", 1.0)], "q2": []}
    fused = rrf_fuse([a, b], rrf_k=60)
    assert fused["q1"][0] == ("y", pytest.approx(1 / 62 + 1 / 61))
    assert dict(fused["q1"]) == pytest.approx({"x": 1 / 61, "y": 1 / 62 + 1 / 61, "w": 1 / 62})
    assert fused["q2"] == [("z", pytest.approx(1 / 61))]


def test_hybrid_fusion_and_tuning_split(tmp_path, scifact_small):
    from pyserini.search.faiss import DenseSearchResult

    from eval.beir.hybrid import pairs

    dense = pairs({"q": [DenseSearchResult("a", 0.9), DenseSearchResult("b", 0.5), DenseSearchResult("q", 0.4)]})
    assert dense == {"q": [("a", 0.9), ("b", 0.5), ("q", 0.4)]}
    sparse = {"q": [("b", 20.0), ("c", 10.0)]}
    # min-max centred: a = 0.5 - 0.5α, b = -0.1 + 0.5α, c = -0.5 - 0.5α; the query id "q" is dropped
    assert [d for d, _ in fuse(dense, sparse, 0.1, 10)["q"]] == ["a", "b", "c"]
    assert [d for d, _ in fuse(dense, sparse, 4.0, 10)["q"]] == ["b", "a", "c"]
    single = {"q": [("a", 1.0)]}  # one score cannot be min-max normalised
    assert [d for d, _ in fuse(single, sparse, 0.1, 10)["q"]][0] == "b"

    assert tuning_split(Dataset(str(scifact_small))) is None
    assert tuning_split(Dataset("beir/scifact/test")).name == "beir/scifact/train"
    assert tuning_split(Dataset("beir/nfcorpus/test")).name == "beir/nfcorpus/dev"
    folder = tmp_path / "with_dev"
    (folder / "qrels").mkdir(parents=True)
    for name in ("corpus.jsonl", "queries.jsonl", "qrels/test.tsv"):
        (folder / name).write_bytes((scifact_small / name).read_bytes())
    (folder / "qrels" / "dev.tsv").write_bytes((scifact_small / "qrels" / "test.tsv").read_bytes())
    split = tuning_split(Dataset(str(folder)))
    assert split.split == "dev" and split.qrels() == Dataset(str(folder)).qrels()


def test_unknown_system_is_a_clear_error(tmp_path, scifact_small, capsys):
    from eval.beir.__main__ import main

    assert main(["--dataset", str(scifact_small), "--output", str(tmp_path), "--systems", "bm42"]) == 2
    assert "bm42" in capsys.readouterr().err


def test_adapted_system_searches_with_a_changed_strategy(harness, scifact_small):
    """With top-k:8 as the default, the default's checkpoint alone and no test (alpha 1, no minimum gain), folds
    switch to a better strategy; its run is that strategy's own search of the index and the report says what the
    switch did."""
    from eval.beir.harness import results_markdown
    from eval.beir.context import Context
    from eval.beir.systems import aligner_adapted
    from pyserini_aligner.adapt.select import per_query

    class TopK8(Context):
        @property
        def strategy(self) -> str:
            return "top-k:8"

    base = harness_context(scifact_small, harness[1])
    ctx = TopK8(dataset=base.dataset, work=base.work, progress=False, alpha=1.0, min_gain=0.0,
                adapt_checkpoints=("aligner",))
    run = aligner_adapted(ctx)
    row = ctx.extras["aligner-adapted"]
    assert row["baseline"] == "aligner top-k:8" and row["changed_folds"] >= 1 and row["checkpoints"] == ["aligner"]
    assert row["switched"]["checkpoint"] == {"folds": 0, "delta": None}
    assert row["switched"]["strategy"] == {"folds": row["changed_folds"], "delta": row["changed_delta"]}
    changed = [f for f in row["fold_choices"] if f["changed"]]
    assert len(changed) == row["changed_folds"] and all(f["gain"] > 0 for f in changed)
    assert row["changed_delta"] == pytest.approx(sum(f["delta"] for f in changed) / len(changed), abs=2e-4)
    # a query of a changed fold's strategy gets that strategy's own search of the index (every document ranked,
    # as deep as the aligner system), not a rescored head of the top-k:8 run
    from pyserini_aligner.search import AlignerSearcher

    eight = ctx.runs["aligner-exact"]
    moved = sorted(q for q in run if run[q] != eight[q])
    assert moved and row["changed_queries"] >= len(moved)
    found = {}
    for spec in {f["strategy"] for f in changed}:
        searcher = AlignerSearcher(full_index(ctx), encoder=ctx.model, strategy=spec)
        found[spec] = searcher.batch_search([ctx.queries[q] for q in moved], moved, k=1001)
    for q in moved:
        assert len(run[q]) == len(eight[q]) > ctx.candidates  # the whole 300-document corpus, not a head of 100
        assert any([d for d, _ in run[q][:10]] == [h.docid for h in hits[q] if h.docid != q][:10]
                   for hits in found.values()), q
    per_eight = per_query(ctx.qrels, eight)
    for f in changed:
        rest = [q for q in per_eight if q not in f["queries"]]
        assert f["held_out_baseline"] == pytest.approx(sum(per_eight[q] for q in rest) / len(rest), abs=1e-4)
    md = results_markdown({"dataset": "d", "systems": {"aligner-adapted": {**row, "ndcg@10_run": 0.5, "recall@100":
                                                                            1.0, "recall@1000": 1.0}}})
    assert (f"switched {row['changed_folds']}/2 folds: checkpoint 0, strategy {row['changed_folds']} (held-out Δ "
            f"{row['changed_delta']:+.4f})") in md
    assert "| checkpoint | 0/2 (0%) |  |" in md
    share = f"{row['changed_folds']}/2 ({50 * row['changed_folds']}%)"
    assert f"| strategy only | {share} | {row['changed_delta']:+.4f} |" in md
    assert md.count("| aligner | top-") >= len(changed)


def test_adapted_system_switches_checkpoint(harness, scifact_small):
    """With the untrained initialisation as the default and no test (alpha 1, no minimum gain), folds switch to a
    trained checkpoint, chosen on its own exact index's rescoring of the default's candidates: a query of such a
    fold is ranked by that checkpoint's search of its index, and the report counts checkpoint switches apart from
    strategy switches."""
    from eval.beir.harness import results_markdown
    from eval.beir.context import Context
    from eval.beir.systems import aligner_adapted
    from pyserini_aligner.adapt.select import per_query
    from pyserini_aligner.search import AlignerSearcher

    base = harness_context(scifact_small, harness[1])
    ctx = Context(dataset=base.dataset, work=base.work, progress=False, encoder="untrained", alpha=1.0,
                  min_gain=0.0)
    run = aligner_adapted(ctx)
    row = ctx.extras["aligner-adapted"]
    assert row["baseline"] == "untrained top-k:1" and row["checkpoints"] == ["untrained", *SHIPPED]
    assert list(row["scores"]) == ["untrained", *SHIPPED]
    switched = [f for f in row["fold_choices"] if f["switch"] == "checkpoint"]
    assert switched and row["switched"]["checkpoint"]["folds"] == len(switched)
    assert all(f["checkpoint"] in SHIPPED for f in switched)
    # the choice: the default's candidates rescored on the checkpoint's own index, against the default's rescoring
    untrained = ctx.runs["aligner-exact"]
    default = per_query(ctx.qrels, rescored_runs(ctx, untrained, ["top-k:1"])["top-k:1"])
    for f in switched:
        chosen = per_query(ctx.qrels, rescored_runs(ctx, untrained, [f["strategy"]], f["checkpoint"])[f["strategy"]])
        assert f["gain"] == pytest.approx(sum(chosen[q] - default[q] for q in f["queries"]) / 8, abs=1e-4)
    # the run: a moved query is ranked by a chosen pair's own search of its checkpoint's index, as deep as
    # aligner-exact (the pair of another fold: some folds may switch the strategy only)
    qids = list(ctx.queries)
    searched = {}
    for f in (f for f in row["fold_choices"] if f["changed"]):
        searcher = AlignerSearcher(full_index(ctx, f["checkpoint"]), encoder=f["checkpoint"], strategy=f["strategy"])
        hits = searcher.batch_search([ctx.queries[q] for q in qids], qids, k=ctx.hits + 1)  # the harness's depth
        searched[f["checkpoint"], f["strategy"]] = {q: [(h.docid, h.score) for h in hits[q] if h.docid != q][:10]
                                                    for q in qids}
    moved = sorted(q for q in run if run[q] != untrained[q])
    assert moved
    for q in moved:
        assert len(run[q]) == len(untrained[q])
        assert any([d for d, _ in run[q][:10]] == [d for d, _ in top[q]] for top in searched.values()), q
    for f in switched:  # held out: that search against the default's on the other queries
        scores = per_query(ctx.qrels, searched[f["checkpoint"], f["strategy"]])
        rest = [q for q in scores if q not in f["queries"]]
        assert f["held_out"] == pytest.approx(sum(scores[q] for q in rest) / len(rest), abs=1e-4)
    md = results_markdown({"dataset": "d", "systems": {"aligner-adapted": {**row, "ndcg@10_run": 0.5, "recall@100":
                                                                            1.0, "recall@1000": 1.0}}})
    assert f"| checkpoint | {len(switched)}/2 ({50 * len(switched)}%) |" in md
    assert "checkpoints tried besides the default: " + ", ".join(SHIPPED) in md


def test_cached_runs_are_keyed_on_every_module_that_scores():
    """A change to any module that encodes, decodes or scores (every search module, the backends' included, but the
    command line and the defaults) changes the cache key, so the harness never reuses a stale run."""
    from pathlib import Path

    from eval.beir.cache import SCORING_MODULES
    import pyserini_aligner.search as search

    root, plumbing = Path(search.__file__).parent, {"__init__", "__main__", "defaults"}
    scoring = {".".join(["pyserini_aligner.search", *path.relative_to(root).with_suffix("").parts])
               for path in root.rglob("*.py") if path.stem not in plumbing}  # backends/ too
    assert "pyserini_aligner.search.backends.choose" in scoring
    scoring |= {"pyserini_aligner.model", "pyserini_aligner.alignment", "pyserini_aligner.strategy",
                "pyserini_aligner.kernels", "pyserini_aligner.index.codec", "pyserini_aligner.index.reader"}
    assert scoring <= set(SCORING_MODULES), scoring - set(SCORING_MODULES)


def test_dense_vectors_are_those_of_pyserinis_document_encoder():
    from pyserini.encode import AutoDocumentEncoder

    from conftest import scifact_docs
    from eval.beir.dense import MAX_LENGTH, encode_mean_pooled, minilm_folder

    texts = [doc["contents"] for doc in scifact_docs(24)] + ["", "a"]  # most past MAX_LENGTH tokens: cut
    folder = minilm_folder()
    reference = AutoDocumentEncoder(folder, pooling="mean", l2_norm=True, device="cpu")
    assert sum(len(ids) > MAX_LENGTH for ids in reference.tokenizer(texts)["input_ids"]) > 5
    expected = np.concatenate([reference.encode(texts[i:i + 8], max_length=MAX_LENGTH) for i in range(0, 26, 8)])
    np.testing.assert_allclose(encode_mean_pooled(texts, folder, batch_size=8), expected, atol=1e-5)
    bf16 = encode_mean_pooled(texts, folder, batch_size=8, dtype="bf16")  # the harness's choice on a bf16 CPU
    cosines = (bf16 * expected).sum(axis=1)
    assert cosines.min() > 0.999 and not np.allclose(bf16, expected, atol=1e-5)


def test_the_harness_encodes_the_lower_layers_once_with_the_models_own_vectors(harness, scifact_small):
    """Every shipped checkpoint was fine-tuned above layer 3; the full indexes hold what each model encodes alone."""
    from pyserini_aligner.index.reader import StoredIndex

    _, cache, _ = harness
    ctx = harness_context(scifact_small, cache)
    assert ctx.layers.depth == 3
    docs = list(Dataset(str(scifact_small)).docs())[:6]
    least = 0.99999 if ctx.dtype == "fp32" else 0.9995  # bf16 rounds differently in batches of other shapes
    for name in SHIPPED:
        store = StoredIndex(full_index(ctx, name))
        vectors, mask, _ = store.gather(np.asarray([store.row_of(doc.docid) for doc in docs]))
        alone = ctx.checkpoint(name).encode([doc.contents for doc in docs], is_query=False, dtype=ctx.dtype)
        for row, encoded in enumerate(alone):
            stored = vectors[row][mask[row]].numpy()
            assert stored.shape == encoded.vectors.shape
            cosines = (stored * encoded.vectors).sum(axis=1) / np.linalg.norm(stored, axis=1)
            assert cosines.min() > least, (name, row, cosines.min())
