"""AligneR search over a multi-vector index: FAISS candidate generation + alignment refinement, exhaustive
scoring (quality ceiling) and reranking of any candidate list.

The classes are imported on first use (``from pyserini_aligner.search import AlignerSearcher``), so that the
command line ``python -m pyserini_aligner.search`` does not load torch for ``--help`` or a bad flag."""
from __future__ import annotations

from importlib import import_module

_CLASSES = {"AlignerSearcher": "pyserini_aligner.search.searcher", "SearchOptions": "pyserini_aligner.search.options",
            "ExhaustiveScorer": "pyserini_aligner.search.exhaustive",
            "AlignmentReranker": "pyserini_aligner.search.rerank"}

__all__ = ["AlignerSearcher", "SearchOptions", "ExhaustiveScorer", "AlignmentReranker"]


def __getattr__(name: str):
    if name not in _CLASSES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_CLASSES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
