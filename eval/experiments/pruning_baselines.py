"""Document-pruning baselines at the same β^d: which tokens of each document go into FAISS.

``python -m eval.experiments.pruning_baselines --dataset beir/scifact/test --output <dir> [--betas 0.4 0.2 0.1]``

From the harness's full AligneR index (eval.beir.aligner.full_index: the same cached index under ``--cache``), each
β^d keeps the ceil(β^d·len) top-scored tokens of each document, scored by
- ``learned``: the model's stored unary salience (doc_salience.f32; the harness's aligner-pruned index);
- ``random``: seeded uniform scores, one index per ``--seeds`` entry (the table gives mean ± sd);
- ``idf``: ln(N / df) of the token's wordpiece id, df over the corpus (re-tokenised with the model's tokenizer);
- ``first``: equal scores, so the first tokens are kept (ties go to the earlier position);
each under every ``--redundancy`` rule: ``off`` (scores alone) or a cosine threshold (salience.prune_mask: a token
within that cosine of a higher-scored token of its document is kept only if the distinct tokens leave room).
For the last three, a copy of the full index with each segment's doc_salience.f32 replaced (other files
hard-linked) is derived with builder.derive_index. Every index is searched with AlignerSearcher at each β^q (the
query side always uses the model's own query salience). Written to ``pruning_baselines.json`` and ``.md``: nDCG@10
on the qrels, and overlap@10, the share of the exhaustive scorer's top 10 (every stored token of every document, no
pruning) that the pruned search also returns in its top 10 (needs no relevance labels).
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

from eval.beir.aligner import full_index, pruned_index
from eval.beir.context import Context, harness_dtype, work_dir
from pyserini_aligner.hits import drop_query_hits
from pyserini_aligner.metrics import evaluate
from pyserini_aligner.salience import DEFAULT_PRUNE_REDUNDANCY

log = logging.getLogger(__name__)
METHODS = ("learned", "random", "idf", "first")
Run = dict[str, list[str]]  # qid -> docids, best first


def idf_salience(ctx: Context, index_dir: Path, batch: int = 1024) -> np.ndarray:
    """[T] float32: IDF of each stored token's wordpiece id, document frequencies over the index's corpus."""
    from pyserini_aligner.index.reader import StoredIndex

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
    from pyserini_aligner.index.format import read_manifest

    count = read_manifest(full).num_tokens
    if method == "random":
        return np.random.default_rng(seed).random(count, dtype=np.float32)
    if method == "idf":
        return idf_salience(ctx, full)
    if method == "first":
        return np.ones(count, dtype=np.float32)
    raise ValueError(f"unknown pruning method {method!r}; choose from {METHODS}")


def _link_or_copy(source: str, target: str) -> None:
    """Hard-link ``source`` at ``target`` (a copy across file systems)."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def rescored_source(ctx: Context, full: Path, method: str, seed: int) -> Path:
    """``<full>-sal-<method>[-<seed>]``: a copy of the full index (files hard-linked where possible) whose segments'
    doc_salience.f32 hold ``method``'s scores, each file's record updated in the manifest."""
    from pyserini_aligner.index.commit import write_manifest
    from pyserini_aligner.index.format import LOCK, MANIFEST, SALIENCE, read_manifest
    from pyserini_aligner.index.io import file_record

    target = full.with_name(f"{full.name}-sal-{method}" + (f"-{seed}" if method == "random" else ""))
    if (target / MANIFEST).is_file():
        return target
    work = target.with_name(target.name + ".tmp")
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(full, work, copy_function=_link_or_copy,
                    ignore=shutil.ignore_patterns(MANIFEST, LOCK, ".tmp-*", ".manifest.*"))
    manifest = read_manifest(full)
    if SALIENCE not in (manifest.segments[0].files if manifest.segments else {}):
        raise ValueError(f"{full}: codec {manifest.codec} stores no saliences; rescoring needs an fp16 index")
    scores = method_salience(ctx, full, method, seed)
    start = 0
    for segment in manifest.segments:
        path = work / segment.name / SALIENCE
        path.unlink()  # a hard link to the full index's file: never write through it
        scores[start:start + segment.num_tokens].tofile(path)
        segment.files[SALIENCE] = file_record(path)
        start += segment.num_tokens
    write_manifest(work, manifest)  # last: marks the folder complete
    shutil.rmtree(target, ignore_errors=True)
    work.rename(target)
    return target


def method_index(ctx: Context, method: str, beta_d: float, seed: int, redundancy: float | None) -> Path:
    """The index whose FAISS part holds the β^d top tokens of each document by ``method``'s scores, with
    redundancy-aware pruning at cosine ``redundancy`` (None: scores alone)."""
    from pyserini_aligner.index.builder import derive_index
    from pyserini_aligner.index.format import MANIFEST

    if method == "learned":
        return pruned_index(ctx, beta_d, redundancy)
    source = rescored_source(ctx, full_index(ctx), method, seed)
    target = source.with_name(f"{source.name}-d{beta_d:g}" + ("" if redundancy is None else f"-r{redundancy:g}"))
    if not (target / MANIFEST).is_file():
        derive_index(source, target, doc_prune=beta_d, progress=ctx.progress, overwrite=True,
                     prune_redundancy=redundancy)
    return target


def search_top10(ctx: Context, index_dir: Path, query_prune: float, refine_with: str = "all") -> Run:
    """Top 10 docids per query of AlignerSearcher over ``index_dir`` at β^q = ``query_prune``, refining with "all"
    stored tokens or only the "kept" ones (the pruned tokens then leave the index altogether); the query's own
    docid is dropped (BEIR convention)."""
    from pyserini_aligner.search import AlignerSearcher

    searcher = AlignerSearcher(index_dir, encoder=ctx.model, strategy=ctx.strategy, query_prune=query_prune,
                               refine_with=refine_with)
    return _top10(searcher, ctx, f"{index_dir.name} q{query_prune:g}")


def exhaustive_top10(ctx: Context) -> Run:
    """Top 10 docids per query of the exhaustive scorer over the full index (the pruned searches' target)."""
    from pyserini_aligner.search.exhaustive import ExhaustiveScorer

    return _top10(ExhaustiveScorer(full_index(ctx), encoder=ctx.model, strategy=ctx.strategy), ctx, "exhaustive")


def _top10(searcher, ctx: Context, desc: str, batch: int = 32) -> Run:
    qids, run = list(ctx.queries), {}
    for start in tqdm(range(0, len(qids), batch), desc=desc, disable=not ctx.progress):
        chunk = qids[start:start + batch]
        found = searcher.batch_search([ctx.queries[q] for q in chunk], chunk, k=11, threads=ctx.threads)
        run.update({q: [(h.docid, float(h.score)) for h in found[q]] for q in chunk})
    return {q: [d for d, _ in hits] for q, hits in drop_query_hits(run, 10).items()}


def ndcg10(qrels: dict[str, dict[str, int]], run: Run) -> float:
    """Mean nDCG@10 of a ranked run (ranks become descending scores)."""
    scored = {q: {d: float(len(docs) - r) for r, d in enumerate(docs)} for q, docs in run.items()}
    return evaluate(qrels, scored, ("ndcg@10",))["ndcg@10"]


def overlap10(run: Run, reference: Run) -> float:
    """Mean over the reference's queries of |top10(run) ∩ top10(reference)| / |top10(reference)|."""
    shares = [len(set(run.get(q, [])) & set(ref)) / len(ref) for q, ref in reference.items() if ref]
    return float(np.mean(shares)) if shares else 0.0


def index_bytes(index_dir: Path) -> dict[str, float]:
    """FAISS and whole-index bytes per document."""
    from pyserini_aligner.index.format import read_manifest

    n = read_manifest(index_dir).num_docs
    files = [p for p in Path(index_dir).rglob("*") if p.is_file()]  # segment folders included
    faiss_bytes = sum(p.stat().st_size for p in files if p.name == "faiss.index")
    total = sum(p.stat().st_size for p in files)
    return {"faiss_bytes_per_doc": round(faiss_bytes / n, 1), "index_bytes_per_doc": round(total / n, 1)}


def run_baselines(dataset_spec: str, output: str | os.PathLike, cache: str | os.PathLike = ".cache/indexes",
                  betas: tuple[float, ...] = (0.4, 0.2, 0.1), query_prunes: tuple[float, ...] = (1.0, 0.5),
                  methods: tuple[str, ...] = METHODS, encoder: str = "aligner", seeds: tuple[int, ...] = (0,),
                  threads: int = 2, progress: bool = True, refine_with: str = "all",
                  redundancies: tuple[float | None, ...] = (None, DEFAULT_PRUNE_REDUNDANCY)) -> dict:
    """Build/derive the indexes, search, write ``<output>/pruning_baselines.{json,md}``; returns the json dict."""
    from pyserini_aligner.data import Dataset

    for beta in betas:
        if not 0.0 < beta <= 1.0:
            raise ValueError(f"--betas: {beta} is not in (0, 1]")
    for threshold in redundancies:
        if threshold is not None and not 0.0 < threshold <= 1.0:
            raise ValueError(f"--redundancy: {threshold} is not 'off' or in (0, 1]")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"--methods: unknown {unknown}; choose from {METHODS}")
    if not seeds:
        raise ValueError("--seeds: give at least one seed")
    dataset = Dataset(dataset_spec)
    ctx = Context(dataset=dataset, work=work_dir(dataset, cache), threads=threads, progress=progress,
                  encoder=encoder, seed=seeds[0], dtype=harness_dtype())  # the harness's indexes
    full = full_index(ctx)
    reference = exhaustive_top10(ctx)

    def measured(index_dir: Path) -> dict:
        out = index_bytes(index_dir)
        for qp in query_prunes:
            run = search_top10(ctx, index_dir, qp, refine_with)
            out[f"ndcg@10 beta_q={qp:g}"] = ndcg10(ctx.qrels, run)
            out[f"overlap@10 beta_q={qp:g}"] = overlap10(run, reference)
        return out

    rows = [{"beta_d": 1.0, "method": "full", "redundancy": None, "seed": None, **measured(full)}]
    for beta in betas:
        for threshold in redundancies:
            for method in methods:
                for seed in (seeds if method == "random" else (None,)):
                    rows.append({"beta_d": beta, "method": method, "redundancy": threshold, "seed": seed,
                                 **measured(method_index(ctx, method, beta, seed or 0, threshold))})
                    log.info("%s", rows[-1])
    config = ctx.model.config
    result = {"dataset": dataset.name, "encoder": encoder, "fingerprint": ctx.fingerprint,
              "use_salience": config.use_salience, "salience_in_score": config.salience_in_score,
              "strategy": ctx.strategy, "seeds": list(seeds), "refine_with": refine_with,
              "exhaustive_ndcg@10": ndcg10(ctx.qrels, reference), "rows": rows}
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    (output / "pruning_baselines.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (output / "pruning_baselines.md").write_text(markdown(result, query_prunes), encoding="utf-8")
    return result


def summary_rows(rows: list[dict]) -> list[dict]:
    """Rows with the random seeds of each (β^d, redundancy) merged: metric columns become [mean, sd, n]."""
    merged: dict[tuple, dict] = {}
    for row in rows:
        key = (row["beta_d"], row["redundancy"], row["method"])
        merged.setdefault(key, {**row, "_values": []})["_values"].append(row)
    out = []
    for entry in merged.values():
        values = entry.pop("_values")
        for col in [c for c in entry if c.startswith(("ndcg@10", "overlap@10"))]:
            xs = np.array([v[col] for v in values])
            entry[col] = [float(xs.mean()), float(xs.std(ddof=1)) if len(xs) > 1 else 0.0, len(xs)]
        out.append(entry)
    return out


def markdown(result: dict, query_prunes: tuple[float, ...]) -> str:
    def cell(value: list) -> str:
        mean, sd, n = value
        return f"{mean:.4f}" if n == 1 else f"{mean:.4f} ± {sd:.4f} ({n} seeds)"

    cols = [f"ndcg@10 beta_q={qp:g}" for qp in query_prunes] + [f"overlap@10 beta_q={qp:g}" for qp in query_prunes]
    lines = [f"# Document-pruning baselines: {result['dataset']}", "",
             f"Model `{result['encoder']}` ({result['fingerprint'][:12]}), strategy {result['strategy']}, "
             f"use_salience={result['use_salience']}, salience_in_score={result['salience_in_score']}; "
             "AlignerSearcher (query tokens pruned by the model's query salience), refinement with "
             + ("every stored token." if result.get("refine_with", "all") == "all" else
                "the kept tokens only (pruned tokens leave the index).")
             + " redundancy: cosine threshold of redundancy-aware pruning (off: scores alone). overlap@10: share of "
             f"the exhaustive scorer's top 10 returned (exhaustive nDCG@10 {result['exhaustive_ndcg@10']:.4f}). "
             "Random: mean ± sample sd over seeds.", "",
             "| β^d | redundancy | method | " + " | ".join(f"nDCG@10 β^q={qp:g}" for qp in query_prunes) + " | "
             + " | ".join(f"overlap@10 β^q={qp:g}" for qp in query_prunes) + " | FAISS bytes/doc | index bytes/doc |",
             "|---|---|---|" + "---|" * (len(cols) + 2)]
    for row in summary_rows(result["rows"]):
        rule = "–" if row["method"] == "full" else ("off" if row["redundancy"] is None else f"{row['redundancy']:g}")
        values = " | ".join(cell(row[c]) for c in cols)
        lines.append(f"| {row['beta_d']:g} | {rule} | {row['method']} | {values} | {row['faiss_bytes_per_doc']:,.0f} | "
                     f"{row['index_bytes_per_doc']:,.0f} |")
    return "\n".join(lines) + "\n"


def redundancy_arg(text: str) -> float | None:
    """--redundancy value: "off" (None) or a cosine threshold."""
    if text.lower() == "off":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'off' or a number in (0, 1], got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.experiments.pruning_baselines", description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", required=True, help="ir_datasets name (beir/scifact/test) or a BEIR folder")
    parser.add_argument("--output", required=True, help="folder for pruning_baselines.json / .md")
    parser.add_argument("--cache", default=".cache/indexes", help="index cache shared with python -m eval.beir")
    parser.add_argument("--betas", type=float, nargs="+", default=[0.4, 0.2, 0.1], help="β^d values")
    parser.add_argument("--query-prunes", type=float, nargs="+", default=[1.0, 0.5], help="β^q values")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), help=f"subset of {METHODS}")
    parser.add_argument("--encoder", default="aligner", help="AligneR checkpoint ('aligner', 'aligner-mix' or a folder)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="seeds of the random baseline")
    parser.add_argument("--redundancy", type=redundancy_arg, nargs="+", default=[None, DEFAULT_PRUNE_REDUNDANCY],
                        help=f"pruning rules: 'off' and/or cosine thresholds (default: off {DEFAULT_PRUNE_REDUNDANCY})")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--refine-with", choices=["all", "kept"], default="all",
                        help="refine with every stored token (the method) or only the kept ones (index pruning)")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO)
    try:
        result = run_baselines(args.dataset, args.output, args.cache, tuple(args.betas), tuple(args.query_prunes),
                               tuple(args.methods), args.encoder, tuple(args.seeds), args.threads, not args.quiet,
                               args.refine_with, tuple(args.redundancy))
    except (ValueError, FileNotFoundError) as err:
        parser.exit(2, f"error: {err}\n")
    print(markdown(result, tuple(args.query_prunes)), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
