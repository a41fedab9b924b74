"""Hybrid AligneR + BM25 through Pyserini's ``HybridSearcher``, its weight chosen on train/dev queries (never test).

Pyserini's ``HybridSearcher`` supplies both hit lists (on the test queries, AligneR's are the ``aligner`` system's
search of the same index: its FaissSearcher is an AlignerSearcher); they are fused with its arithmetic, ``alpha · sparse + dense``,
by :func:`eval.beir.fusion.hybrid_fuse`. AligneR scores lie in [-1, 1] while BM25 scores are in the tens, so both
are min-max centred per query first (HybridSearcher's ``normalization=True``); alpha is then BM25's weight
relative to AligneR's.
"""
from __future__ import annotations

import logging
import random
from pathlib import Path

from tqdm.auto import tqdm

from eval.beir.context import Context
from eval.beir.fusion import hybrid_fuse
from pyserini_aligner.data import Dataset
from pyserini_aligner.hits import drop_query_hits
from pyserini_aligner.metrics import evaluate

log = logging.getLogger(__name__)

ALPHAS = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
DEFAULT_ALPHA = 0.5  # used when the dataset has no train/dev split: BM25 at half AligneR's weight
NORMALIZATION = True
TUNING_QUERIES = 100
TUNING_SPLITS = ("dev", "train")  # preferred order


def tuning_split(dataset: Dataset) -> Dataset | None:
    """The dev (else train) split of the dataset's collection, or None: ``beir/nfcorpus/test`` → ``beir/nfcorpus/dev``,
    a BEIR folder → its ``qrels/dev.tsv`` or ``qrels/train.tsv``."""
    if dataset.folder:
        for split in TUNING_SPLITS:
            if split != dataset.split and (dataset.folder / "qrels" / f"{split}.tsv").is_file():
                return Dataset(str(dataset.folder), split=split)
        return None
    import ir_datasets

    parent = dataset.name.rsplit("/", 1)[0]
    for split in TUNING_SPLITS:
        candidate = f"{parent}/{split}"
        if candidate != dataset.name and candidate in ir_datasets.registry:
            return Dataset(candidate)
    return None


def hybrid_searcher(ctx: Context, index_dir: Path, lucene_dir: Path):
    """``HybridSearcher(FaissSearcher(<AligneR index>) → AlignerSearcher, LuceneSearcher(BM25 k1=0.9 b=0.4))``."""
    from pyserini.search.faiss import FaissSearcher
    from pyserini.search.hybrid import HybridSearcher
    from pyserini.search.lucene import LuceneSearcher

    from pyserini_aligner.bm25 import B, K1
    from pyserini_aligner.encoders import AlignerQueryEncoder

    dense = FaissSearcher(str(index_dir), AlignerQueryEncoder(ctx.model), strategy=ctx.strategy)
    sparse = LuceneSearcher(str(lucene_dir))
    sparse.set_bm25(K1, B)
    return HybridSearcher(dense, sparse)


def _batches(ctx: Context, queries: dict[str, str], label: str, search) -> dict:
    qids, out = list(queries), {}
    with tqdm(total=len(qids), desc=label, unit="query", disable=not ctx.progress) as bar:
        for start in range(0, len(qids), 32):
            batch = qids[start:start + 32]
            out.update(search([queries[q] for q in batch], batch))
            bar.update(len(batch))
    return out


def choose_alpha(ctx: Context, hybrid) -> dict:
    """Best alpha of ALPHAS by nDCG@10 on up to TUNING_QUERIES queries (seed ``ctx.seed``) of the tuning split;
    returns {"alpha", "alpha_source", "alpha_grid"} (DEFAULT_ALPHA and no grid without a tuning split)."""
    split = tuning_split(ctx.dataset)
    if split is None:
        log.info("hybrid: %s has no dev/train split, using the default alpha %g", ctx.dataset.name, DEFAULT_ALPHA)
        return {"alpha": DEFAULT_ALPHA, "alpha_source": "default: no dev/train split"}
    qrels = split.qrels()
    queries = {q: t for q, t in split.queries().items() if q in qrels}
    picked = sorted(queries) if len(queries) <= TUNING_QUERIES else \
        sorted(random.Random(ctx.seed).sample(sorted(queries), TUNING_QUERIES))
    queries = {q: queries[q] for q in picked}
    dense, sparse = component_hits(ctx, hybrid, queries, "hybrid tune")
    grid = {}
    for alpha in ALPHAS:
        fused = fuse(dense, sparse, alpha, ctx.hits)
        grid[alpha] = round(evaluate(qrels, fused, ("ndcg@10",))["ndcg@10"], 4)
    best = max(ALPHAS, key=lambda a: (grid[a], -ALPHAS.index(a)))
    log.info("hybrid: alpha %g chosen on %d queries of %s", best, len(queries), split.name)
    return {"alpha": best, "alpha_source": f"{split.name}, {len(queries)} queries",
            "alpha_grid": {str(a): v for a, v in grid.items()}}


def component_hits(ctx: Context, hybrid, queries: dict[str, str], label: str) -> tuple[dict, dict]:
    """The HybridSearcher's dense (AligneR) and sparse (BM25) hit lists as (docid, score) pairs, k0 = ctx.hits (+1
    for the query id)."""
    k0 = ctx.hits + 1
    dense = _batches(ctx, queries, f"{label} (aligner)",
                     lambda texts, ids: hybrid.dense_searcher.batch_search(texts, ids, k0, ctx.threads))
    sparse = hybrid.sparse_searcher.batch_search(list(queries.values()), list(queries), k0, ctx.threads)
    return pairs(dense), pairs(sparse)


def pairs(hits: dict) -> dict[str, list[tuple[str, float]]]:
    """Pyserini's hit objects as (docid, score) pairs, best first."""
    return {qid: [(h.docid, float(h.score)) for h in ranked] for qid, ranked in hits.items()}


def fuse(dense: dict, sparse: dict, alpha: float, k: int) -> dict[str, list[tuple[str, float]]]:
    """:func:`~eval.beir.fusion.hybrid_fuse` of every query's dense and sparse (docid, score) hits (what
    ``HybridSearcher.batch_search`` computes), top k without the query id."""
    out = {qid: hybrid_fuse(list(ranked), list(sparse.get(qid, [])), alpha, k + 1, NORMALIZATION)
           for qid, ranked in dense.items()}
    return drop_query_hits(out, k)


def hybrid_search(ctx: Context, hybrid, index_dir: Path, alpha: float) -> dict[str, list[tuple[str, float]]]:
    """The test queries at ``alpha`` (k0 = k = ctx.hits): BM25's hits from the HybridSearcher's LuceneSearcher;
    AligneR's are the aligner system's search of ``index_dir`` (the HybridSearcher's) with the same defaults
    (:func:`eval.beir.aligner.searched`, the k0 hits before the query id is dropped): the HybridSearcher's
    FaissSearcher over an AligneR index is an AlignerSearcher with the same defaults
    (``tests/test_search.py::test_pyserini_faiss_searcher_opens_aligner_index``)."""
    from eval.beir.aligner import searched
    from pyserini_aligner.search.defaults import DEFAULT_QUERY_PRUNE

    dense = searched(ctx, index_dir, DEFAULT_QUERY_PRUNE, "hybrid (aligner)")
    sparse = hybrid.sparse_searcher.batch_search(list(ctx.queries.values()), list(ctx.queries), ctx.hits + 1,
                                                 ctx.threads)
    return fuse(dense, pairs(sparse), alpha, ctx.hits)
