"""Train an AligneR checkpoint.

``python -m pyserini_aligner.train --config <yaml> [--resume] [--output DIR] [--set field=value ...]``: supervised
training from a prepared bundle (see prepare.py).

``python -m pyserini_aligner.train --unsupervised (--corpus <corpus> | --bundle <bundle.json.gz>) --output <ckpt>
[--init aligner]``: label-free adaptation to a corpus. With ``--corpus`` the pseudo-query bundle is prepared first
(needs Pyserini; ``<ckpt>/train/bundle.json.gz``); ``--bundle`` trains from one prepared elsewhere
(``python -m pyserini_aligner.train.prepare --corpus <corpus> --unsupervised --output <dir>``). ``<ckpt>`` is a
checkpoint folder (config.json, heads.safetensors, backbone_delta.safetensors; the run's log under ``train/``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from pyserini_aligner.cli import HelpFormatter, UsageError, add_quiet_flag, device, run_main
from pyserini_aligner.train.config import init_model_fields, load_config
from pyserini_aligner.train.loop import Trainer

UNSUPERVISED_CONFIG = Path(__file__).resolve().parent / "configs" / "unsupervised.yaml"


def unsupervised_overrides(init: str, bundle: Path) -> list[str]:
    """``--set`` items for an unsupervised run: the bundle, the init checkpoint and its model fields."""
    items = {"data": str(bundle), "init": init, **init_model_fields(init)}
    return [f"{field}={json.dumps(value)}" for field, value in items.items()]


def finish_unsupervised(work: Path, output: Path) -> None:
    """Copy the run's last checkpoint into ``output`` and drop the run's own resume state and checkpoint copies."""
    for name in ("config.json", "heads.safetensors", "backbone_delta.safetensors"):
        if (work / "last" / name).is_file():
            shutil.copy2(work / "last" / name, output / name)
    for name in ("best", "last"):
        shutil.rmtree(work / name, ignore_errors=True)
    (work / "state.pt").unlink(missing_ok=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pyserini_aligner.train", formatter_class=HelpFormatter,
                                     description="Train an AligneR checkpoint (contrastive, hard negatives), or "
                                                 "adapt one to a corpus without labels (--unsupervised).")
    parser.add_argument("--config", help="YAML training config (see pyserini_aligner/train/configs/); with "
                                          "--unsupervised default configs/unsupervised.yaml")
    parser.add_argument("--output", help="output folder (default: the config's output_dir)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override one config field (value parsed as YAML); repeatable")
    parser.add_argument("--resume", action="store_true", help="continue from <output>/state.pt")
    parser.add_argument("--stop-after", type=int, help="stop after this many more steps (resume later)")
    parser.add_argument("--unsupervised", action="store_true",
                        help="label-free adaptation: pseudo-queries from --corpus (or a prepared --bundle)")
    parser.add_argument("--corpus", help="with --unsupervised: JsonCollection file/folder, BEIR folder or "
                                         "ir_datasets id")
    parser.add_argument("--bundle", help="with --unsupervised: a bundle from python -m pyserini_aligner.train.prepare "
                                         "--corpus ... --unsupervised")
    parser.add_argument("--init", default="aligner", help="with --unsupervised: starting checkpoint, a shipped name "
                             "(aligner, aligner-mix) or a folder (default aligner)")
    parser.add_argument("--threads", type=int, default=2, help="BM25 threads when preparing --corpus")
    parser.add_argument("--device", type=device, help="cpu or cuda[:N] (default: cuda when available)")
    add_quiet_flag(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; argparse errors for flags that don't go together or an --output that can't take the run."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.unsupervised:
        if bool(args.corpus) == bool(args.bundle):
            parser.error("--unsupervised needs exactly one of --corpus and --bundle")
        if not args.output:
            parser.error("--unsupervised needs --output (the checkpoint folder to write)")
        output = Path(args.output)
        if output.exists() and not output.is_dir():
            parser.error(f"--output {output} exists and is not a folder")
        if not args.resume and output.is_dir() and any(output.iterdir()):
            parser.error(f"--output {output} is not empty (choose a new folder, or --resume)")
    elif args.corpus or args.bundle:
        parser.error("--corpus and --bundle go with --unsupervised")
    elif not args.config:
        parser.error("--config is required (or --unsupervised)")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (:func:`pyserini_aligner.cli.run_main`)."""
    return run_main(parse_args, train, argv, timestamps=True)


def train(args: argparse.Namespace) -> None:
    """Train (after preparing the pseudo-query bundle of --corpus with --unsupervised); prints the run's summary."""
    overrides = args.set
    if args.unsupervised:
        output = Path(args.output)
        work = output / "train"
        bundle = Path(args.bundle) if args.bundle else work / "bundle.json.gz"
        if args.corpus and not (args.resume and bundle.is_file()):
            from pyserini_aligner.train.prepare import prepare_corpus

            try:
                prepare_corpus(args.corpus, work, work / "lucene", threads=args.threads)
            finally:
                shutil.rmtree(work / "lucene", ignore_errors=True)
        overrides = unsupervised_overrides(args.init, bundle) + args.set
    try:
        cfg = load_config((args.config or UNSUPERVISED_CONFIG) if args.unsupervised else args.config, overrides)
    except (ValueError, FileNotFoundError) as err:  # the --config file or a --set value
        raise UsageError(str(err)) from None
    if cfg.objective == "salience_distill":
        from pyserini_aligner.train.distill import SalienceDistiller as trainer_class
    else:
        trainer_class = Trainer
    trainer = trainer_class(cfg, output_dir=work if args.unsupervised else args.output, device=args.device,
                            progress=not args.quiet)
    summary = trainer.run(resume=args.resume, stop_after=args.stop_after)
    if args.unsupervised and summary.get("finished"):
        finish_unsupervised(work, output)
        summary["checkpoint"] = str(output)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    sys.exit(main())
