"""Training bundle (one gzip JSON file) and the query batches drawn from it.

Bundle layout (written by ``python -m pyserini_aligner.train.prepare``)::

    {"format": "pyserini-aligner-train-bundle", "version": 1, "meta": {...},
     "corpora":    {name: {"docids": [...], "texts": [...]}},
     "train":      {name: [{"qid", "text", "positives": {docid: rel}, "negatives": [docid, ...]}]},
     "validation": {name: {"corpus": name, "queries": {qid: text}, "qrels": {qid: {docid: rel}}}},
     "train_corpus": {name: corpus}}   # optional: a train set's corpus when it is not the set's own name

``negatives`` are ranked (BM25 best first) and never contain a positive. A label-free (pseudo-query) row may add
``"drop": [start, end]``: its one positive is shown in training with the characters [start, end) of its text
removed (the span the pseudo-query was cut from). Only json/gzip/random are used here, so this module needs no
Pyserini or FAISS.
"""

from __future__ import annotations

import gzip
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

FORMAT = "pyserini-aligner-train-bundle"
VERSION = 1


@dataclass
class Corpus:
    name: str
    docids: list[str]
    texts: list[str]
    row: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.row = {docid: i for i, docid in enumerate(self.docids)}


@dataclass
class TrainQuery:
    corpus: str
    qid: str
    text: str
    positives: dict[str, int]  # docid -> relevance (> 0)
    negatives: list[str]  # ranked, no positives
    sample_from: list[str] | None = None  # positives drawn in training (None: all of them)
    source: str = ""  # the train set it comes from (default: its corpus)
    drop: tuple[int, int] | None = None  # characters of the positive's text hidden in training (pseudo-queries)

    def __post_init__(self) -> None:
        self.source = self.source or self.corpus


@dataclass
class ValidationSet:
    name: str
    corpus: str
    queries: dict[str, str]
    qrels: dict[str, dict[str, int]]


@dataclass
class Bundle:
    corpora: dict[str, Corpus]
    train: dict[str, list[TrainQuery]]
    validation: dict[str, ValidationSet]
    meta: dict


def write_bundle(bundle: dict, path: str | os.PathLike) -> Path:
    """Write a bundle dict (layout above, without format/version) as gzip JSON; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": FORMAT, "version": VERSION, **bundle}
    with gzip.open(path, "wt", encoding="utf-8", compresslevel=9) as out:
        json.dump(data, out, ensure_ascii=False, separators=(",", ":"))
    return path


def read_gzip_json(path: Path, what: str, form: str) -> dict:
    """The JSON object of the gzip file ``path`` whose "format" is ``form`` (ValueError naming the file and ``what``
    it should be otherwise)."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as lines:
            data = json.load(lines)
    except (OSError, json.JSONDecodeError, EOFError) as err:
        raise ValueError(f"{path}: not a gzip JSON {what} ({err})") from None
    if not isinstance(data, dict) or data.get("format") != form:
        raise ValueError(f"{path}: 'format' is not {form!r}")
    return data


def load_bundle(path: str | os.PathLike) -> Bundle:
    """Read and check a bundle; every problem raises ValueError naming the file and the key."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"training bundle not found: {path} (make it with python -m "
                                "pyserini_aligner.train.prepare --output <dir>)")
    data = read_gzip_json(path, "training bundle", FORMAT)
    if data.get("version") != VERSION:
        raise ValueError(f"{path}: 'version' {data.get('version')!r} is not supported (expected {VERSION})")

    def need(obj: dict, key: str, kind: type, where: str):
        if not isinstance(obj, dict) or key not in obj:
            raise ValueError(f"{path}: missing key '{where}{key}'")
        if not isinstance(obj[key], kind):
            raise ValueError(f"{path}: '{where}{key}' must be a {kind.__name__}")
        return obj[key]

    corpora = {}
    for name, corpus in need(data, "corpora", dict, "").items():
        docids, texts = need(corpus, "docids", list, f"corpora.{name}."), need(corpus, "texts", list, f"corpora.{name}.")
        if len(docids) != len(texts):
            raise ValueError(f"{path}: corpora.{name} has {len(docids)} docids but {len(texts)} texts")
        corpora[name] = Corpus(name, [str(d) for d in docids], texts)
    train = {}
    train_corpus = data.get("train_corpus", {})
    if not isinstance(train_corpus, dict):
        raise ValueError(f"{path}: 'train_corpus' must be a dict")
    for name, rows in need(data, "train", dict, "").items():
        cname = train_corpus.get(name, name)
        if cname not in corpora:
            raise ValueError(f"{path}: train.{name} has no corpus 'corpora.{cname}'")
        queries = []
        for i, row in enumerate(rows):
            where = f"train.{name}[{i}]."
            positives = need(row, "positives", dict, where)
            if not positives:
                raise ValueError(f"{path}: '{where}positives' is empty")
            unknown = [d for d in list(positives) + need(row, "negatives", list, where) if d not in corpora[cname].row]
            if unknown:
                raise ValueError(f"{path}: '{where}' names docids not in corpora.{cname}: {unknown[:3]}")
            drop = row.get("drop")
            if drop is not None:
                text = corpora[cname].texts[corpora[cname].row[next(iter(positives))]]
                if (len(positives) != 1 or not isinstance(drop, list) or len(drop) != 2
                        or not all(isinstance(v, int) for v in drop) or not 0 <= drop[0] < drop[1] <= len(text)):
                    raise ValueError(f"{path}: '{where}drop' must be [start, end] inside the text of the row's "
                                     "single positive")
                drop = (drop[0], drop[1])
            queries.append(TrainQuery(cname, str(need(row, "qid", str, where)), need(row, "text", str, where),
                                      {d: int(r) for d, r in positives.items()}, list(row["negatives"]),
                                      source=name, drop=drop))
        train[name] = queries
    validation = {}
    for name, vset in need(data, "validation", dict, "").items():
        corpus = need(vset, "corpus", str, f"validation.{name}.")
        if corpus not in corpora:
            raise ValueError(f"{path}: validation.{name}.corpus {corpus!r} is not in 'corpora'")
        validation[name] = ValidationSet(name, corpus, need(vset, "queries", dict, f"validation.{name}."),
                                         need(vset, "qrels", dict, f"validation.{name}."))
    return Bundle(corpora, train, validation, data.get("meta", {}))


def select(bundle: Bundle, train_sets: list[str], validation_sets: list[str], source: str = "config") -> Bundle:
    """The bundle restricted to the named sets; a name the bundle lacks raises ValueError naming the field."""
    for fname, names, have in (("train_sets", train_sets, bundle.train), ("validation_sets", validation_sets,
                                                                          bundle.validation)):
        missing = [n for n in names if n not in have]
        if missing:
            raise ValueError(f"{source}: field '{fname}' names {missing}, not in the bundle (has {sorted(have)})")
    return Bundle(bundle.corpora, {n: bundle.train[n] for n in train_sets},
                  {n: bundle.validation[n] for n in validation_sets}, bundle.meta)


@dataclass
class Batch:
    """One training step: queries, docs (positives first, then each query's negatives) and which docs count."""

    corpus: str
    queries: list[int]  # indices into BatchSampler.queries
    doc_rows: list[int]  # corpus rows: [B positives] + [B * n_neg negatives]
    allowed: list[list[bool]]  # [B][len(doc_rows)] doc j may be scored against query i (True for i's positive)


class BatchSampler:
    """Deterministic batches: epoch e's order and each batch's sampled docs depend only on (seed, e, index)."""

    def __init__(self, bundle: Bundle, batch_queries: int, negatives_per_query: int, negative_depth: int,
                 in_batch_negatives: bool, seed: int, negative_skip: int = 0, max_pseudo_queries: int = 0):
        self.corpora = bundle.corpora
        self.queries: list[TrainQuery] = [q for name in sorted(bundle.train) for q in bundle.train[name]]
        self.batch_queries, self.n_neg, self.depth = batch_queries, negatives_per_query, negative_depth
        self.in_batch, self.seed, self.skip = in_batch_negatives, seed, negative_skip
        self.max_pseudo_queries = max_pseudo_queries

    def epoch(self, epoch: int) -> list[list[int]]:
        """Query-index batches for ``epoch``: each train set shuffled (a label-free set, whose rows carry ``drop``
        spans, cut to ``max_pseudo_queries`` when > 0: a new sample each epoch) and cut apart (one set, so one
        corpus, per batch: in-batch negatives come from the same collection), then the batches shuffled together."""
        rng = random.Random(f"{self.seed}:epoch:{epoch}")
        batches = []
        for name in sorted({q.source for q in self.queries}):
            idx = [i for i, q in enumerate(self.queries) if q.source == name]
            rng.shuffle(idx)
            if self.max_pseudo_queries and self.queries[idx[0]].drop is not None:
                idx = idx[:self.max_pseudo_queries]
            size = min(self.batch_queries, len(idx))
            batches += [idx[s:s + size] for s in range(0, len(idx) - size + 1, size)]
        rng.shuffle(batches)
        return batches

    def batch(self, query_idx: list[int], epoch: int, number: int) -> Batch:
        """Sample one positive per query (weights 2^rel − 1) and ``negatives_per_query`` negatives from ranks
        [negative_skip, negative_depth) of its ranked list (topped up with random non-positive docs when short)."""
        rng = random.Random(f"{self.seed}:batch:{epoch}:{number}")
        queries = [self.queries[i] for i in query_idx]
        corpus = self.corpora[queries[0].corpus]
        positives, negatives = [], []
        for q in queries:
            docids = q.sample_from or sorted(q.positives)
            weights = [2.0 ** q.positives[d] - 1.0 for d in docids]
            positives.append(corpus.row[rng.choices(docids, weights=weights)[0]])
            pool = q.negatives[self.skip:self.depth]
            chosen = rng.sample(pool, min(self.n_neg, len(pool)))
            while len(chosen) < self.n_neg:
                docid = corpus.docids[rng.randrange(len(corpus.docids))]
                if docid not in q.positives and docid not in chosen:
                    chosen.append(docid)
            negatives.append([corpus.row[d] for d in chosen])
        doc_rows = positives + [r for negs in negatives for r in negs]
        allowed = []
        for i, q in enumerate(queries):
            own = {i} | {len(queries) + i * self.n_neg + j for j in range(self.n_neg)}
            allowed.append([j == i or ((self.in_batch or j in own) and corpus.docids[r] not in q.positives)
                            for j, r in enumerate(doc_rows)])
        return Batch(corpus.name, list(query_idx), doc_rows, allowed)
