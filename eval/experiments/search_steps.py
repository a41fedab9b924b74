"""Where a batch's time goes: the milliseconds of each search step (encode, probe, select, interaction, refine) on one
device, and on every rank of a process group that shards the same index.

    python -m eval.experiments.search_steps --index DIR --beir-zip scifact.zip --size 8.8m --devices cuda:0 cuda:1
        cuda:2 cuda:3 --output DIR [--batch 300] [--passes 3]

The queries are the judged queries of the synthetic corpus of ``--size`` passages grown from ``--beir-zip`` (the
corpus ``eval.bench_scale.multi`` builds), searched at k=10 in one batch of ``--batch``. One device: the first of
``--devices``. Shard group: one process a device (NCCL on GPUs, Gloo on CPUs), each holding its share of the
segments, searching in lockstep as ``placement="shard"`` does. Each pass is timed after two untimed ones; a step's
time is taken when the step ends, after the device finishes its work (a rank's step also holds its wait for the
others in the step's collectives). Writes search_steps.json and search_steps.md under ``--output``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from eval.cli import configure_logging, corpus_size, positive_int

STEPS = ("encode", "probe", "select", "interaction", "refine")
WARM_PASSES = 2


def timed_passes(searcher, texts: list[str], passes: int, synchronize) -> dict:
    """{"wall_ms": median wall of a pass, step: mean ms a pass} of ``passes`` searches of ``texts`` as one batch."""
    for _ in range(WARM_PASSES):
        searcher.search_texts(texts, 10, None, False)
    walls = []
    searcher.timings = {}
    for _ in range(passes):
        synchronize()
        start = time.perf_counter()
        searcher.search_texts(texts, 10, None, False)
        synchronize()
        walls.append(time.perf_counter() - start)
    steps = {step: round(seconds * 1000 / passes, 2) for step, seconds in searcher.timings.items()}
    searcher.timings = None
    return {"wall_ms": round(statistics.median(walls) * 1000, 2), **steps}


def batch_texts(beir_zip: Path, size: int, batch: int) -> list[str]:
    """``batch`` query texts: the judged queries of the synthetic corpus of ``size`` passages grown from
    ``beir_zip``, repeated as often as needed."""
    from eval.bench_scale.corpus import SyntheticCorpus, read_beir_zip
    from eval.bench_scale.run import judged_queries

    texts = list(judged_queries(SyntheticCorpus(read_beir_zip(beir_zip)), size, None).values())
    return (texts * (batch // max(len(texts), 1) + 1))[:batch]


def synchronizer(device: str):
    """A function that waits for ``device`` to finish its work (nothing on a CPU)."""
    import torch

    return (lambda: torch.cuda.synchronize(device)) if device.startswith("cuda") else (lambda: None)


def _rank(rank: int, devices: list[str], index: str, texts: list[str], passes: int, group_file: str, results) -> None:
    """One rank of the shard group: its figures, or the error, put on ``results``."""
    try:
        import torch.distributed as dist

        from pyserini_aligner.dist import Collectives, DistContext, join_group
        from pyserini_aligner.search import AlignerSearcher

        device, ctx = devices[rank], DistContext(rank, len(devices), rank)
        join_group(ctx, device=device, cuda_backend="nccl", rendezvous=group_file)
        searcher = AlignerSearcher(index, device=device, backend="torch", placement="shard",
                                   exchange=Collectives(ctx), batch_size=len(texts))
        row = {"rank": rank, "device": device, "rows_held": searcher.num_rows,
               **timed_passes(searcher, texts, passes, synchronizer(device))}
        dist.barrier()
        dist.destroy_process_group()
        results.put(row)
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        results.put({"rank": rank, "error": f"{type(err).__name__}: {err}"})


def measure(index: Path, texts: list[str], devices: list[str], passes: int) -> dict:
    """{"one": one device's figures, "shard": every rank's, in rank order}."""
    import torch.multiprocessing as mp

    from eval.bench_scale.run import release_memory
    from pyserini_aligner.search import AlignerSearcher

    one = AlignerSearcher(str(index), device=devices[0], backend="torch", batch_size=len(texts))
    report = {"one": {"device": devices[0], **timed_passes(one, texts, passes, synchronizer(devices[0]))}}
    del one
    release_memory(devices[0])
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="search-steps-") as folder:
        group_file = str(Path(folder) / "group")
        processes = [context.Process(target=_rank, args=(rank, devices, str(index), texts, passes, group_file,
                                                         results)) for rank in range(len(devices))]
        for process in processes:
            process.start()
        rows = sorted((results.get(timeout=3600) for _ in processes), key=lambda row: row["rank"])
        for process in processes:
            process.join(timeout=60)
    failed = [row["error"] for row in rows if "error" in row]
    if failed:
        raise RuntimeError(f"a shard rank failed: {failed[0]}")
    report["shard"] = rows
    return report


def markdown(report: dict) -> str:
    lines = [f"Search steps, {report['queries']} queries in one batch, k=10, {report['size']} passages, "
             f"{len(report['shard'])} shards; ms a pass (median wall of {report['passes']} passes after "
             f"{WARM_PASSES} untimed; steps: mean).", "",
             "| | wall | " + " | ".join(STEPS) + " |", "|---|" + "---:|" * (len(STEPS) + 1)]
    for name, row in [(f"one {report['one']['device']}", report["one"])] + \
            [(f"shard rank {row['rank']} {row['device']}", row) for row in report["shard"]]:
        lines.append(f"| {name} | {row['wall_ms']} | " + " | ".join(str(row.get(step, "")) for step in STEPS) + " |")
    return "\n".join(lines) + "\n"


def study_parser(name: str, doc: str, index_help: str) -> argparse.ArgumentParser:
    """The flags of a search study over an index of synthetic passages: --index, --beir-zip, --size, --output
    (for NAME.json and NAME.md), --passes and --quiet."""
    parser = argparse.ArgumentParser(prog=f"python -m eval.experiments.{name}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", type=Path, required=True, help=index_help)
    parser.add_argument("--beir-zip", type=Path, required=True, help="the BEIR zip its synthetic passages grew from")
    parser.add_argument("--size", type=corpus_size, required=True, help="the passages it holds, e.g. 8.8m")
    parser.add_argument("--output", type=Path, required=True, help=f"folder for {name}.json and .md")
    parser.add_argument("--passes", type=positive_int, default=3, help="timed passes")
    parser.add_argument("--quiet", action="store_true", help="warnings and errors only")
    return parser


def write_study(output: Path, name: str, report: dict, table: str) -> None:
    """``report`` as NAME.json and its markdown ``table`` as NAME.md under ``output`` (created); the table printed."""
    from eval.bench_scale.report import write_report

    output.mkdir(parents=True, exist_ok=True)
    write_report(output, name, report, table)
    print(table)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = study_parser("search_steps", __doc__, "an index of several segments")
    parser.add_argument("--devices", nargs="+", required=True, help="one device a shard rank (the first: one device)")
    parser.add_argument("--batch", type=positive_int, default=300, help="queries searched in one batch")
    args = parser.parse_args(argv)
    if len(args.devices) < 2:
        parser.error("--devices: name at least two (one a shard rank)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.quiet)
    texts = batch_texts(args.beir_zip, args.size, args.batch)
    report = {"index": str(args.index), "size": args.size, "queries": len(texts), "passes": args.passes,
              **measure(args.index, texts, list(args.devices), args.passes)}
    write_study(args.output, "search_steps", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
