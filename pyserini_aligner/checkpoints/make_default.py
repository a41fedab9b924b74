"""Write the untrained AligneR baseline: ``python -m pyserini_aligner.checkpoints.make_default --output <dir>``.

The shipped ``aligner`` checkpoint is trained (see checkpoints/aligner/README.md); this is the untrained
initialisation it was trained from and is compared against (the trainer's ``init: untrained`` draws the same
weights). It is a documented initialisation, not a trained model: MiniLM backbone as is, a seeded Gaussian
projection 384 → 128 (a random map roughly preserves inner products, so MaxSim over it behaves like MaxSim over MiniLM
token states), salience heads W=0, b=1 (every real token equally salient) and use_salience=False.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pyserini_aligner.cli import HelpFormatter, add_quiet_flag, run_main
from pyserini_aligner.model import AlignerConfig, AlignerModel

SEED = 0
DESCRIPTION = ("Untrained AligneR initialisation: all-MiniLM-L6-v2 backbone unchanged, Gaussian projection "
               f"384->128 (seed {SEED}, N(0, 1/384)), salience heads W=0 b=1, use_salience=false. "
               "Regenerate with python -m pyserini_aligner.checkpoints.make_default --output <dir>.")


def default_config() -> AlignerConfig:
    """Config of the untrained baseline checkpoint."""
    return AlignerConfig(backbone="minilm", hidden_size=384, dim=128, query_maxlen=64, doc_maxlen=256,
                         keep_special=True, use_salience=False, salience_mode="lp", alpha_q=0.5, alpha_d=0.4,
                         eps=0.002, default_strategy="top-k:1", description=DESCRIPTION)


def untrained_model() -> AlignerModel:
    """The untrained initialisation, built in memory on the CPU (``load_model("untrained")`` returns it)."""
    model = AlignerModel(default_config())
    model.reset_heads(seed=SEED)
    return model


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
