"""eval.bench_memory: a tiny build measured in a fresh process, a built index tiled, and bad input."""
import json

from eval import bench_memory
from eval.bench_memory import STEPS
from test_bench_scale import SCIFACT, _tiny_zip


def test_builds_then_measures_each_step_in_a_fresh_process(tmp_path, capsys):
    archive = _tiny_zip(tmp_path / "scifact.zip")
    out, work = tmp_path / "out", tmp_path / "work"
    assert bench_memory.main(["--beir-zip", str(archive), "--build", "40", "--device", "cpu", "--codec", "IVF8,PQ4",
                              "--batch-size", "16", "--queries", "4", "--warmup", "1", "--threads", "1",
                              "--work", str(work), "--output", str(out), "--quiet"]) == 0
    report = json.loads((out / "bench_memory.json").read_text())
    index, search, total = report["index"], report["search"], report["summary"]
    assert (index["docs"], index["codec"], index["segments"]) == (40, "IVF8,PQ4", 1)
    assert 0 < index["codec_bytes"] < index["index_bytes"] and index["kept"] > 0
    assert report["build"]["docs"] == 40 and (work / "40" / "index" / "manifest.json").is_file()  # --work keeps it
    assert search["backend"] == "faiss" and search["threads"] == 1 and search["queries"] == 4
    assert 0 < search["p50_ms"] <= search["p95_ms"]
    memory = search["memory"]
    assert list(memory) == list(STEPS)
    peaks = [memory[step]["peak"] for step in STEPS]
    assert peaks == sorted(peaks) and peaks[0] < 200 << 20 < peaks[-1]  # torch and the model load after the start
    assert all(memory[step]["rss"] <= memory[step]["peak"] for step in STEPS)
    assert memory["start"]["anon"] + memory["start"]["file"] <= memory["start"]["rss"] + (1 << 20)
    assert memory["search"]["anon"] <= total["anon_peak_bytes"] <= total["peak_bytes"]
    assert total["peak_bytes"] == peaks[-1] and total["target_bytes"] == (2 << 30) + index["codec_bytes"]
    assert total["within_target"] and total["open_anon_per_doc"] == round(total["open_anon_bytes"] / 40, 1)
    table = (out / "bench_memory.md").read_text()
    assert capsys.readouterr().out.endswith(table) and table.count("\n| ") == len(STEPS) + 1

    tiled = tmp_path / "tiled-out"
    assert bench_memory.main(["--beir-zip", str(archive), "--index", str(work / "40" / "index"), "--tile", "3",
                              "--queries", "2", "--warmup", "0", "--output", str(tiled), "--quiet"]) == 0
    again = json.loads((tiled / "bench_memory.json").read_text())
    assert again["tiled_from"] == index and again["index"]["docs"] == 120 and again["index"]["segments"] == 3
    copies_docids = 2 * 40 * len("~t1")  # copies 1 and 2 name their documents docid~t1, docid~t2
    assert again["index"]["index_bytes"] == 3 * index["index_bytes"] - 2 * index["codec_bytes"] + copies_docids
    assert not list(tiled.glob(".bench_memory-*"))  # the temporary tiled index is removed


def test_bad_input_is_one_line(tmp_path, capsys):
    assert bench_memory.main(["--beir-zip", str(SCIFACT), "--index", str(tmp_path), "--output",
                              str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: --index {tmp_path}: no manifest.json (not an "
                                                             "index folder)"]
    assert bench_memory.main(["--beir-zip", str(tmp_path / "missing.zip"), "--build", "5", "--output",
                              str(tmp_path / "o")]) == 1
    assert capsys.readouterr().err.startswith("error: ")
