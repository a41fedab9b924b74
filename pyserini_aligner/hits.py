"""Hit lists ``qid -> [hit, ...]`` (best first), as every searcher and the evaluation return them."""
from __future__ import annotations

from typing import Mapping, Sequence, TypeVar

Hit = TypeVar("Hit")


def docid_of(hit) -> str:
    """The docid of a ``(docid, score)`` pair or of a Pyserini hit (``.docid``)."""
    return hit.docid if hasattr(hit, "docid") else hit[0]


def drop_query_hits(hits: Mapping[str, Sequence[Hit]], k: int | None = None) -> dict[str, list[Hit]]:
    """Every query's hits without the one whose docid is the query id itself, cut at ``k`` (None: all).

    BEIR's convention for corpora where a query is also a document (ArguAna, Quora, ...): search ``k + 1`` hits,
    then drop the query. Don't use it where query ids and docids are unrelated numbers that may collide.
    """
    return {qid: [h for h in ranked if docid_of(h) != qid][:k] for qid, ranked in hits.items()}
