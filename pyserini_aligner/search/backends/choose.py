"""Choosing a backend and its front end when an index generation is opened (:func:`open_backend`,
:func:`front_end`), and where the codes of several devices go (:func:`choose_placement`: a whole copy on each when it
fits, else consecutive segments on each)."""
from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
import torch

from pyserini_aligner.index.reader import StoredIndex
from pyserini_aligner.search.backends.base import FrontEnd, Scoring, SearchBackend
from pyserini_aligner.search.backends.exchanged import Exchanged, ExchangedReplica
from pyserini_aligner.search.backends.faiss_cpu import FaissFlat, FaissIVF
from pyserini_aligner.search.backends.fronts import Encoded, Graphed
from pyserini_aligner.search.backends.tokens import TorchTokens
from pyserini_aligner.search.backends.torch_codes import TorchCodes, codes_on, resident_bytes
from pyserini_aligner.search.backends.workers import Workers
from pyserini_aligner.search.encoding import GatheredEncoder, query_encoder
from pyserini_aligner.search.options import SearchOptions

log = logging.getLogger(__name__)

# device memory a search needs beside the index (a batch of 300 queries at the GPU's default depth peaks near
# 1.3 GiB), kept free when deciding whether a whole copy of the index fits on a device
WORKSPACE_BYTES = 4 << 30


def split_devices(store: StoredIndex, devices: Sequence, numbers: Sequence[int] | None = None) -> list[list[int]]:
    """Consecutive segment numbers (of ``numbers``, default all) per device, balanced by token count (a device
    may get none)."""
    numbers = list(range(len(store.segments))) if numbers is None else list(numbers)
    tokens = np.array([store.segments[i].info.num_tokens for i in numbers], dtype=np.float64)
    bounds = np.cumsum(tokens) / max(tokens.sum(), 1) * len(devices)
    owner = np.minimum((bounds - tokens / max(tokens.sum(), 1) * len(devices) / 2).astype(int), len(devices) - 1)
    return [[numbers[i] for i in range(len(tokens)) if owner[i] == d] for d in range(len(devices))]


def fits_whole(store: StoredIndex, device: torch.device, refine_with: str) -> bool:
    """Whether a whole copy of the index's codes, and room to search, fit in ``device``'s free memory (a GPU)."""
    if device.type != "cuda":
        return False
    free, _ = torch.cuda.mem_get_info(device)
    return resident_bytes(store, range(len(store.segments)), refine_with, device) + WORKSPACE_BYTES <= free


def _consecutive(store: StoredIndex, segments: Sequence[int] | None) -> list[int]:
    if segments is None:
        return list(range(len(store.segments)))
    mine = list(segments)
    if mine and (mine[0] < 0 or mine[-1] >= len(store.segments) or mine != list(range(mine[0], mine[0] + len(mine)))):
        raise ValueError(f"segments must be consecutive numbers in [0, {len(store.segments)}), got {mine}")
    return mine


def _device(name: str | torch.device) -> torch.device:
    """``name`` as a torch.device, a CUDA device with its number (plain "cuda" is the current one)."""
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def open_backend(store: StoredIndex, options: SearchOptions, scoring: Scoring, *, searcher_class: type | None = None,
                 encoder=None) -> SearchBackend | Workers:
    """The backend that searches ``store`` (one index generation) with resolved ``options`` (its backend, devices,
    placement, segments, exchange). Several devices (compressed index, torch) are searched by
    :class:`.workers.Workers` (each device gets a one-device ``searcher_class`` with ``encoder`` and these options,
    in a worker process of its own but the first replica): "replicate" puts a whole copy of the codes on each,
    "shard" consecutive segments on each, "auto" replicates when a copy and room to search fit in every device's free
    memory (GPUs only) and shards otherwise. With ``exchange`` (one device per process of a process group) the same
    choice is made across the processes, replicating only when it fits on every rank; ``segments`` (this process's
    consecutive segments) shards explicitly. ValueError for knobs the index or backend does not take."""
    compressed = store.codec is not None
    devices = [_device(d) for d in options.all_devices]
    nprobe, segments, exchange, placement = options.nprobe, options.segments, options.exchange, options.placement
    if options.ef_search is not None and compressed:
        raise ValueError("ef_search tunes HNSW FAISS indexes of fp16 stores; this index is compressed")
    if options.searched_by == "faiss":
        return FaissIVF(store, scoring) if compressed else FaissFlat(store, scoring, nprobe, options.ef_search,
                                                                     options.k_per_token)
    if not compressed:
        if len(devices) > 1 or nprobe is not None or segments is not None or exchange is not None:
            raise ValueError("several devices, segments and nprobe need a compressed index (codec IVF<nlist>,PQ<M>)")
        return TorchTokens(store, devices[0], scoring)
    mine = _consecutive(store, segments)
    if exchange is not None:
        return _exchanged(store, devices[0], scoring, segments, exchange, placement)
    if len(devices) == 1:
        return codes_on(store, mine, devices[0], scoring)
    if placement == "auto":
        placement = choose_placement(store, devices, scoring.refine_with)
    if placement == "shard" and sum(1 for numbers in split_devices(store, devices, mine) if numbers) < 2:
        log.info("%d segment(s) cannot be spread over %d devices: searching on %s", len(mine), len(devices),
                 devices[0])
        return codes_on(store, mine, devices[0], scoring)
    if searcher_class is None:
        raise ValueError("several devices need searcher_class, the searcher each worker process opens")
    return Workers(store.index_dir, store.manifest.generation, [str(d) for d in devices], placement, searcher_class,
                   encoder, options.replace(devices=None, segments=None, placement="auto"))


def front_end(engine: SearchBackend | Workers, options: SearchOptions, scoring: Scoring, model, graphed,
              threads: int) -> FrontEnd:
    """What the searcher calls for ``engine``: the worker processes of several devices as they are; else the
    backend behind this process's query encoder (``graphed``, a :class:`..graphs.GraphedQueryEncoder`, or the
    eager ``model`` with ``threads`` threads), shared across a process group where there is one, and batches through
    CUDA-graph plans where the graphed encoder and the codes share a GPU."""
    if isinstance(engine, Workers):
        return engine
    encode = query_encoder(model, graphed, threads, options.batch_size, options.query_max_length)
    if options.exchange is not None:
        encode = GatheredEncoder(encode, options.exchange)
    front = Encoded(engine, encode, scoring, threads)
    if graphed is not None and isinstance(engine, TorchCodes) and engine.device == graphed.ids.device:
        from pyserini_aligner.search.graphs import GraphedSearch

        plan = GraphedSearch(graphed, engine.shard, scoring.query_prune, scoring.strategy, scoring.use_salience)
        return Graphed(plan, front)
    return front


def close_backend(engine: SearchBackend | Workers | None) -> None:
    """Let go of ``engine`` once a newer generation's is open: worker processes are stopped (the other backends
    hold memory only, freed with them)."""
    if isinstance(engine, Workers):
        engine.close()


def choose_placement(store: StoredIndex, devices: Sequence[torch.device], refine_with: str) -> str:
    """What placement "auto" takes on ``devices``: "replicate" when a whole copy of the index and room to search fit
    in every device's free memory (GPUs only), else "shard"."""
    return "replicate" if all(fits_whole(store, d, refine_with) for d in devices) else "shard"


def _exchanged(store: StoredIndex, device: torch.device, scoring: Scoring, segments: Sequence[int] | None, exchange,
               placement: str) -> SearchBackend:
    """The backend of one rank of a process group (see :func:`open_backend`)."""
    if segments is not None:
        if placement == "replicate":
            raise ValueError("segments and placement 'replicate' exclude each other: a replica holds every segment")
        placement = "shard"
    if placement == "auto":  # every rank takes part, so that all decide alike
        placement = "replicate" if all(exchange.all_gather(fits_whole(store, device, scoring.refine_with))) \
            else "shard"
    if placement == "replicate":
        return ExchangedReplica(codes_on(store, range(len(store.segments)), device, scoring), exchange)
    if segments is None:
        segments = split_devices(store, range(exchange.world_size))[exchange.rank]
    mine = _consecutive(store, segments)
    return Exchanged(codes_on(store, mine, device, scoring) if mine else None, exchange, device)
