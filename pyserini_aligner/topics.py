"""Topics (qid → query text) and qrels (qid → {docid: relevance}) from files, BEIR folders or dataset ids.

The one reader of queries and judgements for every command (search, adapt, the evaluation harness). A spec is
tried as, in order: an existing file; an existing BEIR folder (``corpus.jsonl``, ``queries.jsonl``,
``qrels/<split>.tsv``); a missing file (a name with a file suffix, or an absolute/``./`` path: "does not exist");
an ir_datasets id (``beir/scifact/test``); for topics, finally a Pyserini topics name (``msmarco-passage-dev``).
Every error names the file and line.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from pyserini_aligner.textio import InputError, text_lines

Topics = dict[str, str]
Qrels = dict[str, dict[str, int]]
TSV_SUFFIXES = (".tsv", ".txt")
JSONL_SUFFIXES = (".jsonl",)
FILE_SUFFIXES = TSV_SUFFIXES + JSONL_SUFFIXES + (".json", ".trec", ".gz", ".qrels")
QID_FIELDS = ("qid", "_id", "id")
TEXT_FIELDS = ("query", "text", "title")
BEIR_QRELS_HEADER = ["query-id", "corpus-id", "score"]


def _looks_like_path(spec: str) -> bool:
    path = Path(spec)
    return path.suffix.lower() in FILE_SUFFIXES or path.is_absolute() or spec.startswith((".", "~"))


def _add(topics: Topics, lines: dict[str, int], qid: str, text: str, path, number: int) -> None:
    if qid in lines:
        raise InputError(f"{path}, line {number}: query id {qid!r} already given on line {lines[qid]}")
    lines[qid] = number
    topics[qid] = text


def read_topics_file(path: str | os.PathLike) -> Topics:
    """qid → text from a topics file: TSV/TXT ``qid<TAB>text`` or JSONL (``qid``/``_id``/``id`` and
    ``query``/``text``/``title``); other suffixes (.json, .trec, .gz) are read by Pyserini.

    As Pyserini's TSV topic reader, a TSV line keeps its second field: text after a second tab (extra columns)
    is ignored. A line without a tab, an empty query id, a repeated query id or a byte that is not UTF-8 raises
    InputError naming the file and line(s). Blank lines are skipped.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    topics: Topics = {}
    seen: dict[str, int] = {}
    if suffix in TSV_SUFFIXES:
        for number, line in text_lines(path):
            if not line.strip():
                continue
            fields = line.split("\t")
            if len(fields) < 2 or not fields[0].strip():
                raise InputError(f"{path}, line {number}: expected 'qid<TAB>query text'")
            _add(topics, seen, fields[0].strip(), fields[1].strip(), path, number)
    elif suffix in JSONL_SUFFIXES:
        for number, line in text_lines(path):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise InputError(f"{path}, line {number}: not valid JSON ({error.msg})") from None
            qid = next((record[f] for f in QID_FIELDS if isinstance(record, dict) and f in record), None)
            text = next((record[f] for f in TEXT_FIELDS if isinstance(record, dict) and f in record), None)
            if qid is None or not isinstance(text, str):
                raise InputError(f"{path}, line {number}: expected a JSON object with a query id "
                                 f"({'/'.join(QID_FIELDS)}) and a text ({'/'.join(TEXT_FIELDS)})")
            _add(topics, seen, str(qid), text, path, number)
    else:
        from pyserini.query_iterator import TopicsFormat, get_query_iterator

        topics = {str(qid): text for qid, text in get_query_iterator(str(path), TopicsFormat.DEFAULT)}
    if not topics:
        raise InputError(f"{path}: no topics")
    return topics


def load_topics(spec: str | os.PathLike, split: str = "test") -> Topics:
    """qid → text from a topics file, a BEIR folder (its ``split``'s judged queries), an ir_datasets id or a
    Pyserini topics name. A missing file raises FileNotFoundError ("topics file ... does not exist")."""
    from pyserini_aligner.data import Dataset, is_beir_folder

    spec = str(spec)
    path = Path(spec).expanduser()
    if path.is_file():
        return read_topics_file(path)
    if path.is_dir():
        if not is_beir_folder(path):
            raise InputError(f"topics {spec} is a folder but not a BEIR folder (corpus.jsonl, queries.jsonl, "
                             "qrels/<split>.tsv); pass a topics file, a BEIR folder or a dataset id")
        return Dataset(str(path), split=split).queries()
    if _looks_like_path(spec):
        raise FileNotFoundError(f"topics file {spec} does not exist")
    if "/" in spec:
        return Dataset(spec).queries()
    from pyserini.query_iterator import TopicsFormat, get_query_iterator

    try:
        iterator = get_query_iterator(spec, TopicsFormat.DEFAULT)
    except (ValueError, FileNotFoundError):
        raise InputError(f"topics {spec!r}: no such file, and not an ir_datasets id (e.g. beir/scifact/test) "
                         "or a Pyserini topics name") from None
    return {str(qid): text for qid, text in iterator}


def read_qrels_file(path: str | os.PathLike, beir: bool | None = None) -> Qrels:
    """qid → {docid: relevance} from a TREC qrels file (exactly 4 columns ``qid iteration docid relevance``) or a
    BEIR qrels TSV (``query-id<TAB>corpus-id<TAB>score``, told by its header line, or ``beir=True``).

    A line with the wrong number of columns, a relevance that is not an integer, a repeated (qid, docid) pair or
    a byte that is not UTF-8 raises InputError naming the file and line; so does a file without judgements.
    """
    qrels: Qrels = {}
    seen: dict[tuple[str, str], int] = {}
    for number, line in text_lines(path):
        if beir is None:
            beir = line.split("\t") == BEIR_QRELS_HEADER
        if not line.strip() or (beir and number == 1 and line.split("\t") == BEIR_QRELS_HEADER):
            continue
        if beir:
            fields = line.split("\t")
            if len(fields) != 3:
                raise InputError(f"{path}, line {number}: expected 'query-id<TAB>corpus-id<TAB>score' "
                                 f"(BEIR qrels, 3 columns), got {len(fields)} columns")
            qid, docid, relevance = fields
        else:
            fields = line.split()
            if len(fields) != 4:
                raise InputError(f"{path}, line {number}: expected 'qid iteration docid relevance' (TREC qrels, "
                                 f"4 columns), got {len(fields)} columns")
            qid, _, docid, relevance = fields
        if not relevance.strip().lstrip("-").isdigit():
            raise InputError(f"{path}, line {number}: relevance {relevance!r} is not an integer")
        if (qid, docid) in seen:
            raise InputError(f"{path}, line {number}: judgement of {docid!r} for query {qid!r} already given on "
                             f"line {seen[qid, docid]}")
        seen[qid, docid] = number
        qrels.setdefault(qid, {})[docid] = int(relevance)
    if not qrels:
        raise InputError(f"{path}: no judgements")
    return qrels


def read_qrels(spec: str | os.PathLike, split: str = "test") -> Qrels:
    """qid → {docid: relevance} from a qrels file (TREC or BEIR TSV), a BEIR folder (``qrels/<split>.tsv``) or an
    ir_datasets id (``beir/scifact/train``). A missing file raises FileNotFoundError."""
    from pyserini_aligner.data import Dataset, is_beir_folder

    spec = str(spec)
    path = Path(spec).expanduser()
    if path.is_file():
        return read_qrels_file(path)
    if path.is_dir():
        if not is_beir_folder(path):
            raise InputError(f"qrels {spec} is a folder but not a BEIR folder (qrels/<split>.tsv)")
        return Dataset(str(path), split=split).qrels()
    if _looks_like_path(spec) or "/" not in spec:
        raise FileNotFoundError(f"qrels file {spec} does not exist")
    return Dataset(spec).qrels()
