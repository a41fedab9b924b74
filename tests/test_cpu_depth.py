"""The CPU depth study: its settings, its table, and a run over the harness's indexes whose default row is what the
searcher's own defaults return."""
import argparse
import json

import pytest

from eval.experiments.cpu_depth import DEFAULT_SETTING, Setting, main, markdown, settings_list
from harness_support import harness_context, harness_run
from pyserini_aligner.search.options import DEPTH_DEFAULTS


def test_settings_parse_as_refined_and_interaction_pairs():
    assert settings_list("128/0, 64/512,96") == [Setting(128, 0), Setting(64, 512), Setting(96, 0)]
    assert DEFAULT_SETTING == Setting(DEPTH_DEFAULTS["cpu"][2], DEPTH_DEFAULTS["cpu"][3])
    assert str(Setting(64, 512)) == "64/512"
    for bad in ("x/1", "0/5", "5/-1", "5/", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            settings_list(bad)


def test_markdown_marks_the_default_row():
    report = {"dataset": "beir/x/dev", "queries": 3, "hits": 10, "query_prune": 0.5, "threads": 2,
              "timed_queries": 3, "batch_size": 32, "default": "128/0", "reference": {"ndcg@10": 0.5},
              "rows": [{"setting": "128/0", "overlap@10": 0.8, "ndcg@10": 0.45, "p50_ms": 1.0, "p95_ms": 2.0,
                        "batch_ms_per_query": 0.5},
                       {"setting": "64/512", "overlap@10": 0.9, "p50_ms": 1.5, "p95_ms": 2.5,
                        "batch_ms_per_query": 0.7}]}
    lines = markdown(report).splitlines()
    assert lines[0].startswith("beir/x/dev, 3 queries, 10 hits, β^q 0.5, 2 threads")
    assert lines[-3] == "| exact, 1000 hits | 1.0 | 0.5 | | | |"
    assert lines[-2] == "| **128/0** (default) | 0.8 | 0.45 | 1.0 | 2.0 | 0.5 |"
    assert lines[-1] == "| 64/512 | 0.9 |  | 1.5 | 2.5 | 0.7 |"


def test_the_default_row_is_the_searchers_defaults(tmp_path_factory, scifact_small, tmp_path, capsys):
    """Over the harness's indexes of a 150-document folder: one row a setting, every value in range, and the
    default row's overlap is that of the searcher with no depth given against the exact index's run."""
    from eval.beir.aligner import default_index, full_index, search
    from eval.experiments.refine_bytes import overlap_at
    from pyserini_aligner.search import AlignerSearcher

    _, cache, _ = harness_run(tmp_path_factory, scifact_small)
    out = tmp_path / "out"
    assert main(["--dataset", str(scifact_small), "--cache", str(cache), "--output", str(out), "--hits", "5",
                 "--settings", f"{DEFAULT_SETTING},4/0,4/16", "--timed-queries", "3", "--quiet"]) == 0
    report = json.loads((out / "cpu_depth.json").read_text())
    assert [row["setting"] for row in report["rows"]] == [str(DEFAULT_SETTING), "4/0", "4/16"]
    assert capsys.readouterr().out.endswith((out / "cpu_depth.md").read_text() + "\n")  # the table is printed
    for row in report["rows"]:
        assert 0.0 <= row["overlap@5"] <= 1.0 and 0.0 <= row["ndcg@10"] <= 1.0
        assert 0 < row["p50_ms"] <= row["p95_ms"]

    ctx = harness_context(scifact_small, cache)
    reference = search(ctx, full_index(ctx), 0.5, desc="exact", hits=1000)
    searcher = AlignerSearcher(default_index(ctx), device="cpu")
    qids = list(ctx.queries)
    found = searcher.batch_search([ctx.queries[q] for q in qids], qids, k=6)
    run = {q: [(h.docid, float(h.score)) for h in found[q] if h.docid != q][:5] for q in qids}
    assert report["rows"][0]["overlap@5"] == round(overlap_at(run, reference, 5), 4)


def test_bad_flags_exit_with_a_message(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--dataset", "beir/scifact/train", "--output", "x", "--settings", "0/5"])
    assert exit_info.value.code == 2
    assert "C must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--dataset", "beir/scifact/train", "--output", "x", "--hits", "0"])
    assert "argument --hits: expected an integer >= 1" in capsys.readouterr().err
