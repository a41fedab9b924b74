"""AligneR pieces of the harness: cached indexes (full, the default compressed one, β^d-pruned; the full index of
any other checkpoint), searches and per-strategy rescoring."""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from tqdm.auto import tqdm

from eval.beir.cache import Hits, cache_path, cached_hits, load_hits, queries_hash, save_hits
from eval.beir.context import Context
from pyserini_aligner.hits import drop_query_hits
from pyserini_aligner.salience import DEFAULT_PRUNE_REDUNDANCY

log = logging.getLogger(__name__)

PRUNED = {"doc_prune": 0.2, "query_prune": 0.5}  # the aligner-pruned system: β^d, β^q


def index_key(index_dir: Path) -> dict:
    """What identifies an index's contents (for run cache keys)."""
    from pyserini_aligner.index.format import read_manifest

    m = read_manifest(index_dir)
    return {"fingerprint": m.model_fingerprint, "doc_prune": m.doc_prune, "prune_redundancy": m.prune_redundancy,
            "index_type": m.index_type,
            "num_docs": m.num_docs, "num_tokens": m.num_tokens, "num_kept": m.num_kept, "created": m.created}


def full_index(ctx: Context, encoder: str | None = None) -> Path:
    """``<work>/aligner-<fingerprint[:8]>[-bf16]``: the corpus encoded with ``encoder`` (default ``ctx.encoder``; a
    shipped name or a checkpoint folder) in ``ctx.dtype``, built once: exact fp16 vectors, every token indexed (the
    pruned and compressed variants are derived from it)."""
    from pyserini_aligner.index import build_index
    from pyserini_aligner.index.builder import model_name_of
    from pyserini_aligner.index.format import MANIFEST

    model = ctx.checkpoint(encoder)
    target = ctx.work / f"aligner-{model.fingerprint()[:8]}{ctx.dtype_suffix}"
    if not (target / MANIFEST).is_file():
        log.info("building the AligneR index %s", target)
        docs = ((doc.docid, doc.contents) for doc in ctx.dataset.docs())
        with ctx.sharing(model.backbone):
            build_index(docs, target, model, codec="fp16", doc_prune=1.0, progress=ctx.progress, overwrite=True,
                        model_name=model_name_of(encoder or ctx.encoder), dtype=ctx.dtype)
    return target


def pruned_index(ctx: Context, doc_prune: float, redundancy: float | None = DEFAULT_PRUNE_REDUNDANCY) -> Path:
    """The full index with β^d = ``doc_prune`` of each document's tokens in FAISS, chosen by salience with
    redundancy-aware pruning at cosine ``redundancy`` (None: salience alone); derived once, not re-encoded."""
    from pyserini_aligner.index.derive import derive_pruned_index
    from pyserini_aligner.index.format import MANIFEST, read_manifest

    full = full_index(ctx)
    if doc_prune == 1.0:
        return full
    target = full.with_name(f"{full.name}-d{doc_prune:g}" + ("" if redundancy is None else f"-r{redundancy:g}"))
    if not (target / MANIFEST).is_file() or read_manifest(target).prune_redundancy != redundancy:
        log.info("deriving %s (doc_prune=%g, prune_redundancy=%s) from %s", target, doc_prune, redundancy, full)
        derive_pruned_index(full, target, doc_prune, progress=ctx.progress, overwrite=True,
                            prune_redundancy=redundancy)
    return target


def default_index(ctx: Context) -> Path:
    """The index a user gets from ``python -m pyserini_aligner.index`` with its defaults (codec auto, β^d and the
    redundancy rule of the defaults), derived once from the full index's stored tokens instead of encoding again
    (its codec trains on a sample of every document's tokens rather than on the first documents')."""
    from pyserini_aligner.index.builder import derive_index
    from pyserini_aligner.index.options import DEFAULT_CODEC, DEFAULT_DOC_PRUNE
    from pyserini_aligner.index.codec_spec import resolve_codec
    from pyserini_aligner.index.format import MANIFEST, read_manifest

    full = full_index(ctx)
    target = full.with_name(f"{full.name}-default")
    source = read_manifest(full)
    codec = resolve_codec(DEFAULT_CODEC, source.dim, source.num_tokens)  # what the defaults pick today
    if not (target / MANIFEST).is_file() or read_manifest(target).codec != codec:
        log.info("deriving the default index %s from %s", target, full)
        derive_index(full, target, doc_prune=DEFAULT_DOC_PRUNE, codec=DEFAULT_CODEC,
                     prune_redundancy=DEFAULT_PRUNE_REDUNDANCY, progress=ctx.progress, overwrite=True)
    return target


def search(ctx: Context, index_dir: Path, query_prune: float = 1.0, desc: str = "aligner",
           hits: int | None = None, strategy: str | None = None, encoder: str | None = None) -> Hits:
    """AlignerSearcher over ``index_dir`` (``strategy``, default ``ctx.strategy``; β^q = ``query_prune``; queries
    encoded by ``encoder``, default ``ctx.encoder``: the index's checkpoint), top ``hits`` (default ``ctx.hits``)
    per query without the query's own id (:func:`searched`, then :func:`~pyserini_aligner.hits.drop_query_hits`)."""
    hits = ctx.hits if hits is None else hits
    return drop_query_hits(searched(ctx, index_dir, query_prune, desc, hits, strategy, encoder), hits)


def searched(ctx: Context, index_dir: Path, query_prune: float = 1.0, desc: str = "aligner",
             hits: int | None = None, strategy: str | None = None, encoder: str | None = None) -> Hits:
    """What :func:`search` searches: the top ``hits`` + 1 of every query as the searcher returns them (the query's
    own id among them, as BEIR's convention searches one more and drops it); the searcher refines max(its default
    candidate budget, hits + 1) documents. Cached under ``<work>/runs`` (shared by every caller with the same index
    and knobs); ``desc`` labels the progress bar."""
    hits = ctx.hits if hits is None else hits
    strategy = ctx.strategy if strategy is None else strategy
    key = {"index": index_key(index_dir), "strategy": strategy, "query_prune": query_prune,
           "k": hits + 1, "queries": queries_hash(ctx.queries)}

    def compute() -> Hits:
        from pyserini_aligner.search import AlignerSearcher

        searcher = AlignerSearcher(index_dir, encoder=ctx.checkpoint(encoder), strategy=strategy,
                                   query_prune=query_prune)
        qids, found = list(ctx.queries), {}
        step = searcher.batch_size
        with tqdm(total=len(qids), desc=desc, unit="query", disable=not ctx.progress) as bar:
            for start in range(0, len(qids), step):
                batch = qids[start:start + step]
                results = searcher.batch_search([ctx.queries[q] for q in batch], batch, k=hits + 1,
                                                threads=ctx.threads)
                found.update({q: [(h.docid, float(h.score)) for h in results[q]] for q in batch})
                bar.update(len(batch))
        return found

    return cached_hits(ctx.work / "runs", "aligner", key, compute)


def rescored_runs(ctx: Context, candidates: Hits, strategies, encoder: str | None = None) -> dict[str, Hits]:
    """``strategy -> run``: each query's top ``ctx.candidates`` hits of ``candidates`` reranked under every strategy
    by ``encoder`` (default ``ctx.encoder``) over its full index's stored vectors (exact: the documents' texts as
    that checkpoint encodes them, stored in fp16). Cached per strategy; missing ones are computed together."""
    from pyserini_aligner.adapt.select import rescore
    from pyserini_aligner.index.reader import StoredIndex

    index_dir = full_index(ctx, encoder)
    heads = {q: [d for d, _ in ranked[:ctx.candidates]] for q, ranked in candidates.items()}
    base = {"index": index_key(index_dir), "candidates": hashlib.sha256(json.dumps(heads, sort_keys=True).encode())
            .hexdigest()[:16], "queries": queries_hash(ctx.queries)}
    typed = {str(s): s for s in strategies}  # Strategy values, keyed by their strings
    specs = list(typed)
    paths = {s: cache_path(ctx.work / "runs", f"rescore-{s.replace(':', '')}", {**base, "strategy": s}) for s in specs}
    missing = [s for s in specs if not paths[s].is_file()]
    runs = {s: load_hits(paths[s]) for s in specs if s not in missing}
    if missing:
        fresh = rescore(StoredIndex(index_dir), ctx.checkpoint(encoder), ctx.queries, heads,
                        [typed[s] for s in missing], progress=ctx.progress)
        for s in missing:
            save_hits(fresh[s], paths[s])
        runs.update(fresh)
    return {s: runs[s] for s in specs}
