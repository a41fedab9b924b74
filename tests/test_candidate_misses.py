"""eval.experiments.candidate_misses end to end on the CPU: a few hundred synthetic passages, the default index built
from their exact tokens, every missed exact top-10 passage given one cause, the candidate variants scored."""
import json

import pytest
from test_bench_scale import _tiny_zip

from eval.experiments import candidate_misses


def test_every_miss_has_one_cause_and_wider_candidates_hold_more_of_the_exact_top_10(tmp_path, capsys):
    archive, out = _tiny_zip(tmp_path / "scifact.zip", n_queries=4, n_other=2), tmp_path / "out"
    assert candidate_misses.main(["--beir-zip", str(archive), "--size", "100", "--queries", "4", "--device", "cpu",
                                  "--depth", "20:1:20:40", "--codec", "IVF16,PQ4,Refine(PQ16)", "--batch-size", "64",
                                  "--search-batch", "4", "--output", str(out), "--quiet"]) == 0
    report = json.loads((out / "candidate_misses.json").read_text())
    result = report["result"]
    assert report["settings"]["depth"][2:] == [40, 20] and result["exact_top10"] == 40
    assert result["same_as_engine_search"] == 4  # the step-by-step search ranks as the engine does
    causes = result["causes"]
    assert result["missed"] == len(result["misses"]) == sum(c["misses"] for c in causes.values()) > 0
    assert {m["cause"] for m in result["misses"]} <= set(candidate_misses.CAUSES)
    variants = {v["variant"]: v for v in result["variants"]}
    default = variants["default"]
    assert default["overlap@10"] == result["overlap@10"] == pytest.approx(1 - result["missed"] / 40, abs=1e-4)
    not_refined = result["missed"] - causes["codes"]["misses"]
    assert default["recall@refined"] == pytest.approx(1 - not_refined / 40, abs=1e-4)
    assert default["refined"] <= 20 and variants["C ×4"]["refined"] <= 80
    assert default["recall@refined"] <= variants["C ×2"]["recall@refined"] <= variants["C ×4"]["recall@refined"]
    assert variants["default ∪ oracle top C"]["recall@refined"] >= max(
        default["recall@refined"], variants["oracle interaction top C"]["recall@refined"])
    assert all(v["overlap@10"] <= v["recall@refined"] for v in variants.values())
    table = (out / "candidate_misses.md").read_text()
    assert f"| codes | {causes['codes']['misses']} |" in table and "| C ×4 |" in table
    assert capsys.readouterr().out.endswith(table)
    with pytest.raises(SystemExit) as refused:
        candidate_misses.parse_args(["--beir-zip", str(archive), "--size", "200", "--depth", "8:1",
                                     "--output", str(out)])
    assert refused.value.code == 2
