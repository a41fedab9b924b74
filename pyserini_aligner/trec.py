"""Run files: written by Pyserini's run writer (``pyserini.output_writer``), the one writer of this project, and
read back as ``qid -> {docid: score}``.

Formats (``OUTPUT_FORMATS``, Pyserini's ``--output-format``): ``trec`` (``qid Q0 docid rank score tag``) and
``msmarco`` (``qid<TAB>docid<TAB>rank``). With ``max_passage`` a hit's docid is cut at ``max_passage_delimiter``
and only the best passage of each document is kept, at most ``max_passage_hits`` per query (Pyserini's MaxP).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Mapping, NamedTuple, Sequence

from pyserini_aligner.textio import atomic_path

Run = dict[str, dict[str, float]]  # qid -> {docid: score}
OUTPUT_FORMATS = ("trec", "msmarco")


def check_run_ids(qid, docids: Sequence[str], path: str | os.PathLike) -> None:
    """ValueError naming the run file when a query id or docid would break its lines: empty, or holding spaces, tabs
    or line breaks (fields are separated by white space). Topics readers and the indexer refuse such ids first."""
    for kind, value in (("query id", str(qid)), *(("docid", str(docid)) for docid in docids)):
        if not value or any(c.isspace() for c in value):
            raise ValueError(f"run {path}: {kind} {value!r} of query {str(qid)!r} can't be written: ids must be "
                             "non-empty without spaces, tabs or line breaks (TREC runs separate fields by white "
                             "space)")


class Hit(NamedTuple):
    """What Pyserini's writers read from a hit."""

    docid: str
    score: float


def write_run(hits: Mapping[str, Sequence[tuple[str, float]]], path: str | os.PathLike, tag: str,
              output_format: str = "trec", max_passage: bool = False, max_passage_delimiter: str = "#",
              max_passage_hits: int = 100) -> Path:
    """Write ``qid -> [(docid, score), ...]`` (best first, every hit given) with Pyserini's run writer.

    Written to a temporary file next to ``path`` and renamed into place, so that an error never leaves a partial
    run under ``path`` (nor a temporary file). OutputPathError when ``path`` can't be written; ValueError for an
    ``output_format`` not in OUTPUT_FORMATS, or a query id or docid that would break a line (:func:`check_run_ids`;
    nothing is written).
    """
    if output_format not in OUTPUT_FORMATS:
        raise ValueError(f"output format must be one of {OUTPUT_FORMATS}, got {output_format!r}")
    for qid, ranked in hits.items():
        check_run_ids(qid, [docid for docid, _ in ranked], path)
    from pyserini.output_writer import OutputFormat, get_output_writer

    with atomic_path(path) as temporary:
        writer = get_output_writer(str(temporary), OutputFormat(output_format), "w", max_hits=sys.maxsize,
                                   tag=tag, use_max_passage=max_passage,
                                   max_passage_delimiter=max_passage_delimiter, max_passage_hits=max_passage_hits)
        with writer:
            for qid, ranked in hits.items():
                writer.write(qid, [Hit(docid, float(score)) for docid, score in ranked])
    return Path(path)


def read_run(path: str | os.PathLike) -> Run:
    """Read a TREC run into ``qid -> {docid: score}``; a malformed line raises ValueError naming file and line."""
    run: Run = {}
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            fields = line.split()
            if not fields:
                continue
            if len(fields) != 6:
                raise ValueError(f"{path}, line {number}: expected 'qid Q0 docid rank score tag'")
            try:
                score = float(fields[4])
            except ValueError:
                raise ValueError(f"{path}, line {number}: score {fields[4]!r} is not a number") from None
            run.setdefault(fields[0], {})[fields[2]] = score
    return run
