"""The systems the harness can run. Each takes a ``Context`` and returns ``qid -> [(docid, score)]`` best first;
numbers to report besides the run's metrics (chosen alpha, fold std, ...) go to ``ctx.extras[name]``."""
from __future__ import annotations

import logging
from typing import Callable

from eval.beir.context import Context, Hits

log = logging.getLogger(__name__)


def require(ctx: Context, name: str, needed_by: str | None = None) -> Hits:
    """The run of system ``name``, running it first if it has not run yet."""
    if name not in ctx.runs:
        log.info("running %s%s on %s", name, f" (needed by {needed_by})" if needed_by else "", ctx.dataset.name)
        ctx.runs[name] = SYSTEMS[name](ctx)
    return ctx.runs[name]


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
    """Pyserini ``FaissSearcher`` over ``<work>/dense-minilm-<model hash>[-bf16]`` (all-MiniLM-L6-v2 mean pooling,
    encoded in ``ctx.dtype``, built once) with ``AutoQueryEncoder``."""
    from eval.beir.dense import build_dense_index, dense_searcher as open_searcher, minilm_folder, model_key

    folder = minilm_folder()
    index = ctx.work / f"dense-minilm-{model_key(folder)}{ctx.dtype_suffix}"
    if not (index / "index").is_file():
        build_dense_index(ctx.dataset.docs(), index, folder, progress=ctx.progress, layers=ctx.layers,
                          dtype=ctx.dtype)
    return open_searcher(index, folder)


def dense(ctx: Context) -> Hits:
    """Pyserini FaissSearcher over all-MiniLM-L6-v2 mean-pooled vectors (the single-vector baseline)."""
    from eval.beir.dense import dense_search
    from pyserini_aligner.hits import drop_query_hits

    return drop_query_hits(dense_search(dense_searcher(ctx), ctx.queries, k=ctx.hits + 1, threads=ctx.threads),
                           ctx.hits)


def aligner(ctx: Context) -> Hits:
    """AligneR as users get it: the default index (codec auto, β^d of the defaults) with the checkpoint's default
    strategy, searched with the searcher's defaults (β^q of the defaults)."""
    from eval.beir.aligner import default_index, search
    from pyserini_aligner.index.format import read_manifest
    from pyserini_aligner.search.defaults import DEFAULT_QUERY_PRUNE

    index = default_index(ctx)
    manifest = read_manifest(index)
    ctx.extras["aligner"] = {"strategy": ctx.strategy, "codec": str(manifest.codec), "doc_prune": manifest.doc_prune,
                             "query_prune": DEFAULT_QUERY_PRUNE}
    return search(ctx, index, DEFAULT_QUERY_PRUNE, desc="aligner")


def aligner_exact(ctx: Context) -> Hits:
    """AligneR on exact float16 token vectors, every token indexed and searched: what compression costs."""
    from eval.beir.aligner import full_index, search

    ctx.extras["aligner-exact"] = {"strategy": ctx.strategy}
    return search(ctx, full_index(ctx), desc="aligner-exact")


def aligner_pruned(ctx: Context) -> Hits:
    """AligneR with β^d = 0.2 of each document's tokens in FAISS and β^q = 0.5 of the query's searched
    (refinement still uses every stored token)."""
    from eval.beir.aligner import PRUNED, pruned_index, search

    ctx.extras["aligner-pruned"] = {"strategy": ctx.strategy, **PRUNED}
    return search(ctx, pruned_index(ctx, PRUNED["doc_prune"]), PRUNED["query_prune"], desc="aligner-pruned")


def hybrid(ctx: Context) -> Hits:
    """Pyserini HybridSearcher over AligneR (the default index, the searcher's defaults) and BM25, alpha chosen on
    the dev/train split; the test queries' AligneR hits are the aligner system's search (see ``hybrid_search``)."""
    from eval.beir.aligner import default_index
    from eval.beir.hybrid import NORMALIZATION, choose_alpha, hybrid_search, hybrid_searcher

    index = default_index(ctx)
    searcher = hybrid_searcher(ctx, index, lucene_index(ctx))
    choice = choose_alpha(ctx, searcher)
    ctx.extras["hybrid"] = {**choice, "normalization": NORMALIZATION}
    return hybrid_search(ctx, searcher, index, choice["alpha"])


def rrf(ctx: Context) -> Hits:
    """Reciprocal rank fusion (ranx ``fuse``, k=60) of bm25 and aligner."""
    from eval.beir.fusion import rrf_fuse

    return rrf_fuse([require(ctx, "bm25", "rrf"), require(ctx, "aligner", "rrf")], k=ctx.hits)


def aligner_adapted(ctx: Context) -> Hits:
    """Few-shot adaptation of the checkpoint and the alignment, as ``pyserini_aligner.adapt`` chooses them. Folds of
    ``ctx.fold_size`` test queries each choose a (checkpoint, strategy) pair on their own queries only: the
    default (``ctx.encoder`` with its default strategy, the aligner-exact system) unless a pair, scored by nDCG@10
    of aligner-exact's top ``ctx.candidates`` rescored with it (every checkpoint of ``ctx.adapt_checkpoints``,
    default every shipped one, from its own exact index: over all test queries the candidates are nearly the whole
    corpus, so the index, built once and cached, costs what encoding them would), gains >= ``ctx.min_gain`` with
    p <= ``ctx.alpha`` (one-sided paired randomisation test, max-T over every pair; see ``choose``). A chosen pair
    then searches its checkpoint's index with its strategy (AlignerSearcher, top ``ctx.hits``: what the user gets
    from the index that adapt's command builds); nDCG@10 is the mean over folds of that search's nDCG@10 on the
    other queries. The run ranks each query with the choice of a fold without it (see
    ``Adaptation.assignment``)."""
    from eval.beir.aligner import full_index, rescored_runs, search
    from pyserini_aligner.adapt.checkpoints import checkpoint_label
    from pyserini_aligner.adapt.select import (CANDIDATE_STRATEGIES, Candidate, few_shot_adaptation, mean_delta,
                                               per_query, strategy_table)
    from pyserini_aligner.checkpoints import SHIPPED
    from pyserini_aligner.search.options import SearchOptions

    full = require(ctx, "aligner-exact", "aligner-adapted")
    own = checkpoint_label(ctx.encoder)
    sources = {own: None}  # label -> encoder as rescored_runs and search take it (None: ctx.encoder)
    sources.update({checkpoint_label(c): c for c in (ctx.adapt_checkpoints or SHIPPED)
                    if checkpoint_label(c) != own})
    runs = {Candidate(label, s): run for label, encoder in sources.items()
            for s, run in rescored_runs(ctx, full, CANDIDATE_STRATEGIES, encoder).items()}
    table = strategy_table(ctx.qrels, runs)
    judged = sorted(set(ctx.queries) & set(ctx.qrels))
    own_default = Candidate(own, str(SearchOptions(strategy=ctx.strategy).strategy))  # its string as the table's
    adaptation = few_shot_adaptation({c: {q: v[q] for q in judged} for c, v in table.items()}, own_default,
                                     ctx.fold_size, ctx.seed, ctx.alpha, ctx.min_gain)
    baseline = adaptation.baseline
    served = {c: full if c == baseline else
              search(ctx, full_index(ctx, sources[c.checkpoint]), desc=f"aligner-adapted {c}", strategy=c.strategy,
                     encoder=sources[c.checkpoint])
              for c in adaptation.candidates()}
    scores = {c: per_query(ctx.qrels, run) for c, run in served.items()}
    adaptation = adaptation.scored(scores)
    moved = [q for q in judged if adaptation.assignment[q] != baseline]
    moved_delta = [scores[adaptation.assignment[q]][q] - scores[baseline][q] for q in moved]
    switched = {"checkpoint": [f for f in adaptation.changed if f.chosen.checkpoint != own],
                "strategy": [f for f in adaptation.changed if f.chosen.checkpoint == own]}
    ctx.extras["aligner-adapted"] = {
        "ndcg@10": round(adaptation.mean, 4), "ndcg@10_std": round(adaptation.std, 4),
        "folds": len(adaptation.folds), "fold_size": ctx.fold_size, "candidates": ctx.candidates,
        "baseline": str(baseline), "checkpoints": list(sources),
        "alpha": ctx.alpha, "min_gain": ctx.min_gain, "search_hits": ctx.hits,
        "chosen": {str(c): n for c, n in adaptation.chosen_counts().items()},
        "changed_folds": len(adaptation.changed),
        "changed_delta": _rounded(adaptation.changed_delta),
        "switched": {kind: {"folds": len(folds), "delta": _rounded(mean_delta(folds))}
                     for kind, folds in switched.items()},
        "changed_queries": len(moved),
        "changed_queries_delta": round(sum(moved_delta) / len(moved), 4) if moved else None,
        "fold_choices": [{"checkpoint": f.chosen.checkpoint, "strategy": f.chosen.strategy, "changed": f.choice.changed,
                          "switch": None if not f.choice.changed else
                          "checkpoint" if f.chosen.checkpoint != own else "strategy",
                          # the gain and p of the chosen pair where the fold switched, of the best pair otherwise
                          "best": str(f.choice.best), "gain": round(f.choice.gain(_shown(f.choice)), 4),
                          "p": round(f.choice.p_values[_shown(f.choice)], 4),
                          "held_out": round(f.held_out, 4), "held_out_baseline": round(f.held_out_baseline, 4),
                          "delta": round(f.delta, 4), "queries": f.queries} for f in adaptation.folds],
        "scores": {name: {c.strategy: round(sum(v[q] for q in judged) / len(judged), 4)
                          for c, v in table.items() if c.checkpoint == name}
                   for name in dict.fromkeys(c.checkpoint for c in table)}}
    return {q: served[adaptation.assignment.get(q, baseline)][q] for q in full}


def _shown(choice) -> object:
    """The pair a fold's report shows: the one chosen where the fold switched (the best by mean may have missed the
    test), else the best by mean."""
    return choice.chosen if choice.changed else choice.best


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


SYSTEMS: dict[str, Callable[[Context], Hits]] = {
    "bm25": bm25, "dense": dense, "aligner": aligner, "aligner-exact": aligner_exact, "aligner-pruned": aligner_pruned,
    "hybrid": hybrid, "rrf": rrf, "aligner-adapted": aligner_adapted}
