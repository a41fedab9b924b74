"""The systems the harness can run. Each takes a ``Context`` and returns ``qid -> [(docid, score)]`` best first;
numbers to report besides the run's metrics (chosen alpha, fold std, ...) go to ``ctx.extras[name]``."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pyserini_aligner.data import Dataset

log = logging.getLogger(__name__)

Hits = dict[str, list[tuple[str, float]]]


@dataclass
class Context:
    """What every system sees: the dataset, where to keep indexes, and shared knobs."""

    dataset: Dataset
    work: Path  # indexes and caches for this dataset
    hits: int = 1000
    threads: int = 2
    progress: bool = True
    encoder: str = "aligner"  # AligneR checkpoint: "aligner" or a folder
    candidates: int = 100  # aligner hits rescored per query by aligner-adapted
    fold_size: int = 8
    seed: int = 0
    runs: dict[str, Hits] = field(default_factory=dict)  # systems already run (for fusion)
    extras: dict[str, dict] = field(default_factory=dict)  # per system: numbers for results.json

    def _lazy(self, name: str, make: Callable):
        if name not in self.__dict__:
            self.__dict__[name] = make()
        return self.__dict__[name]

    @property
    def queries(self) -> dict[str, str]:
        return self._lazy("_queries", self.dataset.queries)

    @property
    def qrels(self) -> dict[str, dict[str, int]]:
        return self._lazy("_qrels", self.dataset.qrels)

    @property
    def model(self):
        """The AligneR model (loaded once)."""
        from pyserini_aligner.model import AlignerModel

        return self._lazy("_model", lambda: AlignerModel.from_pretrained(self.encoder))

    @property
    def fingerprint(self) -> str:
        return self._lazy("_fingerprint", self.model.fingerprint)

    @property
    def strategy(self) -> str:
        """The checkpoint's default strategy: explicit, so that adapting a cached index cannot change the runs."""
        return self.model.config.default_strategy

    def require(self, name: str, needed_by: str | None = None) -> Hits:
        """The run of system ``name``, running it first if it has not run yet."""
        if name not in self.runs:
            log.info("running %s%s on %s", name, f" (needed by {needed_by})" if needed_by else "", self.dataset.name)
            self.runs[name] = SYSTEMS[name](self)
        return self.runs[name]


def lucene_index(ctx: Context) -> Path:
    """``<work>/lucene``: Pyserini's Lucene index of ``title + text``, built once."""
    from pyserini_aligner.bm25 import build_lucene_index

    index = ctx.work / "lucene"
    if not (index / "segments.gen").exists() and not any(index.glob("segments_*")):
        build_lucene_index(ctx.dataset.docs(), index, threads=ctx.threads)
    return index


def bm25(ctx: Context) -> Hits:
    """Pyserini Lucene BM25 (k1=0.9, b=0.4), flat ``title + text``, with the query id removed from its hits."""
    from pyserini_aligner.bm25 import bm25_search

    return bm25_search(lucene_index(ctx), ctx.queries, k=ctx.hits, threads=ctx.threads)


def dense_searcher(ctx: Context):
    """Pyserini ``FaissSearcher`` over ``<work>/dense-minilm-<model hash>`` (all-MiniLM-L6-v2 mean pooling, built
    once) with ``AutoQueryEncoder``."""
    from eval.beir.dense import build_dense_index, dense_searcher as open_searcher, minilm_folder, model_key

    folder = minilm_folder()
    index = ctx.work / f"dense-minilm-{model_key(folder)}"
    if not (index / "index").is_file():
        build_dense_index(ctx.dataset.docs(), index, folder, progress=ctx.progress)
    return open_searcher(index, folder)


def dense(ctx: Context) -> Hits:
    """Pyserini FaissSearcher over all-MiniLM-L6-v2 mean-pooled vectors (the single-vector baseline)."""
    from eval.beir.aligner import drop_query_hits
    from eval.beir.dense import dense_search

    return drop_query_hits(dense_search(dense_searcher(ctx), ctx.queries, k=ctx.hits + 1, threads=ctx.threads),
                           ctx.hits)


def aligner(ctx: Context) -> Hits:
    """AligneR with the checkpoint's default strategy, all tokens indexed and searched."""
    from eval.beir.aligner import full_index, search

    ctx.extras["aligner"] = {"strategy": ctx.strategy}
    return search(ctx, full_index(ctx), desc="aligner")


def aligner_pruned(ctx: Context) -> Hits:
    """AligneR with β^d = 0.2 of each document's tokens in FAISS and β^q = 0.5 of the query's searched
    (refinement still uses every stored token)."""
    from eval.beir.aligner import PRUNED, pruned_index, search

    ctx.extras["aligner-pruned"] = {"strategy": ctx.strategy, **PRUNED}
    return search(ctx, pruned_index(ctx, PRUNED["doc_prune"]), PRUNED["query_prune"], desc="aligner-pruned")


def hybrid(ctx: Context) -> Hits:
    """Pyserini HybridSearcher over AligneR and BM25, alpha chosen on the dev/train split."""
    from eval.beir.aligner import full_index
    from eval.beir.hybrid import NORMALIZATION, choose_alpha, hybrid_search, hybrid_searcher

    searcher = hybrid_searcher(ctx, full_index(ctx), lucene_index(ctx))
    choice = choose_alpha(ctx, searcher)
    ctx.extras["hybrid"] = {**choice, "normalization": NORMALIZATION}
    return hybrid_search(ctx, searcher, choice["alpha"])


def rrf(ctx: Context) -> Hits:
    """Reciprocal rank fusion (ranx ``fuse``, k=60) of bm25 and aligner."""
    from eval.metrics import rrf_fuse

    return rrf_fuse([ctx.require("bm25", "rrf"), ctx.require("aligner", "rrf")], k=ctx.hits)


def aligner_adapted(ctx: Context) -> Hits:
    """Few-shot alignment adaptation: folds of ``ctx.fold_size`` test queries each pick a strategy (by nDCG@10 of the
    aligner's top ``ctx.candidates`` rescored with it), scored on the other queries; nDCG@10 is the mean over folds.
    The run ranks each query with a strategy chosen on a fold without it (see ``Adaptation.assignment``)."""
    from eval.beir.aligner import rescored_runs, with_tail
    from pyserini_aligner.adapt.select import CANDIDATE_STRATEGIES, few_shot_adaptation, strategy_table

    full = ctx.require("aligner", "aligner-adapted")
    runs = rescored_runs(ctx, full, CANDIDATE_STRATEGIES)
    table = strategy_table(ctx.qrels, runs)
    judged = sorted(set(ctx.queries) & set(ctx.qrels))
    adaptation = few_shot_adaptation({s: {q: v[q] for q in judged} for s, v in table.items()}, ctx.fold_size,
                                     ctx.seed)
    ctx.extras["aligner-adapted"] = {
        "ndcg@10": round(adaptation.mean, 4), "ndcg@10_std": round(adaptation.std, 4),
        "folds": len(adaptation.folds), "fold_size": ctx.fold_size, "candidates": ctx.candidates,
        "chosen": adaptation.chosen_counts(),
        "strategies": {s: round(sum(v[q] for q in judged) / len(judged), 4) for s, v in table.items()}}
    heads = {q: runs[adaptation.assignment.get(q, ctx.strategy)][q] for q in full}
    return with_tail(heads, full)


SYSTEMS: dict[str, Callable[[Context], Hits]] = {
    "bm25": bm25, "dense": dense, "aligner": aligner, "aligner-pruned": aligner_pruned, "hybrid": hybrid,
    "rrf": rrf, "aligner-adapted": aligner_adapted}


def work_dir(dataset: Dataset, root: str | os.PathLike) -> Path:
    """``<root>/<dataset name with / as _>``: one folder of indexes per corpus."""
    corpus = dataset.name.rsplit("/", 1)[0] if not dataset.folder else dataset.folder.resolve().as_posix()
    return Path(root) / corpus.strip("/").replace("/", "_")
