"""``python -m eval.bench_scale.multi --beir-zip scifact.zip --size 8.8m --gpus 4 --output <dir>``

Search on several GPUs over one real index. The first ``--size`` synthetic passages (:mod:`.corpus`) are written as a
JsonCollection (parts written at once by several processes) and built by ``torchrun`` on G GPUs into one index of G
segments (timed). That index is then searched at k=10 on one GPU and on all G with the codes replicated and with them
sharded: p50/p95 one query at a time (query encoding included), q/s for batches of ``--search-batch`` queries (median
of ``--passes`` passes after an untimed one; one GPU also at batches of ``--search-batch``/G, the part each of G
replicas searches), on G GPUs the median ms of a batch in the searcher, in its slowest worker and in a worker on
average (what the hand-over between processes and an uneven split cost), how many G-GPU rankings equal the one-GPU
ranking (same docids in order; same docids and scores), and the ratios against the targets: replicated q/s >=
0.8·G·one GPU and p50 <= 1.2 × one GPU, sharded q/s >= 0.6·G·one GPU. ``--compare-build`` also builds size/G passages
on one GPU (build throughput against the G-GPU build). ``--exact`` also ranks every passage exhaustively with its exact
float16 tokens (the fidelity reference, encoded again a step at a time and never held whole: 8.8M passages hold 162 GB
of them; one process a GPU scores a run of the corpus's part files) and reports the one-GPU ranking's overlap@10 with
it. Writes multi.json and multi.md under ``--output``; ``--device cpu`` runs the same steps with CPU processes (a quick
check of the harness, not a measurement).

``--phase build`` only writes the corpus and builds the index in ``--work`` (its figures saved there in build.json);
``--phase search`` then measures that index (a build and a search that do not fit in one command's time limit).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Sequence

from eval.bench_scale.corpus import SyntheticCorpus, read_beir_zip, size_label
from eval.cli import configure_logging, corpus_size, positive_int

TARGETS = {"replicate_qps": 0.8, "replicate_p50": 1.2, "shard_qps": 0.6}  # of G × one GPU's q/s; of its p50
PART_PASSAGES = 500_000  # passages a writing process takes at most


def _write_part(beir_zip: Path, seed: int, start: int, stop: int, path: Path) -> int:
    """Write passages ``start`` .. ``stop - 1`` of the synthetic corpus to ``path`` (JSON lines); their count."""
    corpus = SyntheticCorpus(read_beir_zip(beir_zip), seed=seed)
    count = 0
    with path.open("w", encoding="utf-8") as out:
        for docid, text in corpus.passages_between(start, stop):
            out.write(json.dumps({"id": docid, "contents": text}) + "\n")
            count += 1
    return count


def write_corpus(beir_zip: Path, n: int, folder: Path, seed: int = 0) -> float:
    """The first ``n`` passages as a JsonCollection folder of part files (named in corpus order), written by
    several processes at once; the wall seconds it took."""
    start = time.perf_counter()
    folder.mkdir(parents=True)
    parts = max(1, min(os.cpu_count() or 1, -(-n // PART_PASSAGES)))
    bounds = [n * i // parts for i in range(parts + 1)]
    jobs = [(beir_zip, seed, a, b, folder / f"part-{i:03d}.jsonl") for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    if parts == 1:
        written = [_write_part(*jobs[0])]
    else:
        with ProcessPoolExecutor(parts) as pool:
            written = list(pool.map(_write_part, *zip(*jobs)))
    if sum(written) != n:
        raise RuntimeError(f"wrote {sum(written)} passages, expected {n}")
    return time.perf_counter() - start


def timed_build(corpus: Path, index: Path, device: str, batch_size: int, gpus: int | None) -> float:
    """Build ``index`` from ``corpus`` with ``python -m pyserini_aligner.index`` (under torchrun with ``gpus``
    ranks, one a GPU); its wall seconds. The command must succeed."""
    command = ["-m", "pyserini_aligner.index", "--corpus", str(corpus), "--index", str(index), "--device", device,
               "--batch-size", str(batch_size), "--quiet"]
    if gpus is not None:
        command = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus), *command]
    start = time.perf_counter()
    subprocess.run([sys.executable, *command], check=True, env=os.environ.copy())
    return time.perf_counter() - start


def _exact_part(files: Sequence[Path], queries: list[str], device: str, batch_size: int) -> list:
    """:func:`.exact.exact_ranking` of the passages of the JsonCollection part ``files`` on ``device``."""
    from eval.bench_scale.exact import exact_ranking

    def passages():
        for path in files:
            with path.open(encoding="utf-8") as lines:
                for line in lines:
                    doc = json.loads(line)
                    yield doc["id"], doc["contents"]

    return exact_ranking(passages(), queries, "aligner", device, batch_size)


def parallel_exact(corpus: Path, queries: list[str], devices: Sequence[str], batch_size: int) -> list:
    """Per query, the top 10 of exhaustive scoring of every passage of ``corpus`` (a folder of part files in corpus
    order) with its exact tokens: the parts are split into consecutive runs, one a device, each scored by a process
    of its own on its device, and the rankings merged."""
    import multiprocessing

    from eval.bench_scale.exact import merged_rankings

    files = sorted(corpus.glob("part-*.jsonl"))
    bounds = [len(files) * i // len(devices) for i in range(len(devices) + 1)]
    runs = [files[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
    with ProcessPoolExecutor(len(runs), mp_context=multiprocessing.get_context("spawn")) as pool:
        parts = list(pool.map(_exact_part, runs, [queries] * len(runs), devices[:len(runs)],
                              [batch_size] * len(runs)))
    return merged_rankings(parts)


def search_mode(index: Path, devices: Sequence[str], placement: str, texts: list[str], batches: Sequence[int],
                passes: int) -> tuple[dict, list]:
    """Time one placement of the index on ``devices`` (:func:`.run.time_search` at each of ``batches``, q/s the
    median of ``passes``), then profile one pass at the last batch size (seconds of query encoding against the whole
    pass) and, on several devices, time ``passes`` more: the median of the batch's wall time in the searcher, of its
    slowest worker's search and of its workers' mean (ms); (figures, ranking of the last batch pass)."""
    from eval.bench_scale.run import release_memory, time_search
    from pyserini_aligner.search import AlignerSearcher

    held = {}
    batch = batches[-1]

    def open_ranker():
        searcher = AlignerSearcher(index, devices=list(devices), backend="torch", placement=placement,
                                   batch_size=batch)
        held["searcher"] = searcher

        def rank(queries: list[str], size: int):
            searcher.configure(batch_size=size)
            return searcher.rank(queries, k=10)

        return rank

    row, ranked = time_search(open_ranker, texts, devices[0], batches=batches, repeats=passes)
    searcher = held.pop("searcher")
    row["placement"] = searcher.engine.placement
    if getattr(searcher.engine, "last_seconds", None) is not None:  # worker processes: where a batch's time goes
        walls, slowest, mean = [], [], []
        for _ in range(passes):
            searcher.rank(texts[:batch], k=10)
            seconds = [t for t in searcher.engine.last_seconds if t is not None]
            walls.append(searcher.engine.last_wall)
            slowest.append(max(seconds))
            mean.append(sum(seconds) / len(seconds))
        row[f"workers_ms_b{batch}"] = {name: round(1000 * statistics.median(values), 2)
                                       for name, values in (("wall", walls), ("slowest", slowest), ("mean", mean))}
    searcher.timings = {}
    start = time.perf_counter()
    searcher.rank(texts[:batch], k=10)
    row["encode_share_b%d" % batch] = round(searcher.timings.get("encode", 0.0) / (time.perf_counter() - start), 3)
    del searcher
    release_memory(devices[0])
    return row, ranked


def agreement(ranked: list, reference: list) -> dict:
    """How many rankings equal the reference's: the same docids in order, and the same (docid, score) pairs."""
    return {"same_docids": sum([d for d, _ in a] == [d for d, _ in b] for a, b in zip(ranked, reference)),
            "identical": sum(a == b for a, b in zip(ranked, reference))}


def markdown(report: dict) -> str:
    g, s, build = report["gpus"], report["search"], report["build"]
    one, batch = s["one_gpu"], report["search_batch"]
    lines = [f"### {g} × {report['gpu']}, {size_label(report['size'])} synthetic passages (one index of "
             f"{report['segments']} segments built by torchrun)", "",
             f"Build with {g} torchrun ranks: {build['seconds']} s, {build['passages_per_s']} passages/s (corpus "
             f"written in {report['corpus_s']} s); codec {report['codec']}, {report['bytes_per_passage']} bytes a "
             f"passage on disk, {report['index_gib']} GiB of codes resident a copy; placement auto chooses "
             f"{report['auto_placement']}.", "",
             f"| | p50 ms | p95 ms | q/s b{batch} | q/s ÷ ({g} × one GPU) | p50 ÷ one GPU | same docids | "
             "identical |",
             "|---|---:|---:|---:|---:|---:|---:|---:|",
             f"| 1 GPU | {one['p50_ms']} | {one['p95_ms']} | {one[f'qps_b{batch}']} | | | | |"]
    for name in ("replicate", "shard"):
        row = s[name]
        lines.append(f"| {g} GPUs, {name} | {row['p50_ms']} | {row['p95_ms']} | {row[f'qps_b{batch}']} | "
                     f"{row['qps_scaling']} | {row['p50_ratio']} | {row['same_docids']}/{s['queries']} | "
                     f"{row['identical']}/{s['queries']} |")
    part = max(1, batch // g)
    lines += ["", f"One GPU at batch {part}, the part of a batch each replica searches: {one[f'qps_b{part}']} q/s "
                  f"({round(one[f'qps_b{part}'] / one[f'qps_b{batch}'], 3)} × its q/s at batch {batch})."]
    for name in ("replicate", "shard"):
        spent = s[name].get(f"workers_ms_b{batch}")
        if spent:
            lines.append(f"{name.capitalize()}, a batch of {batch} (median ms): {spent['wall']} in the searcher, "
                         f"{spent['slowest']} in its slowest worker, {spent['mean']} in a worker on average.")
    if "overlap@10_exact" in s:
        lines += ["", f"Exhaustive scoring of every passage with its exact float16 tokens ({s['exact_s']} s over {g} "
                      f"GPUs): the one-GPU top 10 keeps {s['overlap@10_exact']} of it."]
    checks = ", ".join(f"{name} {'met' if ok else 'missed'}" for name, ok in report["targets_met"].items())
    lines += ["", f"Targets (replicated q/s >= {TARGETS['replicate_qps']}·G·one GPU, p50 <= "
                  f"{TARGETS['replicate_p50']}× one GPU; sharded q/s >= {TARGETS['shard_qps']}·G·one GPU): "
                  f"{checks}."]
    if "one_gpu_build" in report:
        b = report["one_gpu_build"]
        lines.append(f"One GPU builds {b['passages']} passages at {b['passages_per_s']} passages/s: the {g}-GPU build "
                     f"runs at {report['build_scaling']} × linear.")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m eval.bench_scale.multi", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--beir-zip", type=Path, required=True, help="BEIR zip the passages grow from (SciFact)")
    parser.add_argument("--size", type=corpus_size, required=True, help="passages, e.g. 2m or 8.8m")
    parser.add_argument("--gpus", type=positive_int, required=True, help="GPUs (torchrun ranks and search devices)")
    parser.add_argument("--output", type=Path, required=True, help="folder for multi.json and multi.md")
    parser.add_argument("--work", type=Path, default=None,
                        help="new folder for the corpus and the indexes, kept afterwards (default: a temporary one)")
    parser.add_argument("--batch-size", type=positive_int, default=256, help="passages encoded together (build)")
    parser.add_argument("--search-batch", type=positive_int, default=300, help="queries searched together")
    parser.add_argument("--max-queries", type=positive_int, default=None, help="at most this many judged queries")
    parser.add_argument("--passes", type=positive_int, default=15,
                        help="timed passes over the queries a batch size (q/s is their median)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cuda, or cpu for a quick check of the harness with CPU processes")
    parser.add_argument("--compare-build", action="store_true",
                        help="also build size/G passages on one GPU (build throughput against the G-GPU build)")
    parser.add_argument("--phase", choices=["all", "build", "search"], default="all",
                        help="build: only write the corpus and build the index in --work; search: only measure the "
                             "index a build phase left in --work; all (default): both")
    parser.add_argument("--exact", action="store_true",
                        help="also score every passage exhaustively with its exact tokens, split over the GPUs, and "
                             "report the one-GPU ranking's overlap@10 with it")
    parser.add_argument("--quiet", action="store_true", help="warnings and errors only")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.quiet)
    if args.phase == "search" and args.work is None:
        print("error: --phase search needs --work, the folder of a --phase build run", file=sys.stderr)
        return 1
    if args.phase != "search" and args.work is not None and args.work.exists() and any(args.work.iterdir()):
        print(f"error: --work {args.work} already exists and is not empty; pass a new folder", file=sys.stderr)
        return 1
    if not args.beir_zip.is_file():
        print(f"error: --beir-zip {args.beir_zip}: no such file", file=sys.stderr)
        return 1
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_multi-"))
    built = work / "build.json"
    if args.phase == "search":
        if not built.is_file():
            print(f"error: --work {work}: no build.json; run --phase build there first", file=sys.stderr)
            return 1
        corpus_s, build_s = (json.loads(built.read_text())[key] for key in ("corpus_s", "build_s"))
    else:
        work.mkdir(parents=True, exist_ok=True)
        corpus_s = write_corpus(args.beir_zip, args.size, work / "corpus")
        build_s = timed_build(work / "corpus", work / "index", args.device, args.batch_size, args.gpus)
        built.write_text(json.dumps({"corpus_s": corpus_s, "build_s": build_s}))
        if args.phase == "build":
            print(f"built {args.size} passages in {build_s:.1f} s (corpus written in {corpus_s:.1f} s): {work}")
            return 0
    args.output.mkdir(parents=True, exist_ok=True)

    import torch

    from eval.bench_scale.measure import folder_bytes, overlap_at_k
    from eval.bench_scale.report import write_report
    from eval.bench_scale.run import judged_queries
    from pyserini_aligner.index.reader import StoredIndex
    from pyserini_aligner.search.backends.choose import choose_placement
    from pyserini_aligner.search.backends.torch_codes import resident_bytes

    cuda = args.device == "cuda"
    devices = [f"cuda:{i}" for i in range(args.gpus)] if cuda else ["cpu"] * args.gpus
    store = StoredIndex(work / "index")
    report = {"gpu": torch.cuda.get_device_name(0) if cuda else "CPU", "gpus": args.gpus, "size": args.size,
              "segments": len(store.segments), "search_batch": args.search_batch, "corpus_s": round(corpus_s, 1),
              "build": {"seconds": round(build_s, 1), "passages_per_s": round(args.size / build_s, 1)},
              "index_gib": round(resident_bytes(store, range(len(store.segments)), "all",
                                                torch.device(devices[0])) / 2 ** 30, 2),
              "codec": str(store.codec_spec) if store.codec is not None else None,
              "bytes_per_passage": round(folder_bytes(work / "index") / args.size, 1),
              "auto_placement": choose_placement(store, [torch.device(d) for d in devices], "all")}
    del store
    unfinished = "(unfinished: the figures so far are in multi.json)\n"
    write_report(args.output, "multi", report, unfinished)  # a run cut short keeps what it measured
    texts = list(judged_queries(SyntheticCorpus(read_beir_zip(args.beir_zip)), args.size, args.max_queries).values())
    part = max(1, args.search_batch // args.gpus)
    one, reference = search_mode(work / "index", devices[:1], "auto", texts, sorted({part, args.search_batch}),
                                 args.passes)
    search = report["search"] = {"queries": len(texts), "one_gpu": one}
    write_report(args.output, "multi", report, unfinished)
    qps = f"qps_b{args.search_batch}"
    for placement in ("replicate", "shard"):
        row, ranked = search_mode(work / "index", devices, placement, texts, (args.search_batch,), args.passes)
        row.update(agreement(ranked, reference))
        row["qps_scaling"] = round(row[qps] / (args.gpus * one[qps]), 3)
        row["p50_ratio"] = round(row["p50_ms"] / one["p50_ms"], 3)
        search[placement] = row
        write_report(args.output, "multi", report, unfinished)
    if args.exact:
        start = time.perf_counter()
        exact = parallel_exact(work / "corpus", texts, devices, args.batch_size)
        search["exact_s"] = round(time.perf_counter() - start, 1)
        search["overlap@10_exact"] = round(overlap_at_k(reference, exact, 10), 4)
    report["targets_met"] = {
        "replicated q/s": search["replicate"]["qps_scaling"] >= TARGETS["replicate_qps"],
        "replicated p50": search["replicate"]["p50_ratio"] <= TARGETS["replicate_p50"],
        "sharded q/s": search["shard"]["qps_scaling"] >= TARGETS["shard_qps"]}
    if args.compare_build:
        part = args.size // args.gpus
        write_corpus(args.beir_zip, part, work / "part")
        seconds = timed_build(work / "part", work / "one", args.device, args.batch_size, None)
        report["one_gpu_build"] = {"passages": part, "seconds": round(seconds, 1),
                                   "passages_per_s": round(part / seconds, 1)}
        report["build_scaling"] = round(report["build"]["passages_per_s"]
                                        / (args.gpus * report["one_gpu_build"]["passages_per_s"]), 3)
    table = markdown(report)
    write_report(args.output, "multi", report, table)
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
