"""Small measuring functions over plain data: latency percentiles, folder sizes, timed subprocesses."""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np


def percentiles_ms(seconds: Sequence[float]) -> dict[str, float]:
    """p50 and p95 of per-query times, in milliseconds."""
    values = np.asarray(seconds, dtype=np.float64) * 1000.0
    return {"p50_ms": round(float(np.percentile(values, 50)), 2), "p95_ms": round(float(np.percentile(values, 95)), 2)}


def per_query_latency(search: Callable[[str], object], queries: Sequence[str], warmup: int = 5) -> list[float]:
    """Wall seconds of ``search(q)`` for each query, after ``warmup`` untimed calls."""
    for query in queries[:warmup]:
        search(query)
    times = []
    for query in queries:
        start = time.perf_counter()
        search(query)
        times.append(time.perf_counter() - start)
    return times


def throughput_qps(batch_search: Callable[[list[str]], object], queries: Sequence[str], batch: int = 32) -> float:
    """Queries per second of ``batch_search`` over ``queries`` in batches of ``batch``."""
    start = time.perf_counter()
    for first in range(0, len(queries), batch):
        batch_search(list(queries[first:first + batch]))
    return len(queries) / (time.perf_counter() - start)


def file_bytes(folder: str | os.PathLike, names: Sequence[str] | None = None) -> int:
    """Total bytes of the files named ``names`` anywhere under ``folder`` (an index's segment and codec folders
    included; every file when ``names`` is None)."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*")
               if p.is_file() and (names is None or p.name in names))


def timed_module(module: str, args: Sequence[str], env: dict | None = None) -> dict[str, float]:
    """Run ``python -m module args`` in a fresh process; its wall seconds and peak RSS in MiB."""
    with tempfile.TemporaryDirectory() as tmp:
        rss_file = Path(tmp) / "rss"
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "eval.bench.child", str(rss_file), module, *args], check=True,
                       env=env)
        seconds = time.perf_counter() - start
        rss = int(rss_file.read_text())
    return {"seconds": round(seconds, 1), "peak_rss_mib": round(rss / 2**20, 1)}


def stream_seconds(path: str | os.PathLike, repeats: int = 3, chunk_bytes: int = 64 << 20) -> float:
    """Median seconds to pass a file's bytes through memory once (an XOR over 8-byte words): a full scan's floor."""
    size = Path(path).stat().st_size // 8 * 8
    times = []
    for _ in range(repeats):
        words = np.memmap(path, dtype=np.uint64, mode="r", shape=(size // 8,))
        start = time.perf_counter()
        for first in range(0, len(words), chunk_bytes // 8):
            np.bitwise_xor.reduce(words[first:first + chunk_bytes // 8])
        times.append(time.perf_counter() - start)
        del words
    return statistics.median(times)
