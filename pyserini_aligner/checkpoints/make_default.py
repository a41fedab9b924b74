"""Write the untrained AligneR baseline: ``python -m pyserini_aligner.checkpoints.make_default --output <dir>``.

The shipped ``aligner`` checkpoint is trained (see checkpoints/aligner/README.md); this writes the untrained
initialisation it was trained from (:mod:`pyserini_aligner.untrained`, which the run time uses; this command line is
imported by no library module).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pyserini_aligner.cli import HelpFormatter, add_quiet_flag, run_main
from pyserini_aligner.untrained import untrained_model


def make_default(output: Path) -> str:
    """Write the checkpoint into ``output``; returns its fingerprint."""
    model = untrained_model()
    model.save_pretrained(output)
    return model.fingerprint()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pyserini_aligner.checkpoints.make_default",
                                     description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--output", type=Path, required=True,
                        help="checkpoint folder to write (not the shipped checkpoints/aligner, which is trained)")
    add_quiet_flag(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (:func:`pyserini_aligner.cli.run_main`)."""
    return run_main(build_parser().parse_args, run, argv)


def run(args: argparse.Namespace) -> None:
    """Write the checkpoint at --output and name its fingerprint."""
    print(f"wrote {args.output} (fingerprint {make_default(args.output)})")


if __name__ == "__main__":
    sys.exit(main())
