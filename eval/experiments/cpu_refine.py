"""What does a CPU refinement cost as the residual codes grow? Each index's refinement step timed two ways on the
same candidates, one query at a time (each query's top 128 from the searcher, as many documents as it refines
for 10 hits, and its query vectors):

- ``adc``: the searcher's way (:meth:`~pyserini_aligner.search.codes.CodeShard.similarity`): a query-centroid table
  and R look-up tables, then one ``embedding_bag`` sum of 1 + R rows a token;
- ``decode+product``: each token decoded once (:meth:`~pyserini_aligner.search.codes.CodeShard.decode`: centroid
  plus R codewords, at unit length) and one product with the query's tokens.

    python -m eval.experiments.cpu_refine --dataset beir/scifact/test --index IDX_32 IDX_64 --output DIR

The indexes are timed in turn on each query; medians over the queries of the best of ``--repeats`` timings each (2
threads unless ``--threads``), and the largest difference between the two similarity tensors. Writes cpu_refine.json
and cpu_refine.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from eval.cli import configure_logging, positive_int, write_report
from pyserini_aligner.search.options import DEPTH_DEFAULTS

CANDIDATES = DEPTH_DEFAULTS["cpu"][2]  # the CPU's refined candidates at 10 hits


def best_of(repeats: int, step) -> float:
    """The shortest of ``repeats`` wall times of ``step()``, in ms."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


class Subject:
    """One index's searcher and code shard, and its timings so far."""

    def __init__(self, index: Path):
        from pyserini_aligner.search import AlignerSearcher
        from pyserini_aligner.search.codes import CodeShard

        self.index = index
        self.searcher = AlignerSearcher(index, device="cpu")
        self.shard = CodeShard(self.searcher.store, [0], "cpu")
        self.rows_of = {row: r for r, row in enumerate(self.searcher.store.docids)}
        self.adc, self.decode, self.both, self.tokens, self.diff = [], [], [], [], 0.0

    def time_query(self, text: str, repeats: int) -> None:
        """Both ways on ``text``'s candidates."""
        import torch

        shard = self.shard
        encoded = self.searcher.model.encode_padded([text], is_query=True)
        q = encoded.vectors.float()[:, :int(encoded.mask.sum())]  # [1, n, d]: the query's real tokens
        ranked = self.searcher.rank([text], k=CANDIDATES)[0]
        rows = torch.tensor([[self.rows_of[docid] for docid, _ in ranked]])
        lengths = shard.lengths[rows].long()
        span = torch.arange(int(lengths.max()))
        positions = (shard.offsets[rows].unsqueeze(-1) + span).clamp_max(len(shard.token_ids) - 1)
        mask = span < lengths.unsqueeze(-1)

        def product():
            return torch.einsum("bnd,bcld->bcnl", q, shard.decode(positions, mask))

        self.adc.append(best_of(repeats, lambda: shard.similarity(q, positions, mask)))
        self.decode.append(best_of(repeats, lambda: shard.decode(positions, mask)))
        self.both.append(best_of(repeats, product))
        self.tokens.append(int(lengths.sum()))
        self.diff = max(self.diff, float((shard.similarity(q, positions, mask) - product()).abs()
                                         .masked_fill(~mask.unsqueeze(-2), 0).max()))

    def row(self) -> dict:
        """{"index", "codec", "queries", "tokens_per_query", "adc_ms", "decode_ms", "decode_product_ms",
        "max_abs_diff"}: medians over the queries."""
        return {"index": self.index.name, "codec": str(self.searcher.manifest.codec), "queries": len(self.adc),
                "tokens_per_query": round(statistics.median(self.tokens)),
                "adc_ms": round(statistics.median(self.adc), 2), "decode_ms": round(statistics.median(self.decode), 2),
                "decode_product_ms": round(statistics.median(self.both), 2), "max_abs_diff": self.diff}


def measure(indexes: list[Path], texts: list[str], repeats: int) -> list[dict]:
    """One row (:meth:`Subject.row`) an index, the indexes timed in turn on each query (so that they share the
    machine's state)."""
    subjects = [Subject(index) for index in indexes]
    for text in texts:
        for subject in subjects:
            subject.time_query(text, repeats)
    return [subject.row() for subject in subjects]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.experiments.cpu_refine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", required=True, help="ir_datasets id or BEIR folder whose queries are searched")
    parser.add_argument("--index", type=Path, nargs="+", required=True, help="compressed indexes of the corpus")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--queries", type=positive_int, default=50, help="the first this many queries")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timings of each step a query (best kept)")
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    configure_logging(args.quiet)
    import torch

    from pyserini_aligner.data import Dataset

    torch.set_num_threads(args.threads)
    texts = list(Dataset(args.dataset).queries().values())[:args.queries]
    rows = measure(args.index, texts, args.repeats)
    report = {"dataset": args.dataset, "threads": args.threads, "candidates": CANDIDATES, "rows": rows}
    lines = [f"{args.dataset}, first {len(texts)} queries, {CANDIDATES} candidates each (its top {CANDIDATES}: "
             f"as many as the searcher refines for 10 hits), "
             f"{args.threads} threads; medians of each query's best of {args.repeats}.", "",
             "| codec | candidate tokens a query | adc ms | decode ms | decode + product ms | max abs difference |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| `{r['codec']}` | {r['tokens_per_query']:,} | {r['adc_ms']} | {r['decode_ms']} | "
              f"{r['decode_product_ms']} | {r['max_abs_diff']:.1e} |" for r in rows]
    write_report(args.output, "cpu_refine", report, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
