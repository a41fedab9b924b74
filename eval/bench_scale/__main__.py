"""``python -m eval.bench_scale --beir-zip scifact.zip --sizes 5k,100k,1m --device cuda --output <dir>``

Builds an AligneR index (β^d=0.2) of a synthetic MS MARCO-like corpus grown from the BEIR zip at each size and
measures build time, GPU/host memory, disk, latency, throughput, overlap with exhaustive scoring and nDCG@10 on the
zip's test queries. Writes bench_scale.json and bench_scale.md in --output and prints the table.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eval.bench_scale.corpus import parse_size
from eval.cli import configure_logging, corpus_size, positive_int, run_report


def _sizes(text: str) -> list[int]:
    try:
        return [parse_size(part) for part in text.split(",") if part.strip()] or [parse_size(text)]
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    import torch

    parser = argparse.ArgumentParser(prog="python -m eval.bench_scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--beir-zip", type=Path, required=True, help="a BEIR zip with qrels/test.tsv, e.g. scifact.zip")
    parser.add_argument("--sizes", type=_sizes, required=True, help="corpus sizes, e.g. 5k,100k,1m")
    parser.add_argument("--output", type=Path, required=True, help="folder for bench_scale.json and bench_scale.md")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where to encode, build and search (default: cuda when available)")
    parser.add_argument("--codec", default="auto",
                        help="token codec: auto (IVF<nlist>,PQ4,Refine(PQ<R>), nlist and R from the corpus size), "
                             "IVF<nlist>,PQ<M>[,Refine(PQ<R>)] or fp16")
    parser.add_argument("--batch-size", type=positive_int, default=128, help="documents per encoding batch (build)")
    parser.add_argument("--max-queries", type=positive_int, help="time and score only the first N judged queries")
    parser.add_argument("--cpu-threads", type=positive_int,
                        help="also time one-query search on the CPU with N threads on the largest built index")
    parser.add_argument("--tile-to", type=corpus_size,
                        help="also measure search on the largest index tiled to this size (whole copies: rounded up)")
    parser.add_argument("--exhaustive-max-docs", type=corpus_size,
                        help="skip exhaustive scoring (overlap@10, exhaustive nDCG@10) above this size")
    parser.add_argument("--exact-max-docs", type=corpus_size,
                        help="up to this size, also rank every passage exhaustively with its exact float16 tokens "
                             "(encoded once more, kept on the device) and report overlap@10 with that ranking")
    parser.add_argument("--work", type=Path, help="keep the indexes in this folder (default: a temporary folder "
                                                  "in --output, removed at the end)")
    parser.add_argument("--add-fraction", type=float, default=0.0,
                        help="also time adding this fraction of new passages to the largest index (e.g. 0.01)")
    parser.add_argument("--encoder", default="aligner", help="AligneR checkpoint")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic corpus")
    parser.add_argument("--quiet", action="store_true", help="no progress bars, warnings only")
    args = parser.parse_args(argv)
    if args.tile_to is not None and args.tile_to <= max(args.sizes):
        parser.error(f"argument --tile-to: {args.tile_to} is not above the largest size {max(args.sizes)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.quiet)
    from eval.bench_scale.run import run_bench

    def run() -> None:
        run_bench(args.beir_zip, args.sizes, args.output, args.device, codec=args.codec, batch_size=args.batch_size,
                  max_queries=args.max_queries, cpu_threads=args.cpu_threads, tile_to=args.tile_to, work=args.work,
                  exhaustive_max_docs=args.exhaustive_max_docs, exact_max_docs=args.exact_max_docs,
                  add_fraction=args.add_fraction, encoder=args.encoder, seed=args.seed, quiet=args.quiet)

    return run_report(run, args.output / "bench_scale.md")


if __name__ == "__main__":
    sys.exit(main())
