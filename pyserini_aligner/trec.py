"""Run files: written in the lines of Pyserini's run writers (``pyserini.output_writer``), by the one writer of
this project, and read back as ``qid -> {docid: score}``. Pyserini's writers are not imported: importing them
starts Pyserini's JVM and loads its encoders (seconds of start-up for a command that needs neither);
``tests/test_startup.py`` holds the lines to theirs, byte for byte.

Formats (``OUTPUT_FORMATS``, Pyserini's ``--output-format``): ``trec`` (``qid Q0 docid rank score tag``) and
``msmarco`` (``qid<TAB>docid<TAB>rank``). With ``max_passage`` a hit's docid is cut at ``max_passage_delimiter``
and only the best passage of each document is kept, at most ``max_passage_hits`` per query (Pyserini's MaxP).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Mapping, Sequence

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


def run_lines(qid: str, ranked: Sequence[tuple[str, float]], tag: str, output_format: str = "trec",
              max_passage: bool = False, max_passage_delimiter: str = "#",
              max_passage_hits: int = 100) -> Iterator[str]:
    """The lines Pyserini's writer of ``output_format`` writes for one query's hits (best first). With
    ``max_passage``, docids are cut at the delimiter and each document's first (best) passage is kept, at most
    ``max_passage_hits``; otherwise every hit, its docid stripped of surrounding white space."""
    seen: set[str] = set()
    rank = 1
    for docid, score in ranked:
        docid = docid.split(max_passage_delimiter)[0] if max_passage and max_passage_delimiter else docid.strip()
        if max_passage:
            if docid in seen:
                continue
            seen.add(docid)
        yield f"{qid} Q0 {docid} {rank} {float(score):.6f} {tag}\n" if output_format == "trec" else \
            f"{qid}\t{docid}\t{rank}\n"
        rank += 1
        if max_passage and rank > max_passage_hits:
            break


def write_run(hits: Mapping[str, Sequence[tuple[str, float]]], path: str | os.PathLike, tag: str,
              output_format: str = "trec", max_passage: bool = False, max_passage_delimiter: str = "#",
              max_passage_hits: int = 100) -> Path:
    """Write ``qid -> [(docid, score), ...]`` (best first, every hit given) as Pyserini's run writer does.

    Written to a temporary file next to ``path`` and renamed into place, so that an error never leaves a partial
    run under ``path`` (nor a temporary file). OutputPathError when ``path`` can't be written; ValueError for an
    ``output_format`` not in OUTPUT_FORMATS, or a query id or docid that would break a line (:func:`check_run_ids`;
    nothing is written).
    """
    if output_format not in OUTPUT_FORMATS:
        raise ValueError(f"output format must be one of {OUTPUT_FORMATS}, got {output_format!r}")
    for qid, ranked in hits.items():
        check_run_ids(qid, [docid for docid, _ in ranked], path)
    with atomic_path(path) as temporary:
        with open(temporary, "w", encoding="utf-8") as out:
            for qid, ranked in hits.items():
                out.writelines(run_lines(qid, ranked, tag, output_format, max_passage, max_passage_delimiter,
                                         max_passage_hits))
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
