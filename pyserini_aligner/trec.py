"""TREC run files: ``qid Q0 docid rank score tag``, one hit a line."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from pyserini_aligner.textio import atomic_output

Run = dict[str, dict[str, float]]  # qid -> {docid: score}


def write_run(hits: Mapping[str, Sequence[tuple[str, float]]], path: str | os.PathLike, tag: str) -> Path:
    """Write ``qid -> [(docid, score), ...]`` (best first) as a TREC run.

    Written to a temporary file next to ``path`` and renamed into place, so that an error never leaves a partial
    run under ``path`` (nor a temporary file). OutputPathError when ``path`` can't be written.
    """
    with atomic_output(path) as out:
        for qid, ranked in hits.items():
            for rank, (docid, score) in enumerate(ranked, 1):
                out.write(f"{qid} Q0 {docid} {rank} {score:.6f} {tag}\n")
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


def ranked(run: Mapping[str, Mapping[str, float]], k: int | None = None) -> dict[str, list[tuple[str, float]]]:
    """``qid -> {docid: score}`` as ``qid -> [(docid, score)]`` best first (ties by docid), cut at ``k``."""
    return {qid: sorted(scores.items(), key=lambda item: (-item[1], item[0]))[:k] for qid, scores in run.items()}


def from_hits(results: Mapping[str, Iterable]) -> Run:
    """Pyserini hit lists (objects with ``docid`` and ``score``) as a run dict."""
    return {qid: {hit.docid: float(hit.score) for hit in hits} for qid, hits in results.items()}
