"""``python -m pyserini_aligner.adapt --index <dir> --topics <file | ir_datasets id> --qrels <file | ir_datasets id>``

Few-shot alignment adaptation: retrieve candidates for a handful of labelled queries with the index's current default
strategy (the baseline), rescore them with every candidate alignment strategy and print each strategy's nDCG@10,
its gain over the baseline and the p-value of that gain (one-sided paired randomisation test over the queries,
corrected for trying several strategies). The best strategy replaces the baseline only when it gains at least
--min-gain with p <= --alpha, and is then saved as the index's default strategy (used by AlignerSearcher,
``FaissSearcher(<index>)`` and Pyserini's search CLIs from then on). When nothing beats the baseline the index is
left as it is (its manifest is not rewritten).
"""
from __future__ import annotations

import argparse
import sys

from pyserini_aligner.adapt.select import (ALPHA, CANDIDATE_STRATEGIES, METRIC, MIN_GAIN, PERMUTATIONS, Choice,
                                           choose_strategy, rescore, strategy_table)
from pyserini_aligner.cli import (HelpFormatter, add_quiet_flag, fraction, non_negative, positive_int, run_main,
                                  strategy)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pyserini_aligner.adapt", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--index", required=True, help="AligneR index folder; its default strategy is updated")
    parser.add_argument("--topics", required=True, help="labelled queries: topics file (TSV qid<TAB>text, JSONL), "
                                                        "BEIR folder or an ir_datasets id such as beir/scifact/train")
    parser.add_argument("--qrels", required=True, help="judgements: TREC qrels file (4 columns), BEIR qrels TSV (with "
                                                       "its header), BEIR folder or ir_datasets id")
    parser.add_argument("--candidates", type=positive_int, default=100, help="documents retrieved and rescored per query")
    parser.add_argument("--strategies", nargs="+", type=strategy, default=list(CANDIDATE_STRATEGIES),
                        help="strategies to try (the baseline is always tried)")
    parser.add_argument("--alpha", type=fraction, default=ALPHA,
                        help=f"significance level a strategy's gain over the baseline must reach (default {ALPHA})")
    parser.add_argument("--min-gain", type=non_negative, default=MIN_GAIN,
                        help=f"smallest mean {METRIC} gain over the baseline, in {METRIC} units (default {MIN_GAIN}"
                             " = 0.5 point)")
    parser.add_argument("--permutations", type=positive_int, default=PERMUTATIONS,
                        help="random sign flips of the test when exact enumeration would need more")
    parser.add_argument("--sample", type=positive_int, default=None, help="use a random sample of N labelled topics")
    parser.add_argument("--seed", type=int, default=0, help="seed of --sample and of the test's sign flips")
    parser.add_argument("--encoder", default=None, help="checkpoint folder (default: the model in the manifest)")
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--dry-run", action="store_true", help="print the table but leave the index unchanged")
    add_quiet_flag(parser)
    return parser


def format_table(choice: Choice) -> str:
    """One row per strategy: mean metric, gain over the baseline, p-value; the chosen one marked."""
    lines = [f"{'strategy':<14} {METRIC:>8} {'gain':>8} {'p':>7}   ({choice.queries} queries)"]
    for spec, value in choice.means.items():
        gain, p = ("", "") if spec == choice.baseline else (f"{choice.gain(spec):+.4f}", f"{choice.p_values[spec]:.4f}")
        lines.append(f"{spec:<14} {value:>8.4f} {gain:>8} {p:>7}{'   <- chosen' if spec == choice.strategy else ''}")
    return "\n".join(lines)


def verdict(choice: Choice, alpha: float, min_gain: float) -> str:
    """Why the baseline was kept or replaced, in one line."""
    best = choice.best
    if choice.changed:
        return (f"replacing {choice.baseline}: {choice.strategy} gains {choice.gain(choice.strategy):+.4f} with p = "
                f"{choice.p_values[choice.strategy]:.4f} (>= {min_gain:g} and p <= {alpha:g})")
    if best == choice.baseline:
        return f"keeping {choice.baseline}: no strategy beats it"
    return (f"keeping {choice.baseline}: the best, {best}, gains {choice.gain():+.4f} with p = "
            f"{choice.p_values[best]:.4f} (needs >= {min_gain:g} and p <= {alpha:g})")


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (:func:`pyserini_aligner.cli.run_main`)."""
    return run_main(build_parser().parse_args, adapt, argv)


def adapt(args: argparse.Namespace) -> int:
    """Rescore the candidates of the labelled queries with every strategy and keep or replace the baseline."""
    from pyserini_aligner.adapt.inputs import labelled_topics
    from pyserini_aligner.alignment import parse_strategy
    from pyserini_aligner.data import load_topics, read_qrels
    from pyserini_aligner.index.store import read_manifest, set_default_strategy
    from pyserini_aligner.resolve import model_for_index
    from pyserini_aligner.search.searcher import AlignerSearcher

    qrels = read_qrels(args.qrels)
    topics = labelled_topics(load_topics(args.topics), qrels, args.sample, args.seed)
    manifest = read_manifest(args.index)
    model = model_for_index(args.encoder, manifest, args.index)
    baseline = str(parse_strategy(manifest.default_strategy))  # the strategy the index uses now
    searcher = AlignerSearcher(args.index, encoder=model, strategy=baseline)
    strategies = list(dict.fromkeys([baseline, *(str(parse_strategy(s)) for s in args.strategies)]))
    qids = list(topics)
    found = searcher.batch_search([topics[q] for q in qids], qids, k=args.candidates, threads=args.threads)
    candidates = {q: [hit.docid for hit in found[q]] for q in qids}
    runs = rescore(searcher.store, searcher.model, topics, candidates, strategies, progress=not args.quiet)
    choice = choose_strategy(strategy_table(qrels, runs), qids, baseline, args.alpha, args.min_gain,
                             args.permutations, args.seed)
    print(format_table(choice))
    print(verdict(choice, args.alpha, args.min_gain))
    if not any(value > 0 for value in choice.means.values()):
        print(f"error: every strategy scores {METRIC} 0 on these {len(qids)} queries (no relevant document among "
              f"the top {args.candidates} candidates); {args.index} is left unchanged", file=sys.stderr)
        return 1
    if not choice.changed:
        print(f"{args.index} keeps default strategy {baseline} (unchanged)")
    elif args.dry_run:
        print(f"dry run: {args.index} keeps default strategy {baseline}")
    else:
        set_default_strategy(args.index, choice.strategy)
        print(f"saved default strategy {choice.strategy} in {args.index}/manifest.json (was {baseline})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
