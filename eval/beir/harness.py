"""Run systems on one dataset, write their TREC runs, ``results.json`` and ``results.md``."""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Sequence

from eval.beir.systems import SYSTEMS, Context, work_dir
from eval.metrics import METRICS, evaluate
from pyserini_aligner.data import Dataset
from pyserini_aligner.trec import write_run

log = logging.getLogger(__name__)


def run_harness(dataset_spec: str, systems: Sequence[str], output: str | os.PathLike, cache: str | os.PathLike,
                hits: int = 1000, threads: int = 2, progress: bool = True) -> dict:
    """Run ``systems`` on the dataset; returns the results dict also written to ``<output>/results.json``."""
    unknown = [name for name in systems if name not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {unknown}; choose from {sorted(SYSTEMS)}")
    dataset = Dataset(dataset_spec)
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    ctx = Context(dataset=dataset, work=work_dir(dataset, cache), hits=hits, threads=threads, progress=progress)
    qrels = dataset.qrels()
    results = {"dataset": dataset.name, "systems": {}}
    for name in systems:
        log.info("running %s on %s", name, dataset.name)
        start = time.perf_counter()
        ctx.runs[name] = SYSTEMS[name](ctx)
        seconds = time.perf_counter() - start
        run_path = write_run(ctx.runs[name], output / f"run.{name}.trec", tag=name)
        scores = evaluate(qrels, {q: dict(h) for q, h in ctx.runs[name].items()})
        results["systems"][name] = {**{m: round(scores[m], 4) for m in METRICS}, "run": str(run_path),
                                    "seconds": round(seconds, 1)}
    (output / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    (output / "results.md").write_text(results_markdown(results), encoding="utf-8")
    return results


def results_markdown(results: dict) -> str:
    """The results as a Markdown table, one row per system."""
    lines = [f"### {results['dataset']}", "", "| system | " + " | ".join(METRICS) + " |",
             "|---|" + "---:|" * len(METRICS)]
    for name, row in results["systems"].items():
        lines.append(f"| {name} | " + " | ".join(f"{row[m]:.4f}" for m in METRICS) + " |")
    return "\n".join(lines) + "\n"
