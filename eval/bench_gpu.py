"""GPU search benchmark: build compressed AligneR indexes and search them with ``device="cuda"`` (torch backend).

Two steps, because the GPU machine has torch but neither Pyserini, FAISS nor ranx:

    python -m eval.bench_gpu measure --beir-zip scifact.zip --output runs/bench_gpu_scifact --device cuda
    python -m eval.bench_gpu score --output runs/bench_gpu_scifact --dataset beir/scifact/test

``measure`` reads the BEIR zip directly, builds each configuration's index (encode + codec on the device), and
times per-query search at k=10 (query encoding included) and batch throughput; it writes ``bench_gpu.json`` and
one TREC run per configuration. ``score`` adds nDCG@10 (ranx, via the project's harness) and writes ``bench_gpu.md``.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch

from eval.bench.measure import file_bytes, percentiles_ms
from eval.cli import configure_logging

CODEC = "IVF16384,PQ4"
CONFIGS = {  # name: (β^d, β^q)
    "β^d=0.2": (0.2, 1.0),
    "β^d=0.2, β^q=0.5": (0.2, 0.5),
    "β^d=1": (1.0, 1.0),
}
BATCHES = (32, 300)


def read_beir_zip(path: Path, work: Path, split: str = "test") -> tuple[list[tuple[str, str]], dict[str, str]]:
    """(corpus as (docid, text) pairs, {qid: text} of the queries judged in ``split``) of a BEIR zip, extracted into
    ``work`` and read with the project's BEIR-folder reader (no ir_datasets needed)."""
    from pyserini_aligner.data import Dataset

    with zipfile.ZipFile(path) as archive:
        archive.extractall(work)
    dataset = Dataset(str(Path(work) / Path(path).stem), split)
    return [(doc.docid, doc.contents) for doc in dataset.docs()], dataset.queries()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def agreement(a: list[list[tuple[str, float]]], b: list[list[tuple[str, float]]]) -> dict:
    """How two rankings of the same queries agree: queries with the same docid order, largest score difference."""
    same = sum([d for d, _ in x] == [d for d, _ in y] for x, y in zip(a, b))
    diff = max((abs(s - t) for x, y in zip(a, b) for (_, s), (_, t) in zip(x, y)), default=0.0)
    return {"same_order": same, "queries": len(a), "max_score_diff": float(f"{diff:.2g}")}


def eager_encode_ms(model, texts: list[str]) -> dict:
    """Latency percentiles of encoding one query at a time with the eager model (no CUDA graph)."""
    times = []
    for text in texts:
        _sync(str(model.device))
        begin = time.perf_counter()
        model.encode_padded([text], is_query=True)
        _sync(str(model.device))
        times.append(time.perf_counter() - begin)
    return percentiles_ms(times)


def measure_config(index_dir: Path, corpus, queries: dict[str, str], index_args: dict, search_args: dict,
                   device: str, encoder: str, run_path: Path) -> dict:
    """Build the index, then latency (k=10, one query at a time) and throughput (batches of BATCHES)."""
    from pyserini_aligner.index import build_index
    from pyserini_aligner.search import AlignerSearcher
    from pyserini_aligner.trec import write_run

    _sync(device)
    start = time.perf_counter()
    manifest = build_index(iter(corpus), index_dir, encoder, device=device, batch_size=128, progress=False,
                           **index_args)
    _sync(device)
    row = {"build_seconds": round(time.perf_counter() - start, 1),
           "bytes_per_doc": round(file_bytes(index_dir) / manifest.num_docs), **index_args, **search_args}
    start = time.perf_counter()
    searcher = AlignerSearcher(index_dir, device=device, batch_size=max(BATCHES), **search_args)
    row["load_seconds"] = round(time.perf_counter() - start, 2)
    texts, qids = list(queries.values()), list(queries)
    for text in texts[:10]:  # warm-up (kernels, allocator)
        searcher.rank([text], k=10)
    times, single = [], []
    for text in texts:
        begin = time.perf_counter()
        single += searcher.rank([text], k=10)  # results come back to the host: the time includes the GPU work
        times.append(time.perf_counter() - begin)
    row["k10"] = percentiles_ms(times)
    for batch in BATCHES:
        searcher.configure(batch_size=batch)
        runs = []
        for _ in range(3):
            begin = time.perf_counter()
            ranked = searcher.rank(texts, k=10)
            runs.append(time.perf_counter() - begin)
        row[f"qps_batch{batch}"] = round(len(texts) / statistics.median(runs), 1)
    if searcher.graphed_queries:  # queries went through CUDA graphs (batches up to a captured size)
        row["graph_check"] = {**agreement(single, ranked), "eager_encode_1q": eager_encode_ms(searcher.model, texts)}
    searcher.configure(batch_size=max(BATCHES))
    ranked = searcher.rank(texts, k=100)
    write_run({qid: hits for qid, hits in zip(qids, ranked)}, run_path, tag="AligneR-gpu")
    if device.startswith("cuda"):
        row["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)
        torch.cuda.reset_peak_memory_stats()
    return row


def measure(beir_zip: Path, output: Path, device: str, encoder: str, codec: str = CODEC) -> dict:
    output.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if device.startswith("cuda") else f"{platform.machine()} CPU"
    with tempfile.TemporaryDirectory() as work:
        corpus, queries = read_beir_zip(beir_zip, Path(work))
        report = {"dataset": f"{beir_zip.stem} test", "device": name, "torch": torch.__version__,
                  "docs": len(corpus), "queries": len(queries), "codec": codec, "configs": {}}
        for i, (label, (doc_prune, query_prune)) in enumerate(CONFIGS.items()):
            row = measure_config(Path(work) / f"index{i}", corpus, queries, dict(codec=codec, doc_prune=doc_prune),
                                 dict(query_prune=query_prune), device, encoder, output / f"run{i}.trec")
            row["run"] = f"run{i}.trec"
            report["configs"][label] = row
            print(label, row, flush=True)
    (output / "bench_gpu.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


def score(output: Path, dataset: str) -> dict:
    """Add nDCG@10 of each configuration's run (ranx) and write bench_gpu.md."""
    from pyserini_aligner.metrics import evaluate
    from pyserini_aligner.data import Dataset
    from pyserini_aligner.trec import read_run

    report = json.loads((output / "bench_gpu.json").read_text(encoding="utf-8"))
    qrels = Dataset(dataset).qrels()
    for row in report["configs"].values():
        row["ndcg@10"] = round(evaluate(qrels, read_run(output / row["run"]), ("ndcg@10",))["ndcg@10"], 4)
    (output / "bench_gpu.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (output / "bench_gpu.md").write_text(markdown(report), encoding="utf-8")
    return report


def markdown(report: dict) -> str:
    lines = [f"### GPU search: {report['dataset']} ({report['docs']} docs, {report['queries']} queries), codec "
             f"{report['codec']}, measured on {report['device']} (torch {report['torch']})", "",
             "| pruning | build s | B/doc | p50 ms k=10 | p95 ms k=10 | "
             + " | ".join(f"QPS batch {b}" for b in BATCHES) + " | nDCG@10 |",
             "|---|---:|---:|---:|---:|" + "---:|" * len(BATCHES) + "---:|"]
    for label, row in report["configs"].items():
        lines.append(f"| {label} | {row['build_seconds']} | {row['bytes_per_doc']} | {row['k10']['p50_ms']} | "
                     f"{row['k10']['p95_ms']} | " + " | ".join(str(row[f'qps_batch{b}']) for b in BATCHES)
                     + f" | {row.get('ndcg@10', '')} |")
    for label, row in report["configs"].items():
        check = row.get("graph_check")
        if check:
            lines.append(f"\n{label}: one query through the CUDA graph vs the eager batch path: same docid order for "
                         f"{check['same_order']}/{check['queries']} queries, score differences ≤ "
                         f"{check['max_score_diff']:g}; eager encoding of one query alone: p50 "
                         f"{check['eager_encode_1q']['p50_ms']} ms.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.bench_gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="step", required=True)
    run = sub.add_parser("measure", help="build and time (on the GPU machine)")
    run.add_argument("--beir-zip", type=Path, required=True, help="a BEIR zip, e.g. scifact.zip")
    run.add_argument("--output", type=Path, required=True)
    run.add_argument("--device", default="cuda")
    run.add_argument("--encoder", default="aligner")
    run.add_argument("--codec", default=CODEC, help="token codec of every configuration")
    scored = sub.add_parser("score", help="add nDCG@10 with ranx and write bench_gpu.md")
    scored.add_argument("--output", type=Path, required=True)
    scored.add_argument("--dataset", required=True, help="ir_datasets id of the same split, e.g. beir/scifact/test")
    args = parser.parse_args(argv)
    configure_logging()
    if args.step == "measure":
        measure(args.beir_zip, args.output, args.device, args.encoder, args.codec)
    else:
        print(markdown(score(args.output, args.dataset)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
