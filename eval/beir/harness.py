"""Run systems on one dataset, write their TREC runs, ``results.json`` and ``results.md``.

results.json: {"dataset", "systems": {name: {"ndcg@10", "recall@100", "recall@1000", "run", "seconds", ...extras}},
"significance": see ``pyserini_aligner.metrics.significance``}. A system that reports its own value of a metric
(aligner-adapted: nDCG@10 as the mean over folds) keeps its run's value under "<metric>_run". aligner-adapted also
reports each fold's choice of checkpoint and strategy ("fold_choices"), how many folds changed either
("changed_folds") and the mean held-out gain over the default on those folds ("changed_delta"), the same split by
what changed ("switched": {"checkpoint": {"folds", "delta"}, "strategy": {...}}), and each checkpoint's mean
nDCG@10 under each strategy on the rescored candidates ("scores").
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Sequence

from eval.beir.context import Context, harness_dtype, work_dir
from eval.beir.systems import SYSTEMS, require
from pyserini_aligner.adapt.select import ALPHA, MIN_GAIN
from pyserini_aligner.metrics import METRICS, evaluate, significance
from pyserini_aligner.data import Dataset
from pyserini_aligner.trec import write_run

log = logging.getLogger(__name__)

BASELINES = ("bm25", "dense")


def run_harness(dataset_spec: str, systems: Sequence[str], output: str | os.PathLike, cache: str | os.PathLike,
                hits: int = 1000, threads: int = 2, progress: bool = True, encoder: str = "aligner",
                candidates: int = 100, fold_size: int = 8, seed: int = 0, alpha: float = ALPHA,
                min_gain: float = MIN_GAIN, adapt_checkpoints: Sequence[str] | None = None,
                dtype: str = "auto") -> dict:
    """Run ``systems`` on the dataset; returns the results dict also written to ``<output>/results.json``.
    ``adapt_checkpoints``: the checkpoints aligner-adapted tries besides ``encoder`` (None: every shipped one).
    ``dtype``: the precision corpora are encoded in (:func:`~eval.beir.context.harness_dtype`)."""
    unknown = [name for name in systems if name not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {unknown}; choose from {sorted(SYSTEMS)}")
    dataset = Dataset(dataset_spec)
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    ctx = Context(dataset=dataset, work=work_dir(dataset, cache), hits=hits, threads=threads, progress=progress,
                  encoder=encoder, candidates=candidates, fold_size=fold_size, seed=seed,
                  alpha=alpha, min_gain=min_gain, dtype=harness_dtype(dtype),
                  adapt_checkpoints=None if adapt_checkpoints is None else tuple(adapt_checkpoints))
    results = {"dataset": dataset.name, "dtype": ctx.dtype, "systems": {}}
    for name in systems:
        start = time.perf_counter()
        require(ctx, name)
        seconds = time.perf_counter() - start
        run_path = write_run(ctx.runs[name], output / f"run.{name}.trec", tag=name)
        scores = evaluate(ctx.qrels, ctx.runs[name])
        row = {m: round(scores[m], 4) for m in METRICS}
        extras = ctx.extras.get(name, {})
        row.update({f"{m}_run": row[m] for m in METRICS if m in extras})
        row.update({"run": str(run_path), "seconds": round(seconds, 1), **extras})
        results["systems"][name] = row
    results["significance"] = significance(ctx.qrels, {n: ctx.runs[n] for n in systems}, BASELINES)
    (output / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    (output / "results.md").write_text(results_markdown(results), encoding="utf-8")
    return results


def _cell(row: dict, metric: str) -> str:
    std = row.get(f"{metric}_std")
    return f"{row[metric]:.4f}" + (f" ± {std:.4f}" if std is not None else "")


def _note(name: str, row: dict) -> str:
    if name == "hybrid":
        return f"alpha={row['alpha']:g} ({row['alpha_source']})"
    if name == "aligner":
        return f"strategy {row['strategy']}, the default index: codec {row['codec']}, β^d={row['doc_prune']:g}"
    if name == "aligner-pruned":
        return f"β^d={row['doc_prune']:g}, β^q={row['query_prune']:g}"
    if name == "aligner-adapted":
        chosen = ", ".join(f"{s}×{n}" for s, n in sorted(row["chosen"].items(), key=lambda x: -x[1]))
        return (f"{row['folds']} folds of {row['fold_size']}; switched {_changed(row)}; "
                f"run nDCG@10 {row['ndcg@10_run']:.4f}; chosen {chosen}")
    if "strategy" in row:
        return f"strategy {row['strategy']}"
    return ""


def _changed(row: dict) -> str:
    """"k/n folds: checkpoint a, strategy b (held-out Δ ±x)" for aligner-adapted."""
    delta, switched = row["changed_delta"], row["switched"]
    return (f"{row['changed_folds']}/{row['folds']} folds: checkpoint {switched['checkpoint']['folds']}, strategy "
            f"{switched['strategy']['folds']}" + ("" if delta is None else f" (held-out Δ {delta:+.4f})"))


def _share(folds: int, total: int) -> str:
    return f"{folds}/{total} ({100 * folds / total:.0f}%)"


def adaptation_markdown(row: dict) -> list[str]:
    """aligner-adapted's choices: the rule, how often a fold switched checkpoint or strategy and what that did."""
    others = row["checkpoints"][1:]  # the first is the default's
    lines = ["", f"Few-shot adaptation (aligner-adapted): each fold of {row['fold_size']} queries keeps "
                 f"{row['baseline']} unless a (checkpoint, strategy) pair (nDCG@10 of the aligner's top "
                 f"{row['candidates']} rescored; checkpoints tried besides the default: "
                 f"{', '.join(others) or 'none'}) gains ≥ {row['min_gain']:g} with p ≤ {row['alpha']:g} (one-sided "
                 "paired randomisation test, max-T over the pairs; the best such pair by mean); a chosen pair then "
                 f"searches its checkpoint's exact index with its strategy (top {row['search_hits']}). The table of "
                 "switched folds gives the chosen pair's gain and p. The run ranks "
                 f"{row['changed_queries']} queries with a changed choice" +
                 ("" if row["changed_queries_delta"] is None else
                  f" (Δ nDCG@10 on them {row['changed_queries_delta']:+.4f})") + ".",
             "", f"| switched | folds | held-out Δ nDCG@10 vs {row['baseline']} |", "|---|---:|---:|"]
    kinds = (("checkpoint", row["switched"]["checkpoint"]), ("strategy only", row["switched"]["strategy"]),
             ("either", {"folds": row["changed_folds"], "delta": row["changed_delta"]}))
    lines += [f"| {kind} | {_share(cell['folds'], row['folds'])} | "
              f"{'' if cell['delta'] is None else format(cell['delta'], '+.4f')} |" for kind, cell in kinds]
    changed = [(i, f) for i, f in enumerate(row["fold_choices"], 1) if f["changed"]]
    if changed:
        lines += ["", "| fold | checkpoint | strategy | gain on fold | p | held-out nDCG@10 | "
                      f"{row['baseline']} | Δ |", "|---:|---|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {i} | {f['checkpoint']} | {f['strategy']} | {f['gain']:+.4f} | {f['p']:.4f} | "
                  f"{f['held_out']:.4f} | {f['held_out_baseline']:.4f} | {f['delta']:+.4f} |" for i, f in changed]
    return lines


def _p_cell(p: float | None, max_p: float) -> str:
    return "n/a" if p is None else f"{p:.4f}" + ("*" if p <= max_p else "")


def results_markdown(results: dict) -> str:
    """The results as Markdown: one row per system, then the significance tests against each baseline."""
    lines = [f"### {results['dataset']}", ""]
    if results.get("dtype"):
        lines += [f"Corpora encoded in {results['dtype']}.", ""]
    lines += ["| system | " + " | ".join(METRICS) + " | notes |", "|---|" + "---:|" * len(METRICS) + "---|"]
    for name, row in results["systems"].items():
        lines.append(f"| {name} | " + " | ".join(_cell(row, m) for m in METRICS) + f" | {_note(name, row)} |")
    if "aligner-adapted" in results["systems"]:
        lines += adaptation_markdown(results["systems"]["aligner-adapted"])
    sig = results.get("significance", {})
    if sig.get("pairs"):
        tests = list(sig["tests"])
        lines += ["", f"Significance ({'; '.join(sig['tests'].values())}; p-values, "
                      f"{sig['n_permutations']} permutations; W/T/L = queries won/tied/lost):", "",
                  "| system | baseline | metric | Δ | " + " | ".join(f"p ({t})" for t in tests) + " | W/T/L |",
                  "|---|---|---|---:|" + "---:|" * len(tests) + "---|"]
        for name, bases in sig["pairs"].items():
            for base, per_metric in bases.items():
                for metric, cell in per_metric.items():
                    ps = " | ".join(_p_cell(cell[f"p_{t}"], sig["max_p"]) for t in tests)
                    lines.append(f"| {name} | {base} | {metric} | {cell['delta']:+.4f} | {ps} | "
                                 f"{cell['win']}/{cell['tie']}/{cell['loss']} |")
        lines.append(f"\n\\* p ≤ {sig['max_p']}; n/a: the t-test is undefined (identical per-query scores)")
    return "\n".join(lines) + "\n"
