"""On-disk cache of runs under the harness's work folder, keyed by everything that determines them.

A key holds the inputs (index manifest, searcher knobs, query texts) and :func:`code_version` (a hash of the scoring
code), so a change in either computes the run again instead of reusing a stale one.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from functools import lru_cache
from pathlib import Path
from typing import Callable

from pyserini_aligner.textio import atomic_output

log = logging.getLogger(__name__)

Hits = dict[str, list[tuple[str, float]]]
SCORING_MODULES = ("pyserini_aligner.model", "pyserini_aligner.alignment", "pyserini_aligner.strategy",
                   "pyserini_aligner.salience", "pyserini_aligner.kernels", "pyserini_aligner.index.codec",
                   "pyserini_aligner.index.reader",
                   "pyserini_aligner.search.searcher", "pyserini_aligner.search.options",
                   "pyserini_aligner.search.encoding", "pyserini_aligner.search.candidates",
                   "pyserini_aligner.search.codes", "pyserini_aligner.search.graphs", "pyserini_aligner.search.allowed",
                   "pyserini_aligner.search.exhaustive", "pyserini_aligner.search.flat",
                   "pyserini_aligner.search.rerank", "pyserini_aligner.search.backends.base",
                   "pyserini_aligner.search.backends.choose", "pyserini_aligner.search.backends.fronts",
                   "pyserini_aligner.search.backends.faiss_cpu", "pyserini_aligner.search.backends.torch_codes",
                   "pyserini_aligner.search.backends.tokens", "pyserini_aligner.search.backends.exchanged",
                   "pyserini_aligner.search.backends.workers", "pyserini_aligner.adapt.select")


@lru_cache(maxsize=None)
def code_version() -> str:
    """sha256 (16 hex digits) over the source of the modules that encode queries and score documents."""
    digest = hashlib.sha256()
    for name in SCORING_MODULES:
        digest.update(Path(importlib.util.find_spec(name).origin).read_bytes())
    return digest.hexdigest()[:16]


def key_hash(key: dict) -> str:
    """16 hex digits identifying ``key`` (JSON-serialisable) plus :func:`code_version`."""
    text = json.dumps({"key": key, "code": code_version()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def queries_hash(queries: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(queries, sort_keys=True).encode()).hexdigest()[:16]


def cache_path(folder: Path, label: str, key: dict) -> Path:
    """``<folder>/<label>-<key hash>.json``."""
    return Path(folder) / f"{label}-{key_hash(key)}.json"


def load_hits(path: Path) -> Hits:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return {qid: [(docid, float(score)) for docid, score in hits] for qid, hits in data.items()}


def save_hits(hits: Hits, path: Path) -> None:
    """Write ``hits`` as JSON (exact scores), atomically."""
    with atomic_output(path) as out:
        out.write(json.dumps({qid: [[d, float(s)] for d, s in h] for qid, h in hits.items()}))


def cached_hits(folder: Path, label: str, key: dict, compute: Callable[[], Hits]) -> Hits:
    """``compute()``, or the run saved by an earlier call with the same ``label`` and ``key``."""
    path = cache_path(folder, label, key)
    if path.is_file():
        log.info("reusing cached run %s", path)
        return load_hits(path)
    hits = compute()
    save_hits(hits, path)
    return hits
