"""The cross-domain experiment end to end on CPU: tiny bundle cut from the real corpora, a few steps per run."""

import gzip
import json
import os
import zipfile
from pathlib import Path

import pytest
import torch

from eval.experiments.cross_domain.prepare import TEST_FORMAT
from eval.experiments.cross_domain.run import RECIPES, best_top_p_drop, choose_recipe, choose_refinement, split_recipe
from pyserini_aligner.model import AlignerModel
from pyserini_aligner.train.data import write_bundle
from pyserini_aligner.train.pseudo import pseudo_queries, title_queries


def corpus_docs(name: str, n: int) -> list[tuple[str, str, str]]:
    """(docid, title, title + text) of the corpus's first ``n`` documents."""
    with zipfile.ZipFile(Path(os.environ["PYSERINI_ALIGNER_BEIR_DIR"]) / f"{name}.zip") as archive:
        lines = archive.read(f"{name}/corpus.jsonl").decode().splitlines()[:n]
    return [(d["_id"], d["title"], f"{d['title']} {d['text']}".strip()) for d in map(json.loads, lines)]


@pytest.fixture(autouse=True)
def torch_queries(monkeypatch):
    """The experiment loads and trains a dozen models on the CPU: their queries are encoded by torch, not through an
    ONNX Runtime graph exported for each (that path is tested in tests/test_onnx_runtime.py)."""
    from pyserini_aligner.onnx_runtime import RUNTIME_ENV, TORCH

    monkeypatch.setenv(RUNTIME_ENV, TORCH)


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory):
    """Both corpora (8 docs each); two sentences of each document stand in for the labelled queries (6 for
    training, 4 for validation, 4 for test)."""
    folder = tmp_path_factory.mktemp("cross_domain")
    corpora, train, validation, tests, train_corpus = {}, {}, {}, {}, {}
    for name, val_name, test_name in (("scifact", "scifact-heldout", "scifact-test"),
                                      ("nfcorpus", "nfcorpus-dev", "nfcorpus-test")):
        titled = corpus_docs(name, 8)
        docs = [(d, t) for d, _, t in titled]
        docids = [d for d, _ in docs]
        corpora[name] = {"docids": docids, "texts": [t for _, t in docs]}
        queries = pseudo_queries(docs, per_doc=2, min_rest_words=5)
        others = lambda q: [d for d in docids if d != q.docid][:5]  # noqa: E731
        train[name] = [{"qid": q.qid, "text": q.text, "positives": {q.docid: 1}, "negatives": others(q)}
                       for q in queries[:6]]
        train[f"{name}-pseudo"] = [{"qid": q.qid, "text": q.text, "positives": {q.docid: 1}, "negatives": others(q),
                                    "drop": list(q.span)} for q in queries]
        train[f"{name}-titles"] = [{"qid": q.qid, "text": q.text, "positives": {q.docid: 1}, "negatives": others(q),
                                    "drop": list(q.span)} for q in title_queries(titled, min_rest_words=5)]
        train_corpus[f"{name}-pseudo"] = train_corpus[f"{name}-titles"] = name
        validation[val_name] = {"corpus": name, "queries": {q.qid: q.text for q in queries[6:10]},
                                "qrels": {q.qid: {q.docid: 1} for q in queries[6:10]}}
        tests[test_name] = {"corpus": name, "queries": {q.qid: q.text for q in queries[10:14]},
                            "qrels": {q.qid: {q.docid: 1} for q in queries[10:14]}}
    write_bundle({"meta": {}, "corpora": corpora, "train": train, "validation": validation,
                  "train_corpus": train_corpus}, folder / "bundle.json.gz")
    with gzip.open(folder / "test.json.gz", "wt") as out:
        json.dump({"format": TEST_FORMAT, "sets": tests}, out)
    return folder


def test_choose_recipe_rule():
    floors = {"scifact": 0.70, "nfcorpus": 0.33}
    scores = {"default": {"scifact": {"in": 0.80, "off": 0.32}, "nfcorpus": {"in": 0.35, "off": 0.72}},
              "anchor": {"scifact": {"in": 0.80, "off": 0.34}, "nfcorpus": {"in": 0.35, "off": 0.71}},
              "greedy": {"scifact": {"in": 0.70, "off": 0.36}, "nfcorpus": {"in": 0.30, "off": 0.75}}}
    assert choose_recipe(scores, floors)[0] == "anchor"  # greedy wins off-domain but loses in-domain
    del scores["anchor"]
    recipe, why = choose_recipe(scores, floors)
    assert recipe == "default" and "no recipe reached" in why
    assert split_recipe("default") == ("default", 1.0) and split_recipe("anchor-mix@0.5") == ("anchor-mix", 0.5)
    for bad in ("nope", "default@0", "default@1.5", "default@x"):
        with pytest.raises(ValueError, match="--recipes"):
            split_recipe(bad)


def test_experiment_end_to_end_on_cpu(bundle_dir, tmp_path, capsys):
    from eval.experiments.cross_domain.__main__ import main

    tiny = {"epochs": 1, "max_steps": 2, "batch_queries": 4, "query_maxlen": 16, "doc_maxlen": 24,
            "eval_batch_size": 16, "precision": "fp32", "prune_k_per_token": 4, "negatives_per_query": 1,
            "negative_depth": 3, "negative_skip": 0, "train_layers": 1, "distill_rank": 20,
            "projection_fit_steps": 5}
    sets = [a for k, v in tiny.items() for a in ("--set", f"{k}={v}")]
    export = tmp_path / "export"
    code = main(["--bundle", str(bundle_dir), "--output", str(tmp_path / "work"), "--export", str(export),
                 "--recipes", "anchor-mix-pseudo@0.5", "--adaptations", "anchored,titles", "--no-salience",
                 "--device", "cpu", "--quiet", *sets])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    results = json.loads((export / "results.json").read_text())
    recipe = results["choice"]["recipe"]
    assert recipe == "anchor-mix-pseudo@0.5" and printed["choice"] == recipe
    assert set(results["single_domain"]) == {f"{recipe}.{d}" for d in ("scifact", "nfcorpus")}
    assert results["projection_fit"]["fit128"]["steps"] == 5
    assert set(results["test"]) == {"raw384", "pca128", "fit128", f"{recipe}.scifact", f"{recipe}.nfcorpus", "final",
                                    "adapt.scifact-to-nfcorpus", "adapt.nfcorpus-to-scifact", "shipped"}
    for row in results["test"].values():
        assert set(row) == {"scifact-test", "nfcorpus-test"} and all(0.0 <= v <= 1.0 for v in row.values())
    assert set(results["top_p"]) == {"raw384", "final", "shipped"} and len(results["targets"]) == 10
    assert results["final"]["recipe"] == recipe and "Chosen recipe" in (export / "results.md").read_text()
    model = AlignerModel.from_pretrained(export / "checkpoint")  # the salience stage is tested in test_train
    assert model.config.dim == 128 and model.config.doc_maxlen == 24
    runs = tmp_path / "work" / "runs"
    # "@0.5" is the base run's weights halfway back to the start (fp16 deltas): start + 0.5 (trained - start)
    from safetensors.torch import load_file
    from transformers import AutoModel

    from pyserini_aligner.model import resolve_backbone

    start = AutoModel.from_pretrained(resolve_backbone("minilm")).state_dict()
    trained = load_file(str(runs / "anchor-mix-pseudo.scifact" / "last" / "backbone_delta.safetensors"))
    half = load_file(str(runs / f"{recipe}.scifact" / "last" / "backbone_delta.safetensors"))
    assert set(half) == set(trained) and half
    for name, value in half.items():
        expected = start[name] + 0.5 * (trained[name].float() - start[name])
        torch.testing.assert_close(value.float(), expected, atol=2e-3, rtol=2e-3)
    assert RECIPES["anchor-mix-pseudo"]["label_free"] == ["pseudo"]
    log = (runs / "anchor-mix-pseudo.scifact" / "config.yaml").read_text()
    assert "scifact-pseudo" in log and "anchor_weight: 1.0" in log
    assert "weight_interpolation: 0.5" in (runs / "final" / "config.yaml").read_text()
    # each adaptation setting ran in both directions; the titles setting trained on the target's titles too
    assert set(results["adaptation"]) == {f"adapt-{a}.{s}" for a in ("anchored", "titles")
                                          for s in ("scifact-to-nfcorpus", "nfcorpus-to-scifact")}
    assert results["adaptation_choice"]["setting"] in {"anchored", "titles"}
    assert "- nfcorpus-titles" in (runs / "adapt-titles.scifact-to-nfcorpus" / "config.yaml").read_text()
    # validation only: the choices, no final run and no test set opened
    assert main(["--bundle", str(bundle_dir), "--output", str(tmp_path / "val"), "--recipes", "default",
                 "--adaptations", "fused-distill", "--validation-only", "--device", "cpu", "--quiet", *sets]) == 0
    printed = json.loads(capsys.readouterr().out)
    results = json.loads((tmp_path / "val" / "results.json").read_text())
    assert printed["choice"] == "default" and printed["adaptation"]["setting"] == "fused-distill"
    # the fused teacher's parts were measured on each target's validation queries before adapting towards them
    assert set(results["teachers"]) == {"scifact-to-nfcorpus", "nfcorpus-to-scifact"}
    assert all(set(r) == {"model", "raw384", "bm25", "model+raw384", "model+bm25", "raw384+bm25", "fusion"}
               and all(0.0 <= v <= 1.0 for v in r.values()) for r in results["teachers"].values())
    assert "fused teacher and its parts" in (tmp_path / "val" / "results.md").read_text()
    assert "anchor: fusion" in (tmp_path / "val" / "runs" / "adapt-fused-distill.nfcorpus-to-scifact" /
                                "config.yaml").read_text()
    assert "test" not in results and "final" not in results and (tmp_path / "val" / "results.md").is_file()
    assert main(["--bundle", str(tmp_path), "--output", str(tmp_path / "w2"), "--quiet"]) == 2
    assert "bundle.json.gz is missing" in capsys.readouterr().err


def test_top_p_only_measures_the_response_of_named_checkpoints(bundle_dir, tmp_path, capsys):
    from eval.experiments.cross_domain.__main__ import main

    code = main(["--bundle", str(bundle_dir), "--output", str(tmp_path / "work"), "--top-p-only", "aligner",
                 "--device", "cpu", "--quiet", "--set", "doc_maxlen=24", "--set", "query_maxlen=16"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    results = json.loads((tmp_path / "work" / "results.json").read_text())
    assert set(results["top_p"]) == {"raw384", "aligner"} and "test" not in results
    for domain in ("scifact", "nfcorpus"):
        row = results["top_p"]["aligner"][domain]
        assert set(row["test"]) == {"top-k:1", "top-p:0.01", "top-p:0.02", "top-p:0.03", "top-p:0.05"}
        best = max(v for k, v in row["test"].items() if k != "top-k:1")
        assert row["best_top_p_minus_top_k1"] == pytest.approx(best - row["test"]["top-k:1"], abs=1e-4)
        check = results["targets"][f"top-p response of aligner on {domain} test"]
        assert printed[f"top-p response of aligner on {domain} test"] == check["ok"]
        assert check["ok"] == (check["aligner"] >= check["raw384"])
    assert "Top-p response" in (tmp_path / "work" / "results.md").read_text()
    assert main(["--bundle", str(bundle_dir), "--output", str(tmp_path / "w2"), "--top-p-only", ",",
                 "--device", "cpu", "--quiet"]) == 2


def test_choose_refinement_rule():
    def row(k1: float, *top_p: float) -> dict[str, float]:
        return {"top-k:1": k1, **{f"top-p:{p}": v for p, v in zip((0.01, 0.02, 0.03, 0.05), top_p)}}

    validation = {"raw384": {"a": row(0.70, 0.69, 0.68, 0.6, 0.5), "b": row(0.35, 0.34, 0.3, 0.3, 0.3)},
                  "shipped": {"a": row(0.80, 0.77, 0.7, 0.7, 0.7), "b": row(0.37, 0.34, 0.3, 0.3, 0.3)},
                  "keeps": {"a": row(0.798, 0.795, 0.7, 0.7, 0.7), "b": row(0.369, 0.362, 0.3, 0.3, 0.3)},
                  "better": {"a": row(0.801, 0.8, 0.7, 0.7, 0.7), "b": row(0.37, 0.369, 0.3, 0.3, 0.3)},
                  "loses": {"a": row(0.78, 0.79, 0.7, 0.7, 0.7), "b": row(0.36, 0.36, 0.3, 0.3, 0.3)}}
    assert best_top_p_drop(validation["raw384"]["a"]) == pytest.approx(-0.01)
    assert choose_refinement(validation)[0] == "better"  # "loses" keeps top-p but is 1.5 points below in-domain
    del validation["better"]
    assert choose_refinement(validation)[0] == "keeps"
    validation["keeps"]["b"]["top-p:0.01"] = 0.355  # 1.4 points below its top-k:1, raw384 only 1
    chosen, why = choose_refinement(validation)
    assert chosen is None and "no refinement" in why


def test_refine_trains_from_the_shipped_checkpoint_and_tests_only_the_chosen(bundle_dir, tmp_path, capsys,
                                                                             monkeypatch):
    from eval.experiments.cross_domain import run
    from eval.experiments.cross_domain.__main__ import main

    rule = {}

    def first_setting(validation):  # the real rule's answer is recorded; the test stage runs for "mix-self"
        rule["answer"] = choose_refinement(validation)
        return "mix-self", "first setting"

    monkeypatch.setattr(run, "choose_refinement", first_setting)
    tiny = {"max_steps": 2, "batch_queries": 4, "query_maxlen": 16, "doc_maxlen": 24, "eval_batch_size": 16,
            "precision": "fp32", "negatives_per_query": 1, "negative_depth": 3, "negative_skip": 0}
    sets = [a for k, v in tiny.items() for a in ("--set", f"{k}={v}")]
    export = tmp_path / "export"
    assert main(["--bundle", str(bundle_dir), "--output", str(tmp_path / "work"), "--export", str(export),
                 "--refine", "mix-self,mix", "--no-salience", "--device", "cpu", "--quiet", *sets]) == 0
    printed = json.loads(capsys.readouterr().out)
    results = json.loads((export / "results.json").read_text())
    validation = results["refinement_choice"]["validation"]
    assert set(validation) == {"raw384", "shipped", "mix-self", "mix"}
    assert rule["answer"] == choose_refinement(validation) and printed["choice"] == "mix-self"
    assert set(results["top_p"]) == {"raw384", "shipped", "mix-self"} and len(results["targets"]) == 6
    assert printed["targets"] == {k: v["ok"] for k, v in results["targets"].items()}
    config = (tmp_path / "work" / "runs" / "refine-mix-self" / "config.yaml").read_text()
    assert "anchor_strategy: top-k:1" in config and "init: aligner" in config and "top-p:0.02" in config
    assert "Refinements of the shipped checkpoint" in (export / "results.md").read_text()
    model = AlignerModel.from_pretrained(export / "checkpoint")
    assert model.config.dim == 128 and model.config.doc_maxlen == 24
    assert "mix of alignments" in model.config.description
    # validation only: the choice, no test set opened
    assert main(["--bundle", str(bundle_dir), "--output", str(tmp_path / "val"), "--refine", "mix",
                 "--validation-only", "--device", "cpu", "--quiet", *sets]) == 0
    capsys.readouterr()
    results = json.loads((tmp_path / "val" / "results.json").read_text())
    assert set(results["refinement_choice"]["validation"]) == {"raw384", "shipped", "mix"} and "top_p" not in results
    assert main(["--bundle", str(bundle_dir), "--output", str(tmp_path / "w2"), "--refine", "nope",
                 "--device", "cpu", "--quiet"]) == 2
    assert "--refine: unknown setting" in capsys.readouterr().err


def test_wide_recipe_without_adaptation(bundle_dir, tmp_path, capsys):
    """A 384-d recipe (the backbone's own token space, identity projection) runs end to end with no label-free
    adaptation: its models and the exported checkpoint have dim 384 and no adaptation is reported."""
    from eval.experiments.cross_domain.__main__ import main

    tiny = {"epochs": 1, "max_steps": 2, "batch_queries": 4, "query_maxlen": 16, "doc_maxlen": 24,
            "eval_batch_size": 16, "precision": "fp32", "prune_k_per_token": 4, "negatives_per_query": 1,
            "negative_depth": 3, "negative_skip": 0, "train_layers": 1, "projection_fit_steps": 5}
    sets = [a for k, v in tiny.items() for a in ("--set", f"{k}={v}")]
    export = tmp_path / "export"
    assert main(["--bundle", str(bundle_dir), "--output", str(tmp_path / "work"), "--export", str(export),
                 "--recipes", "wide", "--adaptations", "none", "--device", "cpu", "--quiet",
                 *sets]) == 0
    printed = json.loads(capsys.readouterr().out)
    results = json.loads((export / "results.json").read_text())
    assert printed["choice"] == "wide" and "adaptation" not in results and "adaptation_choice" not in results
    assert not any(name.startswith("adapt") for name in results["test"])
    assert not any(name.startswith("adaptation") for name in results["targets"])
    assert "dim: 384" in (tmp_path / "work" / "runs" / "wide.scifact" / "config.yaml").read_text()
    assert AlignerModel.from_pretrained(export / "checkpoint").config.dim == 384
