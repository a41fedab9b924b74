"""eval.bench_scale: the synthetic corpus, nDCG@10 against ranx, and a tiny end-to-end run on the CPU."""
import json
import os
import random
import zipfile
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch

from eval.bench_scale import __main__ as cli
from eval.bench_scale.corpus import SPAN_WEIGHTS, SyntheticCorpus, parse_size, read_beir_zip, size_label
from eval.bench_scale.measure import overlap_at_k
from eval.bench_scale.report import COLUMNS, DASH
from pyserini_aligner.index.reader import StoredIndex

SCIFACT = Path(os.environ["PYSERINI_ALIGNER_BEIR_DIR"]) / "scifact.zip"


@pytest.fixture(scope="module")
def scifact():
    return read_beir_zip(SCIFACT)


@pytest.fixture(scope="module")
def corpus(scifact):
    return SyntheticCorpus(scifact, seed=0)


def test_reads_the_zip_directly(scifact):
    assert len(scifact.docs) == 5183 and len(scifact.queries) == 300
    assert sum(len(judged) for judged in scifact.qrels.values()) == 339
    docid, contents = scifact.docs[0]
    assert docid == "4983" and contents.startswith("Microstructural development of human newborn cerebral white")


def test_originals_first_with_their_docids_judged_ones_leading(scifact, corpus):
    head = list(islice(corpus, len(scifact.docs) + 3))
    assert dict(head[:len(scifact.docs)]) == dict(scifact.docs)
    judged = list(dict.fromkeys(d for rels in scifact.qrels.values() for d in rels))
    assert [docid for docid, _ in head[:len(judged)]] == judged
    assert [docid for docid, _ in head[len(scifact.docs):]] == ["p0", "p1", "p2"]


def test_generator_is_deterministic_and_sizes_are_prefixes(scifact, corpus):
    past_spans = corpus.num_originals + corpus.num_spans + 300  # into the joined passages
    again = SyntheticCorpus(scifact, seed=0)
    first = list(corpus.passages(past_spans))
    assert first == list(again.passages(past_spans))
    assert list(corpus.passages(1000)) == first[:1000]
    other = list(islice(SyntheticCorpus(scifact, seed=1).passages(past_spans), corpus.num_originals, None))
    assert sum(a != b for a, b in zip(first[corpus.num_originals:], other)) > 0.99 * len(other)
    with pytest.raises(ValueError, match="corpus size"):
        corpus.passages(0)


def test_passage_lengths_and_variety(corpus):
    from pyserini_aligner.model import AlignerModel

    tokenizer = AlignerModel.from_pretrained("aligner").tokenizer
    spans = list(islice(corpus, corpus.num_originals, corpus.num_originals + 20_000))
    start = corpus.num_originals + corpus.num_spans
    joined = list(islice(corpus, start, start + 20_000))
    assert 60_000 < corpus.num_spans < 150_000  # SciFact: about 100k distinct spans
    for part in (spans, joined):
        texts = [text for _, text in random.Random(0).sample(part, 1000)]
        words = np.array([len(t.split()) for t in texts])
        pieces = np.array([len(ids) for ids in tokenizer.ids(texts, special=False)])
        assert 40 <= words.mean() <= 55 and np.percentile(words, 5) >= 8
        assert 60 <= pieces.mean() <= 80
        assert len({t for _, t in part}) > 0.99 * len(part)  # passages are rarely identical
    assert len({t for _, t in joined}) > 0.999 * len(joined)
    sentences = np.array([corpus.spans[i, 2] for i in range(20_000)])
    shares = np.bincount(sentences, minlength=5)[1:] / len(sentences)
    assert np.allclose(shares, list(SPAN_WEIGHTS.values()), atol=0.02)


def test_passages_between_equal_the_sequence(corpus):
    """Any range of the sequence, made without the passages before it: across the originals, the spans and the
    joined passages (and their blocks of random draws)."""
    ends = corpus.num_originals + corpus.num_spans
    ranges = [(0, 3), (corpus.num_originals - 2, corpus.num_originals + 2), (ends - 2, ends + 3),
              (ends + 4094, ends + 4099), (ends + 3 * 4096 + 5, ends + 3 * 4096 + 9)]
    whole = list(islice(iter(corpus), ranges[-1][1]))
    for start, stop in ranges:
        assert list(corpus.passages_between(start, stop)) == whole[start:stop]


def test_sizes_parse_and_print():
    assert [parse_size(s) for s in ("300", "5k", "100K", "1m", "8.8m")] == [300, 5000, 100_000, 10**6, 8_800_000]
    assert [size_label(n) for n in (300, 5000, 10**6, 8_800_000, 5183)] == ["300", "5k", "1m", "8.8m", "5183"]
    for bad in ("0", "5q", "1.5", "", "inf", "nan"):
        with pytest.raises(ValueError, match="size"):
            parse_size(bad)


def test_overlap_at_k():
    a = [[("x", 3.0), ("y", 2.0)], [("u", 1.0), ("v", 0.5)]]
    b = [[("y", 3.0), ("x", 2.0)], [("u", 1.0), ("w", 0.5)]]
    assert overlap_at_k(a, b, k=2) == 0.75


def _tiny_zip(path: Path, n_queries: int = 6, n_other: int = 10) -> Path:
    """A BEIR zip cut from SciFact: the judged documents of the first test queries plus a few others."""
    with zipfile.ZipFile(SCIFACT) as archive:
        docs = archive.read("scifact/corpus.jsonl").decode().splitlines()
        queries = archive.read("scifact/queries.jsonl").decode().splitlines()
        qrels = archive.read("scifact/qrels/test.tsv").decode().splitlines()
    qids = list(dict.fromkeys(row.split("\t")[0] for row in qrels[1:]))[:n_queries]
    rows = [row for row in qrels[1:] if row.split("\t")[0] in qids]
    judged = {row.split("\t")[1] for row in rows}
    kept = [line for line in docs if json.loads(line)["_id"] in judged]
    kept += [line for line in docs if json.loads(line)["_id"] not in judged][:n_other]
    with zipfile.ZipFile(path, "w") as out:
        out.writestr("scifact/corpus.jsonl", "\n".join(kept) + "\n")
        out.writestr("scifact/queries.jsonl", "\n".join(q for q in queries if json.loads(q)["_id"] in qids) + "\n")
        out.writestr("scifact/qrels/test.tsv", "\n".join([qrels[0], *rows]) + "\n")
    return path


def fewer_warmup_queries(monkeypatch) -> None:
    """One untimed query before each per-query latency: a harness test shows the figures filled, not steady."""
    from eval.bench_scale import run

    monkeypatch.setattr(run, "WARMUP", 1)


def test_end_to_end_tiny_run_fills_every_column(tmp_path, capsys, monkeypatch):
    fewer_warmup_queries(monkeypatch)
    archive = _tiny_zip(tmp_path / "scifact.zip")
    out, work = tmp_path / "out", tmp_path / "work"
    assert cli.main(["--beir-zip", str(archive), "--sizes", "40", "--max-queries", "5", "--device", "cpu",
                     "--codec", "IVF8,PQ4", "--batch-size", "16", "--cpu-threads", "1", "--tile-to", "100",
                     "--exact-max-docs", "40",
                     "--output", str(out), "--work", str(work), "--quiet"]) == 0
    report = json.loads((out / "bench_scale.json").read_text())
    assert report["machine"]["cpu_count"] >= 1 and report["machine"]["torch"]
    row, tiled = report["rows"]
    assert row["docs"] == 40 and row["codec"] == "IVF8,PQ4" and row["queries"] == 5
    assert row["build"]["total_s"] > 0 and row["passages_per_s"] > 0
    assert row["peak_disk_bytes"] >= row["index_bytes"] > 0 and row["bytes_per_passage"] > 0
    assert row["peak_rss_build_gib"] > 0.1 and row["peak_gpu_build_gib"] is None
    assert 0 < row["p50_ms"] <= row["p95_ms"] and row["qps_b32"] > 0 and row["qps_b300"] > 0
    assert 0.5 <= row["overlap@10"] <= 1 and 0.3 < row["ndcg@10"] <= 1 and 0.3 < row["ndcg@10_exhaustive"] <= 1
    assert 0.5 <= row["overlap@10_exact"] <= 1 and 0.3 < row["ndcg@10_exact"] <= 1
    assert "overlap@10_exact" not in report["rows"][1]  # a tiled index has no exact reference of its own
    assert report["cpu"]["threads"] == 1 and 0 < report["cpu"]["p50_ms"] <= report["cpu"]["p95_ms"]
    assert tiled["docs"] == 120 and tiled["tiled"]["copies"] == 3 and tiled["label"] == "120"
    assert 0 < tiled["p50_ms"] <= tiled["p95_ms"] and 0 < tiled["ndcg@10"] <= row["ndcg@10_exhaustive"] + 1e-9
    built, tiled_index = StoredIndex(work / "40" / "index"), StoredIndex(work / "tiled" / "index")  # --work keeps
    assert tiled_index.docids == built.docids + [f"{d}~t{c}" for c in (1, 2) for d in built.docids]
    table = (out / "bench_scale.md").read_text()
    assert capsys.readouterr().out.endswith(table)  # the table is printed last
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    assert lines[0] == "| " + " | ".join(COLUMNS) + " |"
    size_row, tiled_row, cpu_row = ([c.strip() for c in line.strip("|").split("|")] for line in lines[1:])
    gpu = COLUMNS.index("peak GPU GB (build/search)")
    assert size_row[gpu] == f"{DASH} / {DASH}"  # measured on CUDA only
    assert all(cell and DASH not in cell for i, cell in enumerate(size_row) if i != gpu)
    assert tiled_row[0] == "120 tiled" and tiled_row[1].startswith("tiled ×3 of 40")
    assert all(DASH not in tiled_row[COLUMNS.index(name)] for name in ("p50 ms", "p95 ms", "q/s b32"))
    assert tiled_row[COLUMNS.index("overlap@10 (codes / exact)")].endswith(f"/ {DASH}")
    assert cpu_row[0].startswith("40 on CPU, 1 thread") and cpu_row[7] == str(report["cpu"]["p50_ms"])
    # the same --work again: refused before anything is built, nothing removed
    assert cli.main(["--beir-zip", str(archive), "--sizes", "40", "--device", "cpu", "--output", str(out),
                     "--work", str(work)]) == 1
    assert "already exists" in capsys.readouterr().err and StoredIndex(work / "40" / "index").num_docs == 40


def test_sweep_reports_each_setting_against_the_codes_and_the_exact_tokens(tmp_path, capsys):
    """eval.bench_scale.sweep on the CPU: every setting's overlap@10 with exhaustive scoring of the index's codes and,
    with --exact, of the exact tokens; the deepest setting keeps at least what the shallowest does."""
    from eval.bench_scale import sweep

    archive = _tiny_zip(tmp_path / "scifact.zip")
    sweep.main(["--beir-zip", str(archive), "--size", "40", "--device", "cpu", "--batch-size", "16", "--exact",
                "--settings", "2:1:2,100:16:40", "--output", str(tmp_path / "out"), "--quiet"])
    report = json.loads((tmp_path / "out" / "sweep.json").read_text())
    shallow, deep = report["rows"]
    assert deep["overlap@10"] == 1.0 and shallow["overlap@10"] <= deep["overlap@10"]
    assert 0.5 <= deep["overlap@10_exact"] <= 1.0 and shallow["overlap@10_exact"] <= deep["overlap@10_exact"]
    assert deep["overlap@10_exact"] == report["overlap@10_exhaustive_exact"]  # every document refined: exhaustive
    table = (tmp_path / "out" / "sweep.md").read_text()
    assert f"| {deep['overlap@10']} / {deep['overlap@10_exact']} |" in table and capsys.readouterr().out.endswith(table)


def test_multi_gpu_harness_on_cpu_processes(tmp_path, capsys, monkeypatch):
    """eval.bench_scale.multi with two CPU processes, in two phases: the corpus written in parts and one index of two
    segments built by torchrun; then that index searched on one "device" and on two in both placements, with
    identical rankings."""
    from eval.bench_scale import multi

    fewer_warmup_queries(monkeypatch)
    archive, out, work = _tiny_zip(tmp_path / "scifact.zip"), tmp_path / "out", tmp_path / "work"
    common = ["--beir-zip", str(archive), "--size", "60", "--gpus", "2", "--device", "cpu", "--work", str(work)]
    assert multi.main([*common, "--phase", "search", "--output", str(out)]) == 1
    assert "no build.json" in capsys.readouterr().err
    assert multi.main([*common, "--phase", "build", "--batch-size", "16", "--output", str(out), "--quiet"]) == 0
    assert not out.exists() and (work / "build.json").is_file()
    assert multi.main([*common, "--phase", "search", "--max-queries", "5", "--search-batch", "4", "--passes", "1",
                       "--exact", "--output", str(out), "--quiet"]) == 0
    report = json.loads((out / "multi.json").read_text())
    assert report["segments"] == 2 and report["auto_placement"] == "shard" and report["build"]["seconds"] > 0
    assert report["bytes_per_passage"] > 0 and report["codec"].startswith("IVF")
    search = report["search"]
    assert search["queries"] == 5 and search["one_gpu"]["placement"] == "one"
    assert search["one_gpu"]["qps_b2"] > 0  # the part of a batch each of the two replicas searches
    for placement in ("replicate", "shard"):
        row = search[placement]
        assert row["placement"] == placement and row["identical"] == row["same_docids"] == 5
        assert 0 < row["p50_ms"] <= row["p95_ms"] and row["qps_b4"] > 0 and row["qps_scaling"] > 0
        assert 0 <= row["encode_share_b4"] <= 1
        spent = row["workers_ms_b4"]  # a batch in the searcher, in its slowest worker, in a worker on average
        assert 0 < spent["mean"] <= spent["slowest"] <= spent["wall"]
    assert set(report["targets_met"]) == {"replicated q/s", "replicated p50", "sharded q/s"}
    assert 0 < search["overlap@10_exact"] <= 1 and search["exact_s"] > 0
    assert StoredIndex(work / "index").num_docs == 60
    assert capsys.readouterr().out.endswith((out / "multi.md").read_text())
    assert multi.main(["--beir-zip", str(archive), "--size", "60", "--gpus", "2", "--device", "cpu",
                       "--output", str(out), "--work", str(work)]) == 1  # --work is not reused
    assert "already exists" in capsys.readouterr().err


def test_bad_input_is_a_one_line_error(tmp_path, capsys):
    for argv, message in ((["--sizes", "5q"], "argument --sizes"), (["--sizes", "5k", "--bogus"], "unrecognized"),
                          (["--sizes", "5k", "--tile-to", "1k"], "argument --tile-to")):
        with pytest.raises(SystemExit) as stop:
            cli.main(["--beir-zip", str(SCIFACT), "--output", str(tmp_path), *argv])
        assert stop.value.code == 2 and message in capsys.readouterr().err
    assert cli.main(["--beir-zip", str(tmp_path / "missing.zip"), "--sizes", "5k", "--output", str(tmp_path / "o"),
                     "--device", "cpu"]) == 1
    assert "BEIR zip not found" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_the_exact_reference_streams_the_corpus_and_merges_parts(tmp_path, monkeypatch):
    """exact_ranking encodes and scores the passages a step at a time: the same top 10 as exhaustive scoring of
    every token held at once (exact_top), and so do two halves of the corpus ranked apart and merged."""
    from eval.bench_scale import exact
    from pyserini_aligner.resolve import load_model

    corpus = SyntheticCorpus(read_beir_zip(_tiny_zip(tmp_path / "scifact.zip")))
    passages = list(corpus.passages(40))
    queries = list(corpus.source.queries.values())[:4]
    model = load_model("aligner", device="cpu")
    held = exact.encode_tokens(model, [text for _, text in passages], batch_size=16)
    reference = exact.exact_top(model, queries, held[0], held[2], [docid for docid, _ in passages])
    monkeypatch.setattr(exact, "ENCODE_STEP", 16)  # three steps: 16, 16 and 8 passages
    streamed = exact.exact_ranking(iter(passages), queries, "aligner", "cpu", batch_size=16)
    halves = exact.merged_rankings([exact.exact_ranking(part, queries, "aligner", "cpu", batch_size=16)
                                    for part in (passages[:23], passages[23:])])
    for ranking in (streamed, halves):
        assert [[d for d, _ in hits] for hits in ranking] == [[d for d, _ in hits] for hits in reference]
        assert [s for hits in ranking for _, s in hits] == pytest.approx([s for hits in reference for _, s in hits],
                                                                         abs=1e-5)


def test_merged_rankings_keep_the_best_of_every_part_and_the_earlier_part_on_ties():
    from eval.bench_scale.exact import merged_rankings

    first = [[("a", 0.9), ("b", 0.5)], [("c", 0.4)]]
    second = [[("d", 0.7), ("e", 0.5)], [("f", 0.8), ("g", 0.1)]]
    assert merged_rankings([first, second], k=3) == [[("a", 0.9), ("d", 0.7), ("b", 0.5)],
                                                     [("f", 0.8), ("c", 0.4), ("g", 0.1)]]


def test_exact_reference_against_a_loop():
    """exhaustive_top: mean over query tokens of the best document token, every document, best first."""
    from eval.bench_scale.exact import exhaustive_top

    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([3, 1, 5, 2, 4])
    tokens = torch.nn.functional.normalize(torch.randn(int(lengths.sum()), 8, generator=gen), dim=-1)
    q = torch.nn.functional.normalize(torch.randn(2, 4, 8, generator=gen), dim=-1)
    q_mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    scores, rows = exhaustive_top(q, q_mask, tokens, lengths, 3)
    bounds = [0] + lengths.cumsum(0).tolist()
    for b in range(2):
        loop = [sum(max(float(q[b, i] @ tokens[t]) for t in range(bounds[d], bounds[d + 1]))
                    for i in range(4) if q_mask[b, i]) / int(q_mask[b].sum()) for d in range(5)]
        best = sorted(range(5), key=lambda d: -loop[d])[:3]
        assert rows[b].tolist() == best
        assert scores[b].tolist() == pytest.approx([loop[d] for d in best], abs=1e-5)
