"""Search under torchrun: every rank holds either its consecutive share of the index's segments or a whole copy.

Per query batch the ranks' query encodings are gathered (on GPUs each rank encodes a part, on CPUs rank 0 all).
Placement "shard": every rank probes its segments, each probe's K-th score over all ranks is found (the ranks share
that work), each rank ranks the documents it holds by the candidate proxy (:func:`.engine.rank_candidates`, as one
process would over the whole index) and the best of all ranks are the candidates; on GPUs each rank then fetches the
tokens of its part of the queries' candidates and scores them itself, on CPUs every rank scores those it holds and
the scores are combined (:class:`.backends.Exchanged`). Placement "replicate": every rank searches its consecutive
part of the batch over its copy and the hits are gathered. Either way every rank ends with the ranking a single process computes over
the whole index. Collectives (:class:`pyserini_aligner.dist.Collectives`) exchange tensors (on the GPUs under NCCL,
through the host under Gloo).
"""
from __future__ import annotations

import os

from pyserini_aligner.dist import Collectives, DistContext
from pyserini_aligner.search.searcher import AlignerSearcher


def distributed_searcher(index_dir: str | os.PathLike, ctx: DistContext, device: str = "cpu",
                         placement: str = "auto", **kwargs) -> AlignerSearcher:
    """An AlignerSearcher (torch backend) of rank ``ctx.rank``, searching in lockstep with the other ranks; device
    "cuda" means cuda:LOCAL_RANK. placement: "shard" (this rank's share of the segments), "replicate" (the whole
    index) or "auto" (replicate when the index fits on every rank's GPU). kwargs: AlignerSearcher's knobs. Every
    rank must call it, and then search, with the same arguments."""
    dev = f"cuda:{ctx.local_rank}" if str(device).startswith("cuda") else "cpu"
    return AlignerSearcher(index_dir, device=dev, backend="torch", exchange=Collectives(ctx), placement=placement,
                           **kwargs)
