"""Interpreter start-up cost of the ``pyserini_aligner.pth`` hook.

``python -m eval.bench_startup [--repeats 30]`` starts ``python -X importtime -c pass`` repeatedly and reads the
cumulative import time of the hook (``pyserini_aligner._startup`` with its parent package) from Python's own
import-time report, next to the whole start-up wall time measured in the same runs. Prints medians as JSON.
"""
import argparse
import json
import statistics
import subprocess
import sys
import time

HOOK_MODULES = ("pyserini_aligner", "pyserini_aligner._startup")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    hook_ms, wall_ms = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], capture_output=True, text=True,
                              check=True)
        wall_ms.append((time.perf_counter() - start) * 1000)
        hook_ms.append(hook_microseconds(done.stderr) / 1000)
    if not any(hook_ms):
        raise SystemExit("the start-up hook was not imported: is pyserini_aligner.pth in site-packages? (make install)")
    print(json.dumps({"hook_import_ms_median": round(statistics.median(hook_ms), 2),
                      "interpreter_startup_ms_median": round(statistics.median(wall_ms), 2),
                      "repeats": args.repeats}, indent=2))


if __name__ == "__main__":
    main()
