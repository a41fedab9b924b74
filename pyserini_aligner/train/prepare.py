"""Build a training bundle: ``python -m pyserini_aligner.train.prepare [--output runs/train_data]`` (CPU, needs
Pyserini).

``python -m pyserini_aligner.train.prepare --output <dir>``: train queries SciFact train (minus a held-out slice)
and NFCorpus train, with BM25 hard negatives mined by Pyserini (Lucene, k1=0.9, b=0.4, over title + text);
validation NFCorpus dev and the held-out SciFact train queries. No test split is read. ``--pseudo-per-doc N``
adds label-free sets over the same corpora (see pseudo.py): ``scifact-pseudo`` / ``nfcorpus-pseudo`` (N sentences
per document) and ``scifact-titles`` / ``nfcorpus-titles`` (each document's title).

``python -m pyserini_aligner.train.prepare --corpus <JsonCollection | BEIR folder | ir_datasets id> --unsupervised
--output <dir>``: label-free only, set ``corpus-pseudo`` over corpus ``corpus``, no validation set.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
from pathlib import Path

from pyserini_aligner.cli import HelpFormatter, add_quiet_flag, positive_int, run_main
from pyserini_aligner.train.data import load_bundle, write_bundle
from pyserini_aligner.train.pseudo import PseudoQuery, pseudo_queries, title_queries

log = logging.getLogger(__name__)
BUNDLE_NAME = "bundle.json.gz"
DEFAULT_OUTPUT = Path("runs/train_data")  # the training configs read runs/train_data/bundle.json.gz
TRAIN_SPLITS = {"scifact": "beir/scifact/train", "nfcorpus": "beir/nfcorpus/train"}
DEV_SPLITS = {"nfcorpus-dev": ("nfcorpus", "beir/nfcorpus/dev")}
HELDOUT = "scifact-heldout"
PSEUDO_SUFFIX = "-pseudo"
TITLES_SUFFIX = "-titles"  # label-free: each document's title as its query
CORPUS_NAME = "corpus"  # the corpus of an unsupervised bundle


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


def pseudo_rows(index_dir: Path, queries: list[PseudoQuery], depth: int, threads: int) -> list[dict]:
    """Bundle rows of label-free pairs (``pseudo.PseudoQuery``) with their top-``depth`` BM25 negatives from
    ``index_dir`` (the source document excluded), in qid order."""
    from pyserini_aligner.bm25 import bm25_search

    if not queries:
        raise ValueError("no pseudo-query could be cut from the corpus (no sentence of 6-40 words in a document of "
                         "at least 26 words)")
    hits = bm25_search(index_dir, {q.qid: q.text for q in queries}, k=depth + 1, threads=threads, remove_query=False)
    return [{"qid": q.qid, "text": q.text, "positives": {q.docid: 1},
             "negatives": [d for d, _ in hits[q.qid] if d != q.docid][:depth], "drop": list(q.span)}
            for q in sorted(queries, key=lambda q: q.qid)]


def prepare_corpus(corpus: str, output: Path, work: Path, depth: int = 30, per_doc: int = 1, seed: int = 0,
                   threads: int = 2) -> Path:
    """Write ``output/bundle.json.gz`` of label-free pairs over ``corpus`` (JsonCollection file/folder, BEIR folder
    or ir_datasets id); returns its path."""
    from pyserini_aligner.bm25 import build_lucene_index
    from pyserini_aligner.data import Doc
    from pyserini_aligner.index.corpus import read_corpus

    docs = [(docid, text) for docid, text, *_ in read_corpus(corpus)]
    log.info("%s: %d docs; BM25 index, pseudo-queries and negatives", corpus, len(docs))
    index = build_lucene_index((Doc(d, "", t) for d, t in docs), work / f"{CORPUS_NAME}-lucene", threads=threads)
    rows = pseudo_rows(index, pseudo_queries(docs, per_doc=per_doc, seed=seed), depth, threads)
    name = CORPUS_NAME + PSEUDO_SUFFIX
    meta = {"corpus": str(corpus), "stats": {CORPUS_NAME: {"docs": len(docs)}, name: {"train_queries": len(rows)}},
            "negatives": f"Pyserini BM25 (k1=0.9, b=0.4) top-{depth} docids per pseudo-query (its source excluded)",
            "seed": seed}
    path = write_bundle({"meta": meta, "corpora": {CORPUS_NAME: {"docids": [d for d, _ in docs],
                                                                 "texts": [t for _, t in docs]}},
                         "train": {name: rows}, "train_corpus": {name: CORPUS_NAME}, "validation": {}},
                        output / BUNDLE_NAME)
    load_bundle(path)  # round-trip check
    log.info("wrote %s (%.1f MB): %d pseudo-queries", path, path.stat().st_size / 1e6, len(rows))
    return path


def prepare(output: Path, work: Path, depth: int = 50, heldout_fraction: float = 0.1, seed: int = 0,
            threads: int = 2, pseudo_per_doc: int = 0, pseudo_depth: int = 30) -> Path:
    """Write ``output/bundle.json.gz``; Lucene indexes are built under ``work``; with ``pseudo_per_doc`` > 0 also
    the label-free sets ``<corpus>-pseudo``. Returns the bundle path."""
    from pyserini_aligner.bm25 import build_lucene_index
    from pyserini_aligner.data import Dataset

    corpora, train, validation, stats, train_corpus = {}, {}, {}, {}, {}
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
        if pseudo_per_doc:
            for suffix, pseudo in ((PSEUDO_SUFFIX, pseudo_queries([(d.docid, d.contents) for d in docs],
                                                                  per_doc=pseudo_per_doc, seed=seed)),
                                   (TITLES_SUFFIX, title_queries((d.docid, d.title, d.contents) for d in docs))):
                if pseudo:
                    train[name + suffix] = pseudo_rows(index, pseudo, pseudo_depth, threads)
                    train_corpus[name + suffix] = name
                    stats[name + suffix] = {"train_queries": len(train[name + suffix])}
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
    path = write_bundle({"meta": meta, "corpora": corpora, "train": train, "validation": validation,
                         "train_corpus": train_corpus}, output / BUNDLE_NAME)
    load_bundle(path)  # round-trip check
    log.info("wrote %s (%.1f MB): %s", path, path.stat().st_size / 1e6, stats)
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pyserini_aligner.train.prepare",
                                     description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"folder for {BUNDLE_NAME}")
    parser.add_argument("--work", type=Path, default=Path(".cache/train_prepare"), help="Lucene index folder")
    parser.add_argument("--depth", type=positive_int, default=50, help="BM25 negatives kept per labelled query")
    parser.add_argument("--heldout-fraction", type=float, default=0.1, help="SciFact train queries held out")
    parser.add_argument("--pseudo-per-doc", type=int, default=0,
                        help="label-free pseudo-queries per document (0: none; --unsupervised: default 1)")
    parser.add_argument("--pseudo-depth", type=positive_int, default=30, help="BM25 negatives kept per pseudo-query")
    parser.add_argument("--corpus", help="with --unsupervised: JsonCollection file/folder, BEIR folder or "
                                         "ir_datasets id to cut pseudo-queries from")
    parser.add_argument("--unsupervised", action="store_true", help="label-free bundle of --corpus only")
    parser.add_argument("--seed", type=int, default=0, help="seed of the held-out split")
    parser.add_argument("--threads", type=positive_int, default=2, help="Lucene indexing and BM25 search threads")
    add_quiet_flag(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; argparse errors for values and pairs that can't work."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.pseudo_per_doc < 0:
        parser.error("--pseudo-per-doc must be >= 0")
    if not 0.0 < args.heldout_fraction < 1.0:
        parser.error("--heldout-fraction must be in (0, 1)")
    if bool(args.corpus) != args.unsupervised:
        parser.error("--corpus and --unsupervised go together")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (:func:`pyserini_aligner.cli.run_main`)."""
    return run_main(parse_args, run, argv, timestamps=True)


def run(args: argparse.Namespace) -> None:
    """Write the bundle the flags ask for."""
    if args.unsupervised:
        prepare_corpus(args.corpus, args.output, args.work, args.pseudo_depth, args.pseudo_per_doc or 1, args.seed,
                       args.threads)
    else:
        prepare(args.output, args.work, args.depth, args.heldout_fraction, args.seed, args.threads,
                args.pseudo_per_doc, args.pseudo_depth)


if __name__ == "__main__":
    sys.exit(main())
