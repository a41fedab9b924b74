"""What a batch costs beyond its queries: batches of several sizes searched on one device, and for each the wall time
of every search step (as search_steps) and, from one profiled pass, what the host did in the step: kernel launches,
waits for the device (stream and event synchronisations, which copies to the host cause) and copies, how long
the device was busy with kernels, and which torch operators the host called most. A step whose wall grows less than its batch, with many waits and an idle device,
has fixed costs that a bigger batch or fewer host round trips would remove.

    python -m eval.experiments.batch_cost --index DIR --beir-zip scifact.zip --size 1m --device cuda
        --batches 75,150,300 --output DIR [--passes 3]

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

from eval.cli import configure_logging, positive_ints
from eval.experiments.search_steps import (STEPS, batch_texts, study_parser, synchronizer, timed_passes,
                                           write_study)

LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize")  # the clock's own cudaDeviceSynchronize is not counted
COPIES = ("cudaMemcpyAsync", "cudaMemcpy")
TOP_OPS = 12  # most frequent host operators listed per step
COUNTED = {**{name: "launches" for name in LAUNCHES}, **{name: "waits" for name in WAITS},
           **{name: "copies" for name in COPIES}}


def step_of(start_us: float, ends: list[tuple[float, str]]) -> str | None:
    """The step an event starting at ``start_us`` belongs to: the first whose end marker comes at or after it
    (``ends``: (marker start µs, step), sorted); None after the last."""
    position = bisect.bisect_left(ends, (start_us, ""))
    return ends[position][1] if position < len(ends) else None


def attribute(events: list[tuple[str, bool, float, float]], ends: list[tuple[float, str]],
              top: int = TOP_OPS) -> dict[str, dict]:
    """Per step: counts of launches, waits and copies, the device's busy ms, and the ``top`` most frequent torch
    operators called on the host (``ops``: [name, calls], nested calls counted too), from profiler ``events`` given
    as (name, on the device, start µs, duration µs), the step end markers ``ends`` as in :func:`step_of`."""
    steps = {step: {"launches": 0, "waits": 0, "copies": 0, "busy_ms": 0.0} for _, step in ends}
    calls: dict[str, Counter] = {step: Counter() for _, step in ends}
    for name, on_device, start, duration in events:
        step = step_of(start, ends)
        if step is None:
            continue
        if on_device:
            steps[step]["busy_ms"] += duration / 1000.0
        elif name in COUNTED:
            steps[step][COUNTED[name]] += 1
        elif name.startswith("aten::"):
            calls[step][name] += 1
    for step, row in steps.items():
        row["busy_ms"] = round(row["busy_ms"], 2)
        row["ops"] = [[name, count] for name, count in calls[step].most_common(top)]
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


def measure(index: Path, texts: list[str], device: str, batches: list[int], passes: int) -> list[dict]:
    """One row a batch size: {"batch", "wall_ms", step: ms, "profile": {step: counts and busy ms}}."""
    from pyserini_aligner.search import AlignerSearcher

    searcher = AlignerSearcher(str(index), device=device, backend="torch", batch_size=max(batches))
    rows = []
    for batch in batches:
        part = texts[:batch]
        rows.append({"batch": batch, **timed_passes(searcher, part, passes, synchronizer(device)),
                     "profile": profiled_pass(searcher, part, device)})
    return rows


def markdown(report: dict) -> str:
    lines = [f"Batch cost on {report['device']}, k=10, {report['size']} passages; ms a pass (wall: median of "
             f"{report['passes']} passes, steps: mean), then one profiled pass: kernel launches, host waits for the "
             "device, copies, and the device's busy ms (kernels) in each step.", "",
             "| batch | step | ms | ms a query | launches | waits | copies | device busy ms |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for row in report["rows"]:
        batch = row["batch"]
        lines.append(f"| {batch} | wall | {row['wall_ms']} | {round(row['wall_ms'] / batch, 3)} | | | | |")
        for step in STEPS:
            if step in row:
                counts = row["profile"].get(step, {})
                lines.append(f"| {batch} | {step} | {row[step]} | {round(row[step] / batch, 3)} | "
                             f"{counts.get('launches', '')} | {counts.get('waits', '')} | {counts.get('copies', '')} | "
                             f"{counts.get('busy_ms', '')} |")
    last = report["rows"][-1] if report["rows"] else None
    if last is not None:
        lines += ["", f"Most frequent torch operators called on the host in each step (batch {last['batch']}, the "
                      "profiled pass; nested calls counted too):", ""]
        for step in STEPS:
            ops = last["profile"].get(step, {}).get("ops")
            if ops:
                lines.append(f"- {step}: " + ", ".join(f"{name[len('aten::'):]} {count}" for name, count in ops))
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = study_parser("batch_cost", __doc__, "the index to search")
    parser.add_argument("--device", default="cuda", help="the device searched (cpu or cuda[:N])")
    parser.add_argument("--batches", type=positive_ints, default=[75, 150, 300],
                        help="comma-separated batch sizes (default 75,150,300)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.quiet)
    texts = batch_texts(args.beir_zip, args.size, max(args.batches))
    report = {"index": str(args.index), "size": args.size, "device": args.device, "passes": args.passes,
              "rows": measure(args.index, texts, args.device, args.batches, args.passes)}
    write_study(args.output, "batch_cost", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
