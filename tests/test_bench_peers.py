"""eval.bench_peers: its command line without FastPlaid, the ratios and table on plain data, and the replayed
encoding this project's index is built from (real model, CPU). FastPlaid itself on the CPU where it is installed."""
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from eval.bench_peers import __main__ as cli
from eval.bench_peers import report as reporting
from eval.bench_peers.replay import EncodedCorpus, ReplayModel
from eval.bench_scale.corpus import SyntheticCorpus, read_beir_zip
from eval.bench_scale.exact import encode_tokens
from eval.bench_scale.report import DASH
from pyserini_aligner.index.reader import StoredIndex

SCIFACT = Path(os.environ["PYSERINI_ALIGNER_BEIR_DIR"]) / "scifact.zip"


def test_help_and_bad_flags_need_no_fast_plaid(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "fast_plaid", None)  # as where it is not installed
    with pytest.raises(SystemExit) as stop:
        cli.main(["--help"])
    assert stop.value.code == 0 and "FastPlaid" in capsys.readouterr().out
    for argv, message in ((["--size", "5q"], "argument --size"), (["--size", "5k", "--bogus"], "unrecognized"),
                          (["--size", "5k", "--fastplaid-probes", "0"], "argument --fastplaid-probes"),
                          ([], "the following arguments are required: --size")):
        with pytest.raises(SystemExit) as stop:
            cli.main(["--beir-zip", str(SCIFACT), "--output", str(tmp_path / "out"), *argv])
        assert stop.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_missing_fast_plaid_is_one_clear_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "fast_plaid", None)
    assert cli.main(["--beir-zip", str(SCIFACT), "--size", "1k", "--output", str(tmp_path / "out")]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("error: FastPlaid cannot be imported") and "fast-plaid==1.7.0.2110" in captured.err
    assert not (tmp_path / "out").exists()


def test_only_a_cuda_device_runs_it():
    assert "CUDA GPU only" in cli.check_device("cpu")
    if not torch.cuda.is_available():
        assert "sees no CUDA GPU" in cli.check_device("cuda")


def engine_row(build_s: float, index_bytes: int, p50: float, qps: float, gpu_one: float | None, gpu: float | None,
               overlap: float | None) -> dict:
    """An engine's figures as run_peers records them (build, then search, then quality)."""
    return {"docs": 1000, "codec": "IVF64,PQ4,Refine(PQ32)", "tokens": 70_000, "build": {"total_s": build_s},
            "passages_per_s": 1000 / build_s, "peak_gpu_build_gib": 1.5, "peak_rss_build_gib": 2.0,
            "peak_disk_bytes": index_bytes, "index_bytes": index_bytes, "bytes_per_passage": index_bytes / 1000,
            "queries": 300, "load_s": 1.0, "p50_ms": p50, "p95_ms": p50 * 2, "peak_gpu_one_query_gib": gpu_one,
            "qps_b32": qps / 2, "qps_b300": qps, "peak_gpu_search_gib": gpu, "peak_rss_search_gib": 3.0,
            "ndcg@10": 0.7, **({"overlap@10_exact": overlap} if overlap is not None else {})}


def test_ratios_are_ours_over_fastplaid():
    ours = engine_row(60.0, 2_600_000, 3.0, 1500.0, 1.0, 2.0, 0.82)
    peer = engine_row(120.0, 5_200_000, 12.0, 500.0, 4.0, 0.0, None)
    assert reporting.ratios(ours, peer) == {"build_s": 0.5, "index_bytes": 0.5, "p50_ms": 0.25, "qps_b300": 3.0,
                                            "peak_gpu_one_query_gib": 0.25, "peak_gpu_search_gib": None,
                                            "overlap@10_exact": None}  # FastPlaid's 0 GiB and missing overlap
    assert reporting.ratios(peer, ours)["p50_ms"] == 4.0 and reporting.ratios(ours, ours)["overlap@10_exact"] == 1.0
    assert reporting.ratios(engine_row(1.0, 3, 1.0, 1.0, None, None, 0.5), engine_row(3.0, 9, 3.0, 3.0, 1.0, 1.0,
                                                                                         0.75))["build_s"] == 0.333
    assert set(reporting.ratios(ours, None).values()) == {None}


def test_report_table_and_files(tmp_path):
    settings = {"label": "1m", "beir_zip": "scifact.zip", "encoder": "aligner", "queries": 300, "warmup": 10,
                "qps_repeats": 3, "doc_prune": 0.2,
                "fastplaid": {"version": "1.7.0.2110", "nbits": 4, "n_ivf_probe": 8, "n_full_scores": 4096}}
    report = {"machine": {"gpu": "NVIDIA H100 80GB HBM3", "device": "cuda", "torch": "2.11.0"}, "settings": settings,
              "exact": {"tokens": 70_000, "ndcg@10": 0.7131}, "engines": {}}
    reporting.write(report, tmp_path)  # before either engine: the header only
    assert "| engine |" in (tmp_path / "bench_peers.md").read_text() and report["ratios"]["p50_ms"] is None
    report["engines"]["aligner"] = engine_row(60.0, 2_600_000, 3.0, 1500.0, 1.0, 2.0, 0.82)
    reporting.write(report, tmp_path)
    rows = [line for line in (tmp_path / "bench_peers.md").read_text().splitlines() if line.startswith("| ")]
    assert len(rows) == 2  # header and pyserini-aligner: no ratio row yet
    report["engines"]["fastplaid"] = engine_row(120.0, 5_200_000, 12.0, 500.0, 4.0, 8.0, 0.9)
    reporting.write(report, tmp_path)
    saved = json.loads((tmp_path / "bench_peers.json").read_text())
    assert saved["ratios"]["qps_b300"] == 3.0 and saved["created"]
    table = (tmp_path / "bench_peers.md").read_text()
    assert "1m synthetic passages grown from scifact.zip, 70,000 tokens; NVIDIA H100 80GB HBM3" in table
    assert "(its nDCG@10: 0.7131)" in table
    header, ours, peer, ratio = ([c.strip() for c in line.strip("|").split("|")]
                                 for line in table.splitlines() if line.startswith("| "))
    assert header == list(reporting.COLUMNS)
    column = {name: header.index(name) for name in header}
    assert ours[0] == "pyserini-aligner (IVF64,PQ4,Refine(PQ32), β^d=0.2)"
    assert peer[0] == "FastPlaid 1.7.0.2110 (nbits=4, n_ivf_probe=8, n_full_scores=4096)"
    assert ours[column["index bytes"]] == "2.6 MB" and peer[column["q/s b300"]] == "500.0"
    assert ours[column["peak GPU GB search (one query / all)"]] == "1.0 / 2.0"
    assert ratio[0] == "ratio pyserini-aligner / FastPlaid"
    assert [ratio[column[name]] for name in ("build s", "index bytes", "p50 ms", "q/s b300",
                                             "peak GPU GB search (one query / all)", "overlap@10")] == \
        ["0.5×", "0.5×", "0.25×", "3.0×", "0.25× / 0.25×", "0.911×"]
    assert ratio[column["p95 ms"]] == DASH and ratio[column["nDCG@10"]] == DASH


@pytest.fixture(scope="module")
def encoded_passages(model):
    """The first 40 synthetic passages, their texts, and every token of them encoded once (float16, CPU)."""
    corpus = SyntheticCorpus(read_beir_zip(SCIFACT))
    passages = [(docid, " ".join(text.split()[:40])) for docid, text in corpus.passages(40)]
    return passages, EncodedCorpus(*encode_tokens(model, [text for _, text in passages], batch_size=16))


def test_replayed_rows_are_what_the_model_encodes(model, encoded_passages):
    passages, encoded = encoded_passages
    assert len(encoded.lengths) == 40 and int(encoded.lengths.sum()) == len(encoded.tokens) == len(encoded.salience)
    views = encoded.passages()
    assert [len(v) for v in views] == encoded.lengths.tolist() and views[3].data_ptr() == encoded.tokens[
        int(encoded.lengths[:3].sum())].data_ptr()  # views, nothing copied
    rows = [7, 2, 31]
    ids, _ = model.tokenize([passages[r][1] for r in rows], is_query=False)
    want = model.encode_token_ids(ids, is_query=False, batch_size=2)
    got = ReplayModel(model, [text for _, text in passages], encoded, "aligner").encode_token_ids(
        [[r] for r in rows], is_query=False, dtype=torch.float16)
    assert got.vectors.dtype == torch.float16 and got.vectors.shape == want.vectors.shape
    assert torch.equal(got.mask, want.mask)
    assert torch.allclose(got.vectors.float(), want.vectors, atol=2e-3)  # fp16 of the same vectors
    assert torch.allclose(got.salience, want.salience, atol=1e-5)
    assert not got.vectors[~got.mask].any() and not got.salience[~got.mask].any()


def test_an_index_built_from_the_replay_stores_the_encoded_tokens(tmp_path, model, encoded_passages):
    from eval.bench_scale.run import build

    passages, encoded = encoded_passages

    class Passages:  # the corpus the build reads: the same 40 texts
        @staticmethod
        def passages(n):
            return iter(passages[:n])

    replay = ReplayModel(model, [text for _, text in passages], encoded, "aligner")
    index_dir, row = build(Passages, 40, tmp_path / "aligner", "cpu", 16, "fp16", replay, quiet=True)
    assert row["docs"] == 40 and row["tokens"] == len(encoded.tokens) and row["index_bytes"] > 0
    assert row["build"]["total_s"] > 0 and row["peak_gpu_build_gib"] is None
    stored = StoredIndex(index_dir)
    assert stored.manifest.model_name == "aligner" and stored.docids == [docid for docid, _ in passages]
    tokens = stored.token_vectors(np.arange(len(encoded.tokens)))
    assert torch.equal(tokens.half(), encoded.tokens)  # the very vectors, not a second encoding
    with pytest.raises(ValueError, match="a passage that was not encoded"):
        replay.tokenize(["never seen"], is_query=False)
    with pytest.raises(ValueError, match="no queries"):
        replay.tokenize(["a query"], is_query=True)


def test_fast_plaid_on_the_cpu(tmp_path, model, encoded_passages):
    """Where fast-plaid is installed (a build for this torch): its index of the encoded tokens, searched with the
    model's query vectors, agrees with exhaustive scoring of those tokens."""
    pytest.importorskip("fast_plaid.search", reason="fast-plaid is not installed here")
    from eval.bench_peers import fastplaid
    from eval.bench_scale.exact import exact_top
    from eval.bench_scale.measure import overlap_at_k

    passages, encoded = encoded_passages
    docids = [docid for docid, _ in passages]
    index_dir, row = fastplaid.build(encoded.passages(), tmp_path / "fastplaid", "cpu")
    assert row["docs"] == 40 and row["tokens"] == len(encoded.tokens) and row["index_bytes"] > 0
    queries = [text for _, text in passages[:6]]  # passages as queries: each should find itself
    ranked = fastplaid.ranker(index_dir, model, docids, "cpu", n_ivf_probe=8, n_full_scores=4096)(queries, 4)
    assert [hits[0][0] for hits in ranked] == docids[:6] and all(len(hits) == 10 for hits in ranked)
    assert overlap_at_k(ranked, exact_top(model, queries, encoded.tokens, encoded.lengths, docids), 10) >= 0.8
