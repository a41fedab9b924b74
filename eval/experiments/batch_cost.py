"""What a batch costs beyond its queries: batches of several sizes searched on one device, and for each the wall time
of every search step (as search_steps) and, from one profiled pass, what the host did in the step: kernel launches,
waits for the device (stream and event synchronisations, which copies to the host cause) and copies, how long
the device was busy with kernels, and which torch operators the host called most. A step whose wall grows less than
its batch, with many waits and an idle device, has fixed costs that a bigger batch or fewer host round trips would
remove. The summary divides each batch's wall by the device's busy time over the whole search.

    python -m eval.experiments.batch_cost --index DIR --beir-zip scifact.zip --size 1m --device cuda
        --batches 75,150,300 --output DIR [--passes 3] [--fronts graphed,steps]

On a GPU the searcher's own front end (``graphed``: batches that one replay takes go through CUDA graphs of the
encoder and of a fixed-shape plan, one "search" step) and the step-by-step search behind it (``steps``) are both
measured, in the same run, on the same searcher.

The queries are those of ``eval.experiments.search_steps`` (the judged queries of the synthetic corpus of ``--size``
passages grown from ``--beir-zip``). Times are in ms a pass: the wall is the median of ``--passes`` timed passes after
two untimed ones, steps their mean; the profiled pass comes after them (the profiler slows the host a little).
Writes batch_cost.json and batch_cost.md under ``--output``.
"""
from __future__ import annotations

import argparse
import bisect
import sys
from collections import Counter
from pathlib import Path

from eval.cli import configure_logging, positive_ints, string_list
from eval.experiments.search_steps import (STEPS, batch_texts, study_parser, synchronizer, timed_passes,
                                           write_study)

LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize")  # the clock's own cudaDeviceSynchronize is not counted
COPIES = ("cudaMemcpyAsync", "cudaMemcpy")
ALL_STEPS = STEPS + ("search",)  # "search": encoding and search replayed from CUDA graphs, timed as one step
FRONTS = ("graphed", "steps")
TOP_OPS = 12  # most frequent host operators (and longest device kernels) listed per step
KERNEL_NAME = 90  # characters of a kernel's name kept
COUNTED = {**{name: "launches" for name in LAUNCHES}, **{name: "waits" for name in WAITS},
           **{name: "copies" for name in COPIES}}


def step_of(start_us: float, ends: list[tuple[float, str]]) -> str | None:
    """The step an event starting at ``start_us`` belongs to: the first whose end marker comes at or after it
    (``ends``: (marker start µs, step), sorted); None after the last."""
    position = bisect.bisect_left(ends, (start_us, ""))
    return ends[position][1] if position < len(ends) else None


def attribute(events: list[tuple[str, bool, float, float]], ends: list[tuple[float, str]],
              top: int = TOP_OPS) -> dict[str, dict]:
    """Per step: counts of launches, waits and copies, the device's busy ms, the ``top`` most frequent torch
    operators called on the host (``ops``: [name, calls], nested calls counted too) and the ``top`` device kernels
    by time (``kernels``: [name, ms]), from profiler ``events`` given as (name, on the device, start µs, duration
    µs), the step end markers ``ends`` as in :func:`step_of`."""
    steps = {step: {"launches": 0, "waits": 0, "copies": 0, "busy_ms": 0.0} for _, step in ends}
    calls: dict[str, Counter] = {step: Counter() for _, step in ends}
    kernels: dict[str, Counter] = {step: Counter() for _, step in ends}
    for name, on_device, start, duration in events:
        step = step_of(start, ends)
        if step is None:
            continue
        if on_device:
            steps[step]["busy_ms"] += duration / 1000.0
            kernels[step][name[:KERNEL_NAME]] += duration / 1000.0
        elif name in COUNTED:
            steps[step][COUNTED[name]] += 1
        elif name.startswith("aten::"):
            calls[step][name] += 1
    for step, row in steps.items():
        row["busy_ms"] = round(row["busy_ms"], 2)
        row["ops"] = [[name, count] for name, count in calls[step].most_common(top)]
        row["kernels"] = [[name, round(ms, 3)] for name, ms in kernels[step].most_common(top)]
    return steps


def profiled_pass(searcher, texts: list[str], device: str) -> dict[str, dict]:
    """One profiled search of ``texts`` as one batch: :func:`attribute` of its events."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from pyserini_aligner.search.backends.base import STEP_END

    cuda = device.startswith("cuda")
    synchronize = synchronizer(device)
    searcher.timings = {}
    synchronize()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as profiler:
        searcher.search_texts(texts, 10, None, False)
        synchronize()
    searcher.timings = None
    events, ends = [], []
    for event in profiler.events():
        start, duration = event.time_range.start, event.time_range.elapsed_us()
        if event.name.startswith(STEP_END):
            ends.append((start, event.name[len(STEP_END):]))
        else:
            events.append((event.name, event.device_type == DeviceType.CUDA, start, duration))
    return attribute(events, sorted(ends))


def measure(index: Path, texts: list[str], device: str, batches: list[int], passes: int,
            fronts: list[str]) -> list[dict]:
    """One row a batch size and front end: {"batch", "front", "wall_ms", step: ms, "profile": {step: counts and busy
    ms}, "busy_ms": the device's busy ms over every step, "wall_per_busy"}. A searcher without a CUDA-graph front
    end (a CPU), and a batch larger than its captured plans take, is measured once, as "steps"."""
    from pyserini_aligner.search import AlignerSearcher
    from pyserini_aligner.search.backends.fronts import Graphed

    searcher = AlignerSearcher(str(index), device=device, backend="torch", batch_size=max(batches))
    graphed = searcher.front if isinstance(searcher.front, Graphed) else None
    rows = []
    for batch in batches:
        part = texts[:batch]
        for front in fronts:
            if front == "graphed" and (graphed is None or batch > graphed.plan.largest_batch(searcher.depth(10, None),
                                                                                             10)):
                continue  # no captured plan takes this batch: the front end would search it step by step
            searcher.front = graphed if front == "graphed" else getattr(searcher.front, "rest", searcher.front)
            row = {"batch": batch, "front": front, **timed_passes(searcher, part, passes, synchronizer(device)),
                   "profile": profiled_pass(searcher, part, device)}
            row["busy_ms"] = round(sum(step["busy_ms"] for step in row["profile"].values()), 2)
            row["wall_per_busy"] = round(row["wall_ms"] / row["busy_ms"], 3) if row["busy_ms"] else None
            rows.append(row)
        if graphed is not None:
            searcher.front = graphed
    return rows


def markdown(report: dict) -> str:
    lines = [f"Batch cost on {report['device']}, k=10, {report['size']} passages; ms a pass (wall: median of "
             f"{report['passes']} passes, steps: mean), then one profiled pass: kernel launches, host waits for the "
             "device, copies, and the device's busy ms (kernels) in each step. Front ends: `graphed` (CUDA graphs "
             "of the encoder and of a fixed-shape plan, one step), `steps` (the step-by-step search).", "",
             "| batch | front | wall ms | device busy ms | wall ÷ busy |", "|---:|---|---:|---:|---:|"]
    for row in report["rows"]:
        lines.append(f"| {row['batch']} | {row['front']} | {row['wall_ms']} | {row['busy_ms']} | "
                     f"{row['wall_per_busy']} |")
    lines += ["", "| batch | front | step | ms | ms a query | launches | waits | copies | device busy ms |",
              "|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in report["rows"]:
        batch, front = row["batch"], row["front"]
        lines.append(f"| {batch} | {front} | wall | {row['wall_ms']} | {round(row['wall_ms'] / batch, 3)} | | | | |")
        for step in ALL_STEPS:
            if step in row:
                counts = row["profile"].get(step, {})
                lines.append(f"| {batch} | {front} | {step} | {row[step]} | {round(row[step] / batch, 3)} | "
                             f"{counts.get('launches', '')} | {counts.get('waits', '')} | {counts.get('copies', '')} | "
                             f"{counts.get('busy_ms', '')} |")
    last = report["rows"][-1] if report["rows"] else None
    if last is not None:
        lines += ["", f"Most frequent torch operators called on the host in each step (batch {last['batch']}, "
                      f"{last['front']}, the profiled pass; nested calls counted too):", ""]
        for step in ALL_STEPS:
            ops = last["profile"].get(step, {}).get("ops")
            if ops:
                lines.append(f"- {step}: " + ", ".join(f"{name[len('aten::'):]} {count}" for name, count in ops))
        for row in report["rows"]:
            if row["batch"] == last["batch"]:
                lines += ["", f"Device kernels by time, ms (batch {row['batch']}, {row['front']}):", ""]
                for step in ALL_STEPS:
                    found = row["profile"].get(step, {}).get("kernels")
                    if found:
                        lines.append(f"- {step}: " + "; ".join(f"`{name}` {ms}" for name, ms in found))
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = study_parser("batch_cost", __doc__, "the index to search")
    parser.add_argument("--device", default="cuda", help="the device searched (cpu or cuda[:N])")
    parser.add_argument("--batches", type=positive_ints, default=[75, 150, 300],
                        help="comma-separated batch sizes (default 75,150,300)")
    parser.add_argument("--fronts", type=string_list(FRONTS), default=list(FRONTS),
                        help="comma-separated front ends measured: graphed, steps (default both)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.quiet)
    texts = batch_texts(args.beir_zip, args.size, max(args.batches))
    report = {"index": str(args.index), "size": args.size, "device": args.device, "passes": args.passes,
              "rows": measure(args.index, texts, args.device, args.batches, args.passes, args.fronts)}
    write_study(args.output, "batch_cost", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
