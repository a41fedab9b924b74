"""The scale benchmark: for each corpus size, build an index, then time and score search on it.

Everything runs in this process, one size after the other (smallest first); bench_scale.json and bench_scale.md
are rewritten after each size, so a run cut short keeps the sizes it finished.
"""
from __future__ import annotations

import gc
import logging
import math
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Callable, Sequence

import torch
from tqdm.auto import tqdm

from eval.bench.measure import per_query_latency, percentiles_ms
from eval.bench_scale import report as reporting
from eval.bench_scale.corpus import SyntheticCorpus, read_beir_zip, size_label
from eval.bench_scale.exact import exact_ranking
from eval.bench_scale.measure import (Peaks, Ranking, folder_bytes, gib, gpu_peak_bytes, machine_info,
                                      overlap_at_k, reset_gpu_peak, run_dict, sync)
from eval.bench_scale.tiling import tile_index
from pyserini_aligner.metrics import evaluate

log = logging.getLogger(__name__)

DOC_PRUNE = None  # β^d of the benchmarks' indexes: the build's default for the corpus size
BATCHES = (32, 300)  # query batch sizes of the throughput figures
WARMUP = 10  # untimed queries before the per-query latency
QPS_REPEATS = 3  # throughput: median of this many passes over the queries
QPS_WARMUP = 1  # untimed passes before them (a batch size's first pass captures graphs, grows the allocator)
CPU_QUERIES = 100  # queries timed on the CPU row
BUILD_STAT_KEYS = ("encode_s", "prune_s", "codec_s", "write_s")


def judged_queries(corpus: SyntheticCorpus, n: int, max_queries: int | None) -> dict[str, str]:
    """The split's queries whose relevant documents are all among the first ``n`` passages (every query once the
    corpus holds the judged originals), at most ``max_queries`` of them, in qrels order."""
    present = {corpus.source.docs[i][0] for i in corpus.original_order[:n]}
    queries = {qid: text for qid, text in corpus.source.queries.items()
               if all(docid in present for docid, rel in corpus.source.qrels[qid].items() if rel > 0)}
    return dict(list(queries.items())[:max_queries]) if max_queries else queries


def release_memory(device: str) -> None:
    """Collect garbage and hand the GPU memory torch caches back to the device."""
    gc.collect()
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()


def build(corpus: SyntheticCorpus, n: int, folder: Path, device: str, batch_size: int, codec: str,
          encoder, quiet: bool, doc_prune: float | None = DOC_PRUNE) -> tuple[Path, dict]:
    """Build the index of the first ``n`` passages at ``folder/index`` with β^d = ``doc_prune``; (index folder,
    build figures). encoder: a checkpoint name or an AlignerModel (e.g. one replaying passages it has already
    encoded)."""
    from pyserini_aligner.index import build_index

    index_dir = folder / "index"
    items = tqdm(corpus.passages(n), total=n, unit="doc", desc=f"build {size_label(n)}", disable=quiet)

    def make() -> dict:
        manifest = build_index(items, index_dir, encoder, doc_prune=doc_prune, device=device, progress=False,
                               batch_size=batch_size, codec=codec, num_docs_hint=n)
        stats = manifest.build_stats  # seconds per phase, summed over segments
        return {"docs": manifest.num_docs, "codec": str(manifest.codec), "tokens": manifest.num_tokens,
                "build": {key: round(float(stats[key]), 2) for key in BUILD_STAT_KEYS if key in stats}}

    return index_dir, measured_build(folder, index_dir, device, make)


def measured_build(folder: Path, index_dir: Path, device: str, make: Callable[[], dict]) -> dict:
    """Run ``make()``, which writes an index at ``index_dir`` (inside the new ``folder``) and returns {"docs": N,
    ..., "build": {phase: seconds}}; adds its wall seconds, peak GPU memory, host RSS and disk under ``folder``
    (the temporary files beside the index included), and the index's bytes."""
    folder.mkdir(parents=True)
    reset_gpu_peak(device)
    with Peaks(folder) as peaks:
        start = time.perf_counter()
        row = make()
        sync(device)
        seconds = time.perf_counter() - start
    size = folder_bytes(index_dir)
    return {**row, "build": {"total_s": round(seconds, 2), **row.get("build", {})},
            "passages_per_s": round(row["docs"] / seconds, 1),
            "peak_gpu_build_gib": gib(gpu_peak_bytes(device)), "peak_rss_build_gib": gib(peaks.peak_rss),
            "peak_disk_bytes": max(peaks.peak_disk, size), "index_bytes": size,
            "bytes_per_passage": round(size / row["docs"], 1)}


Ranker = Callable[[list[str], int], Ranking]  # (query texts, batch size) -> top-10 per query


def time_search(open_ranker: Callable[[], Ranker], texts: Sequence[str], device: str,
                batches: Sequence[int] = BATCHES, repeats: int = QPS_REPEATS) -> tuple[dict, Ranking]:
    """Load a search engine (``open_ranker``, timed) and time it at k=10: p50/p95 one query at a time (query
    encoding included) after WARMUP queries, q/s over ``texts`` per batch size (median of ``repeats`` passes after
    QPS_WARMUP untimed ones), peak GPU memory (torch's allocator) from the load on, after the one-query pass and over
    all, and host RSS; (figures, ranking of the last pass)."""
    texts = list(texts)
    reset_gpu_peak(device)
    with Peaks() as peaks:
        start = time.perf_counter()
        rank = open_ranker()
        row = {"queries": len(texts), "load_s": round(time.perf_counter() - start, 2)}
        row.update(percentiles_ms(per_query_latency(lambda q: rank([q], max(batches)), texts, warmup=WARMUP)))
        row["peak_gpu_one_query_gib"] = gib(gpu_peak_bytes(device))
        for batch in batches:
            times = []
            for _ in range(QPS_WARMUP):
                rank(texts, batch)
            for _ in range(repeats):
                start = time.perf_counter()
                ranked = rank(texts, batch)
                times.append(time.perf_counter() - start)
            row[f"qps_b{batch}"] = round(len(texts) / statistics.median(times), 1)
    row["peak_gpu_search_gib"], row["peak_rss_search_gib"] = gib(gpu_peak_bytes(device)), gib(peaks.peak_rss)
    return row, ranked


def quality(ranked: Ranking, qids: Sequence[str], qrels: dict, exact: Ranking | None = None) -> dict:
    """nDCG@10 of ``ranked`` (the queries ``qids`` in order) and, given the ``exact`` ranking
    (:func:`.exact.exact_ranking` of the same queries), its overlap@10 with it and the exact ranking's nDCG@10."""
    judged = {qid: qrels[qid] for qid in qids}
    row = {"ndcg@10": round(evaluate(judged, run_dict(qids, ranked), ("ndcg@10",))["ndcg@10"], 4)}
    if exact is not None:
        row["overlap@10_exact"] = round(overlap_at_k(ranked, exact, 10), 4)
        row["ndcg@10_exact"] = round(evaluate(judged, run_dict(qids, exact), ("ndcg@10",))["ndcg@10"], 4)
    return row


def search(index_dir: Path, queries: dict[str, str], qrels: dict, device: str, exhaustive: bool,
           exact: list | None = None) -> dict:
    """Latency at k=10 one query at a time (query encoding included), q/s per batch size, and the quality of the
    k=10 ranking: nDCG@10, overlap with exhaustive scoring of the same index and, given the ``exact`` ranking
    (:func:`.exact.exact_ranking` of the same queries), overlap with exhaustive scoring of the exact vectors."""
    texts, qids = list(queries.values()), list(queries)
    judged = {qid: qrels[qid] for qid in qids}
    row, ranked = time_search(lambda: aligner_ranker(index_dir, device), texts, device)
    row.update(quality(ranked, qids, qrels, exact))
    release_memory(device)
    if exhaustive:
        from pyserini_aligner.search.exhaustive import ExhaustiveScorer

        start = time.perf_counter()
        scorer = ExhaustiveScorer(index_dir, device=device, batch_size=32)
        best = scorer.rank(texts, k=10)
        row["exhaustive_s"] = round(time.perf_counter() - start, 2)
        row["overlap@10"] = round(overlap_at_k(ranked, best, 10), 4)
        row["ndcg@10_exhaustive"] = round(evaluate(judged, run_dict(qids, best), ("ndcg@10",))["ndcg@10"], 4)
        del scorer
        release_memory(device)
    return row


def aligner_ranker(index_dir: Path, device: str) -> Ranker:
    """The top-10 of an AlignerSearcher over ``index_dir`` (its defaults), in batches of the given size."""
    from pyserini_aligner.search import AlignerSearcher

    searcher = AlignerSearcher(index_dir, device=device, batch_size=max(BATCHES))

    def rank(texts: list[str], batch: int) -> Ranking:
        searcher.configure(batch_size=batch)
        return searcher.rank(texts, k=10)

    return rank


def add_documents(corpus: SyntheticCorpus, index_dir: Path, n: int, fraction: float, device: str,
                  batch_size: int) -> dict:
    """Time adding the next ``fraction`` · n passages to the built index as a new segment (a live update)."""
    from itertools import islice

    from pyserini_aligner.index.live import AlignerIndex

    count = max(1, int(n * fraction))
    start = time.perf_counter()
    AlignerIndex(index_dir, device=device, batch_size=batch_size).add(islice(iter(corpus), n, n + count))
    sync(device)
    seconds = time.perf_counter() - start
    return {"added": count, "add_s": round(seconds, 2)}


def cpu_search(index_dir: Path, queries: Sequence[str], threads: int) -> dict:
    """p50/p95 at k=10, one query at a time on the CPU with ``threads`` threads (the CPU default backend, or the
    torch backend where FAISS is not installed)."""
    from pyserini_aligner.search import AlignerSearcher

    try:
        searcher = AlignerSearcher(index_dir, device="cpu")
    except ImportError as err:
        log.warning("CPU row: %s; timing the torch backend instead", err)
        searcher = AlignerSearcher(index_dir, device="cpu", backend="torch")
    texts = list(queries[:CPU_QUERIES])
    times = per_query_latency(lambda q: searcher.rank([q], k=10, threads=threads), texts, warmup=WARMUP)
    return {"threads": threads, "backend": searcher.backend, "queries": len(texts), **percentiles_ms(times)}


def run_bench(beir_zip: Path, sizes: Sequence[int], output: Path, device: str, codec: str = "auto",
              batch_size: int = 128, max_queries: int | None = None, cpu_threads: int | None = None,
              tile_to: int | None = None, work: Path | None = None, exhaustive_max_docs: int | None = None,
              encoder: str = "aligner", seed: int = 0, quiet: bool = False, add_fraction: float = 0.0,
              exact_max_docs: int | None = None) -> dict:
    """Measure every size (and the CPU row, and the tiled size); writes bench_scale.json/.md in ``output`` after
    each step and returns the report. Indexes go under ``work`` (kept), or a temporary folder in ``output``."""
    sizes = sorted(set(sizes))
    labels = [size_label(n) for n in sizes] + (["tiled"] if tile_to else [])
    if work is not None:
        taken = [str(work / label) for label in labels if (work / label).exists()]
        if taken:
            raise FileExistsError(f"--work: {taken[0]} already exists (indexes are never overwritten)")
    source = read_beir_zip(beir_zip)
    corpus = SyntheticCorpus(source, seed=seed)
    output.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine_info(device), "settings": {
        "beir_zip": beir_zip.name, "sizes": sizes, "tile_to": tile_to, "doc_prune": DOC_PRUNE or "auto", "codec": codec,
        "batch_size": batch_size, "seed": seed, "encoder": encoder, "warmup": WARMUP, "qps_warmup": QPS_WARMUP,
        "qps_repeats": QPS_REPEATS, "batches": list(BATCHES), "originals": corpus.num_originals, "distinct_spans": corpus.num_spans},
        "rows": [], "cpu": None}
    with ExitStack() as stack:
        if work is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=".bench_scale-", dir=output)))
        largest = None
        for n in sizes:
            queries = judged_queries(corpus, n, max_queries)
            exact = None
            if exact_max_docs is not None and n <= exact_max_docs:
                start = time.perf_counter()
                exact = exact_ranking(corpus.passages(n), list(queries.values()), encoder, device, batch_size,
                                      progress=not quiet, total=n)
                release_memory(device)
                log.info("exact reference of %s: %.1f s", size_label(n), time.perf_counter() - start)
            index_dir, row = build(corpus, n, work / size_label(n), device, batch_size, codec, encoder, quiet)
            row = {"label": size_label(n), "tiled": None, **row}
            release_memory(device)
            exhaustive = exhaustive_max_docs is None or n <= exhaustive_max_docs
            row.update(search(index_dir, queries, source.qrels, device, exhaustive, exact))
            report["rows"].append(row)
            reporting.write(report, output)
            log.info("%s: %s", row["label"], row)
            largest = (index_dir, row, queries)
        index_dir, source_row, queries = largest
        if add_fraction:
            source_row.update(add_documents(corpus, index_dir, source_row["docs"], add_fraction, device, batch_size))
            reporting.write(report, output)
        if tile_to:  # whole copies: the tiled size is tile_to rounded up to a multiple of the largest size
            copies = math.ceil(tile_to / source_row["docs"])
            start = time.perf_counter()
            tiled = tile_index(index_dir, work / "tiled" / "index", copies)
            row = {"label": size_label(tiled.num_docs), "docs": tiled.num_docs, "codec": str(tiled.codec),
                   "tiled": {"copies": copies, "source": source_row["label"],
                             "tile_s": round(time.perf_counter() - start, 2)},
                   "bytes_per_passage": source_row["bytes_per_passage"]}
            exhaustive = exhaustive_max_docs is None or tiled.num_docs <= exhaustive_max_docs
            row.update(search(work / "tiled" / "index", queries, source.qrels, device, exhaustive))
            report["rows"].append(row)
            reporting.write(report, output)
        if cpu_threads:
            report["cpu"] = {"label": source_row["label"], **cpu_search(index_dir, list(queries.values()), cpu_threads)}
            reporting.write(report, output)
    return report
