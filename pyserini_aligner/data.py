"""Corpora, queries and qrels: ir_datasets IDs (``beir/scifact/test``) or a local BEIR folder.

:func:`load_topics` and :func:`read_qrels` are the one entry point from a spec to queries and judgements for every
command (search, adapt, the evaluation harness). A spec is tried as, in order: an existing file (parsed by
:mod:`pyserini_aligner.topics`); an existing BEIR folder (``corpus.jsonl``, ``queries.jsonl``,
``qrels/<split>.tsv``); a missing file (a name with a file suffix, or an absolute/``./`` path: "does not exist");
an ir_datasets id (``beir/scifact/test``); for topics, finally a Pyserini topics name (``msmarco-passage-dev``).

The ``<name>.zip`` BEIR files of a local folder are linked into ir_datasets' cache layout
(``$IR_DATASETS_HOME/beir/<name>/source.zip``; ``IR_DATASETS_HOME`` defaults to ir_datasets' own ``~/.ir_datasets``)
before loading, so that nothing is downloaded. The folder is ``$PYSERINI_ALIGNER_BEIR_DIR``, else ``shared/data/beir``
beside a clone of this project when it holds zips (where the Makefile looks, so a command runs the same inside and
outside ``make``). Without either, ir_datasets' own download path is used unchanged.
"""
from __future__ import annotations

import fcntl
import json
import logging
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from pyserini_aligner.textio import InputError, json_records, text_lines
from pyserini_aligner.topics import FILE_SUFFIXES, Qrels, Topics, check_qid, read_qrels_file, read_topics_file

BEIR_DIR_ENV = "PYSERINI_ALIGNER_BEIR_DIR"
DOCSTORE_LOCK = ".aligner-docstore.lock"  # in the ir_datasets home: held while a document store is opened or built
log = logging.getLogger(__name__)


class DataError(ValueError):
    """Bad or missing input data; the message names the dataset, file or line."""


@dataclass(frozen=True)
class Doc:
    docid: str
    title: str
    text: str
    fields: dict = field(default_factory=dict, compare=False, repr=False)  # stored with an index: all but id and text

    @property
    def contents(self) -> str:
        """Title and body, as Pyserini's BEIR ``contents`` field."""
        return f"{self.title} {self.text}".strip() if self.title else self.text


def ir_datasets_home() -> Path:
    return Path(os.environ.get("IR_DATASETS_HOME", Path.home() / ".ir_datasets"))


def find_beir_dir() -> str | None:
    """The folder of BEIR zips: ``$PYSERINI_ALIGNER_BEIR_DIR`` if set, else ``../shared/data/beir`` from the root of
    the clone this package runs from when it holds a ``.zip`` (the Makefile's default), else None."""
    if os.environ.get(BEIR_DIR_ENV):
        return os.environ[BEIR_DIR_ENV]
    beside = Path(__file__).resolve().parents[2] / "shared" / "data" / "beir"
    return str(beside) if any(beside.glob("*.zip")) else None


def link_beir_sources(beir_dir: str | os.PathLike | None = None) -> list[str]:
    """Link every ``<beir_dir>/<name>.zip`` (default: :func:`find_beir_dir`) to
    ``$IR_DATASETS_HOME/beir/<name>/source.zip``; returns the names."""
    beir_dir = beir_dir or find_beir_dir()
    if not beir_dir:
        return []
    source = Path(beir_dir)
    if not source.is_dir():
        raise DataError(f"{BEIR_DIR_ENV}={beir_dir!r} is not a folder")
    names = []
    for archive in sorted(source.glob("*.zip")):
        target = ir_datasets_home() / "beir" / archive.stem / "source.zip"
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():  # absent, or a dangling link left from another copy of the data
            # made under a name of this process's own and renamed over the target, so that processes linking the
            # same home at once (pytest workers, torchrun ranks) each end with the one link, none with an error
            fresh = target.with_name(f".{target.name}.{os.getpid()}")
            fresh.unlink(missing_ok=True)
            fresh.symlink_to(archive.resolve())
            os.replace(fresh, target)
        names.append(archive.stem)
    return names


def quiet_ir_datasets() -> None:
    """Keep ir_datasets' per-step INFO lines ("[starting] opening zip file") out of the console."""
    from ir_datasets import log as irds_log

    if getattr(irds_log.Logger, "_pyserini_aligner_quiet", False):
        return
    make_logger = irds_log.Logger.logger

    def logger(self):
        made = make_logger(self)
        made.setLevel(max(made.level, logging.WARNING))
        return made

    irds_log.Logger.logger = logger
    irds_log.Logger._pyserini_aligner_quiet = True


def _open_ir_dataset(dataset_id: str):
    linked = link_beir_sources()
    import ir_datasets

    quiet_ir_datasets()

    try:
        dataset = ir_datasets.load(dataset_id)
    except KeyError as error:
        raise DataError(f"unknown dataset ID {dataset_id!r}: ir_datasets has no such dataset "
                        "(BEIR ids look like 'beir/scifact/test' or 'beir/nfcorpus/dev')") from error
    parts = dataset_id.split("/")
    beir_dir = find_beir_dir()
    if parts[0] == "beir" and len(parts) > 1 and beir_dir and parts[1] not in linked:
        raise DataError(f"data file missing for {dataset_id!r}: expected "
                        f"{Path(beir_dir) / (parts[1] + '.zip')} ({BEIR_DIR_ENV})")
    return dataset


@contextmanager
def _downloads(dataset_id: str) -> Iterator[None]:
    """Turn a failed download of a BEIR dataset (no local zip) into a DataError naming the variable to set."""
    try:
        yield
    except OSError as error:
        parts = dataset_id.split("/")
        if parts[0] != "beir" or len(parts) < 2 or (ir_datasets_home() / "beir" / parts[1] / "source.zip").exists():
            raise
        first = (str(error).splitlines() or [type(error).__name__])[0]
        raise DataError(f"{dataset_id!r}: no local copy and the download failed ({first}); put {parts[1]}.zip in a "
                        f"folder and set {BEIR_DIR_ENV} to it (or IR_DATASETS_HOME to an ir_datasets cache that "
                        "holds it)") from None


def is_beir_folder(path: str | os.PathLike) -> bool:
    """True for a folder in BEIR's layout: ``corpus.jsonl`` plus ``queries.jsonl`` or a ``qrels/`` folder."""
    path = Path(path)
    return (path / "corpus.jsonl").is_file() and ((path / "queries.jsonl").is_file() or (path / "qrels").is_dir())


def _read_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    if not path.is_file():
        raise DataError(f"data file missing: {path}")
    return json_records(text_lines(path), path, error=DataError)


def _field(record: dict, name: str, path: Path, number: int) -> str:
    if name not in record:
        raise DataError(f"{path}, line {number}: missing field {name!r}")
    return str(record[name])


def build_docstore(dataset) -> None:
    """Build the document store of ir_datasets ``dataset`` (if it has one that is built on first use) under a lock
    that every process of this package takes: ir_datasets counts a store as built as soon as its first documents are
    written, so a process reading while another builds the same store reads a half-written file.

    The store is also opened under the lock: opening it runs ir_datasets' version check, which removes a store whose
    version file is missing or not yet written, that is, one another process is building."""
    if not hasattr(dataset, "docs_store"):
        return
    import ir_datasets

    lock = Path(ir_datasets.util.home_path()) / DOCSTORE_LOCK
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
        store = dataset.docs_store()
        if hasattr(store, "build"):
            store.build()


class Dataset:
    """One test collection: ``docs()``, ``queries()`` and ``qrels()``, from ir_datasets or a BEIR folder.

    ``spec`` is an ir_datasets ID (``beir/scifact/test``) or a folder with ``corpus.jsonl``,
    ``queries.jsonl`` and ``qrels/<split>.tsv`` (``split`` defaults to test).
    """

    def __init__(self, spec: str, split: str = "test") -> None:
        self.spec = spec
        self.folder = Path(spec) if Path(spec).is_dir() else None
        self.split = split
        self._ir = None if self.folder else _open_ir_dataset(spec)

    @property
    def name(self) -> str:
        return f"{self.folder.name}/{self.split}" if self.folder else self.spec

    def docs(self) -> Iterator[Doc]:
        """Every document; raises DataError for an empty corpus."""
        count = 0
        if self.folder:
            path = self.folder / "corpus.jsonl"
            for number, record in _read_jsonl(path):
                count += 1
                yield Doc(_field(record, "_id", path, number), str(record.get("title") or ""),
                          _field(record, "text", path, number), _beir_fields(record))
        else:
            if not self._ir.has_docs():
                raise DataError(f"{self.spec!r} has no documents")
            with _downloads(self.spec):
                build_docstore(self._ir)
                for doc in self._ir.docs_iter():
                    count += 1
                    yield Doc(doc.doc_id, getattr(doc, "title", "") or "", doc.text,
                              {key: _json_value(value) for key, value in doc._asdict().items()
                               if key not in ("doc_id", "text")})
        if count == 0:
            raise DataError(f"empty corpus: {self.folder / 'corpus.jsonl' if self.folder else self.spec}")

    def queries(self) -> dict[str, str]:
        """Query id → text (only queries that have qrels in this split, for a BEIR folder)."""
        if self.folder:
            path = self.folder / "queries.jsonl"
            wanted = self.qrels()
            queries, lines = {}, {}
            for number, record in _read_jsonl(path):
                qid = check_qid(_field(record, "_id", path, number), f"{path}, line {number}")
                if qid in lines:
                    raise DataError(f"{path}, line {number}: query id {qid!r} already given on line {lines[qid]}")
                lines[qid] = number
                if qid in wanted:
                    queries[qid] = _field(record, "text", path, number)
            return queries
        if not self._ir.has_queries():
            raise DataError(f"{self.spec!r} has no queries (name a split, e.g. {self.spec}/test)")
        with _downloads(self.spec):
            return {check_qid(query.query_id, f"{self.spec}, query {number}"): query.text
                    for number, query in enumerate(self._ir.queries_iter(), 1)}

    def qrels(self) -> dict[str, dict[str, int]]:
        """Query id → {docid: relevance}."""
        qrels: dict[str, dict[str, int]] = {}
        if self.folder:
            path = self.folder / "qrels" / f"{self.split}.tsv"
            if not path.is_file():
                raise DataError(f"data file missing: {path}")
            return read_qrels_file(path, beir=True)
        if not self._ir.has_qrels():
            raise DataError(f"{self.spec!r} has no qrels (name a split, e.g. {self.spec}/test)")
        with _downloads(self.spec):
            for qrel in self._ir.qrels_iter():
                qrels.setdefault(qrel.query_id, {})[qrel.doc_id] = int(qrel.relevance)
        return qrels


def _beir_fields(record: dict) -> dict:
    """The fields of a BEIR ``corpus.jsonl`` record besides ``_id`` and ``text``, with the entries of its
    ``metadata`` object as fields of their own (``url``), as ir_datasets gives the same corpus's documents; a
    ``metadata`` whose names clash with the others (or with ``id``, ``contents``) is kept whole as one field."""
    fields = {key: value for key, value in record.items() if key not in ("_id", "text", "metadata")}
    metadata = record.get("metadata")
    if isinstance(metadata, dict) and not set(metadata) & (set(fields) | {"_id", "text", "id", "contents"}):
        fields.update(metadata)
    elif "metadata" in record:
        fields["metadata"] = metadata
    return fields


def _json_value(value):
    """An ir_datasets document field as a JSON value: named tuples as objects, sequences as arrays, text as is,
    anything else (dates, enums) as its string; NaN and infinities as null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if hasattr(value, "_asdict"):
        return {key: _json_value(item) for key, item in value._asdict().items()}
    if isinstance(value, dict):
        return {str(key): _json_value(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(item) for item in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def iter_corpus(spec: str) -> Iterator[tuple[str, str]]:
    """(docid, contents) for every document of a dataset ID or BEIR folder."""
    for doc in Dataset(spec).docs():
        yield doc.docid, doc.contents


def write_json_collection(docs: Iterator[Doc], folder: str | os.PathLike) -> int:
    """Write ``docs`` as a Pyserini JsonCollection (``docs.jsonl`` with ``id`` and ``contents``); returns the count."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    count = 0
    with (folder / "docs.jsonl").open("w", encoding="utf-8") as out:
        for doc in docs:
            out.write(json.dumps({"id": doc.docid, "contents": doc.contents}, ensure_ascii=False) + "\n")
            count += 1
    return count


def looks_like_path(spec: str) -> bool:
    """True for a spec meant as a file: a file suffix, an absolute path or one starting with . or ~."""
    path = Path(spec)
    return path.suffix.lower() in FILE_SUFFIXES or path.is_absolute() or spec.startswith((".", "~"))


def load_topics(spec: str | os.PathLike, split: str = "test") -> Topics:
    """qid → text from a topics file, a BEIR folder (its ``split``'s judged queries), an ir_datasets id or a
    Pyserini topics name. A missing file raises FileNotFoundError ("topics file ... does not exist")."""
    spec = str(spec)
    path = Path(spec).expanduser()
    if path.is_file():
        return read_topics_file(path)
    if path.is_dir():
        if not is_beir_folder(path):
            raise InputError(f"topics {spec} is a folder but not a BEIR folder (corpus.jsonl, queries.jsonl, "
                             "qrels/<split>.tsv); pass a topics file, a BEIR folder or a dataset id")
        return Dataset(str(path), split=split).queries()
    if looks_like_path(spec):
        raise FileNotFoundError(f"topics file {spec} does not exist")
    if "/" in spec:
        return Dataset(spec).queries()
    from pyserini.query_iterator import TopicsFormat, get_query_iterator

    try:
        iterator = get_query_iterator(spec, TopicsFormat.DEFAULT)
    except (ValueError, FileNotFoundError):
        raise InputError(f"topics {spec!r}: no such file, and not an ir_datasets id (e.g. beir/scifact/test) "
                         "or a Pyserini topics name") from None
    return {check_qid(str(qid), f"topics {spec}, topic {number}"): text
            for number, (qid, text) in enumerate(iterator, 1)}


def read_qrels(spec: str | os.PathLike, split: str = "test") -> Qrels:
    """qid → {docid: relevance} from a qrels file (TREC or BEIR TSV), a BEIR folder (``qrels/<split>.tsv``) or an
    ir_datasets id (``beir/scifact/train``). A missing file raises FileNotFoundError."""
    spec = str(spec)
    path = Path(spec).expanduser()
    if path.is_file():
        return read_qrels_file(path)
    if path.is_dir():
        if not is_beir_folder(path):
            raise InputError(f"qrels {spec} is a folder but not a BEIR folder (qrels/<split>.tsv)")
        return Dataset(str(path), split=split).qrels()
    if looks_like_path(spec) or "/" not in spec:
        raise FileNotFoundError(f"qrels file {spec} does not exist")
    return Dataset(spec).qrels()
