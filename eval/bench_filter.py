"""Filtered search against unfiltered search in the same run: p50/p95 latency (one query at a time, query encoding
included) and q/s at a batch, for filters keeping 50 %, 5 % and 0.1 % of the passages (seeded random docid
subsets), on the device (the torch backend) and on the CPU (the faiss backend, or torch where FAISS is missing).

    python -m eval.bench_filter --beir-zip scifact.zip --size 1m --device cuda --output DIR [--cpu-threads 16]

The index is built from the synthetic MS MARCO-like corpus of :mod:`eval.bench_scale` (the same passages, build and
settings). Up to ``--exhaustive-max-docs`` passages, every filtered ranking is also compared with exhaustive scoring
of the same index restricted to the filter (its share of the exhaustive top 10 found). Writes bench_filter.json and
bench_filter.md in --output and prints the table.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from eval.bench.measure import per_query_latency, percentiles_ms
from eval.bench_scale.corpus import SyntheticCorpus, read_beir_zip, size_label
from eval.bench_scale.measure import machine_info
from eval.bench_scale.run import DOC_PRUNE, WARMUP, build, judged_queries, release_memory
from eval.cli import configure_logging, corpus_size, positive_int, run_report

log = logging.getLogger("eval.bench_filter")

SELECTIVITIES = (0.5, 0.05, 0.001)  # shares of the passages a filter keeps
K = 10
REPEATS = 3  # q/s: median of this many passes over the queries (after one untimed pass)


def _selectivities(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated shares such as 0.5,0.05, got {text!r}") from None
    if not all(0.0 < v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"every share must be in (0, 1], got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m eval.bench_filter", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--beir-zip", type=Path, required=True, help="BEIR zip the passages grow from (SciFact)")
    parser.add_argument("--size", type=corpus_size, required=True, help="passages, e.g. 2k or 1m")
    parser.add_argument("--output", type=Path, required=True, help="folder for bench_filter.json and bench_filter.md")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where to build and search with the torch backend (default: cuda when available)")
    parser.add_argument("--cpu-threads", type=positive_int, default=None,
                        help="also time the CPU (faiss backend) with N threads (default: on a CPU device only)")
    parser.add_argument("--selectivities", type=_selectivities, default=list(SELECTIVITIES),
                        help="shares of the passages the filters keep (default 0.5,0.05,0.001)")
    parser.add_argument("--batch", type=positive_int, default=300, help="queries searched together for q/s")
    parser.add_argument("--max-queries", type=positive_int, default=None, help="at most this many judged queries")
    parser.add_argument("--cpu-queries", type=positive_int, default=100, help="queries timed on the CPU")
    parser.add_argument("--exhaustive-max-docs", type=corpus_size, default=100_000,
                        help="compare with exhaustive filtered scoring up to this size (default 100k)")
    parser.add_argument("--codec", default="auto", help="token codec of the index (as eval.bench_scale)")
    parser.add_argument("--batch-size", type=positive_int, default=128, help="passages per encoding batch (build)")
    parser.add_argument("--work", type=Path, default=None,
                        help="build the index in this folder and keep it (default: a temporary folder in --output)")
    parser.add_argument("--encoder", default="aligner", help="AligneR checkpoint")
    parser.add_argument("--seed", type=int, default=0, help="seed of the corpus and of the filters")
    parser.add_argument("--quiet", action="store_true", help="no progress bars, warnings only")
    return parser.parse_args(argv)


def random_filters(docids: Sequence[str], shares: Sequence[float], seed: int) -> dict[float, list[str]]:
    """share -> a seeded random subset of ``docids`` of that share (at least one docid)."""
    rng = np.random.default_rng(seed)
    return {share: [docids[i] for i in np.sort(rng.choice(len(docids), max(1, round(share * len(docids))),
                                                          replace=False))] for share in shares}


def found_share(ranked: list, best: list) -> float:
    """Mean over queries of the share of the exhaustive top (``best``, at most k hits: all the matches when fewer)
    that ``ranked`` holds; 1.0 for a query whose exhaustive top is empty."""
    return float(np.mean([len({d for d, _ in got} & {d for d, _ in want}) / len(want) if want else 1.0
                          for got, want in zip(ranked, best)]))


def timed(searcher, texts: list[str], filter, batch: int, threads: int | None) -> tuple[dict, list]:
    """p50/p95 of one query at a time and q/s at ``batch`` of top-K searches restricted by ``filter`` (None: none);
    (figures, ranking of the last pass)."""
    row = percentiles_ms(per_query_latency(lambda q: searcher.rank([q], K, threads, filter=filter), texts,
                                           warmup=WARMUP))
    searcher.configure(batch_size=batch)
    ranked = searcher.rank(texts, K, threads, filter=filter)  # untimed: graphs, allocator, the filter's rows
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        ranked = searcher.rank(texts, K, threads, filter=filter)
        times.append(time.perf_counter() - start)
    row[f"qps_b{batch}"] = round(len(texts) / statistics.median(times), 1)
    return row, ranked


def measure(searcher, texts: list[str], filters: dict, batch: int, threads: int | None,
            exhaustive: torch.Tensor | None, docids: Sequence[str]) -> list[dict]:
    """One row per filter (None first: unfiltered), each with its latency relative to the unfiltered search and,
    given the ``exhaustive`` scores [queries, rows], the share of the exhaustive filtered top K found."""
    from pyserini_aligner.filters import Filter

    rows = []
    for share, ids in filters.items():
        chosen = None if ids is None else Filter.docids(ids)
        row, ranked = timed(searcher, texts, chosen, batch, threads)
        row = {"filter": "none" if share is None else f"{share:.1%}",
               "matching": searcher.num_docs if chosen is None else searcher.matching(chosen),
               "depth": list(searcher.depth(K, chosen)), **row}
        if rows:
            row["p50_vs_unfiltered"] = round(row["p50_ms"] / rows[0]["p50_ms"], 2)
        if exhaustive is not None:
            row["found@10_exhaustive"] = round(found_share(ranked, exhaustive_top(exhaustive, docids, ids)), 4)
        rows.append(row)
    return rows


def exhaustive_top(scores: torch.Tensor, docids: Sequence[str], ids: list[str] | None) -> list:
    """The top K (docid, score) of exhaustive ``scores`` [queries, rows] over the rows of ``ids`` (None: all)."""
    if ids is not None:
        wanted = set(ids)
        keep = torch.tensor([docid in wanted for docid in docids])
        scores = scores.masked_fill(~keep, -torch.inf)
    best = scores.topk(min(K, scores.shape[1]), dim=1)
    return [[(docids[r], s) for r, s in zip(rows, values) if s != -float("inf")]
            for rows, values in zip(best.indices.tolist(), best.values.tolist())]


def markdown(report: dict) -> str:
    """The report's table: one row per place and filter."""
    settings, machine = report["settings"], report["machine"]
    batch = settings["batch"]
    lines = [f"### Filtered search: {size_label(report['docs'])} synthetic passages grown from "
             f"{settings['beir_zip']}, k={K}, {report['queries']} queries; "
             f"{machine['gpu'] or 'CPU'}, torch {machine['torch']}", "",
             f"| where | filter | matching | p50 ms | p95 ms | × unfiltered p50 | q/s b{batch} "
             "| found@10 exhaustive |",
             "|---|---|---|---|---|---|---|---|"]
    for place, rows in report["places"].items():
        for row in rows:
            lines.append(f"| {place} | {row['filter']} | {row['matching']} | {row['p50_ms']} | {row['p95_ms']} | "
                         f"{row.get('p50_vs_unfiltered', '–')} | {row[f'qps_b{batch}']} | "
                         f"{row.get('found@10_exhaustive', '–')} |")
    return "\n".join(lines) + "\n"


def write(report: dict, output: Path) -> None:
    """bench_filter.json and bench_filter.md in ``output``, each written whole (a new file renamed over the old)."""
    for name, text in (("bench_filter.json", json.dumps(report, indent=1) + "\n"), ("bench_filter.md",
                                                                                     markdown(report))):
        partial = output / f".{name}.partial"
        partial.write_text(text, encoding="utf-8")
        partial.replace(output / name)


def run_bench(beir_zip: Path, size: int, output: Path, device: str, cpu_threads: int | None,
              selectivities: Sequence[float], batch: int, max_queries: int | None, cpu_queries: int,
              exhaustive_max_docs: int, codec: str, batch_size: int, work: Path | None, encoder: str, seed: int,
              quiet: bool) -> dict:
    """Build the index, then time every filter on the device and on the CPU; writes the report after each place."""
    from pyserini_aligner.search import AlignerSearcher

    if work is not None and (work / size_label(size)).exists():
        raise FileExistsError(f"--work: {work / size_label(size)} already exists (indexes are never overwritten)")
    corpus = SyntheticCorpus(read_beir_zip(beir_zip), seed=seed)
    queries = judged_queries(corpus, size, max_queries)
    texts = list(queries.values())
    output.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        if work is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=".bench_filter-", dir=output)))
        index_dir, built = build(corpus, size, work / size_label(size), device, batch_size, codec, encoder, quiet)
        release_memory(device)
        report = {"machine": machine_info(device), "docs": built["docs"], "queries": len(texts), "build": built,
                  "settings": {"beir_zip": beir_zip.name, "size": size, "selectivities": list(selectivities),
                               "batch": batch, "doc_prune": DOC_PRUNE or "auto", "codec": codec, "seed": seed,
                               "encoder": encoder, "warmup": WARMUP, "repeats": REPEATS}, "places": {}}
        searcher = AlignerSearcher(index_dir, device=device, backend="torch", batch_size=batch)
        docids = list(searcher.docids)
        filters = {None: None, **random_filters(docids, selectivities, seed)}
        exhaustive = None
        if built["docs"] <= exhaustive_max_docs:
            from pyserini_aligner.search.exhaustive import ExhaustiveScorer

            exhaustive = ExhaustiveScorer(index_dir, device=device, batch_size=32).scores(texts)
            release_memory(device)
        place = f"{device} (torch)"
        report["places"][place] = measure(searcher, texts, filters, batch, None, exhaustive, docids)
        write(report, output)
        del searcher
        release_memory(device)
        threads = cpu_threads or (torch.get_num_threads() if not str(device).startswith("cuda") else None)
        if threads is not None:
            try:
                cpu = AlignerSearcher(index_dir, device="cpu", batch_size=batch)
            except ImportError as err:
                log.warning("CPU rows: %s; timing the torch backend instead", err)
                cpu = AlignerSearcher(index_dir, device="cpu", backend="torch", batch_size=batch)
            count = min(cpu_queries, len(texts))
            place = f"cpu ({cpu.backend}, {threads} thread{'s' if threads != 1 else ''})"
            report["places"][place] = measure(cpu, texts[:count], filters, batch, threads,
                                              None if exhaustive is None else exhaustive[:count], docids)
            write(report, output)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.quiet)

    def run() -> None:
        run_bench(args.beir_zip, args.size, args.output, args.device, args.cpu_threads, args.selectivities,
                  args.batch, args.max_queries, args.cpu_queries, args.exhaustive_max_docs, args.codec,
                  args.batch_size, args.work, args.encoder, args.seed, args.quiet)

    return run_report(run, args.output / "bench_filter.md")


if __name__ == "__main__":
    sys.exit(main())
