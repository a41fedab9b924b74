"""How an index is searched: one typed, validated object that the searcher takes (:class:`SearchOptions`), and the
depth of a top-k search (:class:`Depth`, :meth:`SearchOptions.depth`)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from pyserini_aligner.strategy import Strategy, as_strategy
from pyserini_aligner.search.defaults import DEFAULT_QUERY_PRUNE

if TYPE_CHECKING:
    from pyserini_aligner.index.reader import StoredIndex

BACKENDS = ("faiss", "torch")
PLACEMENTS = ("auto", "replicate", "shard")
REFINE_WITH = ("all", "kept")
DEFAULT_BATCH_SIZE = 32
# Candidate-generation defaults (k_per_token, nprobe, max_candidates, interaction_candidates) per kind of device,
# chosen with python -m eval.bench_scale.sweep on synthetic passages (docs/scaling.md): a GPU narrows 49,152
# candidates by centroid interaction and refines 768 (at 1M passages with 64-byte codes and β^d 0.5, 0.953 of the
# exact top 10 against 0.938 for 512 with β^d 0.2, at 2.8 ms p50; eval/results/scale/sweep_1m_doc_prune_h200.md);
# a CPU refines 128 candidates straight from the probes (SciFact test: nDCG@10 within half a point of exhaustive
# scoring of the same index).
DEPTH_DEFAULTS = {"cuda": (3000, 8, 768, 49152), "cpu": (100, 8, 128, 0)}
DEEP_FACTOR = 2  # entries per probe and documents refined per hit asked for (chosen on NFCorpus dev at 1000 hits)
# A filtered search refines every matching document, without probing, when at most FILTER_EXHAUSTIVE times the refined
# count match; otherwise it probes with the filter's mask, its inverted lists deepened for the rarer matches by at most
# FILTER_DEEPEN times (the probes scan that many times the entries: at 1M passages on a GPU a 5 % filter cost 1.9×
# the unfiltered p50 with 4 times, 1.4× with 2; python -m eval.bench_filter, eval/results/bench_filter_1m_h200*).
# Without a centroid-interaction stage (the CPU's defaults), a probed filter of a compressed index narrows
# FILTER_EXHAUSTIVE times the refined count by centroid interaction (on SciFact's 5,183 documents a 50 % filter keeps
# 0.97 of the exhaustive filtered top 10 so, 0.92 refining twice the candidates instead: python -m
# eval.experiments.filter_fidelity); an fp16 index, which has no centroids, refines live/matching times the
# candidates, at most FILTER_DEEPEN times.
FILTER_EXHAUSTIVE = 4
FILTER_DEEPEN = 2


class Depth(NamedTuple):
    """How deep a top-k search goes: ``per_probe`` (K) entries kept per probe, ``nprobe`` inverted lists probed per
    probe, ``interaction`` (W) candidates narrowed by centroid interaction (0: none), ``refined`` (C) candidates
    rescored with the full alignment score. ``per_probe`` 0 (:attr:`every_row`): no candidate generation, every
    allowed row of a filtered search is refined (``refined`` of them)."""

    per_probe: int
    nprobe: int
    interaction: int
    refined: int

    @property
    def every_row(self) -> bool:
        """Whether the search refines every allowed row instead of probing (a filter that matches few rows)."""
        return self.per_probe == 0


def filtered_depth(depth: Depth, matching: int, live: int, nlist: int | None) -> Depth:
    """The depth of a search that ``depth`` (unfiltered) would make, restricted to ``matching`` of the ``live``
    documents (a compressed index: ``nlist`` inverted lists; None for an fp16 index). At most FILTER_EXHAUSTIVE ×
    the refined count match: every one is refined, unprobed (exhaustive over the filter). Otherwise the probes skip
    the other rows' entries and keep their K best matching ones, as in an index of the matching documents alone,
    which would hold live/matching times fewer entries a list: the inverted lists probed grow by that ratio (at most
    FILTER_DEEPEN times, at most nlist). Where the depth has no centroid-interaction stage, a compressed index's
    probed filter gets one over FILTER_EXHAUSTIVE × the refined count (no more than the rarest probed filter would
    refine unprobed), and an fp16 index refines that ratio times the candidates (at most FILTER_DEEPEN times). The
    centroid interaction narrows at most the matching documents (none when they would be no more than the refined
    ones)."""
    if matching <= FILTER_EXHAUSTIVE * depth.refined:
        return Depth(0, 0, 0, matching)
    if matching >= live:  # a filter of every live document is no filter
        return depth
    ratio = live / matching
    nprobe = depth.nprobe
    if nlist is not None:
        nprobe = min(nlist, max(nprobe, math.ceil(nprobe * min(FILTER_DEEPEN, ratio))))
    refined, interaction = depth.refined, min(depth.interaction, matching)
    if not depth.interaction and nlist is not None:  # narrow a wider set by the centroids of all their tokens
        interaction = FILTER_EXHAUSTIVE * refined
    elif not depth.interaction:  # no centroids to narrow a wider set: refine more of the probes' candidates
        refined = max(refined, math.ceil(refined * min(FILTER_DEEPEN, ratio)))
    return Depth(depth.per_probe, nprobe, interaction if interaction > refined else 0, refined)


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def device_kind(device) -> str:
    """"cuda" for a CUDA device (a name or a torch.device), else "cpu"."""
    return "cuda" if str(device).startswith("cuda") else "cpu"


def default_backend(device) -> str:
    """"torch" on CUDA, else "faiss"."""
    return "torch" if device_kind(device) == "cuda" else "faiss"


def pyserini_device(faiss_device: str) -> str:
    """The searcher's device for Pyserini's ``faiss_device`` argument: a CUDA device as it is, anything else the CPU."""
    return faiss_device if device_kind(faiss_device) == "cuda" else "cpu"


@dataclass(frozen=True)
class SearchOptions:
    """Every setting of a search (:class:`.searcher.AlignerSearcher`); ValueError naming the field for a value no
    search can use. None means the default of the device (``DEPTH_DEFAULTS``; :meth:`resolved` fills them in).

    strategy: alignment strategy for refinement (a string is parsed here; None: the index's). k_per_token: indexed
    document tokens taken per kept query token (raised to 2k for deep searches). query_prune: β^q, fraction of query
    tokens probed (refinement always uses all). max_candidates: documents refined per query (at least 2k).
    refine_with: "all" stored doc tokens or only the "kept" ones. nprobe: inverted lists probed per query token
    (compressed indexes; raised when the lists hold fewer than k_per_token entries); ef_search: HNSW search depth
    (fp16 indexes). device: where queries are encoded and, with the torch backend, searched. batch_size: queries
    encoded and searched together. backend: "faiss" (default on the CPU) or "torch" (default on CUDA).
    interaction_candidates: compressed indexes only, documents first narrowed to max_candidates by centroid
    interaction (0: off). query_max_length: tokens per query, special tokens included (None: the model's).
    devices: several devices of one machine (torch backend, compressed index), placed by ``placement`` ("auto",
    "replicate" or "shard"); segments: this process's consecutive segments of a process group's index; exchange: a
    :class:`pyserini_aligner.dist.Collectives` connecting the processes of that group (not picklable).
    """

    strategy: Strategy | None = None
    k_per_token: int | None = None
    query_prune: float = DEFAULT_QUERY_PRUNE
    max_candidates: int | None = None
    refine_with: str = "all"
    nprobe: int | None = None
    ef_search: int | None = None
    device: str = "cpu"
    batch_size: int = DEFAULT_BATCH_SIZE
    backend: str | None = None
    interaction_candidates: int | None = None
    query_max_length: int | None = None
    devices: tuple[str, ...] | None = None
    segments: tuple[int, ...] | None = None
    exchange: Any = None
    placement: str = "auto"

    def __post_init__(self) -> None:
        if self.strategy is not None:
            object.__setattr__(self, "strategy", as_strategy(self.strategy))
        if not isinstance(self.device, str):
            object.__setattr__(self, "device", str(self.device))  # a torch.device
        for name in ("devices", "segments"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(str(d) for d in value) if name == "devices" else tuple(value))
        if self.devices is not None and not self.devices:
            object.__setattr__(self, "devices", None)
        for name in ("k_per_token", "max_candidates", "nprobe", "ef_search"):
            value = getattr(self, name)
            if value is not None and (not _count(value) or value < 1):
                raise ValueError(f"{name} must be None or an integer >= 1, got {value!r}")
        if not _count(self.batch_size) or self.batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {self.batch_size!r}")
        if self.interaction_candidates is not None and (not _count(self.interaction_candidates)
                                                        or self.interaction_candidates < 0):
            raise ValueError(f"interaction_candidates must be None or an integer >= 0, got "
                             f"{self.interaction_candidates!r}")
        if isinstance(self.query_prune, bool) or not isinstance(self.query_prune, (int, float)) \
                or not 0.0 < self.query_prune <= 1.0:
            raise ValueError(f"query_prune must be in (0, 1], got {self.query_prune!r}")
        if self.refine_with not in REFINE_WITH:
            raise ValueError(f"refine_with must be one of {REFINE_WITH}, got {self.refine_with!r}")
        if self.query_max_length is not None and (not _count(self.query_max_length) or self.query_max_length < 3):
            raise ValueError(f"query_max_length must be >= 3 (two special tokens and one word), got "
                             f"{self.query_max_length!r}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.searched_by == "faiss":
            if any(device_kind(d) == "cuda" for d in self.all_devices):
                raise ValueError("backend 'faiss' runs on the CPU; use backend 'torch' (the default) on CUDA")
            if len(self.all_devices) > 1 or self.segments is not None or self.exchange is not None:
                raise ValueError("several devices, segments and exchange need backend 'torch'")

    @property
    def all_devices(self) -> tuple[str, ...]:
        """The devices searched: ``devices``, else (``device``,)."""
        return self.devices or (self.device,)

    @property
    def first_device(self) -> str:
        """Where queries are encoded: the first of ``devices``, else ``device``."""
        return self.all_devices[0]

    @property
    def searched_by(self) -> str:
        """The backend: ``backend``, else the device's default."""
        return self.backend or default_backend(self.first_device)

    def replace(self, **changes) -> "SearchOptions":
        """These options with ``changes`` (field=value), checked again; TypeError naming an unknown field."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"unknown search option(s) {', '.join(unknown)}; the fields of SearchOptions are "
                            f"{', '.join(f.name for f in dataclasses.fields(self))}")
        return dataclasses.replace(self, **changes) if changes else self

    def on_rank(self, ctx) -> "SearchOptions":
        """These options for rank ``ctx`` (a :class:`pyserini_aligner.dist.DistContext`) of a torchrun job: the torch
        backend, exchanging through the job's collectives; device "cuda" means cuda:LOCAL_RANK."""
        from pyserini_aligner.dist import Collectives, rank_device

        return self.replace(device=rank_device(self.device, ctx), backend="torch", exchange=Collectives(ctx))

    def resolved(self) -> "SearchOptions":
        """These options with the device's defaults filled in (backend, k_per_token, max_candidates,
        interaction_candidates; ``device`` the first of ``devices``). nprobe stays as given (None: the device's
        default at each search, see :meth:`depth`)."""
        default_k, _, default_c, default_w = DEPTH_DEFAULTS[device_kind(self.first_device)]
        return self.replace(device=self.first_device, backend=self.searched_by,
                            k_per_token=default_k if self.k_per_token is None else self.k_per_token,
                            max_candidates=default_c if self.max_candidates is None else self.max_candidates,
                            interaction_candidates=default_w if self.interaction_candidates is None
                            else self.interaction_candidates)

    def depth(self, k: int, store: "StoredIndex", has_interaction: bool, matching: int | None = None) -> Depth:
        """The depth of a top-k search of ``store`` by a backend that has (or not) the centroid-interaction stage,
        from resolved options: K and the refined count are at least ``DEEP_FACTOR``·k, so that a deep search (hybrid
        and reranking pipelines take 1000 hits) finds what exhaustive scoring finds. ``matching``: a filtered
        search's count of matching live documents (:func:`filtered_depth`)."""
        live = max(store.num_live, 1)
        limit = min(max(self.max_candidates, DEEP_FACTOR * k), live)
        staged = self.interaction_candidates and has_interaction
        wide = min(max(self.interaction_candidates, 4 * k), live) if staged else 0
        wide = wide if wide > limit else 0
        per_token = max(self.k_per_token, DEEP_FACTOR * k)
        nprobe = self.nprobe or DEPTH_DEFAULTS[device_kind(self.device)][1]
        if store.codec is not None:
            nlist = store.codec_spec.nlist
            mean_list = max(store.num_live_kept / max(nlist, 1), 1.0)  # deleted entries are never probed
            nprobe = min(nlist, max(nprobe, math.ceil(2 * per_token / mean_list)))
        depth = Depth(per_token, nprobe, wide, limit)
        if matching is None:
            return depth
        return filtered_depth(depth, matching, live, store.codec_spec.nlist if store.codec is not None else None)


def search_options(options: SearchOptions | None = None, **changes) -> SearchOptions:
    """``options`` (else the defaults) with ``changes``: how the searcher takes either one SearchOptions or its
    fields as keyword arguments."""
    return (options or SearchOptions()).replace(**changes)
