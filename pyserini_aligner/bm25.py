"""BM25 through Pyserini itself: a Lucene index of a JsonCollection, searched with ``LuceneSearcher``."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Mapping

from pyserini_aligner.data import Doc, DataError, write_json_collection
from pyserini_aligner.hits import drop_query_hits

K1, B = 0.9, 0.4  # Pyserini's BEIR "flat" regression settings


def build_lucene_index(docs: Iterable[Doc], index_dir: str | os.PathLike, threads: int = 2) -> Path:
    """Index ``docs`` (``contents`` = title + text) with Anserini's IndexCollection, built aside and renamed into place."""
    index_dir = Path(index_dir)
    index_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{index_dir.name}.", dir=index_dir.parent))
    try:
        if write_json_collection(docs, work / "collection") == 0:
            raise DataError("empty corpus: nothing to index")
        from pyserini.pyclass import autoclass

        args = ["-collection", "JsonCollection", "-generator", "DefaultLuceneDocumentGenerator",
                "-input", str(work / "collection"), "-index", str(work / "index"), "-threads", str(threads),
                "-storePositions", "-storeDocvectors", "-storeRaw", "-quiet"]
        autoclass("io.anserini.index.IndexCollection").main(args)
        if index_dir.exists():
            shutil.rmtree(index_dir)
        os.replace(work / "index", index_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return index_dir


def bm25_search(index_dir: str | os.PathLike, queries: Mapping[str, str], k: int = 1000, threads: int = 2,
                remove_query: bool = True, k1: float = K1, b: float = B) -> dict[str, list[tuple[str, float]]]:
    """BM25 top-``k`` per query: ``qid -> [(docid, score)]``; with ``remove_query`` a hit whose id is the qid is dropped."""
    from pyserini.search.lucene import LuceneSearcher

    searcher = LuceneSearcher(str(index_dir))
    searcher.set_bm25(k1, b)
    qids = list(queries)
    extra = 1 if remove_query else 0
    results = searcher.batch_search([queries[q] for q in qids], qids, k=k + extra, threads=threads)
    hits = {qid: [(hit.docid, float(hit.score)) for hit in results.get(qid, [])] for qid in qids}
    return drop_query_hits(hits, k) if remove_query else hits
