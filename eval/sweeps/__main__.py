"""``python -m eval.sweeps --dataset beir/scifact/test --output <dir>``: the alignment sweep (top-k 1, 2, 4, 6, 8 and
top-p 0.5, 1, 1.5, 2 %; nDCG@10, as the paper's Table 3) and the pruning sweep (β^d ∈ {1, 0.4, 0.2, 0.1} ×
β^q ∈ {1, 0.5, 0.3}; nDCG@10 against index bytes per document). Writes sweeps.json, sweeps.md and sweeps.png.
Shares --cache with ``python -m eval.beir``: indexes and runs built there are reused."""
import argparse
import json
import sys
from pathlib import Path

from eval.cli import configure_logging
from eval.beir.context import Context, harness_dtype, work_dir
from eval.sweeps.plot import plot_pruning
from eval.sweeps.run import DOC_PRUNES, PRUNING_HITS, QUERY_PRUNES, alignment_sweep, pruning_sweep, sweeps_markdown
from pyserini_aligner.data import DataError, Dataset


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.sweeps", description=__doc__)
    parser.add_argument("--dataset", required=True, help="ir_datasets id (beir/scifact/test) or a local BEIR folder")
    parser.add_argument("--output", required=True, help="folder for sweeps.json, sweeps.md and sweeps.png")
    parser.add_argument("--cache", default=".cache/indexes", help="folder for indexes and runs (shared with eval.beir)")
    parser.add_argument("--encoder", default="aligner", help="AligneR checkpoint: 'aligner', 'aligner-mix' or a folder")
    parser.add_argument("--hits", type=int, default=1000, help="depth of the aligner run whose top --candidates are "
                                                                 "rescored (as in eval.beir, whose run is reused)")
    parser.add_argument("--pruning-hits", type=int, default=PRUNING_HITS, help="depth of the pruning sweep's searches")
    parser.add_argument("--candidates", type=int, default=100, help="aligner hits rescored per strategy")
    parser.add_argument("--doc-prunes", type=float, nargs="+", default=list(DOC_PRUNES), metavar="BETA_D",
                        help="β^d values of the pruning sweep")
    parser.add_argument("--query-prunes", type=float, nargs="+", default=list(QUERY_PRUNES), metavar="BETA_Q",
                        help="β^q values of the pruning sweep")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto",
                        help="precision the corpus is encoded in, as python -m eval.beir takes it (its indexes are "
                             "reused)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars or info logging")
    args = parser.parse_args(argv)
    configure_logging(args.quiet)
    try:
        dataset = Dataset(args.dataset)
        ctx = Context(dataset=dataset, work=work_dir(dataset, args.cache), hits=args.hits, threads=args.threads,
                      progress=not args.quiet, encoder=args.encoder, candidates=args.candidates,
                      dtype=harness_dtype(args.dtype))
        results = {"dataset": dataset.name, "encoder": args.encoder,
                   "alignment": {"candidates": args.candidates, "ndcg@10": alignment_sweep(ctx)},
                   "pruning_hits": args.pruning_hits,
                   "pruning": pruning_sweep(ctx, args.doc_prunes, args.query_prunes, args.pruning_hits)}
    except (DataError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    (output / "sweeps.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    (output / "sweeps.md").write_text(sweeps_markdown(results), encoding="utf-8")
    plot_pruning(results["pruning"], output / "sweeps.png", f"AligneR pruning sweep: {dataset.name}")
    print((output / "sweeps.md").read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
