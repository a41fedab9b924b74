"""The benchmark: build, size, latency, throughput and quality of AligneR against Pyserini's BM25 and dense search.

Everything runs in one process tree on the same corpus and queries; index builds run in child processes so
their time and peak memory are measured alone. Numbers are medians/percentiles of one run.
"""
from __future__ import annotations

import json
import logging
import os
import platform
import time
from pathlib import Path

from eval.bench import measure
from pyserini_aligner.metrics import evaluate
from pyserini_aligner.data import Dataset
from pyserini_aligner.index.format import read_manifest

log = logging.getLogger(__name__)
FAISS_PART = ("faiss.index", "faiss_ids.i64")
IVF = "IVF4096,Flat"  # the fast variant: same stored tokens, an inverted-file FAISS index over them
CODE_FILES = ("token_centroids.u16", "token_residuals.u8")  # what a full scan of a compressed index streams
CODEC_PARTS = ("codec_train_s", "codec_encode_s")  # the codec step (codec_s): training, assigning + quantising
LABELS = {"aligner": "fp16 full tokens, exact IP (encode + build)", "aligner-ivf": f"{IVF} (derived, no re-encoding)",
          "aligner-default": "the default: codec auto, β^d=0.2, search on codes (encode + build)"}


def _corpus_id(dataset: Dataset) -> str:
    return str(dataset.folder) if dataset.folder else dataset.spec


def build_aligner(index_dir: Path, args: list[str], reuse: bool = False) -> dict:
    """Run ``python -m pyserini_aligner.index args`` in a child process: seconds, peak RSS, bytes per document. With
    ``reuse``, an index already at ``index_dir`` is kept and its own recorded build seconds are reported (no RSS)."""
    if reuse and (index_dir / "manifest.json").is_file():
        seconds = read_manifest(index_dir).build_stats.get("total_s")
        stats = {"seconds": "–" if seconds is None else round(seconds, 1), "peak_rss_mib": "–"}
    else:
        stats = measure.timed_module("pyserini_aligner.index",
                                     ["--index", str(index_dir), "--overwrite", "--quiet", *args])
    docs = read_manifest(index_dir).num_docs
    faiss_bytes, total = measure.file_bytes(index_dir, FAISS_PART), measure.file_bytes(index_dir)
    stats["faiss_bytes_per_doc"] = round(faiss_bytes / docs)
    stats["refine_bytes_per_doc"] = round((total - faiss_bytes) / docs)  # token store, offsets, docids, manifest
    stats["total_bytes_per_doc"] = round(total / docs)
    return stats


def _measure_searcher(name: str, searcher, queries: dict[str, str], qrels: dict, threads: int,
                      timed_queries: int) -> dict:
    """p50/p95 per-query latency at k=10 and k=1000 (over the first ``timed_queries``), batch QPS, and nDCG@10 of
    the k=1000 run over every query."""
    texts, qids = list(queries.values()), list(queries)
    row = {}
    for k in (10, 1000):
        times = measure.per_query_latency(lambda q: searcher.search(q, k=k), texts[:timed_queries])
        row[f"k{k}"] = measure.percentiles_ms(times)
    row["qps_batch32"] = round(measure.throughput_qps(
        lambda batch: searcher.batch_search(batch, [str(i) for i in range(len(batch))], k=10, threads=threads),
        texts[:timed_queries]), 1)
    hits = searcher.batch_search(texts, qids, k=1000, threads=threads)
    scores = evaluate(qrels, {q: {h.docid: float(h.score) for h in hs} for q, hs in hits.items()},
                      ("ndcg@10", "recall@1000"))
    row["ndcg@10"], row["recall@1000"] = round(scores["ndcg@10"], 4), round(scores["recall@1000"], 4)
    log.info("%s: %s", name, row)
    return row


SYSTEMS = ("bm25", "dense", "exhaustive", "exhaustive-default", "aligner", "aligner-ivf", "aligner-default")


def run_bench(dataset_spec: str, output: str | os.PathLike, cache: str | os.PathLike, encoder: str = "aligner",
              threads: int = 2, timed_queries: int = 100, build_only: bool = False,
              systems: tuple[str, ...] = SYSTEMS, reuse: bool = False) -> dict:
    """Run every measurement (the searches of ``systems`` only; ``reuse``: keep indexes already built in ``cache``);
    writes ``bench.json`` and ``bench.md`` in ``output`` and returns the dict."""
    from eval.beir.context import Context, harness_dtype, work_dir
    from eval.beir.systems import dense_searcher, lucene_index
    from pyserini.search.lucene import LuceneSearcher
    from pyserini_aligner.search import AlignerSearcher, ExhaustiveScorer

    dataset = Dataset(dataset_spec)
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    ctx = Context(dataset=dataset, work=work_dir(dataset, cache), threads=threads, dtype=harness_dtype())
    queries, qrels = dataset.queries(), dataset.qrels()
    report = {"dataset": dataset.name, "machine": f"{platform.machine()} {os.cpu_count()} cores (CPU)",
              "queries": len(queries), "timed_queries": min(timed_queries, len(queries)), "build": {}, "search": {}}

    flat_dir = Path(cache) / "bench" / f"{ctx.work.name}-aligner"
    ivf_dir = flat_dir.with_name(flat_dir.name + "-ivf")
    report["build"]["aligner"] = build_aligner(flat_dir, ["--corpus", _corpus_id(dataset), "--encoder", encoder,
                                                          "--codec", "fp16", "--doc-prune", "1.0"], reuse)
    report["build"]["aligner"]["stream_vectors_seconds"] = round(
        sum(measure.stream_seconds(path) for path in sorted(flat_dir.glob("seg-*/doc_vectors.f16"))), 4)
    report["build"]["aligner-ivf"] = build_aligner(ivf_dir, ["--from-index", str(flat_dir), "--index-type", IVF], reuse)
    default_dir = flat_dir.with_name(flat_dir.name + "-default")
    report["build"]["aligner-default"] = build = build_aligner(default_dir, ["--corpus", _corpus_id(dataset),
                                                                             "--encoder", encoder], reuse)
    build["stream_vectors_seconds"] = round(sum(measure.stream_seconds(path) for name in CODE_FILES
                                                for path in sorted(default_dir.glob(f"seg-*/{name}"))), 4)
    manifest = read_manifest(default_dir)
    stats = manifest.build_stats
    build["phases_s"] = {key: round(value, 2) for key, value in stats.items() if key not in CODEC_PARTS}
    build["codec_parts_s"] = {key[len("codec_"):-2]: round(stats.get(key, 0.0), 2) for key in CODEC_PARTS}
    timed = isinstance(build["seconds"], (int, float)) and build["seconds"] > 0  # a reused index may not say
    build["codec_share"] = round(stats.get("codec_s", 0.0) / build["seconds"], 3) if timed else None
    errors = [(s.build_stats["reconstruction_mse"], s.num_tokens) for s in manifest.segments
              if "reconstruction_mse" in s.build_stats]
    if errors:
        build["reconstruction_mse"] = round(sum(e * n for e, n in errors) / sum(n for _, n in errors), 5)

    if build_only:
        return _write(report, output)
    bm25 = LuceneSearcher(str(lucene_index(ctx)))
    bm25.set_bm25(0.9, 0.4)
    makers = {"bm25": lambda: bm25, "dense": lambda: dense_searcher(ctx),
              "exhaustive": lambda: ExhaustiveScorer(flat_dir), "exhaustive-default": lambda: ExhaustiveScorer(default_dir),
              "aligner": lambda: AlignerSearcher(flat_dir), "aligner-ivf": lambda: AlignerSearcher(ivf_dir),
              "aligner-default": lambda: AlignerSearcher(default_dir)}
    for name in [n for n in SYSTEMS if n in systems]:
        report["search"][name] = _measure_searcher(name, makers[name](), queries, qrels, threads, timed_queries)
    found = report["search"]
    report["ratios"] = {f"{system}_vs_{base}_p50_k{k}": round(found[system][f"k{k}"]["p50_ms"] /
                                                                found[base][f"k{k}"]["p50_ms"], 2)
                        for system in ("aligner", "aligner-ivf", "aligner-default") for base in ("bm25", "dense")
                        for k in (10, 1000) if system in found and base in found}
    ceilings = {"exhaustive": "fp16", "exhaustive-default": "default"}
    report["vs_exhaustive"] = {f"{system} - {ceiling}": {metric: round(found[system][metric] - found[ceiling][metric], 4)
                                                          for metric in ("ndcg@10", "recall@1000")}
                               for ceiling in ceilings for system in ("aligner", "aligner-ivf", "aligner-default",
                                                                      "exhaustive-default")
                               if ceiling in found and system in found and system != ceiling}
    return _write(report, output)


def _write(report: dict, output: Path) -> dict:
    report["created"] = time.strftime("%Y-%m-%d %H:%M:%S")
    (output / "bench.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (output / "bench.md").write_text(bench_markdown(report), encoding="utf-8")
    return report


def bench_markdown(report: dict) -> str:
    """The report as Markdown tables."""
    lines = [f"### Benchmark: {report['dataset']} ({report['machine']})", "",
             "| AligneR index | build s | peak RSS MiB | FAISS B/doc | refinement B/doc | total B/doc |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, build in report["build"].items():
        label = LABELS.get(name, name)
        lines.append(f"| {label} | {build['seconds']} | {build['peak_rss_mib']} | {build['faiss_bytes_per_doc']} | "
                     f"{build['refine_bytes_per_doc']} | {build['total_bytes_per_doc']} |")
    if not report["search"]:
        return "\n".join(lines + _build_phases(report)) + "\n"
    compressed = report["build"].get("aligner-default", {})
    lines += ["", f"Latency over the first {report['timed_queries']} queries (query encoding included, after 5 warm-up "
                  f"queries); nDCG@10 over all {report['queries']}. `exhaustive` scores every document with every stored "
                  "fp16 token (the quality ceiling).", "", "Streaming the stored vectors through memory once (a full "
                  f"scan's floor): fp16 {report['build']['aligner']['stream_vectors_seconds']} s, compressed codes "
                  f"{compressed.get('stream_vectors_seconds', '-')} s.", "",
             "| system | p50 ms k=10 | p95 ms k=10 | p50 ms k=1000 | p95 ms k=1000 | QPS (batch 32) | nDCG@10 | "
             "recall@1000 |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, row in report["search"].items():
        lines.append(f"| {name} | {row['k10']['p50_ms']} | {row['k10']['p95_ms']} | {row['k1000']['p50_ms']} | "
                     f"{row['k1000']['p95_ms']} | {row['qps_batch32']} | {row['ndcg@10']} | {row['recall@1000']} |")
    lines += ["", "| ratio (p50 latency) | value |", "|---|---:|"]
    lines += [f"| {name} | {value} |" for name, value in report["ratios"].items()]
    if "vs_exhaustive" in report:
        lines += ["", "| system − exhaustive scoring (of the fp16 or of the default index) | nDCG@10 | recall@1000 |",
                  "|---|---:|---:|"]
        lines += [f"| {name} | {value['ndcg@10']:+.4f} | {value['recall@1000']:+.4f} |"
                  for name, value in report["vs_exhaustive"].items()]
    return "\n".join(lines + _build_phases(report)) + "\n"


def _build_phases(report: dict) -> list[str]:
    """Lines on the default build's phases and its codec step (empty when the report has no default build)."""
    lines = []
    default = report["build"].get("aligner-default")
    if default and "phases_s" in default:
        lines += ["", f"Default build: {default['seconds']} s, of which "
                  + ", ".join(f"{k[:-2]} {v} s" for k, v in default["phases_s"].items())
                  + (f"; the codec step is {default['codec_share']:.1%} of the build"
                     if default.get("codec_share") is not None else "")
                  + (f" (training {default['codec_parts_s']['train']} s, assigning and quantising every token "
                     f"{default['codec_parts_s']['encode']} s; reconstruction error {default['reconstruction_mse']} per "
                     "token, squared)" if "codec_parts_s" in default and "reconstruction_mse" in default else "") + "."]
    return lines
