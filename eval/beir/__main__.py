"""``python -m eval.beir --dataset beir/scifact/test --output runs/scifact [--systems ...] [--encoder ...]``

Runs BM25, the MiniLM dense baseline, AligneR (full, pruned, hybrid with BM25, RRF with BM25, few-shot adapted) on
one BEIR dataset; writes run.<system>.trec, results.json and results.md (with significance tests against bm25 and
dense). Indexes and runs are cached under --cache, keyed by model fingerprint and dataset."""
import argparse
import sys

from eval.cli import configure_logging
from eval.beir.harness import run_harness
from eval.beir.systems import SYSTEMS
from pyserini_aligner.adapt.select import ALPHA, MIN_GAIN
from pyserini_aligner.checkpoints import SHIPPED
from pyserini_aligner.cli import fraction, non_negative
from pyserini_aligner.data import DataError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.beir", description=__doc__)
    parser.add_argument("--dataset", required=True, help="ir_datasets id (beir/scifact/test) or a local BEIR folder")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), help=f"any of {', '.join(SYSTEMS)}")
    parser.add_argument("--output", required=True, help="folder for runs, results.json and results.md")
    parser.add_argument("--cache", default=".cache/indexes", help="folder for indexes (reused between runs)")
    parser.add_argument("--hits", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--encoder", default="aligner", help="AligneR checkpoint: 'aligner', 'aligner-mix' or a folder")
    parser.add_argument("--candidates", type=int, default=100,
                        help="aligner hits rescored by aligner-adapted to choose a checkpoint and strategy on each "
                             "fold")
    parser.add_argument("--adapt-checkpoints", nargs="+", default=None, metavar="CHECKPOINT",
                        help="aligner-adapted: checkpoints tried besides --encoder (shipped names or folders; "
                             f"default: every shipped one, {', '.join(SHIPPED)})")
    parser.add_argument("--fold-size", type=int, default=8, help="queries per few-shot adaptation fold")
    parser.add_argument("--adapt-alpha", type=fraction, default=ALPHA,
                        help="aligner-adapted: significance level a candidate must reach to replace the default")
    parser.add_argument("--adapt-min-gain", type=non_negative, default=MIN_GAIN,
                        help="aligner-adapted: smallest mean nDCG@10 gain over the default on a fold (0.005 = 0.5 "
                             "point)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the folds and of the hybrid tuning sample")
    parser.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto",
                        help="precision corpora are encoded in (dense and every AligneR index): auto is bf16 on a "
                             "CPU that computes it natively (AVX512-BF16 or AMX), else fp32")
    parser.add_argument("--quiet", action="store_true", help="no progress bars or info logging")
    args = parser.parse_args(argv)
    configure_logging(args.quiet)
    try:
        run_harness(args.dataset, args.systems, args.output, args.cache, hits=args.hits, threads=args.threads,
                    progress=not args.quiet, encoder=args.encoder, candidates=args.candidates,
                    fold_size=args.fold_size, seed=args.seed, alpha=args.adapt_alpha,
                    min_gain=args.adapt_min_gain, adapt_checkpoints=args.adapt_checkpoints, dtype=args.dtype)
    except (DataError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(open(f"{args.output}/results.md", encoding="utf-8").read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
