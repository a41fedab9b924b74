"""AligneR search over a multi-vector index: FAISS candidate generation + alignment refinement, exhaustive
scoring (quality ceiling) and reranking of any candidate list."""
from pyserini_aligner.search.exhaustive import ExhaustiveScorer
from pyserini_aligner.search.rerank import AlignmentReranker
from pyserini_aligner.search.searcher import AlignerSearcher

__all__ = ["AlignerSearcher", "ExhaustiveScorer", "AlignmentReranker"]
