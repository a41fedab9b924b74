"""Document-pruning baselines at the same β^d: which tokens of each document go into FAISS.

``python -m eval.pruning_baselines --dataset beir/scifact/test --output <dir> [--betas 0.4 0.2 0.1]``

From the harness's full AligneR index (eval.beir.aligner.full_index: the same cached index under ``--cache``), each
β^d keeps the ceil(β^d·len) top-scored tokens of each document, scored by
- ``learned``: the model's stored unary salience (doc_salience.f32; the harness's aligner-pruned index);
- ``random``: seeded uniform scores;
- ``idf``: ln(N / df) of the token's wordpiece id, df over the corpus (re-tokenised with the model's tokenizer);
- ``first``: equal scores, so the first tokens are kept (ties go to the earlier position).
For the last three, a copy of the full index with doc_salience.f32 replaced (other files hard-linked) is derived
with builder.derive_index. Every index is searched with AlignerSearcher at each β^q (the query side always uses
the model's own query salience), and nDCG@10 is written to ``pruning_baselines.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from eval.beir.aligner import drop_query_hits, full_index, pruned_index
from eval.beir.systems import Context, work_dir
from eval.metrics import evaluate

log = logging.getLogger(__name__)
METHODS = ("learned", "random", "idf", "first")


def idf_salience(ctx: Context, index_dir: Path, batch: int = 1024) -> np.ndarray:
    """[T] float32: IDF of each stored token's wordpiece id, document frequencies over the index's corpus."""
    from pyserini_aligner.index.store import StoredIndex

    store, model = StoredIndex(index_dir), ctx.model
    texts = {doc.docid: doc.contents for doc in ctx.dataset.docs()}
    missing = [d for d in store.docids if d not in texts]
    if missing:
        raise ValueError(f"{index_dir}: docids {missing[:3]} are not in dataset {ctx.dataset.name}")
    special = set(model.special_ids.tolist())
    rows: list[list[int]] = []
    for start in range(0, len(store.docids), batch):
        ids, _ = model.tokenize([texts[d] for d in store.docids[start:start + batch]], is_query=False)
        if not model.config.keep_special:
            ids = [[t for t in row if t not in special] or row for row in ids]
        rows += ids
    lengths = np.diff(np.asarray(store.offsets))
    bad = [i for i, row in enumerate(rows) if len(row) != lengths[i]]
    if bad:
        raise ValueError(f"{index_dir}: document {store.docids[bad[0]]!r} has {lengths[bad[0]]} stored tokens but "
                         f"re-tokenises to {len(rows[bad[0]])} (index built with another model?)")
    flat = np.concatenate([np.asarray(r, dtype=np.int64) for r in rows])
    df = np.zeros(int(flat.max()) + 1, dtype=np.int64)
    for row in rows:
        df[np.unique(row)] += 1
    return np.log(len(rows) / df[flat]).astype(np.float32)


def method_salience(ctx: Context, full: Path, method: str, seed: int) -> np.ndarray:
    """[T] float32 token scores of ``method`` (not "learned") over the full index's stored tokens."""
    from pyserini_aligner.index.store import read_manifest

    count = read_manifest(full).num_tokens
    if method == "random":
        return np.random.default_rng(seed).random(count, dtype=np.float32)
    if method == "idf":
        return idf_salience(ctx, full)
    if method == "first":
        return np.ones(count, dtype=np.float32)
    raise ValueError(f"unknown pruning method {method!r}; choose from {METHODS}")


def rescored_source(ctx: Context, full: Path, method: str, seed: int) -> Path:
    """``<full>-sal-<method>[-<seed>]``: the full index with doc_salience.f32 replaced by ``method``'s scores."""
    from pyserini_aligner.index.store import MANIFEST, SALIENCE

    target = full.with_name(f"{full.name}-sal-{method}" + (f"-{seed}" if method == "random" else ""))
    if (target / MANIFEST).is_file():
        return target
    work = target.with_name(target.name + ".tmp")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for path in full.iterdir():
        if path.name not in (SALIENCE, MANIFEST):
            os.link(path, work / path.name)
    method_salience(ctx, full, method, seed).tofile(work / SALIENCE)
    shutil.copyfile(full / MANIFEST, work / MANIFEST)  # last: marks the folder complete
    shutil.rmtree(target, ignore_errors=True)
    work.rename(target)
    return target


def method_index(ctx: Context, method: str, beta_d: float, seed: int) -> Path:
    """The index whose FAISS part holds the β^d top tokens of each document by ``method``'s scores."""
    from pyserini_aligner.index.builder import derive_index
    from pyserini_aligner.index.store import MANIFEST

    if method == "learned":
        return pruned_index(ctx, beta_d)
    source = rescored_source(ctx, full_index(ctx), method, seed)
    target = source.with_name(f"{source.name}-d{beta_d:g}")
    if not (target / MANIFEST).is_file():
        derive_index(source, target, doc_prune=beta_d, progress=ctx.progress, overwrite=True)
    return target


def search_ndcg(ctx: Context, index_dir: Path, query_prune: float, refine_with: str = "all") -> float:
    """nDCG@10 of AlignerSearcher over ``index_dir`` at β^q = ``query_prune``, refining with "all" stored tokens
    or only the "kept" ones (the pruned tokens then leave the index altogether)."""
    from pyserini_aligner.search import AlignerSearcher

    searcher = AlignerSearcher(index_dir, encoder=ctx.model, strategy=ctx.strategy, query_prune=query_prune,
                               refine_with=refine_with)
    qids, run = list(ctx.queries), {}
    for start in tqdm(range(0, len(qids), searcher.batch_size), desc=f"{index_dir.name} q{query_prune:g}",
                      disable=not ctx.progress):
        batch = qids[start:start + searcher.batch_size]
        found = searcher.batch_search([ctx.queries[q] for q in batch], batch, k=11, threads=ctx.threads)
        run.update({q: [(h.docid, float(h.score)) for h in found[q]] for q in batch})
    run = drop_query_hits(run, 10)
    return evaluate(ctx.qrels, {q: dict(h) for q, h in run.items()}, ("ndcg@10",))["ndcg@10"]


def index_bytes(index_dir: Path) -> dict[str, float]:
    """FAISS and whole-index bytes per document."""
    from pyserini_aligner.index.store import read_manifest

    n = read_manifest(index_dir).num_docs
    faiss_bytes = (index_dir / "faiss.index").stat().st_size
    total = sum(p.stat().st_size for p in index_dir.iterdir() if p.is_file())
    return {"faiss_bytes_per_doc": round(faiss_bytes / n, 1), "index_bytes_per_doc": round(total / n, 1)}


def run_baselines(dataset_spec: str, output: str | os.PathLike, cache: str | os.PathLike = ".cache/indexes",
                  betas: tuple[float, ...] = (0.4, 0.2, 0.1), query_prunes: tuple[float, ...] = (1.0, 0.5),
                  methods: tuple[str, ...] = METHODS, encoder: str = "aligner", seed: int = 0, threads: int = 2,
                  progress: bool = True, refine_with: str = "all") -> dict:
    """Build/derive the indexes, search, write ``<output>/pruning_baselines.{json,md}``; returns the json dict."""
    from pyserini_aligner.data import Dataset

    for beta in betas:
        if not 0.0 < beta <= 1.0:
            raise ValueError(f"--betas: {beta} is not in (0, 1]")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"--methods: unknown {unknown}; choose from {METHODS}")
    dataset = Dataset(dataset_spec)
    ctx = Context(dataset=dataset, work=work_dir(dataset, cache), threads=threads, progress=progress,
                  encoder=encoder, seed=seed)
    full = full_index(ctx)
    rows = [{"beta_d": 1.0, "method": "full", **index_bytes(full),
             **{f"ndcg@10 beta_q={qp:g}": search_ndcg(ctx, full, qp, refine_with) for qp in query_prunes}}]
    for beta in betas:
        for method in methods:
            index_dir = method_index(ctx, method, beta, seed)
            rows.append({"beta_d": beta, "method": method, **index_bytes(index_dir),
                         **{f"ndcg@10 beta_q={qp:g}": search_ndcg(ctx, index_dir, qp, refine_with)
                            for qp in query_prunes}})
            log.info("%s", rows[-1])
    config = ctx.model.config
    result = {"dataset": dataset.name, "encoder": encoder, "fingerprint": ctx.fingerprint,
              "use_salience": config.use_salience, "salience_in_score": config.salience_in_score,
              "strategy": ctx.strategy, "seed": seed, "refine_with": refine_with, "rows": rows}
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    (output / "pruning_baselines.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (output / "pruning_baselines.md").write_text(markdown(result, query_prunes), encoding="utf-8")
    return result


def markdown(result: dict, query_prunes: tuple[float, ...]) -> str:
    cols = [f"ndcg@10 beta_q={qp:g}" for qp in query_prunes]
    lines = [f"# Document-pruning baselines: {result['dataset']}", "",
             f"Model `{result['encoder']}` ({result['fingerprint'][:12]}), strategy {result['strategy']}, "
             f"use_salience={result['use_salience']}, salience_in_score={result['salience_in_score']}; "
             "nDCG@10 of AlignerSearcher (query tokens pruned by the model's query salience), refinement with "
             + ("every stored token." if result.get("refine_with", "all") == "all" else
                "the kept tokens only (pruned tokens leave the index)."), "",
             "| β^d | method | " + " | ".join(f"nDCG@10 β^q={qp:g}" for qp in query_prunes)
             + " | FAISS bytes/doc | index bytes/doc |",
             "|---|---|" + "---|" * (len(cols) + 2)]
    for row in result["rows"]:
        values = " | ".join(f"{row[c]:.4f}" for c in cols)
        lines.append(f"| {row['beta_d']:g} | {row['method']} | {values} | {row['faiss_bytes_per_doc']:,.0f} | "
                     f"{row['index_bytes_per_doc']:,.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.pruning_baselines", description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", required=True, help="ir_datasets name (beir/scifact/test) or a BEIR folder")
    parser.add_argument("--output", required=True, help="folder for pruning_baselines.json / .md")
    parser.add_argument("--cache", default=".cache/indexes", help="index cache shared with python -m eval.beir")
    parser.add_argument("--betas", type=float, nargs="+", default=[0.4, 0.2, 0.1], help="β^d values")
    parser.add_argument("--query-prunes", type=float, nargs="+", default=[1.0, 0.5], help="β^q values")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), help=f"subset of {METHODS}")
    parser.add_argument("--encoder", default="aligner", help="AligneR checkpoint ('aligner' or a folder)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random baseline")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--refine-with", choices=["all", "kept"], default="all",
                        help="refine with every stored token (the method) or only the kept ones (index pruning)")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO)
    try:
        result = run_baselines(args.dataset, args.output, args.cache, tuple(args.betas), tuple(args.query_prunes),
                               tuple(args.methods), args.encoder, args.seed, args.threads, not args.quiet,
                               args.refine_with)
    except (ValueError, FileNotFoundError) as err:
        parser.exit(2, f"error: {err}\n")
    print(markdown(result, tuple(args.query_prunes)), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
