"""Build the training bundle: ``python -m pyserini_aligner.train.prepare [--output runs/train_data]`` (CPU, needs
Pyserini).

Train queries: SciFact train (minus a held-out slice) and NFCorpus train, with BM25 hard negatives mined by
Pyserini (Lucene, k1=0.9, b=0.4, over title + text). Validation: NFCorpus dev and the held-out SciFact train
queries. No test split is read.
"""

from __future__ import annotations

import argparse
import logging
import random
from pathlib import Path

from pyserini_aligner.train.data import load_bundle, write_bundle

log = logging.getLogger(__name__)
BUNDLE_NAME = "bundle.json.gz"
DEFAULT_OUTPUT = Path("runs/train_data")  # the training configs read runs/train_data/bundle.json.gz
TRAIN_SPLITS = {"scifact": "beir/scifact/train", "nfcorpus": "beir/nfcorpus/train"}
DEV_SPLITS = {"nfcorpus-dev": ("nfcorpus", "beir/nfcorpus/dev")}
HELDOUT = "scifact-heldout"


def heldout_qids(qids: list[str], fraction: float, seed: int) -> set[str]:
    """A seeded ``fraction`` of ``qids`` (at least 1), independent of their order."""
    ordered = sorted(qids)
    count = max(1, round(fraction * len(ordered)))
    return set(random.Random(seed).sample(ordered, count))


def mine_negatives(index_dir: Path, queries: dict[str, str], qrels: dict[str, dict[str, int]], depth: int,
                   threads: int) -> dict[str, list[str]]:
    """Top-``depth`` BM25 docids per query that are not judged relevant, best first."""
    from pyserini_aligner.bm25 import bm25_search

    extra = max(len([d for d, r in qrels.get(q, {}).items() if r > 0]) for q in queries)
    hits = bm25_search(index_dir, queries, k=depth + extra, threads=threads, remove_query=False)
    return {q: [d for d, _ in hits[q] if qrels.get(q, {}).get(d, 0) <= 0][:depth] for q in queries}


def prepare(output: Path, work: Path, depth: int = 50, heldout_fraction: float = 0.1, seed: int = 0,
            threads: int = 2) -> Path:
    """Write ``output/bundle.json.gz``; Lucene indexes are built under ``work``. Returns the bundle path."""
    from pyserini_aligner.bm25 import build_lucene_index
    from pyserini_aligner.data import Dataset

    corpora, train, validation, stats = {}, {}, {}, {}
    for name, spec in TRAIN_SPLITS.items():
        dataset = Dataset(spec)
        docs = list(dataset.docs())
        corpora[name] = {"docids": [d.docid for d in docs], "texts": [d.contents for d in docs]}
        queries, qrels = dataset.queries(), dataset.qrels()
        queries = {q: t for q, t in queries.items() if any(r > 0 for r in qrels.get(q, {}).values())}
        if name == "scifact":
            held = heldout_qids(list(queries), heldout_fraction, seed)
            validation[HELDOUT] = {"corpus": name, "queries": {q: queries[q] for q in sorted(held)},
                                   "qrels": {q: qrels[q] for q in sorted(held)}}
            queries = {q: t for q, t in queries.items() if q not in held}
        log.info("%s: %d docs, %d train queries; BM25 index and negatives", spec, len(docs), len(queries))
        index = build_lucene_index(iter(docs), work / f"{name}-lucene", threads=threads)
        negatives = mine_negatives(index, queries, qrels, depth, threads)
        train[name] = [{"qid": q, "text": queries[q], "positives": {d: r for d, r in qrels[q].items() if r > 0},
                        "negatives": negatives[q]} for q in sorted(queries)]
        stats[name] = {"docs": len(docs), "train_queries": len(queries),
                       "mean_negatives": sum(len(n) for n in negatives.values()) / max(1, len(negatives))}
    for name, (corpus, spec) in DEV_SPLITS.items():
        dataset = Dataset(spec)
        queries, qrels = dataset.queries(), dataset.qrels()
        keep = sorted(q for q in queries if any(r > 0 for r in qrels.get(q, {}).values()))
        validation[name] = {"corpus": corpus, "queries": {q: queries[q] for q in keep},
                            "qrels": {q: qrels[q] for q in keep}}
    for name, vset in validation.items():
        stats[name] = {"queries": len(vset["queries"])}
    meta = {"train_splits": TRAIN_SPLITS, "validation": {HELDOUT: f"{heldout_fraction:g} of beir/scifact/train "
                                                                  f"queries (seed {seed})",
                                                         **{n: s for n, (_, s) in DEV_SPLITS.items()}},
            "negatives": f"Pyserini BM25 (k1=0.9, b=0.4) top-{depth} non-relevant docids per query",
            "seed": seed, "stats": stats}
    path = write_bundle({"meta": meta, "corpora": corpora, "train": train, "validation": validation},
                        output / BUNDLE_NAME)
    load_bundle(path)  # round-trip check
    log.info("wrote %s (%.1f MB): %s", path, path.stat().st_size / 1e6, stats)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"folder for {BUNDLE_NAME} (default: %(default)s)")
    parser.add_argument("--work", type=Path, default=Path(".cache/train_prepare"), help="Lucene index folder")
    parser.add_argument("--depth", type=int, default=50, help="BM25 negatives kept per query")
    parser.add_argument("--heldout-fraction", type=float, default=0.1, help="SciFact train queries held out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if args.depth < 1:
        parser.error("--depth must be >= 1")
    if not 0.0 < args.heldout_fraction < 1.0:
        parser.error("--heldout-fraction must be in (0, 1)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prepare(args.output, args.work, args.depth, args.heldout_fraction, args.seed, args.threads)


if __name__ == "__main__":
    main()
