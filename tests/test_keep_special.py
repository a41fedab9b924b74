"""eval.experiments.keep_special on CPU over a tiny bundle: both models × keep_special, JSON + Markdown table."""

import json

from eval.experiments.keep_special import main
from pyserini_aligner.train.data import write_bundle

DOCS = {
    "d0": "Metformin lowers blood glucose in diabetic patients.",
    "d1": "Vitamin D deficiency is linked to weak bones and fractures.",
    "d2": "Statins reduce LDL cholesterol and heart attacks.",
    "d3": "Sleep deprivation impairs memory consolidation.",
    "d4": "Exercise improves mood and reduces depression symptoms.",
}


def test_keep_special_table(tmp_path, capsys):
    validation = {"tiny-dev": {"corpus": "tiny", "queries": {"v0": "statins and heart disease",
                                                             "v1": "depression and physical activity",
                                                             "v2": "does metformin treat diabetes"},
                               "qrels": {"v0": {"d2": 2}, "v1": {"d4": 1}, "v2": {"d0": 1}}}}
    bundle = write_bundle({"meta": {}, "corpora": {"tiny": {"docids": list(DOCS), "texts": list(DOCS.values())}},
                           "train": {}, "validation": validation}, tmp_path / "bundle.json.gz")
    out = tmp_path / "ks.json"
    result = main(["--bundle", str(bundle), "--output", str(out), "--device", "cpu", "--batch-size", "4"])
    assert json.loads(out.read_text()) == result
    assert [(r["model"], r["keep_special"]) for r in result["rows"]] == [
        ("aligner", True), ("aligner", False), ("untrained", True), ("untrained", False)]
    for row in result["rows"]:
        metrics = row["sets"]["tiny-dev"]
        assert metrics["queries"] == 3 and all(0.0 <= metrics[m] <= 1.0 for m in ("ndcg@10", "ndcg@10_pruned"))
    assert result["validation_queries"] == {"tiny-dev": 3}
    assert "| untrained | False |" in capsys.readouterr().out
