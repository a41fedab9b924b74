"""The fields stored with a segment's documents (``fields.sqlite``, layout in :mod:`.format`): checked at the corpus
(:func:`check_fields`), written when the segment finishes (:class:`FieldsWriter`) and read back by row
(:func:`read_records`) or as one column of typed values for filters (:func:`read_column`).

The file is a SQLite database (the standard library's ``sqlite3``) with one table ``fields(row INTEGER PRIMARY KEY,
doc TEXT)``: the JSON object of each segment row that has fields. Rows without fields have no entry. Written once,
it is opened read-only and immutable (``mode=ro&immutable=1``); its size and CRC32 are in the manifest like every
other file of the segment, so the commit protocol makes it appear with its segment or not at all.
"""
from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from pyserini_aligner.filters import BOOL, COMPOSITE, NULL, NUMBER, STRING
from pyserini_aligner.index.io import file_record

RESERVED = ("id", "contents")  # a JsonCollection record's docid and text: never stored as fields
_TYPES = {"true": BOOL, "false": BOOL, "integer": NUMBER, "real": NUMBER, "text": STRING, "object": COMPOSITE,
          "array": COMPOSITE}  # SQLite's json_type -> type code (anything else: NULL)
_TYPE_CASE = "CASE json_type(doc, ?1) " + " ".join(f"WHEN '{name}' THEN {code}" for name, code in _TYPES.items()) + \
    f" ELSE {NULL} END"
_BATCH = 4096  # rows inserted per executemany


def check_fields(fields, where) -> dict:
    """``fields`` (a mapping of string keys to JSON values) as a dict; ValueError naming ``where`` (the document's
    location) and the key when a key is reserved (``id``, ``contents``) or a value is not JSON (NaN, infinity, or
    a type JSON has no form for)."""
    if not isinstance(fields, Mapping):
        raise ValueError(f"{where}: fields must be a JSON object (a dict), got {type(fields).__name__}")
    for key, value in fields.items():
        if not isinstance(key, str):
            raise ValueError(f"{where}: field name {key!r} must be a string")
        if key in RESERVED:
            raise ValueError(f"{where}: field {key!r} is the document's {'docid' if key == 'id' else 'text'}, not a "
                             "stored field")
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}: field {key!r} is not a JSON value ({err})") from None
    return dict(fields)


class FieldsWriter:
    """Writes a segment's ``fields.sqlite`` row by row; :meth:`finish` makes it durable and returns its record."""

    def __init__(self, path: Path):
        self.path, self.names = path, set()
        self._pending: list[tuple[int, str]] = []
        self._db = sqlite3.connect(path, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=OFF")  # a new file in an uncommitted folder: no journal needed
        self._db.execute("PRAGMA synchronous=OFF")  # made durable by one fsync in finish()
        self._db.execute("BEGIN")
        self._db.execute("CREATE TABLE fields(row INTEGER PRIMARY KEY, doc TEXT NOT NULL)")

    def add(self, row: int, fields: Mapping) -> None:
        """Store the fields of segment row ``row`` (rows ascending)."""
        self._pending.append((row, json.dumps(fields, ensure_ascii=False, allow_nan=False)))
        self.names.update(fields)
        if len(self._pending) >= _BATCH:
            self._flush()

    def _flush(self) -> None:
        self._db.executemany("INSERT INTO fields(row, doc) VALUES (?, ?)", self._pending)
        self._pending = []

    def finish(self) -> dict:
        """Commit, close and fsync the file; returns its manifest record."""
        self._flush()
        self._db.execute("COMMIT")
        self._db.close()
        handle = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)
        return file_record(self.path)

    def abort(self) -> None:
        """Close without committing (the segment folder is removed by its writer)."""
        self._db.close()


def connect(path: Path) -> sqlite3.Connection:
    """A read-only connection to a committed ``fields.sqlite`` (immutable: no locks, no journal)."""
    return sqlite3.connect(f"{Path(path).absolute().as_uri()}?mode=ro&immutable=1", uri=True)


def read_records(path: Path, rows: Iterable[int]) -> dict[int, dict]:
    """{row: fields} of the segment rows ``rows`` that have fields."""
    db = connect(path)
    try:
        found = db.execute("SELECT row, doc FROM fields WHERE row IN (SELECT value FROM json_each(?))",
                           (json.dumps([int(r) for r in rows]),))
        return {row: json.loads(doc) for row, doc in found}
    finally:
        db.close()


def _json_path(keys: tuple[str, ...]) -> str | None:
    """SQLite's JSON path of nested ``keys`` (``$."a"."b"``), or None for a key SQLite cannot name (one holding a
    double quote, a backslash or a control character, which SQLite compares in their escaped JSON form)."""
    if not all(json.dumps(key, ensure_ascii=False)[1:-1] == key for key in keys):
        return None
    return "$" + "".join(f'."{key}"' for key in keys)


def read_column(path: Path | None, keys: tuple[str, ...], count: int) -> tuple[np.ndarray, np.ndarray]:
    """The value at nested ``keys`` of every row of a segment of ``count`` rows: (type codes uint8 [count]:
    :data:`.filters.NULL`, ``BOOL``, ``NUMBER``, ``STRING`` or ``COMPOSITE``; values object [count]: None, bool,
    int or float, str, or the JSON text of an object or array). Rows without fields, or without the key, are NULL
    (all of them when ``path`` is None)."""
    codes, values = np.zeros(count, dtype=np.uint8), np.full(count, None, dtype=object)
    if path is None:
        return codes, values
    db = connect(path)
    try:
        json_path = _json_path(keys)
        if json_path is not None:  # typed in SQLite: one pass of C over the documents
            found = db.execute(f"SELECT row, {_TYPE_CASE}, json_extract(doc, ?1) FROM fields",
                               (json_path,)).fetchall()
        else:
            found = [(row, *_descend(json.loads(doc), keys)) for row, doc in db.execute("SELECT row, doc FROM fields")]
    finally:
        db.close()
    if found:
        rows, types, extracted = zip(*found)
        rows = np.array(rows, dtype=np.int64)
        codes[rows] = np.array(types, dtype=np.uint8)
        values[rows] = np.array(extracted, dtype=object)
        booleans = rows[codes[rows] == BOOL]
        values[booleans] = values[booleans].astype(bool)  # SQLite gives JSON true / false as 1 / 0
    return codes, values


def _descend(record, keys: tuple[str, ...]) -> tuple[int, object]:
    """(type code, value as json_extract gives it) at nested ``keys`` of a parsed record."""
    for key in keys:
        if not isinstance(record, dict) or key not in record:
            return NULL, None
        record = record[key]
    if record is None:
        return NULL, None
    if isinstance(record, bool):
        return BOOL, int(record)
    if isinstance(record, (dict, list)):
        return COMPOSITE, json.dumps(record, ensure_ascii=False)
    return {str: STRING, int: NUMBER, float: NUMBER}[type(record)], record
