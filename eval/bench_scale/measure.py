"""Measuring functions of the scale benchmark over plain data: peaks of disk and memory, GPU memory, rankings,
nDCG@10 without ranx, top-10 overlap. torch is imported by the functions that need it, so that a process can read its
memory before importing it."""
from __future__ import annotations

import math
import os
import stat
import threading
from typing import Sequence

import numpy as np

Ranking = list[list[tuple[str, float]]]  # per query: (docid, score), best first


def folder_bytes(folder: str | os.PathLike) -> int:
    """Bytes of every regular file under ``folder`` (recursively; links not followed; 0 when it does not exist).
    Files that vanish while walking (a build renaming its work folder) are skipped."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                info = os.lstat(os.path.join(root, name))
            except FileNotFoundError:
                continue
            total += info.st_size if stat.S_ISREG(info.st_mode) else 0
    return total


def status_fields(*fields: str) -> dict[str, int | None]:
    """``VmRSS``/``VmHWM``/``RssAnon``/``RssFile`` lines of /proc/self/status in bytes, read at one instant (one read
    of the file: VmHWM then holds at least VmRSS); None for each where there is no /proc or no such line."""
    out: dict[str, int | None] = dict.fromkeys(fields)
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            text = status.read()
    except OSError:
        return out
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name in out:
            out[name] = int(value.split()[0]) * 1024
    return out


def status_bytes(field: str) -> int | None:
    """One line of /proc/self/status in bytes (:func:`status_fields`)."""
    return status_fields(field)[field]


def _reset_rss_peak() -> bool:
    """Reset this process's VmHWM (Linux: ``5`` into /proc/self/clear_refs); whether it worked."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as out:
            out.write("5")
        return True
    except OSError:
        return False


class Peaks:
    """Context manager: peak host RSS of this process and peak bytes under ``folder`` while the block runs.

    RSS: the kernel's high-water mark (VmHWM) reset on entry, or where it cannot be reset the largest VmRSS
    sampled every ``interval`` seconds. Disk: the largest size of ``folder`` sampled every ``interval`` seconds and
    at the end (None when no folder is given).
    """

    def __init__(self, folder: str | os.PathLike | None = None, interval: float = 0.2):
        self.folder, self.interval = folder, interval
        self.peak_rss = self.peak_disk = 0
        self._stop = threading.Event()
        self._reset = False

    def _sample(self) -> None:
        self.peak_rss = max(self.peak_rss, status_bytes("VmRSS") or 0)
        if self.folder is not None:
            self.peak_disk = max(self.peak_disk, folder_bytes(self.folder))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> "Peaks":
        self._reset = _reset_rss_peak()
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="peaks", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        if self._reset:
            self.peak_rss = max(self.peak_rss, status_bytes("VmHWM") or 0)
        elif not self.peak_rss:  # no /proc: the process's lifetime peak (Linux reports KiB, macOS bytes)
            import resource
            import sys

            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            self.peak_rss = peak if sys.platform == "darwin" else peak * 1024


def sync(device: str) -> None:
    """Wait for queued GPU work (no-op on CPU)."""
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def reset_gpu_peak(device: str) -> None:
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def gpu_peak_bytes(device: str) -> int | None:
    """torch's peak allocated GPU memory since the last :func:`reset_gpu_peak` (None on CPU)."""
    if not str(device).startswith("cuda"):
        return None
    import torch

    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated())


def run_dict(qids: Sequence[str], ranked: Ranking) -> dict[str, dict[str, float]]:
    """{qid: {docid: score}} of rankings (a docid ranked twice keeps its first, best score)."""
    out = {}
    for qid, hits in zip(qids, ranked):
        docs: dict[str, float] = {}
        for docid, score in hits:
            docs.setdefault(docid, float(score))
        out[qid] = docs
    return out


def overlap_at_k(a: Ranking, b: Ranking, k: int = 10) -> float:
    """Mean over queries of |top-k of a ∩ top-k of b| / k."""
    if len(a) != len(b) or not a:
        raise ValueError(f"overlap_at_k needs two rankings of the same queries, got {len(a)} and {len(b)}")
    return float(np.mean([len({d for d, _ in x[:k]} & {d for d, _ in y[:k]}) / k for x, y in zip(a, b)]))


def gib(n: int | None) -> float | None:
    """Bytes as GiB with 2 decimals (None stays None)."""
    return None if n is None else round(n / 2**30, 2)


def human_bytes(n: int) -> str:
    """1536 -> "1.5 KB", 3.2e9 -> "3.2 GB" (powers of 1000, 3 significant digits)."""
    if n < 1000:
        return f"{n} B"
    power = min(int(math.log10(n) // 3), 3)
    return f"{n / 1000 ** power:.3g} {('KB', 'MB', 'GB')[power - 1]}"


def machine_info(device: str) -> dict:
    """GPU name (None on CPU), torch version, CPU count, platform."""
    import platform

    import torch

    gpu = torch.cuda.get_device_name(torch.device(device)) if str(device).startswith("cuda") else None
    return {"gpu": gpu, "device": str(device), "torch": torch.__version__, "cpu_count": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version()}

