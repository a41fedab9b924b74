"""Sharded builds: which documents a shard takes, and merging shard indexes into one without re-encoding.

Shard ``i`` of ``N`` takes a contiguous slice of the corpus in Pyserini's convention (``pyserini.encode``): with
``n`` documents and ``s = n // N``, shard i holds documents ``[i·s, (i+1)·s)`` and the last shard also takes the
remainder. Merging the shards in shard order therefore gives the documents in corpus order, as one build would.

A merge reads only the inputs' manifests and docids: it checks that the inputs agree on everything that makes
their segments searchable together (model, dimension, codec and its files, pruning settings), then hard-links
(or, where the file system refuses, copies) each input's segment folders into a new index with one codec folder
and commits one manifest that lists all segments in input order.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from itertools import islice
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from tqdm.auto import tqdm

from pyserini_aligner.index.commit import new_name
from pyserini_aligner.index.format import Manifest
from pyserini_aligner.index.reader import StoredIndex

log = logging.getLogger(__name__)

# manifest fields every merged input must share (the codec's files are compared by CRC32 as well)
MERGE_FIELDS = ("model_fingerprint", "dim", "codec", "index_type", "doc_prune", "prune_redundancy", "doc_maxlen",
                "default_strategy")


def shard_range(num_docs: int, shard_id: int, shard_num: int) -> tuple[int, int]:
    """[start, end) document positions of shard ``shard_id`` of ``shard_num`` (Pyserini's convention)."""
    if shard_num < 1 or not 0 <= shard_id < shard_num:
        raise ValueError(f"--shard-id must be in [0, --shard-num) and --shard-num >= 1, got shard {shard_id} of "
                         f"{shard_num}")
    size = num_docs // shard_num
    start = shard_id * size
    return start, num_docs if shard_id == shard_num - 1 else start + size


def shard_items(items: Iterable, start: int, end: int) -> Iterator:
    """Items ``start`` .. ``end - 1`` of ``items`` (the corpus is read, not encoded, up to ``start``)."""
    return islice(items, start, end)


def shard_corpus(spec: str | os.PathLike, shard_id: int, shard_num: int, max_docs: int | None = None,
                 total: int | None = None) -> tuple[Iterator, int, int, int]:
    """(items, start, end, corpus size) of shard ``shard_id`` of ``shard_num`` of corpus ``spec`` (a JsonCollection
    or an ir_datasets id, read by :func:`.corpus.read_corpus`), over its first ``max_docs`` documents when given;
    ``total``: the corpus size when already known (else counted)."""
    from pyserini_aligner.index.corpus import read_corpus

    total = count_documents(spec) if total is None else total
    if max_docs is not None:
        total = min(total, max_docs)
    start, end = shard_range(total, shard_id, shard_num)
    return shard_items(read_corpus(spec), start, end), start, end, total


def count_documents(spec: str | os.PathLike) -> int:
    """Exact number of documents of a corpus (JSONL: non-blank lines; an ir_datasets id: its count; else a pass
    over the documents)."""
    from pyserini_aligner.index.corpus import count_corpus, read_corpus

    counted = count_corpus(spec)
    return counted if counted is not None else sum(1 for _ in read_corpus(spec))


def check_unique_docids(parts: Sequence[tuple[str, Sequence[str], Sequence[bool] | None]]) -> None:
    """ValueError naming the docid and both parts when a live docid occurs twice. parts: (name, docids, deleted
    flags or None) in order."""
    seen: dict[str, int] = {}
    for number, (name, docids, deleted) in enumerate(parts):
        for row, docid in enumerate(docids):
            if deleted is not None and deleted[row]:
                continue
            first = seen.setdefault(docid, number)
            if first != number:  # duplicates inside one part were refused when it was built
                raise ValueError(f"duplicate docid {docid!r}: in {parts[first][0]} and in {name}")


def _link_tree(source: Path, target: Path) -> int:
    """Hard-link the files of folder ``source`` into new folder ``target`` (copy where linking fails); returns
    the number of files copied instead of linked."""
    target.mkdir(parents=True, exist_ok=False)
    copied = 0
    for path in sorted(source.iterdir()):
        if not path.is_file():
            continue
        try:
            os.link(path, target / path.name)
        except OSError:
            shutil.copyfile(path, target / path.name)
            copied += 1
    return copied


def check_compatible(inputs: Sequence[Path], manifests: Sequence[Manifest]) -> None:
    """ValueError naming the input and the field where an input disagrees with the first one."""
    base = manifests[0]
    base_crcs = {name: record.get("crc32") for name, record in base.codec_files.items()}
    for path, manifest in zip(inputs[1:], manifests[1:]):
        for field in MERGE_FIELDS:
            if getattr(base, field) != getattr(manifest, field):
                raise ValueError(f"{path}: field '{field}' is {getattr(manifest, field)!r} but {inputs[0]} has "
                                 f"{getattr(base, field)!r}; only shards built alike can be merged")
        crcs = {name: record.get("crc32") for name, record in manifest.codec_files.items()}
        if crcs != base_crcs:
            raise ValueError(f"{path}: field 'codec_files' (CRC32 {crcs}) differs from {inputs[0]}'s; build every "
                             "shard with the same --codec-from")


def merge_indexes(inputs: Sequence[str | os.PathLike], index_dir: str | os.PathLike, overwrite: bool = False,
                  progress: bool = True) -> Manifest:
    """Merge the indexes ``inputs`` (shards of one corpus, in order) into a new index at ``index_dir`` without
    re-encoding; returns its manifest. Segment files are hard-linked (copied where the file system refuses), so
    the inputs may be deleted afterwards. ValueError naming the input and field when they are not compatible."""
    from pyserini_aligner.index.builder import write_index
    from pyserini_aligner.textio import check_collection

    check_collection(inputs, "inputs")
    if not inputs:
        raise ValueError("--inputs: give at least one index to merge")
    paths = [Path(p).absolute() for p in inputs]
    target = Path(index_dir).absolute()
    for path in paths:
        if target == path or target.is_relative_to(path) or path.is_relative_to(target):
            raise ValueError(f"--index {index_dir}: the merged index must be a new folder apart from the input "
                             f"{path}")
    if len(set(paths)) != len(paths):
        raise ValueError("--inputs: an index is named twice")
    stores = [StoredIndex(p) for p in paths]  # checks each manifest and the small files (docids included)
    manifests = [s.manifest for s in stores]
    check_compatible(paths, manifests)
    check_unique_docids([(str(p), s.docids, s.deleted) for p, s in zip(paths, stores)])
    corpora = {m.corpus for m in manifests}

    def write(root: Path, generation: int) -> Manifest:
        codec_dir, copied = None, 0
        if manifests[0].codec_dir:
            codec_dir = new_name("codec", generation)
            copied += _link_tree(paths[0] / manifests[0].codec_dir, root / codec_dir)
        segments = []
        todo = [(path, info) for path, m in zip(paths, manifests) for info in m.segments]
        for path, info in tqdm(todo, total=len(todo), unit="segment", desc="merge", disable=not progress):
            name = new_name("seg", generation)
            copied += _link_tree(path / info.name, root / name)
            segments.append(dataclasses.replace(info, name=name))
        if copied:
            log.info("%d file(s) copied: the file system refused hard links", copied)
        return dataclasses.replace(manifests[0], segments=segments, codec_dir=codec_dir, created="",
                                   corpus=corpora.pop() if len(corpora) == 1 else "")

    manifest = write_index(target, overwrite, None, write)
    log.info("merged %d index(es) into %s: %d documents in %d segments", len(paths), target, manifest.num_docs,
             len(manifest.segments))
    return manifest
