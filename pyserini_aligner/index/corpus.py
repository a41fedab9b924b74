"""Corpus readers for indexing: Pyserini JsonCollection files/folders, a BEIR folder, or an ir_datasets id.

Each reader yields ``(docid, text, Location, fields)``; the location ("file, line N") is used in error messages, the
fields (a dict, empty when the document has none) are stored with the document (:mod:`.fields`): a JsonCollection
record's keys besides ``id`` and ``contents``, a BEIR ``corpus.jsonl`` record's besides ``_id`` and ``text`` (``title``,
and the entries of ``metadata`` as fields of their own, e.g. ``url``, as ir_datasets names them), an ir_datasets
document's besides ``doc_id`` and ``text``.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from itertools import islice
from typing import Iterable, Iterator, NamedTuple

from pyserini_aligner.index.fields import RESERVED, check_fields
from pyserini_aligner.textio import is_blank, json_records, text_lines


class Location(NamedTuple):
    """Where a document came from, for error messages: ``<source>, line 12`` or ``<source>, document 12``."""

    source: str
    number: int
    unit: str = "line"

    def __str__(self) -> str:
        return f"{self.source}, {self.unit} {self.number}"


CorpusItem = tuple[str, str, Location, dict]
JSON_SUFFIXES = (".jsonl", ".json")
BLANK_EXAMPLES = 5  # docids named in the warning about documents skipped for blank text
log = logging.getLogger(__name__)


class CorpusError(ValueError):
    """Bad corpus input; the message names the file and line."""


def _is_index_folder(folder: Path) -> bool:
    """A pyserini-aligner index, or the temporary folder of a build into one (``.<name>.building-*``)."""
    from pyserini_aligner.index.format import is_index

    return is_index(folder) or (folder.name.startswith(".") and ".building-" in folder.name)


def collection_files(path: Path, warn: bool = True) -> list[Path]:
    """The .jsonl/.json files of a JsonCollection: ``path`` itself, or those under the folder (sorted, recursive).

    An index of this package inside the folder (say an earlier ``--index`` put there) holds no documents: it is
    skipped (with a warning unless ``warn`` is False). A folder that is itself such an index is refused
    (CorpusError)."""
    if path.is_file():
        return [path]
    if _is_index_folder(path):
        raise CorpusError(f"corpus folder {path} is a pyserini-aligner index, not a JsonCollection; pass the folder "
                          "of the documents' .jsonl/.json files")
    files = []
    for folder, subfolders, names in os.walk(path, followlinks=True):
        for name in sorted(subfolders):
            if _is_index_folder(Path(folder, name)):
                if warn:
                    log.warning("corpus folder %s: skipping %s, a pyserini-aligner index (not documents)", path,
                                Path(folder, name))
                subfolders.remove(name)
        files += [Path(folder, name) for name in names
                  if Path(name).suffix in JSON_SUFFIXES and Path(folder, name).is_file()]
    files.sort()
    if not files:
        raise CorpusError(f"no .jsonl or .json files in the corpus folder {path}")
    return files


def _doc_from_record(record, where: Location) -> tuple[str, str, dict]:
    """(docid, contents, the other fields) of a JsonCollection record."""
    if not isinstance(record, dict):
        raise CorpusError(f"{where}: expected a JSON object with fields 'id' and 'contents'")
    for field in ("id", "contents"):
        if field not in record:
            raise CorpusError(f"{where}: missing field {field!r}")
    docid, contents = record["id"], record["contents"]
    if isinstance(docid, bool) or not isinstance(docid, (str, int)):
        raise CorpusError(f"{where}: field 'id' must be a string, got {type(docid).__name__}")
    if not isinstance(contents, str):
        raise CorpusError(f"{where}: field 'contents' must be a string, got {type(contents).__name__}")
    return str(docid), contents, {key: value for key, value in record.items() if key not in RESERVED}


def _read_file(path: Path) -> Iterator[CorpusItem]:
    source = str(path)
    with path.open("rb") as handle:
        head = handle.read(1 << 12).lstrip()
    if path.suffix == ".json" and head.startswith(b"["):  # a JSON array of documents
        try:
            records = json.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError:
            for _ in text_lines(path):  # raises InputError naming the line
                pass
            raise
        except json.JSONDecodeError as err:
            raise CorpusError(f"{path}, line {err.lineno}: not valid JSON ({err.msg})") from None
        if not isinstance(records, list):
            raise CorpusError(f"{path}: expected a JSON array of documents")
        for position, record in enumerate(records, 1):
            where = Location(source, position, "document")
            docid, contents, fields = _doc_from_record(record, where)
            yield docid, contents, where, fields
        return
    for number, record in json_records(text_lines(path), source, error=CorpusError):
        where = Location(source, number)
        docid, contents, fields = _doc_from_record(record, where)
        yield docid, contents, where, fields


def read_json_collection(path: str | os.PathLike) -> Iterator[CorpusItem]:
    """Documents of a JsonCollection (fields ``id`` and ``contents``, any others stored with the document);
    CorpusError when it holds none."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"corpus not found: {path}")
    count = 0
    for file in collection_files(path):
        for item in _read_file(file):
            count += 1
            yield item
    if count == 0:
        raise CorpusError(f"empty corpus: no documents in {path}")


def read_corpus(spec: str | os.PathLike) -> Iterator[CorpusItem]:
    """A BEIR folder (``corpus.jsonl`` with ``_id``, ``title``, ``text``; contents = title + text, as Pyserini's BEIR
    indexes), else a JsonCollection file/folder when ``spec`` exists on disk, else an ir_datasets id
    (e.g. ``beir/scifact``)."""
    from pyserini_aligner.data import Dataset, is_beir_folder

    path = Path(spec)
    if path.is_dir() and is_beir_folder(path):
        source = str(path / "corpus.jsonl")
    elif path.exists() or path.suffix in JSON_SUFFIXES or path.is_absolute() or str(spec).startswith("."):
        yield from read_json_collection(path)
        return
    else:
        source = str(spec)
    for position, doc in enumerate(Dataset(str(spec)).docs(), 1):
        yield doc.docid, doc.contents, Location(source, position, "document"), doc.fields


def _count_file(path: Path) -> int | None:
    """Documents in one collection file: the records of a .json array (None when it does not parse), else the
    non-blank lines."""
    with path.open("rb") as handle:
        if path.suffix == ".json" and handle.read(1 << 12).lstrip().startswith(b"["):
            try:
                records = json.loads(path.read_bytes())
            except ValueError:  # the reader reports it with its line
                return None
            return len(records) if isinstance(records, list) else None
        handle.seek(0)
        return sum(1 for line in handle if line.strip())


def count_corpus(spec: str | os.PathLike) -> int | None:
    """Number of documents in a corpus, for a progress bar's total (a pass over the files: non-blank JSON lines, the
    records of .json arrays; an ir_datasets id's count), or None when it can't be told."""
    from pyserini_aligner.data import is_beir_folder

    path = Path(spec)
    if path.exists():
        files = [path / "corpus.jsonl"] if is_beir_folder(path) else collection_files(path, warn=False)
        counts = [_count_file(f) for f in files]
        return None if None in counts else sum(counts)
    try:
        from pyserini_aligner.data import _open_ir_dataset

        return int(_open_ir_dataset(str(spec)).docs_count())
    except Exception:  # an id ir_datasets cannot count (or open) here: no total, the reader reports the error
        return None


class DocidRegistry:
    """Refuses duplicate or malformed docids; remembers where each docid was first seen, compactly, and counts the
    documents skipped for blank text (``blank``, the first few in ``blank_docids``)."""

    def __init__(self, existing: Iterable[str] = ()):
        self.first: dict[str, int] = {docid: -1 for docid in existing}
        self.sources: list[str] = []
        self._source_ids: dict[str, int] = {}
        self.blank = 0
        self.blank_docids: list[str] = []

    def _pack(self, where: Location) -> int:
        source, number, unit = where
        key = f"{unit}\0{source}"
        if key not in self._source_ids:
            self._source_ids[key] = len(self.sources)
            self.sources.append(key)
        return (self._source_ids[key] << 40) | number

    def _unpack(self, packed: int) -> str:
        if packed < 0:
            return "the index"
        unit, source = self.sources[packed >> 40].split("\0", 1)
        return str(Location(source, packed & ((1 << 40) - 1), unit))

    def add(self, docid, where: Location) -> None:
        if not isinstance(docid, str) or not docid or any(c.isspace() for c in docid):
            raise ValueError(f"{where}: docid {docid!r} must be a non-empty string without spaces, tabs or line "
                             "breaks (TREC runs separate fields by white space)")
        packed = self._pack(where)
        first = self.first.setdefault(docid, packed)
        if first != packed:
            raise ValueError(f"duplicate docid {docid!r}: first at {self._unpack(first)}, again at {where}")


def _unpack_item(item, position: int) -> tuple:
    """(docid, text, Location, fields) of a corpus item: a JsonCollection record (a dict with ``id``, ``contents``
    and any other fields), or a tuple (docid, text), (docid, text, Location), (docid, text, fields) or
    (docid, text, Location, fields)."""
    if isinstance(item, dict):
        where = Location("corpus", position, "document")
        docid, text, fields = _doc_from_record(item, where)
        return docid, text, where, check_fields(fields, where)
    if not isinstance(item, (tuple, list)) or len(item) not in (2, 3, 4):
        raise ValueError(f"corpus item {position}: expected (docid, text[, Location][, fields]) or a dict with 'id' "
                         f"and 'contents', got {item!r:.80}")
    rest = list(item[2:])
    where = rest.pop(0) if rest and not isinstance(rest[0], dict) else Location("corpus", position, "document")
    if not isinstance(where, Location):
        raise TypeError(f"corpus item {position}: location must be a Location, got {type(where).__name__}")
    fields = rest.pop(0) if rest else {}
    if rest:
        raise ValueError(f"corpus item {position}: expected (docid, text[, Location][, fields]), got {item!r:.80}")
    return item[0], item[1], where, check_fields(fields, where)


def checked_items(corpus: Iterable, max_docs: int | None, docids: DocidRegistry) -> Iterator[tuple[str, str, dict]]:
    """(docid, text, fields) from the items :func:`_unpack_item` reads (fields {} when an item has none); refuses
    duplicate or malformed docids and fields that are not JSON.

    A document whose text is blank (no letter or digit: empty, white space, NUL, zero-width or other invisible
    characters, punctuation or symbols only; :func:`~pyserini_aligner.textio.is_blank`) has nothing to index: it is
    skipped, counted in ``docids.blank`` and named in one warning at the end."""
    for position, item in enumerate(islice(corpus, max_docs), 1):
        docid, text, where, fields = _unpack_item(item, position)
        docids.add(docid, where)
        if not isinstance(text, str):
            raise ValueError(f"{where}: text of docid {docid!r} must be a string, got {type(text).__name__}")
        if is_blank(text):
            docids.blank += 1
            if len(docids.blank_docids) < BLANK_EXAMPLES:
                docids.blank_docids.append(docid)
            continue
        yield docid, text, fields
    if docids.blank:
        log.warning("skipped %d document(s) with no text (no letter or digit: empty, white space, punctuation or "
                    "invisible characters only), not indexed: %s%s", docids.blank, ", ".join(docids.blank_docids),
                    ", ..." if docids.blank > len(docids.blank_docids) else "")
