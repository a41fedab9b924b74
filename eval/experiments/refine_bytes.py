"""How many residual bytes a token does a BEIR-sized corpus need? The default index derived from the harness's exact
index with each refinement size, searched with the searcher's defaults, against the exact index searched the same
way: overlap@10 with the exact ranking (no judgements needed) and, where the split has qrels, nDCG@10 and
recall@1000 of both.

    python -m eval.experiments.refine_bytes --dataset beir/scifact/train --refine 32,64 --output DIR

Choose on a train or dev split. Each index is ``IVF<nlist>,PQ4,Refine(PQ<R>)`` with the nlist, β^d and redundancy
rule of the defaults, derived once per R from the stored float16 tokens (no encoding) and cached beside the exact
index under ``--cache``; ``--dtype`` as ``eval.beir``. Writes refine_bytes.json and refine_bytes.md.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from eval.beir.aligner import full_index, search
from eval.beir.context import Context, add_study_arguments, study_context
from eval.cli import configure_logging, positive_ints, write_report
from pyserini_aligner.metrics import evaluate

HITS = 1000
QUERY_PRUNE = 0.5  # the searcher's default β^q


def overlap_at(run: dict, reference: dict, k: int = 10) -> float:
    """Mean over ``reference``'s queries of |top k of run ∩ top k of reference| / k (runs: qid -> [(docid, score)],
    best first)."""
    shares = [len({d for d, _ in run.get(q, [])[:k]} & {d for d, _ in ranked[:k]}) / k
              for q, ranked in reference.items()]
    return sum(shares) / len(shares) if shares else 0.0


def refined_index(ctx: Context, refine_m: int) -> Path:
    """The default index with ``refine_m`` residual bytes a token, derived once from the exact index."""
    from pyserini_aligner.index.builder import derive_index
    from pyserini_aligner.index.codec_spec import choose_nlist
    from pyserini_aligner.index.format import MANIFEST, read_manifest
    from pyserini_aligner.index.options import DEFAULT_DOC_PRUNE
    from pyserini_aligner.salience import DEFAULT_PRUNE_REDUNDANCY

    full = full_index(ctx)
    source = read_manifest(full)
    codec = f"IVF{choose_nlist(source.num_tokens)},PQ4,Refine(PQ{refine_m})"
    target = full.with_name(f"{full.name}-refine{refine_m}")
    if not (target / MANIFEST).is_file() or str(read_manifest(target).codec) != codec:
        derive_index(full, target, doc_prune=DEFAULT_DOC_PRUNE, codec=codec,
                     prune_redundancy=DEFAULT_PRUNE_REDUNDANCY, progress=ctx.progress, overwrite=True)
    return target


def index_bytes(index_dir: Path) -> int:
    return sum(p.stat().st_size for p in index_dir.rglob("*") if p.is_file())


def measure(ctx: Context, refine: list[int]) -> dict:
    """{"exact": {metrics}, "rows": [{"refine_m", "codec", "bytes_per_doc", "overlap@10", metrics...}]}."""
    from pyserini_aligner.index.format import read_manifest

    def metrics(run: dict) -> dict:
        scores = evaluate(ctx.qrels, run, ("ndcg@10", "recall@1000"))
        return {m: round(v, 4) for m, v in scores.items()}

    exact = search(ctx, full_index(ctx), QUERY_PRUNE, desc="exact", hits=HITS)
    report = {"dataset": ctx.dataset.name, "queries": len(ctx.queries), "query_prune": QUERY_PRUNE, "hits": HITS,
              "exact": metrics(exact), "rows": []}
    for m in refine:
        start = time.perf_counter()
        index = refined_index(ctx, m)
        derived = time.perf_counter() - start
        manifest = read_manifest(index)
        run = search(ctx, index, QUERY_PRUNE, desc=f"Refine(PQ{m})", hits=HITS)
        report["rows"].append({"refine_m": m, "codec": str(manifest.codec), "doc_prune": manifest.doc_prune,
                               "bytes_per_doc": round(index_bytes(index) / manifest.num_docs),
                               "overlap@10": round(overlap_at(run, exact), 4), **metrics(run),
                               "derive_s": round(derived, 1)})
    return report


def markdown(report: dict) -> str:
    exact = report["exact"]
    lines = [f"{report['dataset']}, {report['queries']} queries, β^q {report['query_prune']}, {report['hits']} hits; "
             "overlap@10 with the exact index searched the same way.", "",
             "| codec | β^d | bytes a document | overlap@10 | nDCG@10 | recall@1000 |", "|---|---:|---:|---:|---:|---:|",
             f"| exact (fp16, every token) | 1 | | 1.0 | {exact.get('ndcg@10', '')} | {exact.get('recall@1000', '')} |"]
    for row in report["rows"]:
        lines.append(f"| {row['codec']} | {row['doc_prune']} | {row['bytes_per_doc']} | {row['overlap@10']} | "
                     f"{row.get('ndcg@10', '')} | {row.get('recall@1000', '')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.experiments.refine_bytes",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", required=True, help="ir_datasets id, e.g. beir/scifact/train")
    parser.add_argument("--refine", type=positive_ints, default=[32, 64],
                        help="comma-separated residual bytes a token (default 32,64)")
    parser.add_argument("--output", required=True, help="folder for refine_bytes.json and refine_bytes.md")
    add_study_arguments(parser)
    args = parser.parse_args(argv)
    configure_logging(args.quiet)
    ctx = study_context(args, hits=HITS)
    report = measure(ctx, args.refine)
    write_report(args.output, "refine_bytes", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
