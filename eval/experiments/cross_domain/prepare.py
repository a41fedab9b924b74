"""``python -m eval.experiments.cross_domain.prepare --output <dir>`` (CPU, needs Pyserini): the inputs of
``python -m eval.experiments.cross_domain``, compact enough to travel to a machine without Pyserini or the BEIR files.

- ``bundle.json.gz``: the training bundle of ``pyserini_aligner.train.prepare`` (SciFact train minus a held-out slice,
  NFCorpus train, BM25 negatives; validation NFCorpus dev and SciFact held-out) plus the label-free sets
  ``scifact-pseudo`` / ``nfcorpus-pseudo`` (sentences) and ``scifact-titles`` / ``nfcorpus-titles`` (titles); it
  holds both corpora's texts once (gzip JSON).
- ``test.json.gz``: the SciFact and NFCorpus test queries and qrels, opened by the experiment only after it has
  chosen its recipe on validation.
"""
from __future__ import annotations

import argparse
import gzip
import json
import logging
from pathlib import Path

from pyserini_aligner.train.prepare import prepare

TEST_FILE = "test.json.gz"
TEST_FORMAT = "pyserini-aligner-test-sets"
TEST_SPLITS = {"scifact-test": ("scifact", "beir/scifact/test"), "nfcorpus-test": ("nfcorpus", "beir/nfcorpus/test")}


def write_test_sets(path: Path, splits: dict[str, tuple[str, str]] = TEST_SPLITS) -> Path:
    """Write ``{"format", "sets": {name: {"corpus", "queries", "qrels"}}}`` (queries with a relevant doc only)."""
    from pyserini_aligner.data import Dataset

    sets = {}
    for name, (corpus, spec) in splits.items():
        dataset = Dataset(spec)
        queries, qrels = dataset.queries(), dataset.qrels()
        keep = sorted(q for q in queries if any(r > 0 for r in qrels.get(q, {}).values()))
        sets[name] = {"corpus": corpus, "queries": {q: queries[q] for q in keep}, "qrels": {q: qrels[q] for q in keep}}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=9) as out:
        json.dump({"format": TEST_FORMAT, "sets": sets}, out, ensure_ascii=False, separators=(",", ":"))
    tmp.replace(path)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.experiments.cross_domain.prepare",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True, help=f"folder for bundle.json.gz and {TEST_FILE}")
    parser.add_argument("--work", type=Path, default=Path(".cache/train_prepare"), help="Lucene index folder")
    parser.add_argument("--pseudo-per-doc", type=int, default=1, help="label-free pseudo-queries per document")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if args.pseudo_per_doc < 1:
        parser.error("--pseudo-per-doc must be >= 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prepare(args.output, args.work, threads=args.threads, pseudo_per_doc=args.pseudo_per_doc)
    write_test_sets(args.output / TEST_FILE)


if __name__ == "__main__":
    main()
