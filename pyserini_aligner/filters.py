"""Which documents a search may return: a :class:`Filter`, by docids or by a predicate over the fields stored with
the index, parsed once at the edge (the CLIs' ``--filter``, the servers' requests) and resolved against one index
generation into a row mask (:meth:`Filter.rows`)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

ID_FIELD = "id"  # the field name of a document's docid


class FilterError(ValueError):
    """A malformed filter: the one-line message names the token, file or line."""


@dataclass(frozen=True)
class Filter:
    """Documents whose ``field`` is one of ``values`` (``field`` "id": the docids). Build one with
    :meth:`docids`, :meth:`values` or :meth:`from_file`."""

    field: str
    values: frozenset

    @classmethod
    def docids(cls, ids: Iterable[str]) -> "Filter":
        """The documents ``ids`` (a collection of docids; a single str is refused, never read as its characters)."""
        return cls.values(ID_FIELD, ids)

    @classmethod
    def values(cls, field: str, values: Iterable) -> "Filter":
        """The documents whose ``field`` is one of ``values``."""
        if isinstance(values, (str, bytes)):
            raise TypeError("filter values must be a collection of values, not a single string")
        return cls(field, frozenset(values))

    @classmethod
    def from_file(cls, path: str | os.PathLike, field: str = ID_FIELD) -> "Filter":
        """The documents whose ``field`` is one of the lines of the text file ``path`` (blank lines skipped)."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise FilterError(f"filter file not found: {path}") from None
        except UnicodeDecodeError as err:
            raise FilterError(f"{path}: not UTF-8 text (byte {err.start})") from None
        return cls.values(field, [line.strip() for line in text.splitlines() if line.strip()])

    def rows(self, store) -> np.ndarray:
        """bool [store.num_docs]: the rows of index generation ``store`` (a :class:`.index.reader.StoredIndex`)
        whose document matches, deleted rows included (a search also masks those)."""
        if self.field != ID_FIELD:
            raise FilterError(f"field {self.field!r}: this index stores no fields")
        wanted = self.values
        return np.fromiter((docid in wanted for docid in store.docids), dtype=bool, count=store.num_docs)
