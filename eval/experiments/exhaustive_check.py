"""Does the FAISS + refinement searcher keep the quality of exhaustive AligneR scoring?

    python -m eval.experiments.exhaustive_check --dataset beir/scifact/test --index <dir> --output <json>

Runs AlignerSearcher and ExhaustiveScorer (same model, same strategy) over the dataset's queries, evaluates both
with ranx (make_comparable=True) and reports nDCG@10, the ratio searcher / exhaustive, top-10 overlap and the
searcher's per-query latency (one query at a time, query encoding included). Exits 1 when the ratio is below
--min-ratio (default 0.99).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

from pyserini_aligner.metrics import evaluate

METRICS = ("ndcg@10", "recall@10")


def _run(hits: dict[str, list]) -> dict[str, dict[str, float]]:
    return {qid: {h.docid: float(h.score) for h in results} for qid, results in hits.items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m eval.experiments.exhaustive_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", required=True,
                        help="ir_datasets id with queries and qrels, e.g. beir/scifact/test")
    parser.add_argument("--index", required=True, help="index folder built by python -m pyserini_aligner.index")
    parser.add_argument("--output", required=True, help="JSON report to write")
    parser.add_argument("--encoder", default=None, help="checkpoint (default: the model named in the manifest)")
    parser.add_argument("--strategy", default=None, help="alignment strategy (default: the manifest's)")
    parser.add_argument("--k-per-token", type=int, default=None)
    parser.add_argument("--max-candidates", type=int, default=None)
    parser.add_argument("--query-prune", type=float, default=None)
    parser.add_argument("--refine-with", choices=("all", "kept"), default=None)
    parser.add_argument("--nprobe", type=int, default=None)
    parser.add_argument("--ef-search", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1, help="threads for search (FAISS and torch)")
    parser.add_argument("--exhaustive-cache", default=None,
                        help="JSON file holding the exhaustive run: read if present, else written (saves minutes)")
    parser.add_argument("--latency-queries", type=int, default=None, help="time only the first N queries")
    parser.add_argument("--min-ratio", type=float, default=0.99)
    return parser.parse_args(argv)


def exhaustive_run(args, searcher, queries: dict[str, str]) -> dict[str, dict[str, float]]:
    """The exhaustive top-10 run, from --exhaustive-cache when it matches this index, model and strategy."""
    from pyserini_aligner.search import ExhaustiveScorer

    m = searcher.manifest  # exhaustive scores depend on the stored tokens, not on FAISS or pruning
    key = {"fingerprint": m.model_fingerprint, "num_docs": m.num_docs, "num_tokens": m.num_tokens,
           "strategy": str(searcher.strategy), "dataset": args.dataset}
    cache = Path(args.exhaustive_cache) if args.exhaustive_cache else None
    if cache and cache.is_file():
        stored = json.loads(cache.read_text())
        if stored.get("key") == key:
            return stored["run"]
        logging.warning("%s was made for other documents/model/strategy; recomputing", cache)
    scorer = ExhaustiveScorer(args.index, encoder=searcher.model, strategy=searcher.strategy, progress=True)
    started = time.time()
    run = _run(scorer.batch_search(list(queries.values()), list(queries), k=10, threads=args.threads))
    logging.info("exhaustive scoring took %.0f s", time.time() - started)
    if cache:
        cache.write_text(json.dumps({"key": key, "run": run}))
    return run


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from pyserini_aligner.data import Dataset
    from pyserini_aligner.search import AlignerSearcher

    knobs = {name: getattr(args, name) for name in ("strategy", "k_per_token", "max_candidates", "query_prune",
                                                     "refine_with", "nprobe", "ef_search")
             if getattr(args, name) is not None}
    searcher = AlignerSearcher(args.index, encoder=args.encoder, **knobs)
    dataset = Dataset(args.dataset)
    qrels = dataset.qrels()
    queries = {qid: text for qid, text in dataset.queries().items() if qid in qrels}

    started = time.time()
    run = _run(searcher.batch_search(list(queries.values()), list(queries), k=10, threads=args.threads))
    batch_s = time.time() - started
    latencies = []
    for text in list(queries.values())[:args.latency_queries]:
        t0 = time.perf_counter()
        searcher.search(text, k=10, threads=args.threads)
        latencies.append((time.perf_counter() - t0) * 1000)
    exhaustive = exhaustive_run(args, searcher, queries)

    got, ceiling = evaluate(qrels, run, METRICS), evaluate(qrels, exhaustive, METRICS)
    overlap = np.mean([len(set(run.get(q, {})) & set(exhaustive.get(q, {}))) / max(len(exhaustive.get(q, {})), 1)
                       for q in queries])
    ratio = got["ndcg@10"] / ceiling["ndcg@10"] if ceiling["ndcg@10"] else float("nan")
    m = searcher.manifest
    report = {
        "dataset": args.dataset, "index": str(args.index), "queries": len(queries),
        "index_info": {"index_type": m.index_type, "doc_prune": m.doc_prune, "num_docs": m.num_docs,
                       "num_tokens": m.num_tokens, "num_kept": m.num_kept, "model": m.model_name},
        "searcher_knobs": {"strategy": str(searcher.strategy), "k_per_token": searcher.k_per_token,
                           "max_candidates": searcher.max_candidates, "query_prune": searcher.query_prune,
                           "refine_with": searcher.refine_with, "threads": args.threads},
        "searcher": got, "exhaustive": ceiling, "ndcg10_ratio": ratio, "top10_overlap": float(overlap),
        "latency_ms": {"p50": float(np.percentile(latencies, 50)), "p95": float(np.percentile(latencies, 95)),
                       "mean": float(np.mean(latencies)), "queries": len(latencies)},
        "batch_search_s": batch_s, "pass": bool(ratio >= args.min_ratio),
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("searcher", "exhaustive", "ndcg10_ratio", "top10_overlap", "latency_ms")}))
    if not report["pass"]:
        sys.exit(f"searcher nDCG@10 is {ratio:.4f} of exhaustive, below --min-ratio {args.min_ratio}")


if __name__ == "__main__":
    main()
