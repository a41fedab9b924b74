"""The document rows a search may return, as masks that candidate generation applies while it probes: the live rows
(deleted ones never take a probe's entry), and per search the live rows a filter matches (:class:`AllowedRows`): one
boolean per row, its FAISS selector, and its entries of an fp16 segment's token index."""
from __future__ import annotations

from typing import Callable, TypeVar

import numpy as np
import torch

from pyserini_aligner.filters import Filter
from pyserini_aligner.index.reader import StoredIndex

T = TypeVar("T")


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


class AllowedRows:
    """The rows a filtered search may return (a filter resolved against one index generation, deleted rows masked):
    ``mask`` bool [rows] and ``count``, the number of rows it allows. The forms the backends take (a tensor on a
    device, FAISS's selector, an fp16 segment's entries) are made on first use and kept with it, so that a filter
    that the searcher reuses costs its conversions once."""

    def __init__(self, mask: np.ndarray):
        self.mask = np.ascontiguousarray(mask, dtype=bool)
        self.count = int(self.mask.sum())
        self._forms: dict = {}

    def __len__(self) -> int:
        return len(self.mask)

    def form(self, key: object, make: Callable[[], T]) -> T:
        """The form ``key`` of these rows, ``make()`` on first use."""
        if key not in self._forms:
            self._forms[key] = make()
        return self._forms[key]

    def on(self, device: torch.device) -> torch.Tensor:
        """bool [rows] on ``device``."""
        return self.form(("tensor", str(device)), lambda: torch.from_numpy(self.mask).to(device))

    def selector(self):
        """FAISS's selector of the allowed rows (:func:`row_selector`)."""
        return self.form("selector", lambda: row_selector(self.mask))

    def rows(self, device: torch.device) -> torch.Tensor:
        """int64 [count] on ``device``: the allowed rows, ascending."""
        return self.form(("rows", str(device)), lambda: torch.from_numpy(np.flatnonzero(self.mask)).to(device))

    def packed(self) -> tuple[int, bytes]:
        """(rows, the mask packed one bit a row): what crosses a process boundary (:meth:`unpack`)."""
        return self.form("packed", lambda: (len(self.mask), np.packbits(self.mask, bitorder="little").tobytes()))

    @classmethod
    def unpack(cls, packed: tuple[int, bytes]) -> "AllowedRows":
        """The rows of :meth:`packed`'s output."""
        rows, bits = packed
        return cls(np.unpackbits(np.frombuffer(bits, dtype=np.uint8), count=rows, bitorder="little").astype(bool))


def matching_rows(store: StoredIndex, filter: Filter) -> AllowedRows:
    """The live rows of ``store`` that ``filter`` matches."""
    mask = filter.rows(store)
    if mask.shape != (store.num_docs,):
        raise ValueError(f"a filter resolved to {mask.shape} rows; the index has {store.num_docs}")
    return AllowedRows(mask & store.live)
