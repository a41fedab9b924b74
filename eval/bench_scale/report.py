"""bench_scale.json (everything) and bench_scale.md (one table) of a scale benchmark report."""
from __future__ import annotations

import json
import time
from pathlib import Path

from eval.bench_scale.measure import human_bytes

COLUMNS = ("docs", "build s (encode/prune/codec/write)", "passages/s", "peak GPU GB (build/search)",
           "RSS GB (build/search)", "peak disk / final", "B/passage", "p50 ms", "p95 ms", "q/s b32", "q/s b300",
           "overlap@10 (codes / exact)", "nDCG@10 / exhaustive / exact")
DASH = "–"


def _value(value) -> str:
    return DASH if value is None else str(value)


def _build_cell(row: dict) -> str:
    if row["tiled"]:
        tiled = row["tiled"]
        return f"tiled ×{tiled['copies']} of {tiled['source']} ({tiled['tile_s']} s)"
    build = row["build"]
    parts = [build.get(f"{key}_s") for key in ("encode", "prune", "codec", "write")]
    split = "/".join(_value(p) for p in parts) if any(p is not None for p in parts) else None
    return f"{build['total_s']}" + (f" ({split})" if split else "")


def _pair(row: dict, build_key: str, search_key: str) -> str:
    return f"{_value(row.get(build_key))} / {_value(row.get(search_key))}"


def table_row(row: dict) -> list[str]:
    """The cells of one size's row, in COLUMNS order."""
    tiled = bool(row["tiled"])
    disk = DASH if tiled else f"{human_bytes(row['peak_disk_bytes'])} / {human_bytes(row['index_bytes'])}"
    return [f"{row['label']}" + (" tiled" if tiled else ""), _build_cell(row),
            DASH if tiled else str(row["passages_per_s"]), _pair(row, "peak_gpu_build_gib", "peak_gpu_search_gib"),
            _pair(row, "peak_rss_build_gib", "peak_rss_search_gib"), disk, str(row["bytes_per_passage"]),
            str(row["p50_ms"]), str(row["p95_ms"]), str(row["qps_b32"]), str(row["qps_b300"]),
            f"{_value(row.get('overlap@10'))} / {_value(row.get('overlap@10_exact'))}",
            f"{row['ndcg@10']} / {_value(row.get('ndcg@10_exhaustive'))} / {_value(row.get('ndcg@10_exact'))}"]


def cpu_table_row(cpu: dict) -> list[str]:
    """The CPU row: latency columns only."""
    cells = [DASH] * len(COLUMNS)
    threads = f"{cpu['threads']} thread" + ("s" if cpu["threads"] != 1 else "")
    cells[0] = f"{cpu['label']} on CPU, {threads} ({cpu['backend']}, {cpu['queries']} queries)"
    cells[7], cells[8] = str(cpu["p50_ms"]), str(cpu["p95_ms"])
    return cells


def markdown(report: dict) -> str:
    machine, settings = report["machine"], report["settings"]
    where = machine["gpu"] or f"CPU ({machine['device']})"
    rows = report["rows"]
    queries = sorted({row["queries"] for row in rows})
    lines = [f"### Scale: synthetic passages grown from {settings['beir_zip']}, β^d={settings['doc_prune']}, codec "
             f"{', '.join(sorted({row['codec'] for row in rows})) or settings['codec']}; {where}, torch "
             f"{machine['torch']}, {machine['cpu_count']} CPUs", "",
             f"Latency at k=10, one query at a time, query encoding included, over {'/'.join(map(str, queries))} "
             f"judged queries after {settings['warmup']} warm-up; q/s: median of {settings['qps_repeats']} passes"
             f"{' after %d untimed' % settings['qps_warmup'] if settings.get('qps_warmup') else ''}; "
             "overlap@10 (codes) and the second nDCG@10: exhaustive scoring of the same index's codes; overlap@10 "
             "(exact) and the third nDCG@10: exhaustive scoring of every passage's exact float16 tokens (the same "
             "model, unpruned); GB = GiB."
             + (" Tiled rows repeat one built index's segments, so every passage has exact duplicates: their "
                "search cost is that of the tiled size, their overlap and nDCG depend on how ties between "
                "duplicates are broken." if any(row["tiled"] for row in rows) else ""), "",
             "| " + " | ".join(COLUMNS) + " |", "|---|" + "---:|" * (len(COLUMNS) - 1)]
    lines += ["| " + " | ".join(table_row(row)) + " |" for row in rows]
    if report.get("cpu"):
        lines.append("| " + " | ".join(cpu_table_row(report["cpu"])) + " |")
    for row in rows:
        if row.get("add_s") is not None:
            lines += ["", f"Live update: adding {row['added']} new passages ({row['added'] / row['docs']:.0%}) to the "
                      f"{row['label']} index as a new segment took {row['add_s']} s, against {row['build']['total_s']} s "
                      "for its build."]
    return "\n".join(lines) + "\n"


def write(report: dict, output: Path) -> None:
    """Write ``output/bench_scale.json`` and ``output/bench_scale.md`` (:func:`write_report`)."""
    write_report(output, "bench_scale", report, markdown(report))


def write_report(output: Path, name: str, report: dict, table: str) -> None:
    """Write ``report`` (stamped with its time) as ``output/<name>.json`` and ``table`` as ``output/<name>.md``,
    each through a temporary file then renamed, so neither is ever half-written."""
    report["created"] = time.strftime("%Y-%m-%d %H:%M:%S")
    for path, text in ((output / f"{name}.json", json.dumps(report, indent=2) + "\n"), (output / f"{name}.md", table)):
        partial = output / f".{path.name}.partial"
        partial.write_text(text, encoding="utf-8")
        partial.replace(path)
