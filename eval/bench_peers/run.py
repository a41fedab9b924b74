"""The side-by-side run: encode once, rank exactly, then build and search each engine in turn on the same GPU.

1. Every passage's tokens are encoded once (float16, on the GPU, as the exact reference sees them) with their
   saliences, and the judged queries are ranked by exhaustive top-k:1 scoring of those tokens.
2. The tokens move to host memory and the GPU is emptied, so neither engine's figures include them.
3. This project's index (``--codec``, β^d as eval.bench_scale) is built from those tokens through the ordinary
   build (a model that replays them), then timed and scored; its memory is released.
4. FastPlaid builds its index from the same tensors, then is timed and scored the same way.

bench_peers.json and bench_peers.md are rewritten after each step, so a run cut short keeps what it finished.
"""
from __future__ import annotations

import logging
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from eval.bench_peers import fastplaid
from eval.bench_peers import report as reporting
from eval.bench_peers.replay import EncodedCorpus, ReplayModel
from eval.bench_scale.corpus import SyntheticCorpus, read_beir_zip, size_label
from eval.bench_scale.exact import encode_tokens, exact_top, float32_products
from eval.bench_scale.measure import machine_info
from eval.bench_scale.run import (BATCHES, DOC_PRUNE, QPS_REPEATS, WARMUP, aligner_ranker, build, judged_queries,
                                  quality, release_memory, time_search)
from pyserini_aligner.index import StoredIndex

log = logging.getLogger(__name__)


def run_peers(beir_zip: Path, size: int, output: Path, device: str, codec: str = "auto", batch_size: int = 128,
              max_queries: int | None = None, work: Path | None = None, encoder: str = "aligner", seed: int = 0,
              n_ivf_probe: int = 8, n_full_scores: int = 4096, quiet: bool = False) -> dict:
    """Measure both engines on the first ``size`` synthetic passages of ``beir_zip``; writes bench_peers.json/.md
    in ``output`` after each step and returns the report. Indexes go under ``work`` (kept), or a temporary folder
    (removed)."""
    from pyserini_aligner.resolve import load_model

    fastplaid.fast_plaid_search()  # fail before anything is encoded
    if work is not None and work.exists():
        raise FileExistsError(f"--work: {work} already exists (indexes are never overwritten)")
    source = read_beir_zip(beir_zip)
    corpus = SyntheticCorpus(source, seed=seed)
    queries = judged_queries(corpus, size, max_queries)
    texts, qids = list(queries.values()), list(queries)
    output.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine_info(device), "settings": {
        "beir_zip": beir_zip.name, "size": size, "label": size_label(size), "queries": len(texts), "codec": codec,
        "doc_prune": DOC_PRUNE or "auto", "batch_size": batch_size, "seed": seed, "encoder": encoder, "warmup": WARMUP,
        "qps_repeats": QPS_REPEATS, "batches": list(BATCHES),
        "fastplaid": {"version": fastplaid.fast_plaid_version(), "nbits": fastplaid.NBITS,
                      "n_ivf_probe": n_ivf_probe, "n_full_scores": n_full_scores}},
        "exact": None, "engines": {}}
    passages = list(corpus.passages(size))
    docids = [docid for docid, _ in passages]
    model = load_model(encoder, device=device)
    start = time.perf_counter()
    with float32_products():
        encoded = EncodedCorpus(*encode_tokens(model, [text for _, text in passages], batch_size, not quiet))
    report["exact"] = {"passages": size, "tokens": len(encoded.tokens),
                       "encode_s": round(time.perf_counter() - start, 2)}
    start = time.perf_counter()
    exact = exact_top(model, texts, encoded.tokens, encoded.lengths, docids)
    report["exact"]["rank_s"] = round(time.perf_counter() - start, 2)
    report["exact"]["ndcg@10"] = quality(exact, qids, source.qrels)["ndcg@10"]
    encoded = encoded.to("cpu")
    release_memory(device)
    reporting.write(report, output)
    with ExitStack() as stack:
        if work is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_peers-")))
        replay = ReplayModel(model, [text for _, text in passages], encoded, encoder)
        index_dir, row = build(corpus, size, work / "aligner", device, batch_size, codec, replay, quiet)
        report["settings"]["doc_prune"] = StoredIndex(index_dir).manifest.doc_prune  # as the build chose it
        del replay
        release_memory(device)
        searched, ranked = time_search(lambda: aligner_ranker(index_dir, device), texts, device)
        release_memory(device)
        report["engines"]["aligner"] = {**row, **searched, **quality(ranked, qids, source.qrels, exact)}
        reporting.write(report, output)
        log.info("pyserini-aligner: %s", report["engines"]["aligner"])

        index_dir, row = fastplaid.build(encoded.passages(), work / "fastplaid", device)
        del encoded
        release_memory(device)
        searched, ranked = time_search(lambda: fastplaid.ranker(index_dir, model, docids, device, n_ivf_probe,
                                                                n_full_scores), texts, device)
        release_memory(device)
        report["engines"]["fastplaid"] = {**row, **searched, **quality(ranked, qids, source.qrels, exact)}
        reporting.write(report, output)
        log.info("FastPlaid: %s", report["engines"]["fastplaid"])
    return report
