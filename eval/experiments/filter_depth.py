"""How deep should a filtered search probe? Latency and agreement with exhaustive filtered scoring of one index for
each deepening cap of the selectivity rule (:data:`pyserini_aligner.search.options.FILTER_DEEPEN`), on synthetic
passages.

    python -m eval.experiments.filter_depth --index DIR --beir-zip scifact.zip --output DIR [--deepen 1,2,4,8]

``--index`` is an index of the synthetic corpus of :mod:`eval.bench_scale` (e.g. the one ``python -m
eval.bench_filter --work W`` keeps in ``W/<size>/index``). Every judged query is scored exhaustively once (the index's
own codes, every document: :class:`pyserini_aligner.search.exhaustive.ExhaustiveScorer`); then, for each cap, the
filters of :mod:`eval.bench_filter` (50 %, 5 %, 0.1 % of the passages, seeded) are timed on the device with the torch
backend and their top 10 compared with the exhaustive top 10 over the matching passages. Writes filter_depth.json and
filter_depth.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from eval.bench_filter import SELECTIVITIES, measure, random_filters
from eval.bench_scale.corpus import SyntheticCorpus, read_beir_zip
from eval.bench_scale.measure import machine_info
from eval.bench_scale.run import judged_queries, release_memory
from eval.cli import configure_logging, positive_ints, run_report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m eval.experiments.filter_depth", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", type=Path, required=True, help="index of the synthetic corpus")
    parser.add_argument("--beir-zip", type=Path, required=True, help="BEIR zip the passages grew from (SciFact)")
    parser.add_argument("--output", type=Path, required=True, help="folder for filter_depth.json and .md")
    parser.add_argument("--deepen", type=positive_ints, default=[1, 2, 4, 8],
                        help="caps to compare (default 1,2,4,8)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=300, help="queries searched together for q/s")
    parser.add_argument("--max-queries", type=int, default=None, help="at most this many judged queries")
    parser.add_argument("--seed", type=int, default=0, help="seed of the corpus and of the filters")
    parser.add_argument("--quiet", action="store_true", help="no progress bars, warnings only")
    return parser.parse_args(argv)


def markdown(report: dict) -> str:
    lines = [f"### Filtered search by deepening cap: {report['docs']} synthetic passages, k=10, "
             f"{report['queries']} queries; {report['machine'].get('gpu') or report['machine']['device']}", "",
             "| cap | filter | matching | nprobe | p50 ms | × unfiltered p50 | q/s | found@10 exhaustive |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for cap, rows in report["caps"].items():
        for row in rows:
            qps = next(value for key, value in row.items() if key.startswith("qps_b"))
            lines.append(f"| {cap} | {row['filter']} | {row['matching']} | {row['depth'][1]} | {row['p50_ms']} | "
                         f"{row.get('p50_vs_unfiltered', '–')} | {qps} | {row['found@10_exhaustive']} |")
    return "\n".join(lines) + "\n"


def run_study(args: argparse.Namespace) -> dict:
    from pyserini_aligner.search import AlignerSearcher, options
    from pyserini_aligner.search.exhaustive import ExhaustiveScorer

    corpus = SyntheticCorpus(read_beir_zip(args.beir_zip), seed=args.seed)
    searcher = AlignerSearcher(args.index, device=args.device, backend="torch", batch_size=args.batch)
    texts = list(judged_queries(corpus, searcher.num_docs, args.max_queries).values())
    exhaustive = ExhaustiveScorer(args.index, device=args.device, batch_size=32).scores(texts)
    release_memory(args.device)
    docids = list(searcher.docids)
    filters = {None: None, **random_filters(docids, SELECTIVITIES, args.seed)}
    report = {"machine": machine_info(args.device), "docs": searcher.num_docs, "queries": len(texts),
              "settings": {"deepen": args.deepen, "batch": args.batch, "seed": args.seed,
                           "selectivities": list(SELECTIVITIES)}, "caps": {}}
    default = options.FILTER_DEEPEN
    try:
        for cap in args.deepen:
            options.FILTER_DEEPEN = cap
            report["caps"][str(cap)] = measure(searcher, texts, filters, args.batch, None, exhaustive, docids)
    finally:
        options.FILTER_DEEPEN = default
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "filter_depth.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    (args.output / "filter_depth.md").write_text(markdown(report), encoding="utf-8")
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.quiet)
    return run_report(lambda: run_study(args), args.output / "filter_depth.md")


if __name__ == "__main__":
    sys.exit(main())
