"""Cost of the block checksums that a reader checks when it opens an index's large files.

``python -m eval.bench_checksums --corpus beir/scifact --index DIR [--max-docs N] [--repeats 5]``

Builds the default index of ``--corpus`` at ``--index`` unless one is there (``python -m pyserini_aligner.index
--corpus CORPUS --index DIR [--max-docs N]``), and beside it a copy whose manifest
records no block checksums (an index written before them, whose large files open unchecked). Then, ``--repeats``
times and alternating the two, a fresh process loads the model and times opening the index with
``AlignerSearcher`` plus its first search (one query, 10 hits); the model's loading is not counted. Both folders are
read once first, so both runs find the files in the page cache. Also times the check alone
(:func:`pyserini_aligner.index.checksums.bad_block` over every file with block checksums) in this process.

Prints medians (and each run's seconds) as JSON, with the bytes checked and the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from pyserini_aligner.index import checksums, read_manifest
from pyserini_aligner.index.commit import write_manifest
from pyserini_aligner.index.format import is_index

QUERY = "Cold exposure increases brown adipose tissue recruitment."
_CHILD = """
import sys, time
from pyserini_aligner.resolve import load_model
from pyserini_aligner.search import AlignerSearcher
model = load_model(sys.argv[2])
start = time.perf_counter()
AlignerSearcher(sys.argv[1], encoder=model).search(sys.argv[3], k=10)
print(time.perf_counter() - start)
"""


def checked_files(index: Path) -> list[tuple[Path, dict]]:
    """(path, manifest record) of every file of ``index`` that has block checksums."""
    manifest = read_manifest(index)
    folders = [(index / manifest.codec_dir, manifest.codec_files)] if manifest.codec_dir else []
    folders += [(index / seg.name, seg.files) for seg in manifest.segments]
    return [(folder / name, record) for folder, records in folders for name, record in records.items()
            if "blocks" in record]


def without_block_checksums(index: Path, target: Path) -> None:
    """Copy ``index`` to ``target`` with the block checksums left out of its manifest."""
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(index, target)
    manifest = read_manifest(target)
    for records in [manifest.codec_files] + [seg.files for seg in manifest.segments]:
        for record in records.values():
            record.pop("blocks", None)
    write_manifest(target, manifest)


def open_and_search_seconds(index: Path, model: str) -> float:
    done = subprocess.run([sys.executable, "-c", _CHILD, str(index), model, QUERY], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"timing {index} failed:\n{done.stderr[-2000:]}")
    return float(done.stdout.split()[-1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", default="beir/scifact", help="corpus to index when --index holds none")
    parser.add_argument("--index", type=Path, required=True, help="index folder (built here if absent)")
    parser.add_argument("--max-docs", type=int, default=None, help="index only the corpus's first N documents")
    parser.add_argument("--encoder", default="aligner", help="checkpoint for the build and the query")
    parser.add_argument("--repeats", type=int, default=5, help="timed opens of each index")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not is_index(args.index):
        limit = ["--max-docs", str(args.max_docs)] if args.max_docs else []
        subprocess.run([sys.executable, "-m", "pyserini_aligner.index", "--corpus", args.corpus, "--index",
                        str(args.index), "--encoder", args.encoder, *limit], check=True)
    plain = args.index.with_name(args.index.name + "-no-block-checksums")
    without_block_checksums(args.index, plain)
    files = checked_files(args.index)
    if not files:
        raise SystemExit(f"{args.index}: no file over one block ({checksums.BLOCK} bytes); index a larger corpus")
    for path, _ in files:  # both copies in the page cache
        path.read_bytes(), (plain / path.relative_to(args.index)).read_bytes()
    start = time.perf_counter()
    problems = [checksums.bad_block(path, record) for path, record in files]
    check_s = time.perf_counter() - start
    assert not any(problems), problems
    load_before = os.getloadavg()[0]
    verified, unverified = [], []
    for _ in range(args.repeats):
        verified.append(open_and_search_seconds(args.index, args.encoder))
        unverified.append(open_and_search_seconds(plain, args.encoder))
    checked = sum(record["bytes"] for _, record in files)
    with_median, without_median = statistics.median(verified), statistics.median(unverified)
    print(json.dumps({
        "index": str(args.index), "documents": read_manifest(args.index).num_docs,
        "bytes_checked": checked, "files_checked": len(files), "block_bytes": checksums.BLOCK,
        "check_alone_s": round(check_s, 4), "check_mb_per_s": round(checked / check_s / 1e6, 1),
        "open_and_first_search_s_median": {"block_checksums": round(with_median, 4),
                                           "none": round(without_median, 4),
                                           "difference": round(with_median - without_median, 4)},
        "runs_s": {"block_checksums": [round(s, 4) for s in verified], "none": [round(s, 4) for s in unverified]},
        "repeats": args.repeats, "cpus": os.cpu_count(),
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
