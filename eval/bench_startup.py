"""Start-up cost: of the ``pyserini_aligner.pth`` hook in every interpreter, and of the command lines.

``python -m eval.bench_startup [--repeats 30] [--cli-repeats 3] [--index DIR]``

- the hook: starts ``python -X importtime -c pass`` ``--repeats`` times and reads the cumulative import time of the
  hook (``pyserini_aligner._startup`` with its parent package) from Python's own import-time report, next to the
  whole start-up wall time measured in the same runs;
- the command lines, each run ``--cli-repeats`` times (wall time from start to exit): ``python -m
  pyserini_aligner.search --help``, ``python -m pyserini.search.faiss --index <AligneR index> --help``, and a
  5-query search of the quick-start index (``examples/quickstart``: its first five topics, 10 hits) through
  ``python -m pyserini_aligner.search`` and through ``python -m pyserini.search.faiss --encoder aligner``, and the
  same 5 queries through Pyserini's BM25 command line (``python -m pyserini.search.lucene --bm25``) over a Lucene
  index of the quick-start corpus (built in the temporary folder first).
  ``--index`` is the quick-start index (``python -m pyserini_aligner.index --corpus corpus --index idx`` in
  ``examples/quickstart``); without it one is built in a temporary folder first. Each command's CPU seconds (user
  and system, all threads) are reported beside its wall time.

Prints medians (and each run's seconds) as JSON, with the 1-minute load average before and after the command
lines (other processes on the machine slow them).
"""
import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HOOK_MODULES = ("pyserini_aligner", "pyserini_aligner._startup")
QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart"
QUERIES = 5


def hook_microseconds(importtime_report: str) -> int:
    """Cumulative µs of the outermost hook import in a ``-X importtime`` report (0 if it was not imported)."""
    total = 0
    for line in importtime_report.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cumulative, name = (part.strip() for part in line[len("import time:"):].split("|"))
        if name in HOOK_MODULES:  # the outermost entry holds the whole hook
            total = max(total, int(cumulative))
    return total


def timed(args: list[str], cwd: Path | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds: user + system) of ``python ARGS`` from start to exit; RuntimeError with its
    output when it fails."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"python {' '.join(args)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    return seconds, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def hook_costs(repeats: int) -> dict:
    hook_ms, wall_ms = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], capture_output=True, text=True,
                              check=True)
        wall_ms.append((time.perf_counter() - start) * 1000)
        hook_ms.append(hook_microseconds(done.stderr) / 1000)
    if not any(hook_ms):
        raise SystemExit("the start-up hook was not imported: is pyserini_aligner.pth in site-packages? (make install)")
    return {"hook_import_ms_median": round(statistics.median(hook_ms), 2),
            "interpreter_startup_ms_median": round(statistics.median(wall_ms), 2), "repeats": repeats}


def command_costs(index: Path, lucene: Path, work: Path, repeats: int) -> dict:
    """Median wall seconds (and every run's) of each command line measured, in ``work``; ``lucene``: a Lucene index
    of the same corpus."""
    topics = work / "topics5.tsv"
    lines = (QUICKSTART / "topics.tsv").read_text(encoding="utf-8").splitlines()
    topics.write_text("\n".join(lines[:QUERIES]) + "\n", encoding="utf-8")
    search = ["--index", str(index), "--topics", str(topics), "--hits", "10"]
    commands = {
        "pyserini_aligner.search --help": ["-m", "pyserini_aligner.search", "--help"],
        "pyserini.search.faiss --index <aligner index> --help": ["-m", "pyserini.search.faiss", "--index",
                                                                str(index), "--help"],
        f"pyserini_aligner.search, {QUERIES} queries": ["-m", "pyserini_aligner.search", *search, "--output",
                                                        str(work / "run.trec"), "--quiet"],
        f"pyserini.search.faiss --encoder aligner, {QUERIES} queries": [
            "-m", "pyserini.search.faiss", *search, "--encoder", "aligner", "--output", str(work / "faiss.trec")],
        f"pyserini.search.lucene --bm25, {QUERIES} queries": [
            "-m", "pyserini.search.lucene", "--index", str(lucene), "--topics", str(topics), "--hits", "10", "--bm25",
            "--output", str(work / "bm25.trec")],
    }
    results = {}
    for name, args in commands.items():
        runs = [timed(args, cwd=work) for _ in range(repeats)]
        results[name] = {"median_s": round(statistics.median(wall for wall, _ in runs), 2),
                         "runs_s": [round(wall, 2) for wall, _ in runs],
                         "median_cpu_s": round(statistics.median(cpu for _, cpu in runs), 2)}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30, help="runs of the hook measurement")
    parser.add_argument("--cli-repeats", type=int, default=3, help="runs of each command line (0: none)")
    parser.add_argument("--index", type=Path, default=None, help="the quick-start AligneR index (default: build "
                                                                 "one in a temporary folder)")
    args = parser.parse_args()
    report = hook_costs(args.repeats)
    if args.cli_repeats > 0:
        work = Path(tempfile.mkdtemp(prefix="bench-startup-"))
        try:
            index = args.index
            if index is None:
                index = work / "idx"
                timed(["-m", "pyserini_aligner.index", "--corpus", str(QUICKSTART / "corpus"), "--index",
                              str(index), "--quiet"])
            lucene = work / "lucene"
            timed(["-m", "pyserini.index.lucene", "--collection", "JsonCollection", "--input",
                   str(QUICKSTART / "corpus"), "--index", str(lucene), "--storeRaw"])
            load = os.getloadavg()[0]
            report["commands"] = command_costs(index.resolve(), lucene, work, args.cli_repeats)
            report["load_average_1min"] = [round(load, 2), round(os.getloadavg()[0], 2)]  # before, after
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
