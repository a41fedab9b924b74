"""``python -m pyserini_aligner.index.merge --inputs shard_0 shard_1 ... --index merged``

Combine shard indexes (built with ``--shard-id/--shard-num`` and one ``--codec-from``) into one index without
re-encoding: segment files are hard-linked (copied where the file system refuses), in input order.
"""
from __future__ import annotations

import argparse
import sys

from pyserini_aligner.cli import HelpFormatter, add_quiet_flag, run_main
from pyserini_aligner.index.shards import merge_indexes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pyserini_aligner.index.merge", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--inputs", nargs="+", required=True, metavar="DIR", help="shard indexes, in corpus order")
    parser.add_argument("--index", required=True, help="the merged index folder to write")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing index of this package (never any other folder)")
    add_quiet_flag(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (:func:`pyserini_aligner.cli.run_main`)."""
    return run_main(parse_args, merge, argv)


def merge(args: argparse.Namespace) -> None:
    """Merge the --inputs into --index."""
    manifest = merge_indexes(args.inputs, args.index, overwrite=args.overwrite, progress=not args.quiet)
    if not args.quiet:
        print(f"{args.index}: {manifest.num_docs} documents in {len(manifest.segments)} segments, "
              f"codec {manifest.codec}")


if __name__ == "__main__":
    sys.exit(main())
