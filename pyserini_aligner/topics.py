"""Topics (qid → query text) and qrels (qid → {docid: relevance}) files: the one parser of their formats.

Topics: TSV ``qid<TAB>text`` or JSONL (other suffixes through Pyserini). Qrels: TREC (``qid iteration docid
relevance``) or BEIR TSV (``query-id<TAB>corpus-id<TAB>score``). Every error names the file and line. Resolving a
spec that may also be a BEIR folder, an ir_datasets id or a Pyserini topics name is
:func:`pyserini_aligner.data.load_topics` / :func:`pyserini_aligner.data.read_qrels`, built on these.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from pyserini_aligner.textio import InputError, json_records, text_lines

Topics = dict[str, str]
Qrels = dict[str, dict[str, int]]
TSV_SUFFIXES = (".tsv", ".txt")
JSONL_SUFFIXES = (".jsonl",)
FILE_SUFFIXES = TSV_SUFFIXES + JSONL_SUFFIXES + (".json", ".trec", ".gz", ".qrels")
QID_FIELDS = ("qid", "_id", "id")
TEXT_FIELDS = ("query", "text", "title")
BEIR_QRELS_HEADER = ["query-id", "corpus-id", "score"]


def check_qid(qid: str, where: str) -> str:
    """``qid`` when a TREC run can hold it: InputError naming ``where`` (file and line) for an empty query id or one
    with spaces, tabs or line breaks (as docids: TREC runs separate fields by white space)."""
    if not qid or any(c.isspace() for c in qid):
        raise InputError(f"{where}: query id {qid!r} must be a non-empty string without spaces, tabs or line breaks "
                         "(TREC runs separate fields by white space)")
    return qid


def check_tsv_qids(path: str | os.PathLike) -> None:
    """:func:`check_qid` on the query id (text before the first tab) of every line of a TSV topics file, for topics
    that Pyserini's own readers parse (they take such ids as they are, and a repeated id silently replaces the
    earlier query: refused here as :func:`read_topics_file` refuses it); lines without a tab are left to them."""
    lines: dict[str, int] = {}
    for number, line in text_lines(path):
        if "\t" in line:
            _note_line(lines, check_qid(line.split("\t", 1)[0].strip(), f"{path}, line {number}"), path, number)


def _note_line(lines: dict[str, int], qid: str, path, number: int) -> None:
    """Record that ``qid`` is given on line ``number``; InputError naming both lines when it was given before."""
    if qid in lines:
        raise InputError(f"{path}, line {number}: query id {qid!r} already given on line {lines[qid]}")
    lines[qid] = number


def _add(topics: Topics, lines: dict[str, int], qid: str, text: str, path, number: int) -> None:
    _note_line(lines, check_qid(qid, f"{path}, line {number}"), path, number)
    topics[qid] = text


def read_topics_file(path: str | os.PathLike) -> Topics:
    """qid → text from a topics file: TSV/TXT ``qid<TAB>text`` or JSONL (``qid``/``_id``/``id`` and
    ``query``/``text``/``title``); other suffixes (.json, .trec, .gz) are read by Pyserini.

    As Pyserini's TSV topic reader, a TSV line keeps its second field: text after a second tab (extra columns)
    is ignored. A line without a tab, an empty query id or one holding white space (a TREC run could not hold it), a
    repeated query id or a byte that is not UTF-8 raises InputError naming the file and line(s). Blank lines are
    skipped.
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
        for number, record in json_records(text_lines(path), path):
            qid = next((record[f] for f in QID_FIELDS if f in record), None)
            text = next((record[f] for f in TEXT_FIELDS if f in record), None)
            if qid is None or not isinstance(text, str):
                raise InputError(f"{path}, line {number}: expected a JSON object with a query id "
                                 f"({'/'.join(QID_FIELDS)}) and a text ({'/'.join(TEXT_FIELDS)})")
            _add(topics, seen, str(qid), text, path, number)
    else:
        from pyserini.query_iterator import TopicsFormat, get_query_iterator

        topics = {check_qid(str(qid), f"{path}, topic {number}"): text
                  for number, (qid, text) in enumerate(get_query_iterator(str(path), TopicsFormat.DEFAULT), 1)}
    if not topics:
        raise InputError(f"{path}: no topics")
    return topics


def read_qrels_file(path: str | os.PathLike, beir: bool | None = None) -> Qrels:
    """qid → {docid: relevance} from a TREC qrels file (exactly 4 columns ``qid iteration docid relevance``) or a
    BEIR qrels TSV (``query-id<TAB>corpus-id<TAB>score``, told by its header line, or ``beir=True``).

    A line with the wrong number of columns, a relevance that is not an integer, a repeated (qid, docid) pair or
    a byte that is not UTF-8 raises InputError naming the file and line; so does a file without judgements.
    """
    return parse_qrels(text_lines(path), path, beir)


def parse_qrels(lines: Iterable[tuple[int, str]], source: str | os.PathLike, beir: bool | None = None) -> Qrels:
    """:func:`read_qrels_file` over ``(line number, line)`` pairs (e.g. :func:`~pyserini_aligner.textio.decoded_lines`
    of a zip member); errors name ``source``."""
    path = source
    qrels: Qrels = {}
    seen: dict[tuple[str, str], int] = {}
    for number, line in lines:
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
