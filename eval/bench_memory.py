"""Resident memory of CPU search: whether an index opens and searches within a laptop's memory.

``python -m eval.bench_memory --beir-zip scifact.zip --index DIR --output OUT`` measures a built index;
``python -m eval.bench_memory --beir-zip scifact.zip --build 1m --device cuda --work W --output OUT`` first builds
the first N synthetic MS MARCO-like passages grown from the zip (:mod:`eval.bench_scale`: the same corpus and
build), keeps the index in ``W/<size>/index`` and measures it. ``--tile N`` measures the index listed N times
instead (:mod:`eval.bench_scale.tiling`: N times the documents and lists, one segment a copy).

The search runs in a fresh process, so that nothing of the build or of this process counts: it imports the searcher,
loads the index's query encoder, opens an ``AlignerSearcher`` on the CPU (default backend: "faiss" for a compressed
index), then searches the zip's test queries one at a time (k=10, query encoding included). After each step it
reads the process's peak resident memory (VmHWM; ``ru_maxrss`` where there is no /proc) and its current resident
memory, split into anonymous memory (what the process allocated) and file pages (the memory-mapped index files it
has touched, which the kernel may drop and read again). Writes bench_memory.json and bench_memory.md in --output and
prints the table; the peak is compared with 2 GiB plus the index's codebooks (its codec folder).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from eval.cli import configure_logging, corpus_size, positive_int, run_report

TARGET_BYTES = 2 << 30  # peak resident memory allowed beside the codebooks
FIELDS = {"peak": "VmHWM", "rss": "VmRSS", "anon": "RssAnon", "file": "RssFile"}
STEPS = {"start": "interpreter", "import": "imports (torch, FAISS, the searcher)", "encoder": "query encoder loaded",
         "open": "index opened", "search": "queries searched"}


def memory_now() -> dict[str, int | None]:
    """This process's peak and current resident bytes (``FIELDS``); the peak from ``ru_maxrss`` without /proc."""
    import resource

    from eval.bench_scale.measure import status_fields

    read = status_fields(*FIELDS.values())  # one instant: the peak is at least the current
    out = {name: read[field] for name, field in FIELDS.items()}
    if out["peak"] is None:  # Linux reports KiB, macOS bytes
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out["peak"] = peak if sys.platform == "darwin" else peak * 1024
    return out


class AnonPeak:
    """Context manager: the largest RssAnon of this process, sampled every ``interval`` seconds (the kernel keeps
    no high-water mark of anonymous memory alone; VmHWM adds the file pages of the memory-mapped index, which the
    kernel may drop again under memory pressure)."""

    def __init__(self, interval: float = 0.005):
        import threading

        self.interval, self.peak = interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="anon-peak", daemon=True)

    def _loop(self) -> None:
        from eval.bench_scale.measure import status_bytes

        while True:
            self.peak = max(self.peak, status_bytes("RssAnon") or 0)
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> "AnonPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def measure_search(index_dir: str, texts: list[str], backend: str | None, threads: int | None, warmup: int) -> dict:
    """Memory after each of ``STEPS`` and the one-query latency (k=10) of a CPU searcher over ``index_dir``; run in
    a fresh process (:func:`search_in_child`). ``anon_peak``: the largest anonymous memory sampled from the start."""
    with AnonPeak() as anon:
        result = _measured_steps(index_dir, texts, backend, threads, warmup)
    result["anon_peak"] = max(anon.peak, *(step["anon"] or 0 for step in result["memory"].values()))
    return result


def _measured_steps(index_dir: str, texts: list[str], backend: str | None, threads: int | None, warmup: int) -> dict:
    memory = {"start": memory_now()}
    import faiss  # noqa: F401  (the default CPU backend's library, imported by the backend when it opens)
    import torch

    from eval.bench.measure import per_query_latency, percentiles_ms
    from pyserini_aligner.index.format import read_manifest
    from pyserini_aligner.resolve import model_for_index
    from pyserini_aligner.search import AlignerSearcher

    if threads:
        torch.set_num_threads(threads)
    memory["import"] = memory_now()
    manifest = read_manifest(Path(index_dir))
    model = model_for_index(None, manifest, Path(index_dir), "cpu")
    memory["encoder"] = memory_now()
    start = time.perf_counter()
    searcher = AlignerSearcher(index_dir, encoder=model, device="cpu", **({"backend": backend} if backend else {}))
    open_s = time.perf_counter() - start
    memory["open"] = memory_now()
    times = per_query_latency(lambda q: searcher.rank([q], k=10), texts, warmup=warmup)
    memory["search"] = memory_now()
    return {"backend": searcher.backend, "threads": torch.get_num_threads(), "open_s": round(open_s, 2),
            "queries": len(texts), "warmup": min(warmup, len(texts)), **percentiles_ms(times), "memory": memory}


def search_in_child(index_dir: Path, texts: list[str], backend: str | None, threads: int | None,
                    warmup: int) -> dict:
    """:func:`measure_search` in a freshly started interpreter (multiprocessing's spawn)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(measure_search, str(index_dir), texts, backend, threads, warmup).result()


def index_figures(index_dir: Path) -> dict:
    """Counts and bytes of an index: documents, tokens, inverted-list entries (kept tokens), the bytes of the files
    its manifest names (a tiled index's linked files counted at each link) and of its codec files (centroids and
    codebooks: 0 for fp16)."""
    from pyserini_aligner.index.format import read_manifest

    manifest = read_manifest(index_dir)
    codec_bytes = sum(record["bytes"] for record in (manifest.codec_files or {}).values())
    return {"codec": str(manifest.codec), "docs": manifest.num_docs, "tokens": manifest.num_tokens,
            "kept": sum(s.num_kept for s in manifest.segments), "segments": len(manifest.segments),
            "index_bytes": codec_bytes + sum(record["bytes"] for s in manifest.segments for record in s.files.values()),
            "codec_bytes": codec_bytes}


def build_index(beir_zip: Path, size: int, work: Path, device: str, codec: str, batch_size: int, encoder: str,
                seed: int, quiet: bool) -> tuple[Path, dict, list[str]]:
    """Build the first ``size`` synthetic passages (:func:`eval.bench_scale.run.build`) in ``work/<size>``;
    (index folder, build figures, the judged test queries whose documents it holds)."""
    from eval.bench_scale.corpus import SyntheticCorpus, read_beir_zip, size_label
    from eval.bench_scale.run import build, judged_queries

    corpus = SyntheticCorpus(read_beir_zip(beir_zip), seed=seed)
    index_dir, row = build(corpus, size, work / size_label(size), device, batch_size, codec, encoder, quiet)
    return index_dir, row, list(judged_queries(corpus, size, None).values())


def summary(index: dict, search: dict) -> dict:
    """Peak against the target (2 GiB plus the codebooks), and the anonymous memory the open index added, per
    document and per kept token (what grows with the index)."""
    memory = search["memory"]
    added = memory["open"]["anon"] - memory["encoder"]["anon"] if memory["open"]["anon"] is not None else None
    limit = TARGET_BYTES + index["codec_bytes"]
    return {"peak_bytes": memory["search"]["peak"], "anon_peak_bytes": search["anon_peak"], "target_bytes": limit,
            "within_target": memory["search"]["peak"] <= limit, "open_anon_bytes": added,
            "open_anon_per_doc": None if added is None else round(added / max(index["docs"], 1), 1),
            "open_anon_per_kept": None if added is None else round(added / max(index["kept"], 1), 2)}


def _mib(value: int | None) -> str:
    return "–" if value is None else f"{value / 2**20:.1f}"


def write_report(report: dict, output: Path) -> None:
    """bench_memory.json (everything) and bench_memory.md (the memory after each step, then the figures)."""
    output.mkdir(parents=True, exist_ok=True)
    (output / "bench_memory.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    index, search, total = report["index"], report["search"], report["summary"]
    lines = [f"# CPU search memory: {index['docs']} documents, codec {index['codec']}", "",
             f"Index {_mib(index['index_bytes'])} MiB on disk ({index['segments']} segment(s), {index['tokens']} "
             f"tokens, {index['kept']} inverted-list entries), codec folder {_mib(index['codec_bytes'])} MiB. "
             f"Backend {search['backend']}, {search['threads']} thread(s); opened in {search['open_s']} s; "
             f"{search['queries']} queries one at a time (k=10, encoding included) after {search['warmup']} "
             f"warm-up: p50 {search['p50_ms']} ms, p95 {search['p95_ms']} ms.", "",
             "| after | peak RSS MiB | RSS MiB | anonymous MiB | file pages MiB |", "|---|---:|---:|---:|---:|"]
    for step, label in STEPS.items():
        values = search["memory"][step]
        lines.append(f"| {label} | {_mib(values['peak'])} | {_mib(values['rss'])} | {_mib(values['anon'])} | "
                     f"{_mib(values['file'])} |")
    verdict = "within" if total["within_target"] else "over"
    lines += ["", f"Peak {_mib(total['peak_bytes'])} MiB: {verdict} the target of 2 GiB plus the codebooks "
              f"({_mib(total['target_bytes'])} MiB); anonymous memory at most {_mib(total['anon_peak_bytes'])} MiB "
              "(sampled every 5 ms; the rest of the peak is file pages: the libraries' code and any index pages "
              f"mapped in, which the kernel may drop under memory pressure). Opening the index added {_mib(total['open_anon_bytes'])} MiB "
              f"of anonymous memory: {total['open_anon_per_doc']} bytes a document, {total['open_anon_per_kept']} "
              "bytes an inverted-list entry.", ""]
    (output / "bench_memory.md").write_text("\n".join(lines), encoding="utf-8")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m eval.bench_memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--beir-zip", type=Path, required=True,
                        help="a BEIR zip: its test queries are searched (and, with --build, its corpus grown)")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--index", type=Path, help="measure this built index")
    where.add_argument("--build", type=corpus_size, help="build this many synthetic passages first, e.g. 1m")
    parser.add_argument("--output", type=Path, required=True, help="folder for bench_memory.json and .md")
    parser.add_argument("--tile", type=positive_int, help="measure the index tiled this many times instead (its "
                                                           "segments listed again, as links: eval.bench_scale.tiling)")
    parser.add_argument("--work", type=Path, help="keep the built index in WORK/<size>/index and the tiled one in "
                                                  "WORK/tiled/index (default: a temporary folder in --output, removed "
                                                  "at the end)")
    parser.add_argument("--device", default="cpu", help="--build: where to encode and build (e.g. cuda)")
    parser.add_argument("--codec", default="auto", help="--build: token codec (default auto)")
    parser.add_argument("--batch-size", type=positive_int, default=128, help="--build: documents per batch")
    parser.add_argument("--encoder", default="aligner", help="--build: AligneR checkpoint")
    parser.add_argument("--seed", type=int, default=0, help="--build: seed of the synthetic corpus")
    parser.add_argument("--backend", choices=["faiss", "torch"], help="search backend (default: the CPU's)")
    parser.add_argument("--threads", type=positive_int, help="torch threads of the search (default: torch's)")
    parser.add_argument("--queries", type=positive_int, default=100, help="queries timed (default 100)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed queries first (default 10)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars, warnings only")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    """Build (with --build), measure and write the report; returns it."""
    import tempfile
    from contextlib import ExitStack

    from eval.bench_scale.corpus import read_beir_zip

    report = {"settings": {"beir_zip": args.beir_zip.name, "build": args.build, "tile": args.tile,
                           "backend": args.backend, "threads": args.threads, "queries": args.queries,
                           "warmup": args.warmup}}
    with ExitStack() as stack:
        work = args.work
        if work is None and (args.build or args.tile):
            args.output.mkdir(parents=True, exist_ok=True)
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=".bench_memory-", dir=args.output)))
        if args.build:
            index_dir, report["build"], texts = build_index(args.beir_zip, args.build, work, args.device, args.codec,
                                                            args.batch_size, args.encoder, args.seed, args.quiet)
        else:
            index_dir, texts = args.index, list(read_beir_zip(args.beir_zip).queries.values())
        if args.tile:
            from eval.bench_scale.tiling import tile_index

            report["tiled_from"] = index_figures(index_dir)
            tile_index(index_dir, work / "tiled" / "index", args.tile)
            index_dir = work / "tiled" / "index"
        report["index"] = index_figures(index_dir)
        report["search"] = search_in_child(index_dir, texts[:args.queries], args.backend, args.threads,
                                           args.warmup)
    report["summary"] = summary(report["index"], report["search"])
    write_report(report, args.output)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.quiet)
    if args.index is not None and not (args.index / "manifest.json").is_file():
        print(f"error: --index {args.index}: no manifest.json (not an index folder)", file=sys.stderr)
        return 2
    return run_report(lambda: run(args), args.output / "bench_memory.md")


if __name__ == "__main__":
    sys.exit(main())
