"""The CPU refinement study: both ways of scoring a query's candidates from their codes, timed on a real index."""
import json

from eval.experiments.cpu_refine import best_of, main


def test_best_of_keeps_the_shortest_time():
    calls = []
    assert best_of(3, lambda: calls.append(1)) >= 0 and len(calls) == 3


def test_both_ways_give_the_same_similarities(default_index, scifact_small, tmp_path, capsys):
    """On the shared default index, the searcher's look-up tables and decoding then multiplying agree to float
    rounding on every real candidate token, and each row reports its codec and positive timings."""
    assert main(["--dataset", str(scifact_small), "--index", str(default_index), "--output", str(tmp_path),
                 "--queries", "3", "--repeats", "1", "--quiet"]) == 0
    report = json.loads((tmp_path / "cpu_refine.json").read_text())
    (row,) = report["rows"]
    assert row["codec"].startswith("IVF") and "Refine(PQ" in row["codec"] and row["queries"] == 3
    assert row["tokens_per_query"] > 0 and min(row["adc_ms"], row["decode_ms"], row["decode_product_ms"]) > 0
    assert row["max_abs_diff"] < 1e-5
    assert f"`{row['codec']}`" in (tmp_path / "cpu_refine.md").read_text() and "| codec |" in capsys.readouterr().out
