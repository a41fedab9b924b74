"""``python -m pyserini_aligner.adapt --index <dir> --topics <file | ir_datasets id> --qrels <file | ir_datasets id>``

Few-shot alignment adaptation: retrieve candidates for a handful of labelled queries, rescore them with every
candidate alignment strategy, print each strategy's nDCG@10 and save the best as the index's default strategy
(used by AlignerSearcher, ``FaissSearcher(<index>)`` and Pyserini's search CLIs from then on).
"""
from __future__ import annotations

import argparse
import logging
import sys

from pyserini_aligner.adapt.select import CANDIDATE_STRATEGIES, METRIC, choose_strategy, rescore, strategy_table
from pyserini_aligner.cli import positive_int


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pyserini_aligner.adapt", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", required=True, help="AligneR index folder; its default strategy is updated")
    parser.add_argument("--topics", required=True, help="labelled queries: topics file (TSV qid<TAB>text, JSONL), "
                                                        "BEIR folder or an ir_datasets id such as beir/scifact/train")
    parser.add_argument("--qrels", required=True, help="judgements: TREC qrels file (4 columns), BEIR qrels TSV (with "
                                                       "its header), BEIR folder or ir_datasets id")
    parser.add_argument("--candidates", type=positive_int, default=100, help="documents retrieved and rescored per query")
    parser.add_argument("--strategies", nargs="+", default=list(CANDIDATE_STRATEGIES), help="strategies to try")
    parser.add_argument("--sample", type=positive_int, default=None, help="use a random sample of N labelled topics")
    parser.add_argument("--seed", type=int, default=0, help="seed of --sample")
    parser.add_argument("--encoder", default=None, help="checkpoint folder (default: the model in the manifest)")
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--dry-run", action="store_true", help="print the table but leave the index unchanged")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def format_table(means: dict[str, float], best: str, n_queries: int) -> str:
    lines = [f"{'strategy':<14} {METRIC:>8}   ({n_queries} queries)"]
    lines += [f"{spec:<14} {value:>8.4f}{'   <- chosen' if spec == best else ''}" for spec, value in means.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from pyserini_aligner.adapt.inputs import labelled_topics
    from pyserini_aligner.index.store import set_default_strategy
    from pyserini_aligner.search.searcher import AlignerSearcher
    from pyserini_aligner.data import load_topics, read_qrels

    try:
        qrels = read_qrels(args.qrels)
        topics = labelled_topics(load_topics(args.topics), qrels, args.sample, args.seed)
        searcher = AlignerSearcher(args.index, encoder=args.encoder)
        qids = list(topics)
        found = searcher.batch_search([topics[q] for q in qids], qids, k=args.candidates, threads=args.threads)
        candidates = {q: [hit.docid for hit in found[q]] for q in qids}
        runs = rescore(searcher.store, searcher.model, topics, candidates, args.strategies, progress=not args.quiet)
        best, means = choose_strategy(strategy_table(qrels, runs), qids)
    except (OSError, ValueError) as error:  # DataError, IndexFormatError and bad strategies are ValueErrors
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(format_table(means, best, len(qids)))
    if not any(value > 0 for value in means.values()):
        print(f"error: every strategy scores {METRIC} 0 on these {len(qids)} queries (no relevant document among "
              f"the top {args.candidates} candidates); {args.index} is left unchanged", file=sys.stderr)
        return 1
    if args.dry_run:
        print(f"dry run: {args.index} keeps default strategy {searcher.manifest.default_strategy}")
    else:
        set_default_strategy(args.index, best)
        print(f"saved default strategy {best} in {args.index}/manifest.json (was {searcher.manifest.default_strategy})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
