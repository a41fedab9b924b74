"""BM25 through Pyserini itself: a Lucene index of a JsonCollection, searched with ``LuceneSearcher``, also
restricted to the documents a filter matches (:class:`FilteredLucene`)."""
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


DOCID_FIELD = "id"  # the Lucene field holding a document's docid (Anserini's IndexArgs.ID)


def filtered_docids(flt, store) -> list[str]:
    """The docids of the live documents of index generation ``store`` (a :class:`.index.reader.StoredIndex`) that
    ``flt`` (a :class:`.filters.Filter`) matches: what the Lucene side of a filtered hybrid is restricted to.
    FilterError for a field the index does not store."""
    import numpy as np

    rows = np.flatnonzero(flt.rows(store) & store.live)
    return [store.docids[row] for row in rows]


class FilteredLucene:
    """A Pyserini ``LuceneSearcher`` restricted to the documents ``docids``, with Lucene's own filtering: each query
    is the searcher's BM25 query of the text (MUST) and a non-scoring FILTER clause, a ``TermInSetQuery`` on the
    docid field, so that every hit scores as in the unfiltered search. ``search`` and ``batch_search`` take the
    arguments of LuceneSearcher's (query texts); anything else is the searcher's own."""

    def __init__(self, searcher, docids: Iterable[str]):
        from pyserini.pyclass import autoclass

        array_list, bytes_ref = autoclass("java.util.ArrayList"), autoclass("org.apache.lucene.util.BytesRef")
        terms = array_list()
        for docid in sorted(set(docids)):
            terms.add(bytes_ref(docid.encode("utf-8")))
        self.searcher, self.size = searcher, terms.size()
        self._filter = autoclass("org.apache.lucene.search.TermInSetQuery")(DOCID_FIELD, terms)
        self._builder = autoclass("org.apache.lucene.search.BooleanQuery$Builder")
        self._occur = autoclass("org.apache.lucene.search.BooleanClause$Occur")

    def query(self, text: str):
        """The Lucene query of ``text``, restricted to the filter's documents."""
        engine = self.searcher.object
        builder = self._builder()
        builder.add(engine.generator.buildQuery("contents", engine.get_analyzer(), text), self._occur.MUST)
        builder.add(self._filter, self._occur.FILTER)
        return builder.build()

    def search(self, q: str, k: int = 10, **options) -> list:
        """The top-``k`` hits (Pyserini's JScoredDoc) of query text ``q`` among the filter's documents."""
        if self.size == 0:
            return []
        return self.searcher.search(self.query(q), k, **options)

    def batch_search(self, queries: list[str], qids: list[str], k: int = 10, threads: int = 1, **options) -> dict:
        """{qid: top-``k`` hits} of each query text, one query after the other (LuceneSearcher's batch search takes
        texts only)."""
        return {qid: self.search(text, k, **options) for text, qid in zip(queries, qids)}

    def __getattr__(self, name: str):
        return getattr(self.searcher, name)
