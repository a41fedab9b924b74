"""``python -m pyserini_aligner.adapt --index <dir> --topics <file | ir_datasets id> --qrels <file | ir_datasets id>``

Few-shot adaptation: choose the checkpoint and the alignment strategy from a handful of labelled queries. The
candidates of those queries (the index's own search with its default strategy, or BM25's top hits from
--lucene-index) are rescored by every shipped checkpoint (and the index's own) under every candidate strategy:
each checkpoint encodes the candidate documents' texts, and no other document. The table gives each (checkpoint,
strategy) pair's nDCG@10, its gain over the baseline (the index's checkpoint and default strategy), the paired
t-statistic of that gain and its p-value (one-sided paired randomisation test over the queries, max-T over every
pair tried). The best pair replaces the baseline only when it gains at least --min-gain with p <= --alpha.

A strategy of the index's checkpoint is then saved as the index's default strategy (used by AlignerSearcher,
``FaissSearcher(<index>)`` and Pyserini's search CLIs from then on). A pair of another checkpoint needs its own
index: the command that builds it is printed (or run, with --build-index), and the index is left as it is. When
nothing beats the baseline the index is left as it is (its manifest is not rewritten). With --checkpoints naming
only the index's own checkpoint, strategies are compared on the index's stored vectors and nothing is encoded.
"""
from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pyserini_aligner.adapt.select import (ALPHA, CANDIDATE_STRATEGIES, METRIC, MIN_GAIN, PERMUTATIONS, Candidate,
                                           Choice)
from pyserini_aligner.checkpoints import SHIPPED
from pyserini_aligner.cli import (HelpFormatter, UsageError, add_quiet_flag, device, fraction, non_negative,
                                  positive_int, run_main, strategy)

if TYPE_CHECKING:
    from pyserini_aligner.adapt.checkpoints import Rescored

log = logging.getLogger("pyserini_aligner.adapt")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pyserini_aligner.adapt", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--index", required=True, help="AligneR index folder; its default strategy is updated")
    parser.add_argument("--topics", required=True, help="labelled queries: topics file (TSV qid<TAB>text, JSONL), "
                                                        "BEIR folder or an ir_datasets id such as beir/scifact/train")
    parser.add_argument("--qrels", required=True, help="judgements: TREC qrels file (4 columns), BEIR qrels TSV (with "
                                                       "its header), BEIR folder or ir_datasets id")
    parser.add_argument("--candidates", type=positive_int, default=100,
                        help="documents retrieved and rescored per query")
    parser.add_argument("--strategies", nargs="+", type=strategy, default=list(CANDIDATE_STRATEGIES),
                        help="strategies to try (the baseline is always tried; default: "
                             f"{' '.join(map(str, CANDIDATE_STRATEGIES))})")
    parser.add_argument("--checkpoints", nargs="+", default=None, metavar="CHECKPOINT",
                        help="checkpoints to try besides the index's own: shipped names or checkpoint folders "
                             f"(default: every shipped one, {', '.join(SHIPPED)}); the index's own alone compares "
                             "strategies on its stored vectors")
    parser.add_argument("--corpus", default=None,
                        help="the collection the index was built from (JsonCollection, BEIR folder or ir_datasets id; "
                             "default: the one its manifest records): the candidates' texts and the index command")
    parser.add_argument("--lucene-index", metavar="DIR", default=None,
                        help="Pyserini Lucene index of the same collection: rescore its BM25 top --candidates instead "
                             "of the AligneR index's, with the texts it stores (built with --storeRaw)")
    parser.add_argument("--build-index", metavar="DIR", default=None,
                        help="when another checkpoint wins, index the corpus with it into DIR (the printed command)")
    parser.add_argument("--alpha", type=fraction, default=ALPHA,
                        help=f"significance level a candidate's gain over the baseline must reach (default {ALPHA})")
    parser.add_argument("--min-gain", type=non_negative, default=MIN_GAIN,
                        help=f"smallest mean {METRIC} gain over the baseline, in {METRIC} units (default {MIN_GAIN}"
                             " = 0.5 point)")
    parser.add_argument("--permutations", type=positive_int, default=PERMUTATIONS,
                        help="random sign flips of the test when exact enumeration would need more")
    parser.add_argument("--sample", type=positive_int, default=None, help="use a random sample of N labelled topics")
    parser.add_argument("--seed", type=int, default=0, help="seed of --sample and of the test's sign flips")
    parser.add_argument("--encoder", default=None, help="checkpoint folder (default: the model in the manifest)")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="texts encoded together")
    parser.add_argument("--device", type=device, default="cpu", help="cpu or cuda[:N]: where queries and candidate "
                                                                     "documents are encoded")
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--dry-run", action="store_true",
                        help="print the table and the decision but change and build nothing")
    add_quiet_flag(parser)
    return parser


NO_TEST = ": one query gives no test"


def _signed(choice: Choice, candidate, note: str = "") -> str:
    """The t-statistic of ``candidate``'s gain as printed: "n/a" (and ``note``) for one query, which has no spread
    to test against."""
    value = choice.t_values[candidate]
    if choice.queries < 2:
        return "n/a" + note
    return f"{value:+.2f}" if abs(value) != float("inf") else ("+inf" if value > 0 else "-inf")


def format_table(choice: Choice) -> str:
    """One row per (checkpoint, strategy) pair: mean metric, gain over the baseline, paired t-statistic and max-T
    p-value; the baseline and the chosen pair marked."""
    width = max([len("checkpoint")] + [len(c.checkpoint) for c in choice.means])
    lines = [f"{'checkpoint':<{width}} {'strategy':<14} {METRIC:>8} {'gain':>8} {'t':>6} {'p':>7}   "
             f"({choice.queries} queries)"]
    for c, value in choice.means.items():
        cells = ("", "", "") if c == choice.baseline else (f"{choice.gain(c):+.4f}", _signed(choice, c),
                                                          f"{choice.p_values[c]:.4f}")
        marks = [m for m, on in (("current", c == choice.baseline), ("chosen", c == choice.chosen)) if on]
        lines.append(f"{c.checkpoint:<{width}} {c.strategy:<14} {value:>8.4f} {cells[0]:>8} {cells[1]:>6} "
                     f"{cells[2]:>7}" + (f"   <- {', '.join(marks)}" if marks else "").rstrip())
    return "\n".join(line.rstrip() for line in lines)


def verdict(choice: Choice, alpha: float, min_gain: float) -> str:
    """Why the baseline was kept or replaced, in one line."""
    best, tried = choice.best, len(choice.means) - 1
    rule = f"max-T over the {tried} pairs tried"
    if choice.changed:
        c = choice.chosen
        return (f"replacing {choice.baseline}: {c} gains {choice.gain(c):+.4f} (t = {_signed(choice, c, NO_TEST)}) "
                f"with p = {choice.p_values[c]:.4f} (>= {min_gain:g} and p <= {alpha:g}; {rule})")
    if best == choice.baseline:
        return f"keeping {choice.baseline}: no candidate beats it"
    return (f"keeping {choice.baseline}: the best, {best}, gains {choice.gain():+.4f} (t = "
            f"{_signed(choice, best, NO_TEST)}) with p = {choice.p_values[best]:.4f} (needs >= {min_gain:g} and "
            f"p <= {alpha:g}; {rule})")


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (:func:`pyserini_aligner.cli.run_main`)."""
    return run_main(build_parser().parse_args, adapt, argv)


def adapt(args: argparse.Namespace) -> int:
    """Rescore the candidates of the labelled queries with every checkpoint and strategy; keep the baseline or
    save, print or build what replaces it."""
    from pyserini_aligner.adapt.checkpoints import (candidate_runs, candidate_texts, check_checkpoints,
                                                    checkpoint_label, rescore_checkpoints)
    from pyserini_aligner.adapt.inputs import labelled_topics
    from pyserini_aligner.adapt.select import choose, rescore, strategy_table
    from pyserini_aligner.data import load_topics, read_qrels
    from pyserini_aligner.index.format import read_manifest
    from pyserini_aligner.resolve import model_for_index

    try:
        check_checkpoints(args.checkpoints or ())
    except ValueError as error:
        raise UsageError(f"--checkpoints: {error}") from None
    manifest = read_manifest(args.index)
    corpus = args.corpus or manifest.corpus or None
    if args.build_index and corpus is None:
        raise UsageError(f"--build-index needs the collection to index: index {args.index} records none; pass "
                         "--corpus")
    model = model_for_index(args.encoder, manifest, args.index, args.device)
    own = checkpoint_label(args.encoder or manifest.model_name)
    others = [c for c in (args.checkpoints or SHIPPED) if checkpoint_label(c) != own]
    if others and args.lucene_index is None and corpus is None:
        if args.checkpoints:
            raise UsageError(f"--checkpoints: comparing checkpoints needs the candidates' texts, and index "
                             f"{args.index} records no corpus; pass --corpus or --lucene-index")
        log.warning("comparing the strategies of %s only: index %s records no corpus, so other checkpoints cannot "
                    "encode the candidates (pass --corpus or --lucene-index)", own, args.index)
        others = []
    qrels = read_qrels(args.qrels)
    topics = labelled_topics(load_topics(args.topics), qrels, args.sample, args.seed)
    baseline = Candidate(own, str(manifest.default_strategy))  # what the index uses now
    strategies = list(dict.fromkeys([manifest.default_strategy, *args.strategies]))
    qids = list(topics)
    candidates = first_stage(args, model, baseline.strategy, topics)
    rescored = []
    if others:
        texts = candidate_texts([d for q in qids for d in candidates[q]], args.lucene_index, corpus)
        rescored = rescore_checkpoints([(own, model), *((checkpoint_label(c), c) for c in others)], topics,
                                       candidates, texts, strategies, manifest.doc_maxlen, args.device,
                                       args.batch_size, progress=not args.quiet)
        runs = candidate_runs(rescored)
    else:
        from pyserini_aligner.index.reader import StoredIndex

        stored = rescore(StoredIndex(args.index), model, topics, candidates, strategies, args.batch_size,
                         progress=not args.quiet)
        runs = {Candidate(own, s): run for s, run in stored.items()}
    choice = choose(strategy_table(qrels, runs), qids, baseline, args.alpha, args.min_gain, args.permutations,
                    args.seed)
    print(format_table(choice))
    distinct = len({d for q in qids for d in candidates[q]})
    if rescored:
        print(f"{distinct} distinct candidate documents; each of the {len(rescored)} checkpoints encoded "
              f"{', '.join(str(r.encoded) for r in rescored)} of the {manifest.num_docs} documents of the index")
    else:
        print(f"{distinct} distinct candidate documents, scored on the index's stored vectors (none encoded)")
    print(verdict(choice, args.alpha, args.min_gain))
    if not any(value > 0 for value in choice.means.values()):
        print(f"error: every candidate scores {METRIC} 0 on these {len(qids)} queries (no relevant document among "
              f"the top {args.candidates} candidates); {args.index} is left unchanged", file=sys.stderr)
        return 1
    if choice.chosen.checkpoint == own:
        return keep_checkpoint(args, choice)
    return switch_checkpoint(args, manifest, corpus, choice.chosen,
                             next(r for r in rescored if r.checkpoint == choice.chosen.checkpoint))


def first_stage(args: argparse.Namespace, model, strategy_spec: str, topics: dict[str, str]) -> dict[str, list[str]]:
    """qid -> the candidate docids: the index's own top --candidates with its default strategy, or BM25's from
    --lucene-index."""
    qids = list(topics)
    if args.lucene_index is not None:
        from pyserini_aligner.bm25 import bm25_search

        found = bm25_search(args.lucene_index, topics, k=args.candidates, threads=args.threads)
        return {q: [docid for docid, _ in found[q]] for q in qids}
    from pyserini_aligner.search.searcher import AlignerSearcher

    searcher = AlignerSearcher(args.index, encoder=model, strategy=strategy_spec)
    found = searcher.batch_search([topics[q] for q in qids], qids, k=args.candidates, threads=args.threads)
    return {q: [hit.docid for hit in found[q]] for q in qids}


def keep_checkpoint(args: argparse.Namespace, choice: Choice) -> int:
    """The index's checkpoint stays: save the chosen strategy as its default (unless it is the default already, or
    --dry-run)."""
    from pyserini_aligner.index.commit import set_default_strategy

    if args.build_index:
        print(f"no index to build: {args.index}'s checkpoint {choice.chosen.checkpoint} stays")
    current, chosen = choice.baseline.strategy, choice.chosen.strategy
    if not choice.changed:
        print(f"{args.index} keeps default strategy {current} (unchanged)")
    elif args.dry_run:
        print(f"dry run: {args.index} keeps default strategy {current}")
    else:
        set_default_strategy(args.index, chosen)
        print(f"saved default strategy {chosen} in {args.index}/manifest.json (was {current})")
    return 0


def switch_checkpoint(args: argparse.Namespace, manifest, corpus: str | None, chosen: Candidate,
                      rescored: Rescored) -> int:
    """Another checkpoint won (``rescored``: its :class:`.checkpoints.Rescored`): the index stays as it is; print the
    command that indexes the collection with the chosen checkpoint and strategy, and run it with --build-index."""
    from pyserini_aligner.adapt.checkpoints import index_command

    name = chosen.checkpoint if chosen.checkpoint in SHIPPED else Path(chosen.checkpoint).name
    target = args.build_index or f"{str(args.index).rstrip('/')}-{name}"
    argv = index_command(manifest, target, corpus, chosen.checkpoint, chosen.strategy, rescored.default_strategy,
                         args.device, rescored.scores_with_salience)
    print(f"{args.index} is left unchanged: it holds vectors of {manifest.model_name or 'another model'}; "
          f"{chosen} needs an index built with {chosen.checkpoint}:")
    print(f"  {shlex.join(argv)}")
    if corpus is None:
        print("  (<corpus>: the collection the index was built from)")
    if not args.build_index:
        return 0
    if args.dry_run:
        print(f"dry run: {target} not built")
        return 0
    from pyserini_aligner.index.__main__ import main as index_main

    status = index_main(argv[3:] + (["--quiet"] if args.quiet else []))
    if status == 0:
        print(f"built {target}: checkpoint {chosen.checkpoint}, default strategy {chosen.strategy}")
    return status


if __name__ == "__main__":
    sys.exit(main())
