"""How deep should a CPU search of a few hits go? The default index (as ``eval.beir`` derives it) searched on the CPU
for ``--hits`` hits with each candidate depth: overlap with the exact index's top ``--hits`` (the exact index searched
for 1,000 hits with the same β^q, as ``eval.experiments.refine_bytes`` takes it), nDCG@10 where the split has qrels,
one-query p50 with query encoding, and batch milliseconds a query.

    python -m eval.experiments.cpu_depth --dataset beir/scifact/train --output DIR [--settings 128/0,256/0,64/512]

A setting ``C/W`` refines C documents a query; W > 0 first narrows W candidates from the probes by centroid
interaction (``--max-candidates`` and ``--interaction-candidates`` of the search command; W = 0: refined straight
from the probes, the CPU's default). The searcher raises both to its floors for a deep search (2k refined, 4k
narrowed), so that the settings differ only for small k. Choose on a train or dev split. Writes cpu_depth.json and
cpu_depth.md.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import NamedTuple

from eval.beir.aligner import default_index, full_index, search
from eval.beir.context import Context, add_study_arguments, study_context
from eval.bench.measure import per_query_latency, percentiles_ms
from eval.cli import configure_logging, positive_int, write_report
from eval.experiments.refine_bytes import overlap_at
from pyserini_aligner.hits import drop_query_hits
from pyserini_aligner.metrics import evaluate
from pyserini_aligner.search.defaults import DEFAULT_QUERY_PRUNE
from pyserini_aligner.search.options import DEPTH_DEFAULTS

REFERENCE_HITS = 1000


class Setting(NamedTuple):
    """Documents refined a query (C) and candidates narrowed by centroid interaction first (W; 0: none)."""

    refined: int
    interaction: int

    def __str__(self) -> str:
        return f"{self.refined}/{self.interaction}"


DEFAULT_SETTING = Setting(DEPTH_DEFAULTS["cpu"][2], DEPTH_DEFAULTS["cpu"][3])


def settings_list(text: str) -> list[Setting]:
    """argparse type: comma-separated ``C/W`` pairs such as 128/0,64/512 (C >= 1, W >= 0)."""
    settings = []
    for part in text.split(","):
        refined, slash, interaction = part.strip().partition("/")
        try:
            setting = Setting(int(refined), int(interaction) if slash else 0)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated C/W pairs such as 128/0,64/512, got "
                                             f"{part.strip()!r}") from None
        if setting.refined < 1 or setting.interaction < 0:
            raise argparse.ArgumentTypeError(f"C must be >= 1 and W >= 0, got {part.strip()!r}")
        settings.append(setting)
    return settings


def measure(ctx: Context, settings: list[Setting], hits: int, timed_queries: int, batch_size: int) -> dict:
    """{"reference": {metrics}, "rows": [{"setting", "overlap@<hits>", metrics, "p50_ms", "p95_ms",
    "batch_ms_per_query"}]}: each setting over every query of ``ctx`` (one query at a time for the first
    ``timed_queries``)."""
    from pyserini_aligner.search import AlignerSearcher

    def metrics(run: dict) -> dict:
        if not ctx.qrels:
            return {}
        return {m: round(v, 4) for m, v in evaluate(ctx.qrels, run, ("ndcg@10",)).items()}

    reference = search(ctx, full_index(ctx), DEFAULT_QUERY_PRUNE, desc="exact", hits=REFERENCE_HITS)
    index = default_index(ctx)
    qids = list(ctx.queries)
    texts = [ctx.queries[q] for q in qids]
    report = {"dataset": ctx.dataset.name, "queries": len(qids), "hits": hits, "query_prune": DEFAULT_QUERY_PRUNE,
              "threads": ctx.threads, "timed_queries": min(timed_queries, len(qids)), "batch_size": batch_size,
              "default": str(DEFAULT_SETTING), "reference": metrics({q: r[:hits] for q, r in reference.items()}),
              "rows": []}
    for setting in settings:
        searcher = AlignerSearcher(index, device="cpu", query_prune=DEFAULT_QUERY_PRUNE,
                                   max_candidates=setting.refined, interaction_candidates=setting.interaction,
                                   batch_size=batch_size)
        start = time.perf_counter()
        found = searcher.batch_search(texts, qids, k=hits + 1, threads=ctx.threads)  # batch_size queries at a time
        batch_s = time.perf_counter() - start
        run = {q: [(h.docid, float(h.score)) for h in ranked] for q, ranked in drop_query_hits(found, hits).items()}
        times = per_query_latency(lambda text: searcher.search(text, k=hits), texts[:timed_queries])
        report["rows"].append({"setting": str(setting), "refined": setting.refined,
                               "interaction": setting.interaction,
                               f"overlap@{hits}": round(overlap_at(run, reference, hits), 4), **metrics(run),
                               **percentiles_ms(times),
                               "batch_ms_per_query": round(batch_s / len(qids) * 1000, 2)})
    return report


def markdown(report: dict) -> str:
    hits = report["hits"]
    lines = [f"{report['dataset']}, {report['queries']} queries, {hits} hits, β^q {report['query_prune']}, "
             f"{report['threads']} threads; overlap@{hits} with the exact index's top {hits}; p50 one query at a time "
             f"(first {report['timed_queries']}, query encoding included); batch ms a query in batches of "
             f"{report['batch_size']}. Default `{report['default']}`.", "",
             f"| C/W | overlap@{hits} | nDCG@10 | p50 ms | p95 ms | batch ms a query |",
             "|---|---:|---:|---:|---:|---:|",
             f"| exact, {REFERENCE_HITS} hits | 1.0 | {report['reference'].get('ndcg@10', '')} | | | |"]
    for row in report["rows"]:
        name = f"**{row['setting']}** (default)" if row["setting"] == report["default"] else row["setting"]
        lines.append(f"| {name} | {row[f'overlap@{hits}']} | {row.get('ndcg@10', '')} | {row['p50_ms']} | "
                     f"{row['p95_ms']} | {row['batch_ms_per_query']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.experiments.cpu_depth", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", required=True, help="ir_datasets id or a local BEIR folder, e.g. beir/scifact/train")
    parser.add_argument("--output", required=True, help="folder for cpu_depth.json and cpu_depth.md")
    parser.add_argument("--settings", type=settings_list, default=[DEFAULT_SETTING, Setting(256, 0), Setting(64, 512),
                                                                   Setting(128, 512), Setting(96, 1024)],
                        help=f"comma-separated C/W pairs (default {DEFAULT_SETTING},256/0,64/512,128/512,96/1024)")
    parser.add_argument("--hits", type=positive_int, default=10, help="hits a query (default 10)")
    parser.add_argument("--timed-queries", type=positive_int, default=100,
                        help="queries timed one at a time (default 100)")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="queries a batch (default 32)")
    parser.add_argument("--threads", type=positive_int, default=2)
    add_study_arguments(parser)
    args = parser.parse_args(argv)
    configure_logging(args.quiet)
    ctx = study_context(args, threads=args.threads)
    report = measure(ctx, args.settings, args.hits, args.timed_queries, args.batch_size)
    write_report(args.output, "cpu_depth", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
