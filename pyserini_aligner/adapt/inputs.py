"""Labelled queries for adaptation: topics and qrels from files or ir_datasets ids."""
from __future__ import annotations

import random
from pathlib import Path

Qrels = dict[str, dict[str, int]]


def read_qrels(spec: str) -> Qrels:
    """qid → {docid: relevance} from a TREC qrels file (``qid 0 docid rel``), a BEIR qrels TSV
    (``query-id<TAB>corpus-id<TAB>score``, header optional) or an ir_datasets id (``beir/scifact/train``)."""
    path = Path(spec)
    if not path.is_file():
        if path.exists() or "/" not in spec or path.is_absolute() or spec.startswith("."):
            raise FileNotFoundError(f"qrels file not found: {spec}")
        from pyserini_aligner.data import Dataset

        return Dataset(spec).qrels()
    qrels: Qrels = {}
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            fields = line.split()
            if not fields or (number == 1 and fields[0] == "query-id"):
                continue
            if len(fields) not in (3, 4) or not fields[-1].lstrip("-").isdigit():
                raise ValueError(f"{path}, line {number}: expected 'qid 0 docid relevance' (TREC) or "
                                 "'query-id<TAB>corpus-id<TAB>score' (BEIR)")
            qrels.setdefault(fields[0], {})[fields[-2]] = int(fields[-1])
    if not qrels:
        raise ValueError(f"{path}: no judgements")
    return qrels


def read_topics(spec: str) -> dict[str, str]:
    """qid → text from a Pyserini topics file (TSV ``qid<TAB>text``, JSONL) or an ir_datasets id."""
    from pyserini_aligner.search.__main__ import load_topics

    if Path(spec).exists() and not Path(spec).is_file():
        raise ValueError(f"topics must be a file or an ir_datasets id, got the folder {spec}")
    return load_topics(spec)


def labelled_topics(topics: dict[str, str], qrels: Qrels, sample: int | None = None,
                    seed: int = 0) -> dict[str, str]:
    """The topics that have at least one positive judgement, optionally a random ``sample`` of them (``seed``)."""
    labelled = {q: t for q, t in topics.items() if any(rel > 0 for rel in qrels.get(q, {}).values())}
    if not labelled:
        raise ValueError(f"none of the {len(topics)} topics has a positive judgement in the qrels "
                         "(do the query ids match?)")
    if sample is not None:
        if sample < 1:
            raise ValueError(f"sample must be >= 1, got {sample}")
        if sample < len(labelled):
            picked = random.Random(seed).sample(sorted(labelled), sample)
            labelled = {q: labelled[q] for q in sorted(picked)}
    return labelled
