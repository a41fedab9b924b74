"""Does a filtered search rank the matching documents as exhaustive scoring of them ranks them, at every selectivity?

    python -m eval.experiments.filter_fidelity --dataset beir/scifact/test --output DIR [--cache .cache/indexes]
        [--shares 0.5,0.05,0.001] [--threads 1] [--latency-queries 100] [--exhaustive-cache DIR]

On the harness's cached indexes of the dataset (``--cache``, as ``python -m eval.beir`` takes it: the full fp16 index
and the default compressed one derived from it, reused, not encoded again), for filters keeping each share of the
documents (seeded random docid subsets), the default index is searched with the defaults (faiss backend, CPU) and
compared with exhaustive scoring (same model and strategy) of every matching document over the full fp16 index, and
over the default index's own stored tokens (the most a search of that index can find). Per filter: the share of
queries with min(k, matching) hits, hits outside the filter (must be 0), mean overlap@10 with each exhaustive
filtered top 10, the search's depth and its p50 latency (one query at a time, query encoding
included) against the unfiltered search's. Writes filter_fidelity.json and filter_fidelity.md; exits 1 when a filter
returns a hit outside it or fewer hits than it should.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch

from eval.bench_filter import _selectivities, found_share, random_filters

K = 10
SEED = 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m eval.experiments.filter_fidelity",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", required=True, help="ir_datasets id with queries and qrels, e.g. beir/scifact/test")
    parser.add_argument("--output", required=True, help="folder for filter_fidelity.json and filter_fidelity.md")
    parser.add_argument("--cache", default=".cache/indexes",
                        help="the harness's folder of indexes (python -m eval.beir --cache), reused")
    parser.add_argument("--shares", type=_selectivities, default=[0.5, 0.05, 0.001], help="shares of documents kept")
    parser.add_argument("--threads", type=int, default=1, help="threads for search (FAISS and torch)")
    parser.add_argument("--latency-queries", type=int, default=100, help="queries timed one at a time per filter")
    parser.add_argument("--exhaustive-cache", type=Path, default=None,
                        help="folder of the exhaustive scores [queries, documents] of each index (<index name>.npy): "
                             "read if present, else written (saves minutes)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser.parse_args(argv)


def exhaustive_scores(full: Path, model, strategy, queries: list[str], cache: Path | None,
                      progress: bool = False) -> np.ndarray:
    """Exact scores [queries, documents] of every document of ``full`` (its rows), from ``cache`` when it has the
    same shape."""
    from pyserini_aligner.search import ExhaustiveScorer

    scorer = ExhaustiveScorer(full, encoder=model, strategy=strategy, progress=progress)
    if cache is not None and cache.is_file():
        scores = np.load(cache)
        if scores.shape == (len(queries), scorer.store.num_docs):
            return scores
        logging.warning("%s holds scores of another shape; recomputing", cache)
    started = time.time()
    scores = scorer.scores(queries).numpy()
    logging.info("exhaustive scoring took %.0f s", time.time() - started)
    if cache is not None:
        np.save(cache, scores)
    return scores


def exact_top(scores: np.ndarray, docids: list[str], allowed: set[str] | None) -> list[list[tuple[str, float]]]:
    """Each query's top K (docid, score) by ``scores`` [queries, documents] among ``allowed`` (None: every one)."""
    keep = np.array([allowed is None or d in allowed for d in docids])
    masked = torch.from_numpy(np.where(keep, scores, -np.inf))
    best = masked.sort(dim=1, descending=True, stable=True)
    return [[(docids[r], s) for r, s in zip(rows[:K], values[:K]) if s != -float("inf")]
            for rows, values in zip(best.indices.tolist(), best.values.tolist())]


def p50_ms(searcher, queries: list[str], threads: int, filters: list) -> list[float]:
    """Median latency (ms) of one query at a time, query encoding included, per filter of ``filters`` (None: no
    filter); each query is searched with every filter in turn, so that a change of the machine's load weighs on all
    of them alike."""
    times = [[] for _ in filters]
    for text in queries:
        for spent, chosen in zip(times, filters):
            started = time.perf_counter()
            searcher.search(text, k=K, threads=threads, filter=chosen)
            spent.append((time.perf_counter() - started) * 1000)
    return [float(np.percentile(spent, 50)) for spent in times]


def markdown(report: dict) -> str:
    """The report as a Markdown table."""
    lines = [f"Filtered search on {report['dataset']} ({report['documents']} documents, {report['queries']} queries), "
             f"default index `{report['index_type']}` searched with the CPU defaults (faiss backend, "
             f"{report['threads']} thread); overlap@10 with exhaustive scoring of the matching documents over the "
             f"full fp16 index, and over the default index's own stored tokens (what refining every match finds; "
             f"the rest is lost to the codes).", "",
             "| filter | matching | depth (K, nprobe, W, C) | queries with min(10, matching) hits | hits outside "
             "| overlap@10 | overlap@10, the index's own scores | p50 ms | p50 vs unfiltered |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for row in report["rows"]:
        depth = "every match refined" if row["depth"][0] == 0 else ", ".join(map(str, row["depth"]))
        lines.append(f"| {row['filter']} | {row['matching']} | {depth} | {row['full_hits']:.3f} | "
                     f"{row['outside']} | {row['overlap@10']:.4f} | {row['overlap@10_index']:.4f} | {row['p50_ms']:.1f} | "
                     f"{row['p50_vs_unfiltered']:.2f}× |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    from eval.beir.aligner import default_index, full_index
    from eval.beir.context import Context, harness_dtype, work_dir
    from pyserini_aligner.data import Dataset
    from pyserini_aligner.index.reader import StoredIndex
    from pyserini_aligner.search import AlignerSearcher

    dataset = Dataset(args.dataset)
    ctx = Context(dataset=dataset, work=work_dir(dataset, args.cache), threads=args.threads,
                  progress=not args.quiet, dtype=harness_dtype())  # the harness's indexes
    full, index = full_index(ctx), default_index(ctx)
    searcher = AlignerSearcher(index, encoder=ctx.model, strategy=ctx.strategy)
    qrels = ctx.qrels
    qids = [qid for qid in ctx.queries if qid in qrels]
    queries = [ctx.queries[qid] for qid in qids]
    if args.exhaustive_cache is not None:
        args.exhaustive_cache.mkdir(parents=True, exist_ok=True)
    exact = {}  # index folder -> (exhaustive scores [queries, documents], its docids)
    for folder in (full, index):
        cache = None if args.exhaustive_cache is None else args.exhaustive_cache / f"{folder.name}.npy"
        exact[folder] = (exhaustive_scores(folder, ctx.model, searcher.strategy, queries, cache,
                                           progress=not args.quiet), list(StoredIndex(folder).docids))
    docids = list(searcher.docids)
    timed = queries[:args.latency_queries]

    rows = []
    filters = random_filters(docids, args.shares, SEED)
    cases = [("none", None)] + [(f"{share:.1%}", filters[share]) for share in args.shares]
    latencies = p50_ms(searcher, timed, args.threads, [chosen for _, chosen in cases])
    for (name, chosen), p50 in zip(cases, latencies):
        allowed = None if chosen is None else set(chosen)
        matching = searcher.matching(chosen)
        started = time.time()
        ranked = searcher.rank(queries, K, threads=args.threads, filter=chosen)
        batch_s = time.time() - started
        want = min(K, matching)
        rows.append({
            "filter": name, "matching": matching, "depth": list(searcher.depth(K, chosen)),
            "full_hits": float(np.mean([len(hits) == want for hits in ranked])),
            "outside": 0 if allowed is None else sum(d not in allowed for hits in ranked for d, _ in hits),
            "overlap@10": found_share(ranked, exact_top(*exact[full], allowed)),
            "overlap@10_index": found_share(ranked, exact_top(*exact[index], allowed)),
            "p50_ms": p50, "p50_vs_unfiltered": p50 / latencies[0], "batch_s": batch_s,
        })
        logging.info("%s", rows[-1])
    m = searcher.manifest
    report = {"dataset": args.dataset, "documents": m.num_docs, "queries": len(queries), "index_type": m.index_type,
              "doc_prune": m.doc_prune, "exhaustive_index": full.name, "strategy": str(searcher.strategy),
              "threads": args.threads, "latency_queries": len(timed), "seed": SEED, "k": K,
              "searcher_knobs": {"k_per_token": searcher.k_per_token, "max_candidates": searcher.max_candidates,
                                 "query_prune": searcher.query_prune, "refine_with": searcher.refine_with},
              "rows": rows}
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    (output / "filter_fidelity.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (output / "filter_fidelity.md").write_text(table)
    print(table, end="")
    bad = [row["filter"] for row in rows if row["outside"] or row["full_hits"] < 1]
    if bad:
        print(f"filters {', '.join(bad)} returned hits outside them or too few hits", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
