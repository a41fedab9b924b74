"""A synthetic MS MARCO-like corpus grown from a BEIR zip (SciFact), generated deterministically and streamed.

The corpus of size N is the first N items of one fixed sequence, so smaller corpora are prefixes of larger ones:

1. the original documents with their docids, those judged in the split's qrels first (in qrels order, so any
   size keeps the judged documents of the first queries), then the others in corpus order;
2. ``p0, p1, ...``: passages of 1 to 4 consecutive body sentences of one document (a regex sentence split), every
   such span at most once, in a seeded random order; span lengths are drawn with SPAN_WEIGHTS, which puts the mean
   near 45 words (about 70 wordpieces);
3. past the distinct spans, passages joining words of two documents (a run of words from one, then from another,
   starting at sentence boundaries), with lengths drawn from the spans' own length distribution, so passages are
   rarely identical even at millions.

Only the source's sentences are kept in memory (a few MB for SciFact); passages are produced one at a time.
"""
from __future__ import annotations

import math
import re
import zipfile
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Iterator

import numpy as np

from pyserini_aligner.textio import InputError, decoded_lines, json_records
from pyserini_aligner.topics import parse_qrels

SPAN_WEIGHTS = {1: 0.35, 2: 0.40, 3: 0.17, 4: 0.08}  # share of passages made of L consecutive sentences
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9(\[])")
_JOIN_BLOCK = 4096  # joined passages drawn per block of random numbers (the sequence does not depend on N)


class CorpusError(InputError):
    """A BEIR zip that cannot be read; the message names the member and line."""


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text``: split after . ! or ? followed by white space and an upper-case letter, digit or
    bracket."""
    return [s for s in (part.strip() for part in _SENTENCE_END.split(text.strip())) if s]


def _member(archive: zipfile.ZipFile, path: Path, suffix: str) -> str:
    names = [n for n in archive.namelist() if n == suffix or n.endswith("/" + suffix)]
    if not names:
        raise CorpusError(f"{path}: no {suffix} inside the zip (not a BEIR dataset zip?)")
    return min(names, key=len)


def _jsonl(archive: zipfile.ZipFile, path: Path, name: str, fields: tuple[str, ...]) -> Iterator[dict]:
    source = f"{path}:{name}"
    with archive.open(name) as lines:
        for number, row in json_records(decoded_lines(lines, source), source, error=CorpusError):
            missing = [f for f in fields if not isinstance(row.get(f), str)]
            if missing:
                raise CorpusError(f"{source}, line {number}: missing string field(s) {missing}")
            yield row


@dataclass
class BeirSource:
    """What a BEIR zip gives the benchmark: documents, the split's judged queries and their qrels."""

    docs: list[tuple[str, str]]  # (docid, contents) with contents = "title text" as Pyserini's BEIR collections
    bodies: list[str]  # body text of each document (no title), the source of the synthetic passages
    queries: dict[str, str] = field(default_factory=dict)  # qid -> text, judged queries in qrels order
    qrels: dict[str, dict[str, int]] = field(default_factory=dict)  # qid -> {docid: relevance}


def read_beir_zip(path: str | Path, split: str = "test") -> BeirSource:
    """Read ``corpus.jsonl``, ``queries.jsonl`` and ``qrels/<split>.tsv`` straight from a BEIR zip."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"BEIR zip not found: {path}")
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise CorpusError(f"{path}: not a zip file") from None
    with archive:
        docs, bodies = [], []
        for row in _jsonl(archive, path, _member(archive, path, "corpus.jsonl"), ("_id", "text")):
            title = row.get("title") or ""
            docs.append((row["_id"], f"{title} {row['text']}".strip() if title else row["text"]))
            bodies.append(row["text"])
        texts = {row["_id"]: row["text"]
                 for row in _jsonl(archive, path, _member(archive, path, "queries.jsonl"), ("_id", "text"))}
        name = _member(archive, path, f"qrels/{split}.tsv")
        with archive.open(name) as lines:
            qrels = parse_qrels(decoded_lines(lines, f"{path}:{name}"), f"{path}:{name}", beir=True)
    missing = [qid for qid in qrels if qid not in texts]
    if missing:
        raise CorpusError(f"{path}: {len(missing)} judged queries of {split} have no text in queries.jsonl, "
                          f"e.g. {missing[0]!r}")
    if not docs:
        raise CorpusError(f"{path}: corpus.jsonl has no documents")
    return BeirSource(docs, bodies, {qid: texts[qid] for qid in qrels}, qrels)


class SyntheticCorpus:
    """The deterministic passage sequence of the module docstring, over a :class:`BeirSource`."""

    def __init__(self, source: BeirSource, seed: int = 0):
        self.source, self.seed = source, seed
        judged = dict.fromkeys(d for rels in source.qrels.values() for d in rels)
        ids = [docid for docid, _ in source.docs]
        known = set(ids)
        position = {docid: i for i, docid in enumerate(ids)}
        first = [position[d] for d in judged if d in known]
        chosen = set(first)
        self.original_order = first + [i for i in range(len(ids)) if i not in chosen]
        self.sentences = [split_sentences(body) for body in source.bodies]
        self.words: list[list[str]] = []  # every body word of each document
        self.sentence_starts: list[list[int]] = []  # index in words of each sentence's first word, then the end
        for sentences in self.sentences:
            lengths = [len(s.split()) for s in sentences]
            self.words.append(" ".join(sentences).split())
            self.sentence_starts.append(np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).tolist())
        self.spans = self._distinct_spans(np.random.default_rng([seed, 0]))
        if not len(self.spans):
            raise CorpusError(f"no document body has {max(SPAN_WEIGHTS)} or more sentences: cannot grow passages "
                              "from this corpus")
        self.span_words = np.array([self.sentence_starts[d][s + n] - self.sentence_starts[d][s]
                                    for d, s, n in self.spans], dtype=np.int64)

    def _distinct_spans(self, rng: np.random.Generator) -> np.ndarray:
        """(doc, first sentence, sentences) of every passage of phase 2, shuffled: [D, 3] int64."""
        pools = {n: np.array([(d, s, n) for d, sentences in enumerate(self.sentences)
                              for s in range(len(sentences) - n + 1)], dtype=np.int64).reshape(-1, 3)
                 for n in SPAN_WEIGHTS}
        total = min(len(pools[n]) / weight for n, weight in SPAN_WEIGHTS.items())
        chosen = [pools[n][rng.permutation(len(pools[n]))[:int(weight * total)]]
                  for n, weight in SPAN_WEIGHTS.items()]
        spans = np.concatenate(chosen)
        return spans[rng.permutation(len(spans))]

    @property
    def num_originals(self) -> int:
        return len(self.source.docs)

    @property
    def num_spans(self) -> int:
        """How many passages come from distinct single-document spans (phase 2)."""
        return len(self.spans)

    def __iter__(self) -> Iterator[tuple[str, str]]:
        """(docid, text) forever: originals, spans, then joined passages."""
        for i in self.original_order:
            yield self.source.docs[i]
        for number, (d, s, n) in enumerate(self.spans):
            yield f"p{number}", " ".join(self.sentences[d][s:s + n])
        yield from self._joined(len(self.spans))

    def passages(self, n: int) -> Iterator[tuple[str, str]]:
        """The first ``n`` (docid, text) of the sequence."""
        if n < 1:
            raise ValueError(f"corpus size must be >= 1, got {n}")
        return islice(iter(self), n)

    def passages_between(self, start: int, stop: int) -> Iterator[tuple[str, str]]:
        """Items ``start`` .. ``stop - 1`` of the sequence (``islice(iter(self), start, stop)``), without making the
        passages before ``start``, so that parts of a large corpus can be written at once."""
        originals, spans = self.num_originals, self.num_spans
        for i in range(start, min(stop, originals)):
            yield self.source.docs[self.original_order[i]]
        for number in range(max(start, originals) - originals, min(stop, originals + spans) - originals):
            d, s, n = self.spans[number]
            yield f"p{number}", " ".join(self.sentences[d][s:s + n])
        first = max(start, originals + spans)
        if stop > first:
            yield from islice(self._joined(spans, skip=first - originals - spans), stop - first)

    def _run_of_words(self, doc: int, sentence: int, count: int) -> list[str]:
        """``count`` words of ``doc`` from the start of ``sentence`` on (starting earlier when the document ends
        first)."""
        words = self.words[doc]
        start = max(0, min(self.sentence_starts[doc][sentence], len(words) - count))
        return words[start:start + count]

    def _joined(self, first_number: int, skip: int = 0) -> Iterator[tuple[str, str]]:
        """The joined passages from number ``first_number`` on, less the first ``skip`` (whose random draws are made
        but whose texts are not)."""
        rng = np.random.default_rng([self.seed, 1])
        counts = np.array([len(s) for s in self.sentences])
        usable = np.flatnonzero(counts > 0)
        number = first_number
        while True:
            length = self.span_words[rng.integers(0, len(self.span_words), _JOIN_BLOCK)]
            docs = usable[rng.integers(0, len(usable), (_JOIN_BLOCK, 2))]
            starts = (rng.random((_JOIN_BLOCK, 2)) * counts[docs]).astype(np.int64)
            share = rng.uniform(0.25, 0.75, _JOIN_BLOCK)
            passed, skip = min(skip, _JOIN_BLOCK), skip - min(skip, _JOIN_BLOCK)
            number += passed
            for i in range(passed, _JOIN_BLOCK):
                total = max(int(length[i]), 2)
                head = min(max(int(round(total * share[i])), 1), total - 1)
                words = (self._run_of_words(docs[i, 0], starts[i, 0], head)
                         + self._run_of_words(docs[i, 1], starts[i, 1], total - head))
                yield f"p{number}", " ".join(words)
                number += 1


def parse_size(text: str) -> int:
    """A corpus size such as "300", "5k", "100k", "1m" or "8.8m" as a number of passages."""
    value = text.strip().lower()
    scale = {"k": 1_000, "m": 1_000_000}.get(value[-1:], 1)
    digits = value[:-1] if scale > 1 else value
    try:
        number = float(digits) * scale
    except ValueError:
        raise ValueError(f"size {text!r}: expected a number with an optional k or m suffix, e.g. 5k, 1m, 8.8m") \
            from None
    if not math.isfinite(number) or number < 1 or number != int(number):
        raise ValueError(f"size {text!r}: must be a whole number of passages >= 1")
    return int(number)


def size_label(n: int) -> str:
    """5000 -> "5k", 1000000 -> "1m", 8800000 -> "8.8m", 300 -> "300"."""
    for scale, suffix in ((1_000_000, "m"), (1_000, "k")):
        if n >= scale and (n * 10) % scale == 0:
            return f"{n / scale:g}{suffix}"
    return str(n)
