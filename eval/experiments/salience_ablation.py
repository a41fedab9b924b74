"""Salience modes at several β^d: validation nDCG@10 of pruned search for checkpoints trained with each mode.

    python -m eval.experiments.salience_ablation --bundle runs/train_data/bundle.json.gz \
        --checkpoint lp=<folder> --checkpoint relu=<folder> --checkpoint hard=<folder> --output ablation.json

For each checkpoint (e.g. the ``ablation_salience_{lp,relu,hard}.yaml`` runs) and each β^d it scores every
validation set of the training bundle (NFCorpus dev, held-out SciFact train queries; never test qrels) with
``train/validate.evaluate``: nDCG@10 of exhaustive full-token scoring, and of the pruned search in which the β^q most
salient query tokens search the β^d most salient tokens of each document (``--redundancy``: salience alone, "off",
the default, which isolates the salience mode; or redundancy-aware at a cosine threshold, as the index builder
prunes). Needs torch and ranx only (no Pyserini, no FAISS).
Results of several calls (one checkpoint each) are merged into the same ``--output`` file.
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from pyserini_aligner import cli
from pyserini_aligner.model import AlignerModel
from pyserini_aligner.resolve import load_model
from pyserini_aligner.strategy import Strategy
from pyserini_aligner.train.data import load_bundle
from pyserini_aligner.train.validate import evaluate

BETAS = (0.4, 0.2, 0.1)


def measure(model: AlignerModel, bundle, betas: tuple[float, ...], beta_q: float, strategy: Strategy,
            batch_size: int, redundancy: float | None = None) -> dict[str, dict[str, dict[str, float]]]:
    """{f"beta_d={β}": {set name: evaluate's row}} for one model."""
    used = sorted({v.corpus for v in bundle.validation.values()})
    corpus_ids = {name: model.tokenize(bundle.corpora[name].texts, is_query=False)[0] for name in used}
    query_ids = {name: model.tokenize(list(v.queries.values()), is_query=True)[0]
                 for name, v in bundle.validation.items()}
    docids = {name: bundle.corpora[name].docids for name in used}
    return {f"beta_d={beta:g}": evaluate(model, bundle.validation, corpus_ids, docids, query_ids, strategy,
                                         batch_size, beta_q=beta_q, beta_d=beta, redundancy=redundancy)
            for beta in betas}


def markdown(result: dict) -> str:
    """One table: mode × β^d → pruned-search nDCG@10 per validation set (exhaustive in the β^d=1 column)."""
    rows = result["models"]
    sets = sorted({name for row in rows.values() for by_beta in row.values() for name in by_beta})
    betas = sorted({key for row in rows.values() for key in row}, key=lambda k: -float(k.split("=")[1]))
    rule = result.get("redundancy")
    rule = "salience alone" if rule is None else f"redundancy-aware at cosine {rule:g}"
    lines = [f"Pruned-search nDCG@10 (β^q={result['beta_q']:g}; documents pruned by {rule}; exhaustive = all tokens) "
             "on the bundle's validation sets", "", "| salience mode | set | exhaustive | " + " | ".join(f"β^d={b.split('=')[1]}" for b in betas)
             + " |", "|---|---|---:|" + "---:|" * len(betas)]
    for mode, by_beta in rows.items():
        for name in sets:
            first = by_beta[betas[0]][name]
            cells = " | ".join(f"{by_beta[b][name]['ndcg@10_pruned']:.4f}" for b in betas)
            lines.append(f"| {mode} | {name} | {first['ndcg@10']:.4f} | {cells} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m eval.experiments.salience_ablation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, required=True, help="training bundle (its validation sets are used)")
    parser.add_argument("--checkpoint", action="append", required=True, metavar="NAME=FOLDER",
                        help="a checkpoint to evaluate, repeatable")
    parser.add_argument("--output", type=Path, required=True, help="JSON file (merged with an existing one)")
    parser.add_argument("--betas", type=float, nargs="+", default=list(BETAS))
    parser.add_argument("--query-prune", type=float, default=0.5, help="β^q")
    parser.add_argument("--strategy", type=cli.strategy, default="top-k:1")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--redundancy", default="off",
                        help="document pruning: 'off' (salience alone, default) or a cosine threshold")
    args = parser.parse_args(argv)
    try:
        redundancy = None if args.redundancy == "off" else float(args.redundancy)
    except ValueError:
        parser.error(f"--redundancy: expected 'off' or a number in (0, 1], got {args.redundancy!r}")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    bundle = load_bundle(args.bundle)
    result = json.loads(args.output.read_text()) if args.output.is_file() else {"models": {}}
    if result.get("redundancy", redundancy) != redundancy:
        parser.error(f"{args.output} holds results with --redundancy {result['redundancy']}; use another --output")
    result.update(beta_q=args.query_prune, strategy=str(args.strategy), redundancy=redundancy)
    for spec in args.checkpoint:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not folder:
            parser.error(f"--checkpoint {spec!r}: expected NAME=FOLDER")
        model = load_model(folder, args.device, dtype=None)
        result["models"][name] = measure(model, bundle, tuple(args.betas), args.query_prune, args.strategy,
                                         args.batch_size, redundancy)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
