"""``python -m pyserini_aligner.explain --index <dir> --query "<text>" --corpus <file | ir_datasets id>
[--docid ID] [--hits 3] [--strategy top-k:2] [--output explain.html] [--png explain.png]``

Writes a self-contained HTML page showing, for each document, the query and document tokens shaded by salience
and each salient query token's aligned document tokens (the strategy's Ã) with similarities.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from pyserini_aligner.cli import HelpFormatter, add_quiet_flag, positive_int, run_main, strategy
from pyserini_aligner.explain import explain, render_html, render_png


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pyserini_aligner.explain", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--index", required=True, help="AligneR index folder (python -m pyserini_aligner.index)")
    parser.add_argument("--query", required=True, help="query text")
    parser.add_argument("--corpus", default=None,
                        help="JsonCollection file/folder or ir_datasets id the index was built from (document text; "
                             "default: the corpus the index manifest records, if any)")
    parser.add_argument("--docid", action="append", default=None,
                        help="explain this document (repeatable); default: the top --hits search results")
    parser.add_argument("--hits", type=positive_int, default=3, help="search results to explain when no --docid is given")
    parser.add_argument("--strategy", type=strategy, default=None,
                        help="alignment, e.g. top-k:2, top-p:0.015, da:4:0.04 (default: the index's)")
    parser.add_argument("--encoder", default=None, help="checkpoint folder (default: the model recorded in the index)")
    parser.add_argument("--top-query", type=positive_int, default=8, help="most salient query tokens whose alignments are shown")
    parser.add_argument("--output", default="explain.html", help="HTML page to write")
    parser.add_argument("--png", default=None, help="also write a PNG heat map (needs matplotlib)")
    add_quiet_flag(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (:func:`pyserini_aligner.cli.run_main`)."""
    return run_main(parse_args, run, argv)


def run(args: argparse.Namespace) -> None:
    """Explain the documents and write the page (and the PNG)."""
    logging.getLogger("pyserini_aligner.model").setLevel(logging.ERROR)  # the page marks truncated documents
    explanations = explain(args.index, args.query, docids=args.docid, hits=args.hits, strategy=args.strategy,
                           corpus=args.corpus, encoder=args.encoder)
    if not explanations:
        raise ValueError(f"the search returned no documents for {args.query!r}")
    details = {"index": args.index, "corpus": args.corpus or "(from the index manifest)"}
    page = render_html(explanations, top_query=args.top_query, details=details)
    Path(args.output).write_text(page, encoding="utf-8")
    if args.png:
        render_png(explanations, args.png)
    print(f"wrote {args.output}" + (f" and {args.png}" if args.png else ""))


if __name__ == "__main__":
    sys.exit(main())
