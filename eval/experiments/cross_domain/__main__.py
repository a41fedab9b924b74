"""``python -m eval.experiments.cross_domain --bundle <dir> --output <dir> [--export <dir>]``: train candidate recipes
on SciFact alone and NFCorpus alone, choose one by cross-domain validation, train it on both, adapt each
single-domain model to the other corpus without labels, then evaluate on the test sets once (see run.py).
``--top-p-only aligner[,<folder>]`` measures only the top-p response of those checkpoints and of the untrained
backbone; ``--refine <settings>`` continues training the shipped checkpoint under the alignment mix, chooses a
setting on validation and tests only that one.

<dir> of --bundle comes from ``python -m eval.experiments.cross_domain.prepare --output <dir>`` (CPU, Pyserini);
this step needs neither Pyserini nor Java. --export gets results.json, results.md and checkpoint/ (config.json,
heads.safetensors, backbone_delta.safetensors: the final model in the shipped checkpoint's form)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from eval.cli import configure_logging
from eval.experiments.cross_domain.run import (ADAPTATIONS, DEFAULT_ADAPTATIONS, DEFAULT_RECIPES, RECIPES, REFINEMENTS,
                                               Experiment)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.experiments.cross_domain", description=__doc__)
    parser.add_argument("--bundle", type=Path, required=True, help="folder with bundle.json.gz and test.json.gz")
    parser.add_argument("--output", type=Path, required=True, help="work folder: runs/, results.json, results.md")
    parser.add_argument("--export", type=Path, help="folder for results.json, results.md and checkpoint/")
    parser.add_argument("--recipes", default=",".join(DEFAULT_RECIPES),
                        help=f"comma-separated candidate recipes (known: {', '.join(RECIPES)}); <recipe>@<alpha> "
                             "exports the same run with weight_interpolation alpha")
    parser.add_argument("--adaptations", default=",".join(DEFAULT_ADAPTATIONS),
                        help=f"comma-separated label-free adaptation settings (known: {', '.join(ADAPTATIONS)}), "
                             "or none")
    parser.add_argument("--validation-only", action="store_true",
                        help="stop after the recipe and adaptation choices (or the --refine choice) on validation "
                             "(no final run; the test file is not opened)")
    parser.add_argument("--top-p-only", metavar="CHECKPOINTS",
                        help="comma-separated checkpoints (names or folders): measure only their top-p response "
                             "and the untrained backbone's (validation and test, exhaustive) and stop")
    parser.add_argument("--refine", metavar="SETTINGS",
                        help=f"comma-separated settings (known: {', '.join(REFINEMENTS)}): continue training the "
                             "shipped checkpoint with each, choose on validation, then test only the chosen one, "
                             "and stop")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a training config field in every run (value parsed as YAML); repeatable")
    parser.add_argument("--no-salience", action="store_true", help="skip training the final model's salience heads")
    parser.add_argument("--device", help="cuda | cpu (default: cuda when available)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars or info logging")
    args = parser.parse_args(argv)
    configure_logging(args.quiet)
    overrides = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            parser.error(f"--set {item!r}: expected FIELD=VALUE")
        overrides[name.strip()] = yaml.safe_load(value)
    try:
        experiment = Experiment(args.bundle, args.output, [r for r in args.recipes.split(",") if r], overrides,
                                device=args.device, progress=not args.quiet, salience=not args.no_salience,
                                export=args.export, adaptations=[a for a in args.adaptations.split(",") if a and a != "none"],
                                validation_only=args.validation_only)
        if args.top_p_only is not None:
            checkpoints = [c for c in args.top_p_only.split(",") if c]
            if not checkpoints:
                raise ValueError("--top-p-only: name at least one checkpoint")
            results = experiment.response_only(checkpoints)
            print(json.dumps({k: v["ok"] for k, v in results["targets"].items()}, indent=2))
            return 0
        if args.refine is not None:
            results = experiment.refine([r for r in args.refine.split(",") if r])
            print(json.dumps({"choice": results["refinement_choice"]["setting"],
                              "targets": {k: v["ok"] for k, v in results.get("targets", {}).items()}}, indent=2))
            return 0
        results = experiment.run()
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.validation_only:
        print(json.dumps({"choice": results["choice"]["recipe"],
                          "adaptation": results.get("adaptation_choice")}, indent=2))
        return 0
    print(json.dumps({"choice": results["choice"]["recipe"], "test": results["test"],
                      "targets": {k: v["ok"] for k, v in results["targets"].items()}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
