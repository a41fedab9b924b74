"""``python -m pyserini_aligner.search --index <dir> --topics <file|ir_datasets id> --output run.trec``

Pyserini's search flags plus AligneR's knobs and ``--filter EXPR|@FILE`` (only the documents a filter matches); an
unknown flag is an error. ``python -m pyserini.search[.lucene] --index <aligner index>`` lands here too (see
``pyserini_aligner.pyserini_patches.hooks``), less the Lucene-only flags that it drops with a warning
(``LUCENE_ONLY_FLAGS`` there).
"""
from __future__ import annotations

import argparse
import logging
import sys

from tqdm import tqdm

from pyserini_aligner.search.defaults import DEFAULT_QUERY_PRUNE
from pyserini_aligner.cli import (HelpFormatter, UsageError, add_filter_flags, add_quiet_flag, device,
                                  filter_matches, flag_value, fraction, parse_filter_flags, positive_int, run_main,
                                  strategy)
from pyserini_aligner.textio import OutputPathError, check_output_path, discard_output
from pyserini_aligner.data import load_topics
from pyserini_aligner.hits import drop_query_hits
from pyserini_aligner.trec import OUTPUT_FORMATS, write_run

log = logging.getLogger("pyserini_aligner.search")
GENERIC_ENCODER = "aligner"  # with an index: the AligneR model recorded in its manifest


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pyserini_aligner.search", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--index", required=True, help="AligneR index folder (python -m pyserini_aligner.index)")
    parser.add_argument("--topics", required=True,
                        help="topics: a Pyserini topics file (TSV qid<TAB>text, JSONL), a BEIR folder (its test "
                             "queries) or an ir_datasets id")
    parser.add_argument("--output", required=True, help="run file to write")
    parser.add_argument("--output-format", choices=OUTPUT_FORMATS, default="trec",
                        help="trec: qid Q0 docid rank score tag; msmarco: qid<TAB>docid<TAB>rank (Pyserini's writers)")
    parser.add_argument("--max-passage", action="store_true",
                        help="MaxP: cut docids at --max-passage-delimiter and keep each document's best passage")
    parser.add_argument("--max-passage-hits", type=positive_int, default=100,
                        help="documents per query written with --max-passage")
    parser.add_argument("--max-passage-delimiter", default="#", help="passage id separator of --max-passage")
    parser.add_argument("--encoder", default=GENERIC_ENCODER,
                        help="'aligner' (the model recorded in the index) or a checkpoint folder")
    parser.add_argument("--hits", type=positive_int, default=1000, help="hits per query")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="queries encoded and searched together")
    parser.add_argument("--threads", type=positive_int, default=1, help="FAISS and torch threads")
    parser.add_argument("--remove-query", action="store_true",
                        help="drop a hit whose docid equals the query id. BEIR's convention for corpora where a "
                             "query is itself a document of the corpus (e.g. ArguAna, Quora), so that it can't be "
                             "retrieved as its own answer; don't use it where query ids and docids are separate "
                             "name spaces that collide (e.g. numeric ids in both), or a relevant document that "
                             "merely shares the query's number is dropped")
    parser.add_argument("--query-max-length", type=positive_int, default=None,
                        help="tokens per query, special tokens included (default: the model's query_maxlen, 64 for "
                             "the shipped model); longer queries are cut")
    parser.add_argument("--device", type=device, default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--devices", type=device, nargs="+", default=None, metavar="DEVICE",
                        help="several devices searched by one process, e.g. cuda:0 cuda:1 cuda:2 cuda:3 (torch "
                             "backend, compressed index; queries are encoded on the first); instead of --device")
    parser.add_argument("--placement", choices=["auto", "replicate", "shard"], default="auto",
                        help="the index on several devices (--devices) or ranks (--distributed): replicate (a whole "
                             "copy on each, every batch of queries split across them), shard (consecutive segments "
                             "on each, every search step on all at once), or auto: replicate when a copy and room "
                             "to search fit in every GPU's free memory, else shard. The ranking is the same")
    parser.add_argument("--backend", choices=["faiss", "torch"], default=None,
                        help="candidate generation and refinement with FAISS + the memory-mapped store (default on "
                             "cpu) or with torch on --device (default on cuda)")
    parser.add_argument("--strategy", type=strategy, default=None,
                        help="alignment, e.g. top-k:1, top-p:0.015, da:4:0.04 (default: the index's)")
    parser.add_argument("--k-per-token", type=positive_int, default=None,
                        help="indexed document tokens taken per kept query token (K; default by device, see "
                             "AlignerSearcher)")
    parser.add_argument("--nprobe", type=positive_int, default=None,
                        help="inverted lists probed per kept query token (compressed indexes; default by device)")
    parser.add_argument("--interaction-candidates", type=int, default=None,
                        help="documents narrowed by centroid interaction before refinement (compressed indexes; 0: "
                             "off; default by device)")
    parser.add_argument("--query-prune", type=fraction, default=DEFAULT_QUERY_PRUNE,
                        help="β^q: fraction of the query's tokens probed (refinement uses all)")
    parser.add_argument("--max-candidates", type=positive_int, default=None,
                        help="documents refined per query (at least --hits; default by device)")
    parser.add_argument("--refine-with", choices=["all", "kept"], default="all",
                        help="score candidates with all stored doc tokens or only the indexed ones")
    add_filter_flags(parser)
    parser.add_argument("--tag", default="AligneR", help="run tag (last column of --output-format trec)")
    parser.add_argument("--distributed", action="store_true",
                        help="under torchrun: every rank searches with its share of the index's segments or, "
                             "with --placement replicate (or auto, where the index fits), its share of every batch "
                             "of queries (torch backend, compressed index; --device cuda means cuda:LOCAL_RANK); "
                             "rank 0 writes the run")
    add_quiet_flag(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, ``filter`` parsed into a Filter (argparse's usage error for a malformed one)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    parse_filter_flags(parser, args)
    return args


def search_options(args: argparse.Namespace):
    """The :class:`pyserini_aligner.search.options.SearchOptions` of the flags (ValueError naming a bad one)."""
    from pyserini_aligner.search.options import SearchOptions

    return SearchOptions(strategy=args.strategy, k_per_token=args.k_per_token, query_prune=args.query_prune,
                         max_candidates=args.max_candidates, nprobe=args.nprobe,
                         interaction_candidates=args.interaction_candidates, refine_with=args.refine_with,
                         batch_size=args.batch_size, query_max_length=args.query_max_length,
                         placement=args.placement, device=args.device, devices=args.devices, backend=args.backend)


def query_encoder(args: argparse.Namespace) -> str | None:
    """The searcher's encoder of --encoder: None for the index's own model."""
    return None if args.encoder == GENERIC_ENCODER else args.encoder


def write_hits(hits: dict[str, list[tuple[str, float]]], args: argparse.Namespace) -> None:
    """The run of the flags' format (--output-format, --max-passage*) at --output, through Pyserini's writers."""
    write_run(hits, args.output, tag=args.tag, output_format=args.output_format, max_passage=args.max_passage,
              max_passage_delimiter=args.max_passage_delimiter, max_passage_hits=args.max_passage_hits)


def run_distributed(args: argparse.Namespace) -> None:
    """--distributed: search in lockstep with the other ranks; rank 0 reads the topics and writes the run."""
    import torch.distributed as dist

    from pyserini_aligner.dist import Collectives, join_group, lost_rank_message, rank_device, torchrun_context
    from pyserini_aligner.search.searcher import distributed_searcher

    if args.backend == "faiss":
        raise UsageError("--distributed searches with backend torch, not --backend faiss")
    if args.devices:
        raise UsageError("--distributed searches on one device a rank (--device cuda means cuda:LOCAL_RANK), not "
                         "--devices")
    try:
        ctx = torchrun_context()
    except RuntimeError as error:
        raise UsageError(str(error)) from None
    # on GPUs NCCL carries the search's tensors (and the ranks split its work), Gloo the small CPU objects
    ctx, created = join_group(ctx, device=rank_device(args.device, ctx))
    exchange = Collectives(ctx)
    log.info("rank %d of %d on %s: process group %s, %s", ctx.rank, ctx.world_size, rank_device(args.device, ctx),
             dist.get_backend(), "the ranks split each batch's work" if exchange.on_device else
             "rank 0 encodes, tensors through the host")
    try:
        problem, topics = None, None
        try:
            searcher = distributed_searcher(args.index, ctx, query_encoder(args), search_options(args))
            topics = load_topics(args.topics) if ctx.rank == 0 else None
        except (OSError, ValueError) as error:
            problem = f"rank {ctx.rank}: {error}"
        problems = [p for p in exchange.all_gather(problem) if p]
        if problems:  # a bad index or topics file on some rank: every rank stops with its message
            raise ValueError(problems[0])
        topics = exchange.broadcast(topics)
        qids, extra, hits = list(topics), 1 if args.remove_query else 0, {}
        with tqdm(total=len(qids), unit="query", disable=args.quiet or ctx.rank != 0) as bar:
            for start in range(0, len(qids), args.batch_size):
                batch = qids[start:start + args.batch_size]
                ranked = searcher.rank([topics[q] for q in batch], k=args.hits + extra, threads=args.threads,
                                       filter=args.filter)
                hits.update(zip(batch, ranked))
                bar.update(len(batch))
        if args.remove_query:
            hits = drop_query_hits(hits, args.hits)
        if ctx.rank == 0:
            write_hits(hits, args)
            log.info("wrote %d queries to %s (%d ranks)", len(hits), args.output, ctx.world_size)
    except RuntimeError as error:  # a rank died or was killed: Gloo's "Connection closed by peer"
        raise RuntimeError(f"rank {ctx.rank}: {lost_rank_message(error)}") from None
    finally:
        if created:
            dist.destroy_process_group()


def matches_some(searcher, args: argparse.Namespace) -> bool:
    """Whether --filter (if given) matches some document of ``searcher``'s index (:func:`.cli.filter_matches`)."""
    if args.filter is None:
        return True
    count = filter_matches(searcher, args.filter)
    log.info("--filter matches %d documents", count)
    return count > 0


def main(argv: list[str] | None = None) -> int:
    """Run a search; returns the exit status (:func:`pyserini_aligner.cli.run_main`). A failed search leaves no run
    under --output: a run there from an earlier command is removed, so that it can't be taken for this one's."""
    argv = list(sys.argv[1:] if argv is None else argv)
    status = 1
    try:
        status = run_main(parse_args, search, argv)
    finally:
        output = flag_value(argv, "--output")
        if status != 0 and discard_output(output):
            print(f"removed {output}: an earlier run that this failed search did not replace", file=sys.stderr)
    return status


def search(args: argparse.Namespace) -> None:
    """Search the --topics and write the run (--distributed: with the other ranks of a torchrun job)."""
    if args.distributed:
        run_distributed(args)
        return
    from pyserini_aligner.search.searcher import AlignerSearcher

    try:
        check_output_path(args.output)
    except OutputPathError as error:
        raise UsageError(str(error)) from None
    topics = load_topics(args.topics)
    searcher = AlignerSearcher(args.index, query_encoder(args), search_options(args))
    qids = list(topics)
    extra = 1 if args.remove_query else 0
    hits = {qid: [] for qid in qids}  # no hits for any query when --filter matches no document
    searched = qids if matches_some(searcher, args) else []
    with tqdm(total=len(searched), unit="query", disable=args.quiet) as bar:
        for start in range(0, len(searched), args.batch_size):
            batch = searched[start:start + args.batch_size]
            ranked = searcher.rank([topics[q] for q in batch], k=args.hits + extra, threads=args.threads,
                                   filter=args.filter)
            hits.update(zip(batch, ranked))  # plain (docid, score) lists: Pyserini (and its JVM) stay unloaded
            bar.update(len(batch))
    if args.remove_query:
        hits = drop_query_hits(hits, args.hits)
    write_hits(hits, args)
    log.info("wrote %d queries to %s", len(hits), args.output)


if __name__ == "__main__":
    sys.exit(main())
