"""``python -m eval.bench_peers --beir-zip scifact.zip --size 1m --output <dir> [--device cuda]``

This project's default index and FastPlaid, built over the same float16 token vectors of a synthetic corpus grown
from the BEIR zip and searched on the same GPU in one run: build time, bytes on disk, p50 one query and q/s at
batch 300 (k=10), peak GPU memory, overlap@10 with exhaustive scoring of the exact tokens and nDCG@10 on the zip's
test queries, and the ratios pyserini-aligner / FastPlaid. Writes bench_peers.json and bench_peers.md in --output
and prints the table. Needs a CUDA GPU and fast-plaid (the release built for the installed torch).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eval.cli import configure_logging, corpus_size, positive_int, run_report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m eval.bench_peers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--beir-zip", type=Path, required=True, help="a BEIR zip with qrels/test.tsv, e.g. scifact.zip")
    parser.add_argument("--size", type=corpus_size, required=True, help="corpus size in passages, e.g. 100k or 1m")
    parser.add_argument("--output", type=Path, required=True, help="folder for bench_peers.json and bench_peers.md")
    parser.add_argument("--device", default="cuda", help="the CUDA device both engines run on (default: cuda)")
    parser.add_argument("--codec", default="auto", help="this project's token codec (default: auto)")
    parser.add_argument("--batch-size", type=positive_int, default=128, help="passages per encoding batch")
    parser.add_argument("--max-queries", type=positive_int, help="time and score only the first N judged queries")
    parser.add_argument("--work", type=Path, help="keep both indexes in this new folder (default: a temporary "
                                                  "folder, removed at the end)")
    parser.add_argument("--encoder", default="aligner", help="AligneR checkpoint that encodes passages and queries")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic corpus")
    parser.add_argument("--fastplaid-probes", type=positive_int, default=8,
                        help="FastPlaid's n_ivf_probe: centroids probed a query token (default: FastPlaid's, 8)")
    parser.add_argument("--fastplaid-candidates", type=positive_int, default=4096,
                        help="FastPlaid's n_full_scores: candidates scored in full (default: FastPlaid's, 4096)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars, warnings only")
    return parser.parse_args(argv)


def check_device(device: str) -> str | None:
    """Why ``device`` cannot run the benchmark (one line), or None."""
    import torch

    if not device.startswith("cuda"):
        return f"--device {device}: the comparison runs on a CUDA GPU only"
    if not torch.cuda.is_available():
        return f"--device {device}: torch {torch.__version__} sees no CUDA GPU here"
    try:
        torch.device(device)
    except RuntimeError as err:
        return f"--device {device}: {err}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from eval.bench_peers.fastplaid import FastPlaidMissing, fast_plaid_search

    try:
        fast_plaid_search()
    except FastPlaidMissing as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    problem = check_device(args.device)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    configure_logging(args.quiet)
    from eval.bench_peers.run import run_peers

    def run() -> None:
        run_peers(args.beir_zip, args.size, args.output, args.device, codec=args.codec, batch_size=args.batch_size,
                  max_queries=args.max_queries, work=args.work, encoder=args.encoder, seed=args.seed,
                  n_ivf_probe=args.fastplaid_probes, n_full_scores=args.fastplaid_candidates, quiet=args.quiet)

    return run_report(run, args.output / "bench_peers.md")


if __name__ == "__main__":
    sys.exit(main())
