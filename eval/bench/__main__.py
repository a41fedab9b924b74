"""``python -m eval.bench --dataset beir/scifact/test --output runs/bench_scifact``"""
import argparse
import sys

from eval.bench.run import SYSTEMS, run_bench
from eval.cli import configure_logging


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.bench", description=__doc__)
    parser.add_argument("--dataset", required=True, help="ir_datasets id (beir/scifact/test) or a local BEIR folder")
    parser.add_argument("--output", required=True, help="folder for bench.json and bench.md")
    parser.add_argument("--cache", default=".cache/indexes", help="folder for indexes (shared with eval.beir)")
    parser.add_argument("--encoder", default="aligner", help="AligneR checkpoint")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timed-queries", type=int, default=100, help="queries timed one by one per system and k")
    parser.add_argument("--build-only", action="store_true", help="measure the index builds only (no searches)")
    parser.add_argument("--systems", type=lambda text: tuple(text.split(",")), default=SYSTEMS,
                        help=f"searches to measure, comma-separated, of {','.join(SYSTEMS)}")
    parser.add_argument("--reuse", action="store_true", help="keep indexes already built in --cache (their "
                        "recorded build seconds are reported)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.systems if name not in SYSTEMS]
    if unknown:
        parser.error(f"--systems: unknown {', '.join(unknown)} (known: {', '.join(SYSTEMS)})")
    configure_logging()
    run_bench(args.dataset, args.output, args.cache, encoder=args.encoder, threads=args.threads,
              timed_queries=args.timed_queries, build_only=args.build_only, systems=args.systems, reuse=args.reuse)
    print(open(f"{args.output}/bench.md", encoding="utf-8").read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
