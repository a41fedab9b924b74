"""Exact inner-product search of an fp16 segment's flat FAISS index, with the products on torch's BLAS.

FAISS searches a flat index (``Flat``: every kept token vector, in float32) with matrix products on the OpenBLAS
that the faiss-cpu wheel bundles: an old build (0.3.15) that picks its kernels by CPU model, one of three OpenBLAS
copies in a process that also loads numpy's and scipy's, next to torch's own BLAS and Pyserini's JVM.
:func:`search_index` computes the same products with torch (the BLAS that encoding and refinement already use), a
block of vectors at a time, and keeps each probe's k best in FAISS's own result heaps, so that a search makes no
call into that OpenBLAS. The ranking is FAISS's (scores to float rounding). Other kinds of index are searched by
FAISS itself. The searcher also runs the coarse step of a compressed index's IVF search (its flat quantizer) here
and lets FAISS scan the chosen lists.
"""
from __future__ import annotations

import numpy as np
import torch

from pyserini_aligner.search.allowed import row_selector

_BLOCK_ELEMENTS = 1 << 24  # scores computed at once (64 MiB of float32)


def flat_vectors(index) -> np.ndarray | None:
    """The float32 vectors [ntotal, d] of a flat inner-product FAISS index (a view of the index's own memory, valid
    while the index lives), or None for any other kind of index."""
    import faiss

    flat = faiss.downcast_index(index)
    if type(flat) not in (faiss.IndexFlatIP, faiss.IndexFlat) or flat.metric_type != faiss.METRIC_INNER_PRODUCT:
        return None
    if flat.ntotal == 0:
        return np.zeros((0, flat.d), dtype=np.float32)
    return faiss.rev_swig_ptr(flat.get_xb(), flat.ntotal * flat.d).reshape(flat.ntotal, flat.d)


def search_index(index, probes: np.ndarray, k: int,
                 allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(scores [R, k] float32, labels [R, k] int64) as ``index.search(probes, k)``: each probe's k largest inner
    products, best first, label −1 where the index holds fewer than k vectors. A flat inner-product index is
    searched with torch's products and FAISS's heaps (see the module); any other index by FAISS. ``allowed`` [ntotal]
    (bool) or None (all): only the vectors it allows are searched (the others never take one of the k places)."""
    vectors = flat_vectors(index)
    if vectors is None:
        if allowed is None:
            return index.search(probes, k)
        return index.search(probes, k, params=selected(index, row_selector(allowed)))
    return flat_search(vectors, probes, k, allowed)


def selected(index, selector):
    """FAISS search parameters of ``index`` (its nprobe for an IVF index, its efSearch for HNSW) with ``selector``."""
    import faiss

    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        return faiss.SearchParametersIVF(sel=selector, nprobe=ivf.nprobe)
    hnsw = faiss.downcast_index(index)
    if isinstance(hnsw, faiss.IndexHNSW):
        return faiss.SearchParametersHNSW(sel=selector, efSearch=hnsw.hnsw.efSearch)
    return faiss.SearchParameters(sel=selector)


def flat_search(vectors: np.ndarray, probes: np.ndarray, k: int,
                allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(scores [R, k] float32, positions [R, k] int64) of each probe's k largest inner products with the rows of
    ``vectors`` [N, d] float32 (only those that ``allowed`` [N] allows, when given), best first (−inf scores and −1
    positions past them). probes [R, d] float32."""
    import faiss

    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    probes = np.ascontiguousarray(probes, dtype=np.float32)
    rows = len(probes)
    scores = np.empty((rows, k), dtype=np.float32)
    positions = np.empty((rows, k), dtype=np.int64)
    if rows == 0:
        return scores, positions
    heaps = faiss.float_minheap_array_t()  # a min-heap of the k largest scores per probe
    heaps.k, heaps.nh = k, rows
    heaps.val, heaps.ids = faiss.swig_ptr(scores), faiss.swig_ptr(positions)
    heaps.heapify()
    query = torch.from_numpy(probes)
    base = torch.from_numpy(np.ascontiguousarray(vectors, dtype=np.float32))
    step = max(1024, _BLOCK_ELEMENTS // rows)
    for first in range(0, len(base), step):
        block = (query @ base[first:first + step].T).numpy()  # [rows, width], C-contiguous
        if allowed is not None:
            block[:, ~allowed[first:first + step]] = -np.inf  # never enters a heap
        heaps.addn(block.shape[1], faiss.swig_ptr(block), first, 0, rows)
    heaps.reorder()  # best first
    positions[~np.isfinite(scores) | (scores <= np.finfo(np.float32).min)] = -1
    scores[positions < 0] = -np.inf
    return scores, positions
