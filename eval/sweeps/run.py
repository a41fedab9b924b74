"""The alignment sweep (nDCG@10 per strategy, the paper's Table 3) and the pruning sweep (β^d × β^q against index
bytes per document), reusing the harness's cached indexes and runs."""
from __future__ import annotations

from pathlib import Path

from eval.beir.aligner import full_index, pruned_index, rescored_runs, search
from eval.beir.context import Context
from pyserini_aligner.metrics import evaluate
from pyserini_aligner.adapt.select import CANDIDATE_STRATEGIES
from pyserini_aligner.index.format import FAISS_IDS, FAISS_INDEX, LOCK, MANIFEST, read_manifest

DOC_PRUNES = (1.0, 0.4, 0.2, 0.1)
PRUNING_HITS = 100  # the pruning sweep reports nDCG@10 and recall@100: the searcher's own candidate budget suffices
QUERY_PRUNES = (1.0, 0.5, 0.3)
FAISS_FILES = (FAISS_INDEX, FAISS_IDS)  # the searched part
META_FILES = (MANIFEST, LOCK)  # commit metadata: its length varies with the settings and checksums


def ndcg10(ctx: Context, hits) -> float:
    return round(evaluate(ctx.qrels, hits, ("ndcg@10",))["ndcg@10"], 4)


def alignment_sweep(ctx: Context, strategies=CANDIDATE_STRATEGIES) -> dict[str, float]:
    """nDCG@10 of the aligner's top ``ctx.candidates`` hits (of its ``ctx.hits``-deep run, as in the harness)
    rescored with each strategy over all stored tokens."""
    candidates = search(ctx, full_index(ctx), desc="aligner")
    runs = rescored_runs(ctx, candidates, strategies)
    return {spec: ndcg10(ctx, run) for spec, run in runs.items()}


def index_bytes(index_dir: Path) -> dict[str, int]:
    """File sizes of an index folder: "faiss" (FAISS index + its row→token map), "store" (the refinement store: every
    other file but the manifest and the write lock), "total" (every file)."""
    files = [path for path in Path(index_dir).rglob("*") if path.is_file()]  # segment and codec folders included
    faiss = sum(path.stat().st_size for path in files if path.name in FAISS_FILES)
    meta = sum(path.stat().st_size for path in files if path.name in META_FILES)
    total = sum(path.stat().st_size for path in files)
    return {"faiss": faiss, "store": total - faiss - meta, "total": total}


def pruning_sweep(ctx: Context, doc_prunes=DOC_PRUNES, query_prunes=QUERY_PRUNES,
                  hits: int = PRUNING_HITS) -> list[dict]:
    """One row per (β^d, β^q): nDCG@10 and recall@100 of a top-``hits`` search, the index's bytes per document."""
    rows = []
    for doc_prune in doc_prunes:
        index_dir = pruned_index(ctx, doc_prune)
        manifest = read_manifest(index_dir)
        sizes = index_bytes(index_dir)
        for query_prune in query_prunes:
            run = search(ctx, index_dir, query_prune, f"aligner β^d={doc_prune:g} β^q={query_prune:g}", hits)
            scores = evaluate(ctx.qrels, run, ("ndcg@10", "recall@100"))
            rows.append({"doc_prune": doc_prune, "query_prune": query_prune,
                         "ndcg@10": round(scores["ndcg@10"], 4), "recall@100": round(scores["recall@100"], 4),
                         "num_kept": manifest.num_kept, "num_tokens": manifest.num_tokens,
                         **{f"{part}_bytes_per_doc": round(size / manifest.num_docs, 1)
                            for part, size in sizes.items()}})
    return rows


def sweeps_markdown(results: dict) -> str:
    """Both sweeps as Markdown tables."""
    align = results["alignment"]
    specs = list(align["ndcg@10"])
    lines = [f"### Alignment sweep: {results['dataset']} (nDCG@10, top-{align['candidates']} aligner candidates "
             "rescored with all stored tokens)", "",
             "| dataset | " + " | ".join(_strategy_header(s) for s in specs) + " |",
             "|---|" + "---:|" * len(specs),
             f"| {results['dataset']} | " + " | ".join(f"{align['ndcg@10'][s]:.4f}" for s in specs) + " |", "",
             f"### Pruning sweep: {results['dataset']} (β^d of each document's tokens in FAISS, β^q of the query's "
             f"searched; top {results['pruning_hits']} hits; refinement with all stored tokens)", "",
             "| β^d | β^q | nDCG@10 | recall@100 | tokens in FAISS | FAISS bytes/doc | store bytes/doc | total bytes/doc |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in results["pruning"]:
        lines.append(f"| {row['doc_prune']:g} | {row['query_prune']:g} | {row['ndcg@10']:.4f} | {row['recall@100']:.4f} "
                     f"| {row['num_kept']} | {row['faiss_bytes_per_doc']:.0f} | {row['store_bytes_per_doc']:.0f} "
                     f"| {row['total_bytes_per_doc']:.0f} |")
    return "\n".join(lines) + "\n"


def _strategy_header(spec: str) -> str:
    kind, value = spec.split(":")
    return f"top-k {value}" if kind == "top-k" else f"top-p {float(value) * 100:g}%"
