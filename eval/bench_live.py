"""Live-index costs: adding 1% of a corpus against a full rebuild, and search latency as small segments accumulate.

    python -m eval.bench_live --corpus beir/scifact --output DIR [--device cpu|cuda] [--max-docs N]
    python -m eval.bench_live --index BIG_INDEX --add-corpus NEW.jsonl --output DIR --device cuda [--topics T]

Corpus mode: every 100th document is held out; the other 99% are built into an index, then the held-out 1% is
added (one segment) and, as the reference, all documents are built from scratch (codec trained afresh). Then
``--segments`` - 1 more small segments accumulate (upserts of ``--upsert-size`` indexed documents each, so each also
tombstones the old copies) and the index is compacted. Search latency (one query at a time, k = ``--hits``, one
thread) is measured on the test queries after the build, with the segments accumulated, and after compaction.

Index mode: ``--add-corpus`` is added to a hard-linked copy of ``--index`` (the original is never written; its
files are immutable and commits replace the manifest by rename) and the add is timed; with ``--topics``, latency
before and after. Writes ``bench_live.json`` and ``bench_live.md`` under ``--output``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from eval.cli import configure_logging

log = logging.getLogger("eval.bench_live")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m eval.bench_live", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--corpus", help="ir_datasets id (beir/scifact) or JsonCollection file/folder to split 99/1")
    source.add_argument("--index", help="existing index to add --add-corpus to (a hard-linked copy is updated)")
    parser.add_argument("--add-corpus", help="with --index: the documents to add (JsonCollection or ir_datasets id)")
    parser.add_argument("--topics", help="queries: ir_datasets id or BEIR folder with its split, or a TSV file of "
                                         "qid<TAB>text (default with --corpus: <corpus>/test)")
    parser.add_argument("--output", required=True, type=Path, help="folder for bench_live.json/.md and the indexes")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]: encoding and search")
    parser.add_argument("--encoder", default="aligner", help="'aligner', 'aligner-mix' or an AligneR checkpoint folder")
    parser.add_argument("--codec", default="auto", help="codec of the indexes built in corpus mode")
    parser.add_argument("--max-docs", type=int, default=None, help="use only the first N documents of --corpus")
    parser.add_argument("--max-queries", type=int, default=None, help="time only the first N queries")
    parser.add_argument("--segments", type=int, default=20, help="small segments accumulated before compaction")
    parser.add_argument("--upsert-size", type=int, default=10, help="documents per accumulated small segment")
    parser.add_argument("--hits", type=int, default=10, help="k of the timed searches")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--quiet", action="store_true", help="no progress bars or info logging")
    args = parser.parse_args(argv)
    if args.index and not args.add_corpus:
        parser.error("--index needs --add-corpus")
    if args.corpus and args.add_corpus:
        parser.error("--add-corpus goes with --index; with --corpus the 1% added is held out of the corpus")
    for flag in ("max_docs", "max_queries", "segments", "upsert_size", "hits", "batch_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    return args


def read_docs(spec: str, max_docs: int | None = None) -> list[tuple[str, str]]:
    """(docid, text) of a JsonCollection or ir_datasets corpus, the first ``max_docs`` of them."""
    from itertools import islice

    from pyserini_aligner.index import read_corpus

    return [(item[0], item[1]) for item in islice(read_corpus(spec), max_docs)]


def read_topics(spec: str, limit: int | None) -> list[str]:
    """Query texts from a topics file (qid<TAB>text), a BEIR folder or a dataset id with its split."""
    from pyserini_aligner.data import load_topics

    texts = list(load_topics(spec).values())
    if not texts:
        raise ValueError(f"--topics {spec}: no queries")
    return texts[:limit]


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def synced(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str):
    """(result, wall seconds) of ``fn()``."""
    synced(device)
    start = time.perf_counter()
    result = fn()
    synced(device)
    return result, time.perf_counter() - start


def latency(index: Path, model, queries: list[str], hits: int, device: str) -> dict:
    """p50/p95/mean milliseconds of one-query searches (one thread) after one warm-up pass over 5 queries."""
    from pyserini_aligner.search.searcher import AlignerSearcher

    searcher = AlignerSearcher(index, encoder=model, device=device)
    for text in queries[:5]:
        searcher.rank([text], hits, threads=1)
    times = [timed(lambda: searcher.rank([text], hits, threads=1), device)[1] * 1000 for text in queries]
    manifest = searcher.manifest
    return {"p50_ms": round(float(np.percentile(times, 50)), 2), "p95_ms": round(float(np.percentile(times, 95)), 2),
            "mean_ms": round(statistics.fmean(times), 2), "queries": len(times), "segments": len(manifest.segments),
            "live_docs": manifest.num_docs, "deleted_rows": manifest.num_rows - manifest.num_docs}


def linked_copy(source: Path, target: Path) -> None:
    """Copy index ``source`` to ``target``, hard-linking the immutable segment and codec files (copying them where
    links cannot be made); the manifest is copied."""
    from pyserini_aligner.index import read_manifest

    manifest = read_manifest(source)
    target.mkdir(parents=True)
    for name in [s.name for s in manifest.segments] + ([manifest.codec_dir] if manifest.codec_dir else []):
        (target / name).mkdir()
        for path in (source / name).iterdir():
            try:
                os.link(path, target / name / path.name)
            except OSError:
                shutil.copy2(path, target / name / path.name)
    shutil.copy2(source / "manifest.json", target / "manifest.json")


def corpus_mode(args: argparse.Namespace, model, report: dict) -> None:
    from pyserini_aligner.index import build_index
    from pyserini_aligner.index.live import AlignerIndex

    docs = read_docs(args.corpus, args.max_docs)
    if len(docs) < 2:
        raise ValueError(f"--corpus {args.corpus}: {len(docs)} document(s); need at least 2")
    held = set(range(0, len(docs), 100))
    added = [doc for i, doc in enumerate(docs) if i in held]
    base = [doc for i, doc in enumerate(docs) if i not in held]
    queries = read_topics(args.topics or f"{args.corpus}/test", args.max_queries)
    common = dict(codec=args.codec, batch_size=args.batch_size, device=args.device, progress=not args.quiet,
                  model_name=args.encoder, overwrite=True)
    index, rebuild = args.output / "index", args.output / "rebuild"
    _, base_s = timed(lambda: build_index(base, index, model, **common), args.device)
    log.info("built %d documents in %.1f s", len(base), base_s)
    report["latency"] = {"built": latency(index, model, queries, args.hits, args.device)}
    live = AlignerIndex(index, encoder=model, device=args.device, batch_size=args.batch_size)
    _, add_s = timed(lambda: live.add(added), args.device)
    _, rebuild_s = timed(lambda: build_index(docs, rebuild, model, **common), args.device)
    log.info("added %d documents in %.2f s; rebuilt %d in %.1f s", len(added), add_s, len(docs), rebuild_s)
    upsert_s = []
    for number in range(args.segments - 1):
        start = number * args.upsert_size % max(len(base) - args.upsert_size, 1)
        upsert_s.append(timed(lambda: live.upsert(base[start:start + args.upsert_size]), args.device)[1])
    report["latency"][f"{args.segments} small segments"] = latency(index, model, queries, args.hits, args.device)
    _, compact_s = timed(live.compact, args.device)
    report["latency"]["compacted"] = latency(index, model, queries, args.hits, args.device)
    shutil.rmtree(rebuild)
    report.update({
        "corpus": args.corpus, "docs": len(docs), "base_docs": len(base), "added_docs": len(added),
        "build_base_s": round(base_s, 3), "add_s": round(add_s, 3), "rebuild_s": round(rebuild_s, 3),
        "add_speedup_over_rebuild": round(rebuild_s / add_s, 1),
        "upserts": {"count": len(upsert_s), "docs_each": args.upsert_size,
                    "median_s": round(statistics.median(upsert_s), 3) if upsert_s else None},
        "compact_s": round(compact_s, 3),
    })


def index_mode(args: argparse.Namespace, model, report: dict) -> None:
    from pyserini_aligner.index import read_manifest
    from pyserini_aligner.index.live import AlignerIndex

    source = Path(args.index)
    original = read_manifest(source)
    index = args.output / "index"
    if index.exists():
        shutil.rmtree(index)
    linked_copy(source, index)
    added = read_docs(args.add_corpus)
    queries = read_topics(args.topics, args.max_queries) if args.topics else []
    if queries:
        report["latency"] = {"before": latency(index, model, queries, args.hits, args.device)}
    live = AlignerIndex(index, encoder=model, device=args.device, batch_size=args.batch_size)
    _, add_s = timed(lambda: live.add(added), args.device)
    log.info("added %d documents to %d in %.2f s", len(added), original.num_docs, add_s)
    if queries:
        report["latency"]["after_add"] = latency(index, model, queries, args.hits, args.device)
    report.update({"index": str(source.resolve()), "docs": original.num_docs, "added_docs": len(added),
                   "add_s": round(add_s, 3), "index_build_stats_s": original.build_stats})


def markdown(report: dict) -> str:
    lines = [f"# Live index: {report.get('corpus') or report.get('index')}", "",
             f"`{report['command']}` on {report['device']} (torch threads {report['torch_threads']}).", ""]
    if "rebuild_s" in report:
        lines += ["| step | documents | seconds |", "|---|---:|---:|",
                  f"| build 99% | {report['base_docs']} | {report['build_base_s']:.2f} |",
                  f"| add 1% (one segment) | {report['added_docs']} | {report['add_s']:.2f} |",
                  f"| full rebuild | {report['docs']} | {report['rebuild_s']:.2f} |",
                  f"| compact | {report['docs']} | {report['compact_s']:.2f} |", "",
                  f"Adding is {report['add_speedup_over_rebuild']}x faster than rebuilding. Each of the "
                  f"{report['upserts']['count']} accumulated segments is an upsert of "
                  f"{report['upserts']['docs_each']} documents (median {report['upserts']['median_s']} s).", ""]
    else:
        lines += [f"Added {report['added_docs']} documents to {report['docs']} in {report['add_s']:.2f} s.", ""]
    if report.get("latency"):
        lines += [f"Search latency, one query at a time, k={report['hits']}, one thread:", "",
                  "| state | segments | live docs | deleted rows | p50 ms | p95 ms |", "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {state} | {row['segments']} | {row['live_docs']} | {row['deleted_rows']} | {row['p50_ms']} | "
                  f"{row['p95_ms']} |" for state, row in report["latency"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.quiet)
    from pyserini_aligner.resolve import load_model

    args.output.mkdir(parents=True, exist_ok=True)
    device = args.device
    report = {"command": "python -m eval.bench_live " + " ".join(sys.argv[1:] if argv is None else argv),
              "device": torch.cuda.get_device_name(device) if device.startswith("cuda")
              else cpu_name(),
              "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "hits": args.hits}
    try:
        model, load_s = timed(lambda: load_model(args.encoder, device, dtype=None), device)
        report["model_load_s"] = round(load_s, 3)
        (corpus_mode if args.corpus else index_mode)(args, model, report)
    except (ValueError, OSError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    (args.output / "bench_live.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.output / "bench_live.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
