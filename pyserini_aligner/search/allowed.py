"""The document rows a search may return, as masks that candidate generation applies while it probes (today the live
rows; deleted ones never take a probe's entry): one boolean per row, its FAISS selector, and its entries of an fp16
segment's token index."""
from __future__ import annotations

import numpy as np

from pyserini_aligner.index.reader import StoredIndex


def allowed_rows(store: StoredIndex) -> np.ndarray:
    """bool [rows]: the document rows of ``store`` that a search may return (the live ones). Candidate generation
    masks the other rows while it probes, in every backend (:meth:`.codes.CodeShard.probe`, :func:`row_selector` for
    FAISS's scans, :func:`allowed_entries` for the token indexes of fp16 segments), so that they never take one of a
    probe's K entries nor lower its K-th score: an index with deleted documents ranks as a build without them."""
    return store.live


def allowed_entries(store: StoredIndex, number: int, allowed: np.ndarray) -> np.ndarray | None:
    """bool [K]: the entries of fp16 segment ``number``'s FAISS index (its kept tokens, by FAISS id) that belong to
    ``allowed`` rows [rows]; None when every one does."""
    seg = store.segments[number]
    rows = store.doc_of_token(seg.faiss_ids + store.token_base[number])
    entries = allowed[rows]
    return None if entries.all() else entries


def row_selector(allowed: np.ndarray):
    """FAISS's selector (``IDSelectorBitmap``) of the ids i where ``allowed`` [N] (bool) is True, for a search's
    ``SearchParameters.sel``: FAISS skips the other ids while it scans. The selector holds its bitmap."""
    import faiss

    bitmap = np.packbits(allowed, bitorder="little")
    selector = faiss.IDSelectorBitmap(len(allowed), faiss.swig_ptr(bitmap))
    selector.referenced_objects = [bitmap]
    return selector
