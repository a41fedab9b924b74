"""The systems the harness can run. Each takes a ``Context`` and returns ``qid -> [(docid, score)]`` best first."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pyserini_aligner.data import Dataset

Hits = dict[str, list[tuple[str, float]]]


@dataclass
class Context:
    """What every system sees: the dataset, where to keep indexes, and shared knobs."""

    dataset: Dataset
    work: Path  # indexes and caches for this dataset
    hits: int = 1000
    threads: int = 2
    progress: bool = True
    runs: dict[str, Hits] = field(default_factory=dict)  # systems already run (for fusion)

    @property
    def queries(self) -> dict[str, str]:
        if "_queries" not in self.__dict__:
            self.__dict__["_queries"] = self.dataset.queries()
        return self.__dict__["_queries"]


def bm25(ctx: Context) -> Hits:
    """Pyserini Lucene BM25 (k1=0.9, b=0.4), flat ``title + text``, with the query id removed from its hits."""
    from pyserini_aligner.bm25 import bm25_search, build_lucene_index

    index = ctx.work / "lucene"
    if not (index / "segments.gen").exists() and not any(index.glob("segments_*")):
        build_lucene_index(ctx.dataset.docs(), index, threads=ctx.threads)
    return bm25_search(index, ctx.queries, k=ctx.hits, threads=ctx.threads)


SYSTEMS: dict[str, Callable[[Context], Hits]] = {"bm25": bm25}


def work_dir(dataset: Dataset, root: str | os.PathLike) -> Path:
    """``<root>/<dataset name with / as _>``: one folder of indexes per corpus."""
    corpus = dataset.name.rsplit("/", 1)[0] if not dataset.folder else dataset.folder.resolve().as_posix()
    return Path(root) / corpus.strip("/").replace("/", "_")
