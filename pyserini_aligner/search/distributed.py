"""Sharded search under torchrun: every rank holds a consecutive share of the index's segments.

Per query batch, rank 0's query encoding is broadcast, every rank probes its segments, the probes of all ranks are
merged exactly as :func:`.engine.merge_probes` merges devices, each rank selects the same candidates
(:func:`.engine.select_candidates`, on the CPU, from identical inputs), refines those it holds, and the refined
scores are gathered: every rank ends with the ranking a single process computes over the whole index.
Collectives (:class:`pyserini_aligner.dist.Collectives`) exchange small CPU objects over Gloo.
"""
from __future__ import annotations

import os

from pyserini_aligner.dist import Collectives, DistContext
from pyserini_aligner.index.store import StoredIndex
from pyserini_aligner.search.searcher import AlignerSearcher, split_devices


def sharded_searcher(index_dir: str | os.PathLike, ctx: DistContext, device: str = "cpu",
                     **kwargs) -> AlignerSearcher:
    """An AlignerSearcher (torch backend) of this rank's share of the segments of ``index_dir``, combining with the
    other ranks; device "cuda" means cuda:LOCAL_RANK. kwargs: AlignerSearcher's knobs."""
    store = StoredIndex(index_dir)
    mine = split_devices(store, range(ctx.world_size))[ctx.rank]
    dev = f"cuda:{ctx.local_rank}" if str(device).startswith("cuda") else "cpu"
    return AlignerSearcher(index_dir, device=dev, backend="torch", segments=mine, exchange=Collectives(ctx),
                           **kwargs)
