"""Sharded search under torchrun: every rank holds a consecutive share of the index's segments.

Per query batch, rank 0's query encoding is broadcast, every rank probes its segments, the probes of all ranks are
merged exactly as :func:`.engine.merge_probes` merges devices, each rank selects the same candidates
(:func:`.engine.select_candidates`, on the CPU, from identical inputs), refines those it holds, and the refined
scores are gathered: every rank ends with the ranking a single process computes over the whole index.
Collectives exchange small CPU objects over Gloo.
"""
from __future__ import annotations

import datetime
import os
from typing import Any

import torch.distributed as dist

from pyserini_aligner.index.distributed import DEFAULT_TIMEOUT_S, DistContext, dist_context
from pyserini_aligner.index.store import StoredIndex
from pyserini_aligner.search.searcher import AlignerSearcher, split_devices


class TorchExchange:
    """``broadcast`` (from rank 0) and ``all_gather`` of picklable objects over torch.distributed's default group."""

    def __init__(self, ctx: DistContext):
        self.rank, self.world_size = ctx.rank, ctx.world_size

    def broadcast(self, obj: Any) -> Any:
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(self, obj: Any) -> list:
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out


def init_group(timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[DistContext, bool]:
    """(this rank's context, whether the Gloo process group was created here) under torchrun; RuntimeError
    outside it."""
    ctx = dist_context()
    if ctx is None:
        raise RuntimeError("--distributed runs under torchrun (RANK, WORLD_SIZE and MASTER_ADDR are not set)")
    if dist.is_initialized():
        return ctx, False
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return ctx, True


def sharded_searcher(index_dir: str | os.PathLike, ctx: DistContext, device: str = "cpu",
                     **kwargs) -> AlignerSearcher:
    """An AlignerSearcher (torch backend) of this rank's share of the segments of ``index_dir``, combining with the
    other ranks; device "cuda" means cuda:LOCAL_RANK. kwargs: AlignerSearcher's knobs."""
    store = StoredIndex(index_dir)
    mine = split_devices(store, range(ctx.world_size))[ctx.rank]
    dev = f"cuda:{ctx.local_rank}" if str(device).startswith("cuda") else "cpu"
    return AlignerSearcher(index_dir, device=dev, backend="torch", segments=mine, exchange=TorchExchange(ctx),
                           **kwargs)
