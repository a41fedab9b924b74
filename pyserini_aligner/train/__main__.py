"""``python -m pyserini_aligner.train --config <yaml> [--resume] [--output DIR] [--set field=value ...]``."""

from __future__ import annotations

import argparse
import json
import logging

from pyserini_aligner.cli import HelpFormatter
from pyserini_aligner.train.config import load_config
from pyserini_aligner.train.loop import Trainer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pyserini_aligner.train", formatter_class=HelpFormatter,
                                     description="Train an AligneR checkpoint (contrastive, hard negatives).")
    parser.add_argument("--config", required=True, help="YAML training config (see pyserini_aligner/train/configs/)")
    parser.add_argument("--output", help="output folder (default: the config's output_dir)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override one config field (value parsed as YAML); repeatable")
    parser.add_argument("--resume", action="store_true", help="continue from <output>/state.pt")
    parser.add_argument("--stop-after", type=int, help="stop after this many more steps (resume later)")
    parser.add_argument("--device", help="cuda | cpu (default: cuda when available)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar, warnings only")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, args.set)
        if cfg.objective == "salience_distill":
            from pyserini_aligner.train.distill import SalienceDistiller as trainer_class
        else:
            trainer_class = Trainer
        trainer = trainer_class(cfg, output_dir=args.output, device=args.device, progress=not args.quiet)
    except (ValueError, FileNotFoundError) as err:
        parser.exit(2, f"error: {err}\n")
    summary = trainer.run(resume=args.resume, stop_after=args.stop_after)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
