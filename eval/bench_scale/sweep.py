"""``python -m eval.bench_scale.sweep --beir-zip scifact.zip --size 1m --device cuda --output <dir>
--settings 100:8:256,1000:16:256:4096``

Builds (or reuses, with ``--work``) one synthetic index and searches it with several candidate-generation settings
``k_per_token:nprobe:max_candidates[:interaction_candidates]``: overlap@10 with exhaustive scoring of the index's codes
(computed once) and, with ``--exact``, with exhaustive scoring of every passage's exact float16 tokens (the same model,
unpruned), nDCG@10, p50/p95 at k=10 one query at a time and q/s in batches of 300. Writes sweep.json and sweep.md and
prints the table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from eval.bench.measure import per_query_latency, percentiles_ms
from eval.bench_scale.corpus import SyntheticCorpus, parse_size, read_beir_zip, size_label
from eval.bench_scale.exact import exact_ranking
from eval.bench_scale.measure import machine_info, overlap_at_k, run_dict
from eval.bench_scale.run import DOC_PRUNE, build, judged_queries
from eval.cli import configure_logging
from pyserini_aligner.metrics import evaluate


def parse_settings(text: str) -> list[tuple[int, int, int, int]]:
    """"K:nprobe:C[:W],..." -> [(K, nprobe, C, W), ...] (W: interaction candidates, 0 = off, default 0)."""
    out = []
    for part in text.split(","):
        try:
            values = [int(x) for x in part.split(":")]
            k, nprobe, limit, wide = (values + [0])[:4] if len(values) in (3, 4) else ([],) * 4
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected K:nprobe:C[:W], got {part!r}") from None
        out.append((k, nprobe, limit, wide))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.bench_scale.sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--beir-zip", type=Path, required=True)
    parser.add_argument("--size", type=parse_size, required=True)
    parser.add_argument("--settings", type=parse_settings, required=True, help="K:nprobe:C,...")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--work", type=Path, help="keep (or reuse) the index here")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--codec", default="auto", help="codec of the index built (default: auto)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--doc-prune", type=float, default=DOC_PRUNE,
                        help="β^d of the index built (default: the build's for the corpus size)")
    parser.add_argument("--max-queries", type=int, default=None)
    parser.add_argument("--exact", action="store_true",
                        help="also rank with every passage's exact tokens and report each setting's overlap with it")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    configure_logging(args.quiet)
    from pyserini_aligner.search import AlignerSearcher
    from pyserini_aligner.index.reader import StoredIndex
    from pyserini_aligner.search.exhaustive import ExhaustiveScorer

    source = read_beir_zip(args.beir_zip)
    corpus = SyntheticCorpus(source)
    queries = judged_queries(corpus, args.size, args.max_queries)
    texts, qids = list(queries.values()), list(queries)
    judged = {qid: source.qrels[qid] for qid in qids}
    work = args.work or args.output / "work"
    folder = work / size_label(args.size)
    if (folder / "index" / "manifest.json").is_file():
        index_dir, built = folder / "index", {}
    else:
        index_dir, built = build(corpus, args.size, folder, args.device, args.batch_size, args.codec, "aligner",
                                 args.quiet, args.doc_prune)
    start = time.perf_counter()
    best = ExhaustiveScorer(index_dir, device=args.device).rank(texts, k=10)
    report = {"machine": machine_info(args.device), "size": args.size, "queries": len(texts), "build": built,
              "doc_prune": StoredIndex(index_dir).manifest.doc_prune,
              "codec": str(StoredIndex(index_dir).manifest.codec),
              "exhaustive_s": round(time.perf_counter() - start, 2),
              "ndcg@10_exhaustive": round(evaluate(judged, run_dict(qids, best), ("ndcg@10",))["ndcg@10"], 4), "rows": []}
    exact = None
    if args.exact:
        start = time.perf_counter()
        exact = exact_ranking(corpus.passages(args.size), texts, "aligner", args.device, args.batch_size,
                              progress=not args.quiet, total=args.size)
        report["exact_s"] = round(time.perf_counter() - start, 2)
        report["overlap@10_exhaustive_exact"] = round(overlap_at_k(best, exact, 10), 4)
    for k, nprobe, limit, wide in args.settings:
        searcher = AlignerSearcher(index_dir, device=args.device, k_per_token=k, nprobe=nprobe,
                                   max_candidates=limit, interaction_candidates=wide, batch_size=300)
        row = {"k_per_token": k, "nprobe": nprobe, "max_candidates": limit, "interaction_candidates": wide}
        if args.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        row.update(percentiles_ms(per_query_latency(lambda q: searcher.rank([q], k=10), texts[:100], warmup=10)))
        single = [searcher.rank([q], k=10)[0] for q in texts[:100]]
        times = []
        searcher.timings = {}
        for _ in range(3):
            start = time.perf_counter()
            ranked = searcher.rank(texts, k=10)
            times.append(time.perf_counter() - start)
        row["qps_b300"] = round(len(texts) / statistics.median(times), 1)
        row["ms_per_batch300"] = {step: round(1000 * t / 3 / max(1, len(texts) / 300), 1)
                                  for step, t in searcher.timings.items()}
        row["overlap@10"] = round(overlap_at_k(ranked, best, 10), 4)
        if exact is not None:
            row["overlap@10_exact"] = round(overlap_at_k(ranked, exact, 10), 4)
        row["single_vs_batch@10"] = round(overlap_at_k(single, ranked[:100], 10), 4)
        if args.device.startswith("cuda"):
            row["search_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        row["ndcg@10"] = round(evaluate(judged, run_dict(qids, ranked), ("ndcg@10",))["ndcg@10"], 4)
        report["rows"].append(row)
        print(row, flush=True)
        del searcher
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "sweep.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"### Candidate generation at {size_label(args.size)} passages ({report['machine'].get('gpu') or 'CPU'}), "
             f"codec {report['codec']}, β^d {report['doc_prune']}; "
             f"exhaustive nDCG@10 {report['ndcg@10_exhaustive']}"
             + (f"; exhaustive scoring of the codes keeps {report['overlap@10_exhaustive_exact']} of the exact top 10"
                if exact is not None else ""), "",
             "| K | nprobe | C | W | p50 ms | p95 ms | q/s b300 | ms per 300 (encode/probe/select[/interaction]/refine) | "
             "overlap@10 (codes / exact) | nDCG@10 | GPU GiB |",
             "|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    lines += [f"| {r['k_per_token']} | {r['nprobe']} | {r['max_candidates']} | {r['interaction_candidates']} | "
              f"{r['p50_ms']} | {r['p95_ms']} | "
              f"{r['qps_b300']} | {'/'.join(str(v) for v in r['ms_per_batch300'].values())} | {r['overlap@10']} / "
              f"{r.get('overlap@10_exact', '–')} | "
              f"{r['ndcg@10']} | {r.get('search_gpu_gib', '-')} |" for r in report["rows"]]
    (args.output / "sweep.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
