"""bench_peers.json (everything) and bench_peers.md (one table with the ratios) of a side-by-side run."""
from __future__ import annotations

from pathlib import Path

from eval.bench_scale.measure import human_bytes
from eval.bench_scale.report import DASH, write_report

ENGINES = {"aligner": "pyserini-aligner", "fastplaid": "FastPlaid"}
# (figure, column): the ratios pyserini-aligner / FastPlaid, and the table column each is shown in
RATIOS = (("build_s", "build s"), ("index_bytes", "index bytes"), ("p50_ms", "p50 ms"), ("qps_b300", "q/s b300"),
          ("peak_gpu_one_query_gib", "peak GPU GB search (one query / all)"),
          ("peak_gpu_search_gib", "peak GPU GB search (one query / all)"), ("overlap@10_exact", "overlap@10"))
COLUMNS = ("engine", "build s", "index bytes", "B/passage", "peak GPU GB build", "p50 ms", "p95 ms", "q/s b32",
           "q/s b300", "peak GPU GB search (one query / all)", "overlap@10", "nDCG@10")


def figure(row: dict, name: str) -> float | None:
    """One figure of an engine's row (``build_s``: its build's total seconds); None where it was not measured."""
    value = row.get("build", {}).get("total_s") if name == "build_s" else row.get(name)
    return None if value is None else float(value)


def ratios(ours: dict | None, peer: dict | None) -> dict[str, float | None]:
    """pyserini-aligner's figure / FastPlaid's for each figure of RATIOS, to 3 significant digits (None where
    either engine lacks it or FastPlaid's is 0)."""
    out = {}
    for name, _ in RATIOS:
        a, b = (figure(row, name) if row else None for row in (ours, peer))
        out[name] = float(f"{a / b:.3g}") if a is not None and b else None
    return out


def _value(value) -> str:
    return DASH if value is None else str(value)


def engine_cells(name: str, row: dict, settings: dict) -> list[str]:
    """The cells of one engine's row, in COLUMNS order."""
    if name == "aligner":
        label = f"{ENGINES[name]} ({row['codec']}, β^d={settings['doc_prune']})"
    else:
        peer = settings["fastplaid"]
        label = (f"{ENGINES[name]} {peer['version']} (nbits={peer['nbits']}, n_ivf_probe={peer['n_ivf_probe']}, "
                 f"n_full_scores={peer['n_full_scores']})")
    return [label, str(row["build"]["total_s"]), human_bytes(row["index_bytes"]), str(row["bytes_per_passage"]),
            _value(row["peak_gpu_build_gib"]), str(row["p50_ms"]), str(row["p95_ms"]), str(row["qps_b32"]),
            str(row["qps_b300"]), f"{_value(row['peak_gpu_one_query_gib'])} / {_value(row['peak_gpu_search_gib'])}",
            _value(row.get("overlap@10_exact")), str(row["ndcg@10"])]


def ratio_cells(values: dict[str, float | None]) -> list[str]:
    """The ratio row, in COLUMNS order (a dash where no ratio is shown)."""
    cells = [DASH] * len(COLUMNS)
    cells[0] = "ratio pyserini-aligner / FastPlaid"
    shown: dict[str, list[str]] = {}
    for name, column in RATIOS:
        shown.setdefault(column, []).append(f"{_value(values[name])}×" if values[name] is not None else DASH)
    for column, parts in shown.items():
        cells[COLUMNS.index(column)] = " / ".join(parts)
    return cells


def markdown(report: dict) -> str:
    machine, settings, exact = report["machine"], report["settings"], report.get("exact") or {}
    engines = report["engines"]
    tokens = f", {exact['tokens']:,} tokens" if exact.get("tokens") else ""
    lines = [f"### Against FastPlaid: {settings['label']} synthetic passages grown from {settings['beir_zip']}"
             f"{tokens}; {machine['gpu'] or machine['device']}, torch {machine['torch']}", "",
             "Both engines index the same token vectors: every passage's tokens, encoded once in float16 by "
             f"{settings['encoder']} (FastPlaid takes them all; pyserini-aligner prunes to β^d for its candidate "
             "lists and compresses them). Both search on the same GPU with queries encoded by the same model "
             "(included in the times). Latency at k=10 one query at a time over "
             f"{settings['queries']} judged queries after {settings['warmup']} warm-up; q/s: median of "
             f"{settings['qps_repeats']} passes; peak GPU: torch's allocator from loading the index on, after the "
             "one-query pass / after the batches; overlap@10: with exhaustive top-k:1 scoring of the exact float16 "
             f"tokens (its nDCG@10: {_value(exact.get('ndcg@10'))}); GB = GiB.", "",
             "| " + " | ".join(COLUMNS) + " |", "|---|" + "---:|" * (len(COLUMNS) - 1)]
    lines += ["| " + " | ".join(engine_cells(name, engines[name], settings)) + " |"
              for name in ENGINES if name in engines]
    if all(name in engines for name in ENGINES):
        lines.append("| " + " | ".join(ratio_cells(report["ratios"])) + " |")
        lines += ["", "Ratios below 1 favour pyserini-aligner for build s, bytes, p50 and GPU memory; above 1 for "
                      "q/s and overlap@10."]
    return "\n".join(lines) + "\n"


def write(report: dict, output: Path) -> None:
    """Add the ratios (once both engines are measured) and write ``output/bench_peers.json`` and ``.md``."""
    engines = report["engines"]
    report["ratios"] = ratios(engines.get("aligner"), engines.get("fastplaid"))
    write_report(output, "bench_peers", report, markdown(report))
