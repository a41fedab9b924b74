"""A long run of long queries through the harness's AligneR search, in one process that hosts Pyserini's JVM.

``python -m eval.bench_long_run [--queries 1406] [--corpus examples/quickstart/corpus/docs.jsonl] [--work DIR]``

Writes a BEIR folder into ``--work`` (the corpus, ``--queries`` queries of ``--words`` words cut from the corpus
text, each judged against the document it starts in), builds the harness's exact index of it (fp16, FAISS ``Flat``,
every token indexed: :func:`eval.beir.aligner.full_index`; ``--index-kind default``: the index derived from it with the
build's default codec, :func:`eval.beir.aligner.default_index`) and searches every query with
:func:`eval.beir.aligner.search` (top ``--hits``, queries of up to 64 tokens; the cached run is removed first, so
the search always runs). Pyserini's result classes are loaded first, so the JVM runs in this process for the whole
search. Prints JSON: queries searched, seconds per query, whether the JVM ran, the BLAS libraries mapped into the
process; exits 1 when a query has no hits.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from eval.cli import configure_logging
from pyserini_aligner.cli import positive_int

QUICKSTART_CORPUS = Path(__file__).resolve().parents[1] / "examples" / "quickstart" / "corpus" / "docs.jsonl"


def write_collection(corpus: Path, folder: Path, queries: int, words: int) -> int:
    """A BEIR folder at ``folder`` from a JsonCollection file: the documents, ``queries`` queries of ``words``
    consecutive words of the corpus text (each starting in a document, judged relevant to it); returns the number of
    documents."""
    docs = [json.loads(line) for line in corpus.read_text(encoding="utf-8").splitlines() if line.strip()]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "qrels").mkdir(exist_ok=True)
    owners, text = [], []
    with open(folder / "corpus.jsonl", "w", encoding="utf-8") as out:
        for doc in docs:
            out.write(json.dumps({"_id": doc["id"], "title": "", "text": doc["contents"]}) + "\n")
            tokens = doc["contents"].split()
            owners += [doc["id"]] * len(tokens)
            text += tokens
    starts = max(len(text) - words, 1)
    with open(folder / "queries.jsonl", "w", encoding="utf-8") as out, \
            open(folder / "qrels" / "test.tsv", "w", encoding="utf-8") as qrels:
        qrels.write("query-id\tcorpus-id\tscore\n")
        for number in range(queries):
            start = (number * 7919) % starts  # a prime stride: distinct windows spread over the corpus
            out.write(json.dumps({"_id": f"q{number}", "text": " ".join(text[start:start + words])}) + "\n")
            qrels.write(f"q{number}\t{owners[start]}\t1\n")
    return len(docs)


def blas_libraries() -> list[str]:
    """File names of the BLAS libraries mapped into this process."""
    names = set()
    with open("/proc/self/maps", encoding="utf-8") as maps:
        for line in maps:
            name = Path(line.split()[-1]).name
            if ".so" in name and "blas" in name.lower():
                names.add(name)
    return sorted(names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.bench_long_run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queries", type=positive_int, default=1406, help="queries to search in one process")
    parser.add_argument("--words", type=positive_int, default=60, help="words per query (cut at 64 tokens)")
    parser.add_argument("--corpus", type=Path, default=QUICKSTART_CORPUS, help="JsonCollection .jsonl file")
    parser.add_argument("--hits", type=positive_int, default=1000)
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--encoder", default="aligner")
    parser.add_argument("--index-kind", choices=["exact", "default"], default="exact",
                        help="exact: the fp16 index with FAISS Flat (the aligner-exact system); default: the one "
                             "derived from it with the build's default codec (the aligner system)")
    parser.add_argument("--work", type=Path, default=None, help="folder for the collection and index (default: a "
                                                                "temporary one, removed afterwards)")
    args = parser.parse_args(argv)
    configure_logging(quiet=True)
    from eval.beir.aligner import default_index, full_index, search
    from eval.beir.context import Context
    from pyserini_aligner.data import Dataset
    from pyserini_aligner.index.format import read_manifest
    from pyserini_aligner.search.searcher import dense_result_classes

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-long-run-"))
    try:
        num_docs = write_collection(args.corpus, work / "collection", args.queries, args.words)
        ctx = Context(dataset=Dataset(str(work / "collection")), work=work / "indexes", hits=args.hits,
                      threads=args.threads, progress=False, encoder=args.encoder)
        index = full_index(ctx) if args.index_kind == "exact" else default_index(ctx)
        shutil.rmtree(ctx.work / "runs", ignore_errors=True)  # always search, never reuse a cached run
        queries = ctx.queries
        dense_result_classes()  # Pyserini's result classes: the JVM starts here, before the timed search
        start = time.perf_counter()
        hits = search(ctx, index, desc="long run")
        seconds = time.perf_counter() - start
        import jnius_config

        empty = sorted(q for q in queries if not hits.get(q))
        manifest = read_manifest(index)
        print(json.dumps({"queries": len(hits), "docs": num_docs, "tokens": manifest.num_tokens,
                          "index_type": manifest.index_type, "hits": args.hits, "threads": args.threads,
                          "search_seconds": round(seconds, 1),
                          "seconds_per_query": round(seconds / max(len(queries), 1), 4),
                          "jvm_running": bool(jnius_config.vm_running), "blas_libraries": blas_libraries(),
                          "queries_without_hits": len(empty)}, indent=2))
        return 1 if empty or len(hits) != len(queries) else 0
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
