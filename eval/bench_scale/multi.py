"""``python -m eval.bench_scale.multi --beir-zip scifact.zip --size 2m --gpus 4 --output <dir>``

Multi-GPU scaling on synthetic passages: a one-GPU build of size/G passages against a torchrun build of all of them
on G GPUs (passages/s each, and their ratio over G), then sharded search of the G-segment index over all G GPUs
against one GPU (q/s in batches of 300 and whether the rankings are identical). Writes multi.json and multi.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from eval.bench_scale.corpus import SyntheticCorpus, parse_size, read_beir_zip, size_label
from eval.bench_scale.run import judged_queries


def write_jsonl(corpus: SyntheticCorpus, n: int, path: Path) -> None:
    with path.open("w", encoding="utf-8") as out:
        for docid, text in corpus.passages(n):
            out.write(json.dumps({"id": docid, "contents": text}) + "\n")


def timed(command: list[str]) -> float:
    """Run ``command`` (it must succeed); its wall-clock seconds."""
    start = time.perf_counter()
    subprocess.run(command, check=True, env=os.environ.copy())
    return time.perf_counter() - start


def qps(searcher, texts: list[str]) -> tuple[float, list]:
    times, ranked = [], []
    for _ in range(3):
        start = time.perf_counter()
        ranked = searcher.rank(texts, k=10)
        times.append(time.perf_counter() - start)
    return len(texts) / statistics.median(times), ranked


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.bench_scale.multi", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--beir-zip", type=Path, required=True)
    parser.add_argument("--size", type=parse_size, required=True)
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_multi"))
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a quick check with CPU processes")
    args = parser.parse_args(argv)
    import torch

    source = read_beir_zip(args.beir_zip)
    corpus = SyntheticCorpus(source)
    args.work.mkdir(parents=True, exist_ok=True)
    full, part = args.work / "full.jsonl", args.work / "part.jsonl"
    write_jsonl(corpus, args.size, full)
    write_jsonl(corpus, args.size // args.gpus, part)
    common = ["--device", args.device, "--batch-size", str(args.batch_size), "--quiet"]
    one = timed([sys.executable, "-m", "pyserini_aligner.index", "--corpus", str(part), "--index",
                 str(args.work / "one"), *common])
    many = timed(["torchrun", "--nproc-per-node", str(args.gpus), "-m", "pyserini_aligner.index", "--corpus",
                  str(full), "--index", str(args.work / "many"), *common])
    cuda = args.device.startswith("cuda")
    report = {"gpu": torch.cuda.get_device_name(0) if cuda else "CPU", "gpus": args.gpus, "size": args.size,
              "one_gpu": {"passages": args.size // args.gpus, "seconds": round(one, 1),
                          "passages_per_s": round(args.size // args.gpus / one, 1)},
              "all_gpus": {"passages": args.size, "seconds": round(many, 1),
                           "passages_per_s": round(args.size / many, 1)}}
    report["build_scaling"] = round(report["all_gpus"]["passages_per_s"]
                                    / (args.gpus * report["one_gpu"]["passages_per_s"]), 3)
    from pyserini_aligner.search import AlignerSearcher

    texts = list(judged_queries(corpus, args.size, None).values())
    devices = [f"cuda:{i}" for i in range(args.gpus)] if cuda else ["cpu"] * args.gpus
    single = AlignerSearcher(args.work / "many", device=devices[0], backend="torch", batch_size=300)
    rate_one, ranked_one = qps(single, texts)
    del single
    if cuda:
        torch.cuda.empty_cache()
    sharded = AlignerSearcher(args.work / "many", devices=devices, backend="torch", batch_size=300)
    rate_all, ranked_all = qps(sharded, texts)
    report["search"] = {"queries": len(texts), "one_gpu_qps_b300": round(rate_one, 1),
                        "sharded_qps_b300": round(rate_all, 1),
                        "search_scaling": round(rate_all / (args.gpus * rate_one), 3),
                        "identical_rankings": ranked_one == ranked_all,
                        "same_docids": sum([d for d, _ in a] == [d for d, _ in b]
                                           for a, b in zip(ranked_one, ranked_all))}
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "multi.json").write_text(json.dumps(report, indent=1) + "\n")
    b, s = report, report["search"]
    md = (f"### {args.gpus} × {report['gpu']}, {size_label(args.size)} synthetic passages\n\n"
          "| | passages | build s | passages/s |\n|---|---:|---:|---:|\n"
          f"| 1 GPU | {b['one_gpu']['passages']} | {b['one_gpu']['seconds']} | {b['one_gpu']['passages_per_s']} |\n"
          f"| {args.gpus} GPUs (torchrun) | {b['all_gpus']['passages']} | {b['all_gpus']['seconds']} | "
          f"{b['all_gpus']['passages_per_s']} |\n\n"
          f"Build throughput {b['build_scaling']} × linear. Search over the {args.gpus}-segment index, {s['queries']} "
          f"queries, batches of 300: one GPU {s['one_gpu_qps_b300']} q/s, {args.gpus} GPUs {s['sharded_qps_b300']} "
          f"q/s ({s['search_scaling']} × linear); identical rankings: {s['identical_rankings']} "
          f"({s['same_docids']}/{s['queries']} queries with the same docids in order).\n")
    (args.output / "multi.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
