"""``--filter EXPR|@FILE`` and ``--filter-field FIELD`` on Pyserini's FAISS and hybrid command lines with an AligneR
index: taken out of the arguments before Pyserini parses them (it knows neither), parsed once into a
:class:`pyserini_aligner.filters.Filter`, and applied to every search of the command: the AligneR searcher that
``FaissSearcher(...)`` builds searches with it (:class:`FilteredDense`), and the BM25 side of a hybrid is restricted
by Lucene to the docids the filter matches in the AligneR index (:class:`pyserini_aligner.bm25.FilteredLucene`), so
that both hit lists, and their fusion, hold only matching documents."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pyserini_aligner.cli import filter_matches

if TYPE_CHECKING:
    from pyserini_aligner.filters import Filter

FILTER_FLAGS: dict[str, int | str] = {"--filter": 1, "--filter-field": 1}  # flag -> number of values
HELP_NOTE = ("pyserini-aligner: with an AligneR index, --filter EXPR|@FILE searches only the documents it matches "
             "(a predicate over the fields stored with the index, e.g. \"year >= 2020\", or a file of docids one per "
             "line; --filter-field FIELD matches the file's lines against a stored field instead); in a hybrid "
             "search it restricts both the AligneR and the BM25 side.")
_ACTIVE: list[Filter] = []  # the filter of the command running in this process (set by guard_pyserini_main)


def activate(flt: Filter | None) -> None:
    """Search with ``flt`` from now on in this process (None: without a filter)."""
    _ACTIVE[:] = [flt] if flt is not None else []


def filtered_dense(searcher):
    """``searcher`` (an AlignerSearcher built by ``FaissSearcher(...)``) searching with the active filter, or
    itself without one."""
    return FilteredDense(searcher, _ACTIVE[0]) if _ACTIVE else searcher


class FilteredDense:
    """An AlignerSearcher whose ``search`` and ``batch_search`` (Pyserini's FaissSearcher calls) search only the
    documents ``flt`` matches; anything else is the searcher's own. A filter that matches no document is told in one
    line on stderr, one the index can't evaluate is a UsageError (:func:`pyserini_aligner.cli.filter_matches`)."""

    def __init__(self, searcher, flt: Filter):
        self.searcher, self.filter = searcher, flt
        filter_matches(searcher, flt)

    def search(self, q, k: int = 10, **options):
        return self.searcher.search(q, k, filter=self.filter, **options)

    def batch_search(self, queries, q_ids, k: int = 10, threads: int | None = None, **options):
        return self.searcher.batch_search(queries, q_ids, k, threads, filter=self.filter, **options)

    def __getattr__(self, name: str):
        return getattr(self.searcher, name)


def filtered_hybrid_class(hybrid_class: type) -> type:
    """Pyserini's ``HybridSearcher`` class whose sparse searcher, next to a :class:`FilteredDense` one, is restricted
    to the docids that the dense side's filter matches (Lucene's own filtering)."""
    class HybridSearcher(hybrid_class):
        def __init__(self, dense_searcher, sparse_searcher):
            if isinstance(dense_searcher, FilteredDense):
                from pyserini_aligner.bm25 import FilteredLucene, filtered_docids

                docids = filtered_docids(dense_searcher.filter, dense_searcher.searcher.store)
                sparse_searcher = FilteredLucene(sparse_searcher, docids)
            super().__init__(dense_searcher, sparse_searcher)

    HybridSearcher.__qualname__ = hybrid_class.__qualname__
    HybridSearcher.__module__ = hybrid_class.__module__
    return HybridSearcher
