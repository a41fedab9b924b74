"""A live index: add, delete, upsert and compact documents without rebuilding.

Every operation takes the index's write lock, writes new immutable files (a segment, tombstone files) and commits
them by swapping ``manifest.json`` (a new generation); readers keep their snapshot until they reopen. An operation
killed at any point leaves the previous generation intact; what it had written is removed at the next write.

- ``add`` encodes only the new documents, with the index's own model, pruning rule and codec (new tokens go to the
  existing centroids), into a new segment; a live docid is refused unless upserting.
- ``delete`` writes tombstones; deleted documents are never returned again.
- ``compact`` rewrites the live documents of every segment into one segment (codes copied, not re-encoded), or
  re-quantises them with a codec retrained on their decoded vectors (``retrain_codec``).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from pyserini_aligner.index import faults
from pyserini_aligner.index.builder import EncodedChunk, encode_chunks, train_codec
from pyserini_aligner.index.commit import IndexLock, commit, new_name, remove_unreferenced
from pyserini_aligner.index.corpus import DocidRegistry, checked_items
from pyserini_aligner.index.format import Manifest, read_manifest
from pyserini_aligner.index.options import DTYPES
from pyserini_aligner.index.reader import Segment, StoredIndex
from pyserini_aligner.index.segment import SegmentWriter, write_codec, write_files
from pyserini_aligner.resolve import check_index_model, load_model
from pyserini_aligner.textio import check_collection

log = logging.getLogger(__name__)


@dataclasses.dataclass
class DeleteReport:
    deleted: int
    unknown: list[str]


class AlignerIndex:
    """Updates of the index at ``index_dir``. encoder: None (the model recorded in the manifest) or a checkpoint
    folder / AlignerModel, which must be the index's model (same fingerprint). dtype: the precision added documents
    are encoded in (as :class:`~.options.BuildOptions` takes it)."""

    def __init__(self, index_dir: str | os.PathLike, encoder=None, device: str | None = None, batch_size: int = 32,
                 progress: bool = False, dtype: str = "auto"):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        self.compute = None if dtype == "auto" else dtype
        self.index_dir = Path(index_dir)
        read_manifest(self.index_dir)  # fail early on a missing or foreign folder
        self.encoder, self.device, self.batch_size, self.progress = encoder, device, batch_size, progress
        self._model = None

    def _model_for(self, manifest: Manifest):
        if self._model is None:
            encoder = self.encoder if self.encoder is not None else manifest.model_name
            if not encoder:
                raise ValueError(f"index {self.index_dir} records no model name; pass the encoder")
            self._model = check_index_model(load_model(encoder, self.device), manifest, self.index_dir)
        return self._model

    def _begin(self) -> tuple[Manifest, StoredIndex]:
        manifest = read_manifest(self.index_dir)
        remove_unreferenced(self.index_dir, manifest)
        return manifest, StoredIndex(self.index_dir)

    def add(self, docs: Iterable, upsert: bool = False) -> Manifest:
        """Encode ``docs`` into a new segment and commit it: (docid, text[, Location][, fields]) items or
        JsonCollection records (dicts with ``id``, ``contents`` and any other fields); fields are stored with their
        document.
        A docid already live is refused unless ``upsert``, which replaces that document. A document with blank text
        is skipped with a warning (upserted, its earlier version is deleted). ``docs`` must be a collection of
        items: a single str is refused (TypeError). Nothing to add or replace commits nothing."""
        check_collection(docs, "docs")
        with IndexLock(self.index_dir):
            manifest, current = self._begin()
            model = self._model_for(manifest)
            generation = manifest.generation + 1
            live = {d for row, d in enumerate(current.docids) if current.live[row]}
            registry = DocidRegistry(() if upsert else live)
            codec = current.codec.to(model.device) if manifest.codec.compressed else None
            writer = SegmentWriter(self.index_dir / new_name("seg", generation), manifest.dim,
                                   manifest.doc_prune, manifest.prune_redundancy, codec,
                                   manifest.index_type)
            try:
                for chunk in encode_chunks(model, checked_items(docs, None, registry), self.batch_size,
                                           manifest.doc_maxlen, compute=self.compute):
                    writer.add(chunk.docids, chunk.vectors, chunk.mask, chunk.salience, chunk.truncated,
                               chunk.fields)
                replaced = [d for d in registry.first if d in live] if upsert else []
                info = writer.finish() if writer.num_docs else None
                if info is None:
                    writer.abort()
                    if not replaced:  # nothing to commit: no new generation
                        return manifest
            except BaseException:
                writer.abort()
                raise
            if replaced:  # a document upserted with blank text is skipped: its earlier version goes all the same
                self._tombstone(manifest, current, replaced, generation)
            if info is not None:
                info.num_empty = registry.blank
                manifest.segments.append(info)
            manifest.generation = generation
            return commit(self.index_dir, manifest)

    def upsert(self, docs: Iterable) -> Manifest:
        """Add ``docs``, replacing the live documents with the same ids."""
        return self.add(docs, upsert=True)

    def delete(self, docids: Iterable[str], strict: bool = False) -> DeleteReport:
        """Tombstone the live documents ``docids``, a collection of docids (a single str is refused with TypeError,
        never read as its characters); unknown ids are reported (ValueError with ``strict``)."""
        check_collection(docids, "docids")
        with IndexLock(self.index_dir):
            manifest, current = self._begin()
            wanted = list(dict.fromkeys(docids))
            unknown = [d for d in wanted if current.row_of(d) is None]
            if unknown and strict:
                raise ValueError(f"{len(unknown)} docid(s) not in the index, e.g. {unknown[:3]}; nothing deleted")
            known = [d for d in wanted if current.row_of(d) is not None]
            if known:
                generation = manifest.generation + 1
                self._tombstone(manifest, current, known, generation)
                manifest.generation = generation
                commit(self.index_dir, manifest)
            return DeleteReport(len(known), unknown)

    def _tombstone(self, manifest: Manifest, current: StoredIndex, docids: list[str],
                   generation: int) -> None:
        """Write new tombstone files for the segments holding live ``docids`` and record them in ``manifest``."""
        rows = np.array([current.row_of(d) for d in docids], dtype=np.int64)
        seg_of = np.searchsorted(current.row_base, rows, side="right") - 1
        for number in np.unique(seg_of):
            seg, info = current.segments[number], manifest.segments[number]
            deleted = seg.deleted.copy()
            deleted[rows[seg_of == number] - current.row_base[number]] = True
            name = f"deletes-{generation:06d}.bits"
            info.files.pop(info.deletes, None)
            info.files.update(write_files(seg.folder, {name: np.packbits(deleted).tobytes()}))
            info.deletes, info.num_deleted = name, int(deleted.sum())
            faults.point("tombstone")

    def compact(self, retrain_codec: bool = False, seed: int = 0, train_size: int = 100_000) -> Manifest:
        """Rewrite the live documents of every segment, with their stored fields, into one segment (in row order);
        with ``retrain_codec`` (compressed
        indexes), re-quantise them with a codec trained on their decoded vectors. Reports the codec's reconstruction
        error on the live tokens before and after in the log and in the segment's ``build_stats``."""
        with IndexLock(self.index_dir):
            manifest, current = self._begin()
            for info in manifest.segments:
                if "reconstruction_mse" in info.build_stats:
                    log.info("segment %s: codec reconstruction error %.5f (mean squared, per token)", info.name,
                             info.build_stats["reconstruction_mse"])
            generation = manifest.generation + 1
            codec = current.codec
            new_codec, codec_dir, codec_files = codec, manifest.codec_dir, manifest.codec_files
            if retrain_codec:
                if not manifest.codec.compressed:
                    raise ValueError("retrain_codec needs a compressed index; an fp16 index has no codec")
                rows = np.flatnonzero(current.live)
                positions = current.token_layout(rows)[0]
                rng = np.random.default_rng(seed)
                sample = np.sort(rng.choice(len(positions), size=min(len(positions), max(train_size, 32 * len(
                    codec.centroids))), replace=False))
                vectors = current.token_vectors(positions[sample])
                mask = torch.ones(1, len(vectors), dtype=torch.bool)
                new_codec = train_codec(codec.spec, [EncodedChunk([], vectors[None], mask, mask.float(), 0, 0.0)],
                                        train_size, seed)
                codec_dir = new_name("codec", generation)
                codec_files = write_codec(self.index_dir / codec_dir, new_codec)
            writer = SegmentWriter(self.index_dir / new_name("seg", generation), manifest.dim,
                                   manifest.doc_prune, manifest.prune_redundancy, new_codec, manifest.index_type)
            truncated = empty = 0
            try:
                for number, seg in enumerate(current.segments):
                    local = np.flatnonzero(~seg.deleted)
                    for start in range(0, len(local), 1024):
                        part = local[start:start + 1024]
                        self._copy(writer, current, seg, number, part, codec, new_codec, retrain_codec)
                    info = manifest.segments[number]
                    if not info.num_deleted:
                        truncated, empty = truncated + info.num_truncated, empty + info.num_empty
                segment = writer.finish()
            except BaseException:
                writer.abort()
                raise
            segment.num_truncated, segment.num_empty = truncated, empty
            manifest.segments, manifest.generation = [segment], generation
            manifest.codec_dir, manifest.codec_files = codec_dir, codec_files
            return commit(self.index_dir, manifest)

    @staticmethod
    def _copy(writer: SegmentWriter, current: StoredIndex, seg: Segment, number: int, local: np.ndarray,
              codec, new_codec, retrain: bool) -> None:
        docids = [seg.docids[i] for i in local]
        fields = current.fields_of(current.row_base[number] + local) if seg.fields_path is not None else None
        starts, lengths = seg.offsets[local], seg.lengths[local]
        positions = np.repeat(starts, lengths) + (np.arange(int(lengths.sum()))
                                                  - np.repeat(np.cumsum(lengths) - lengths, lengths))
        kept = seg.kept[positions]
        if codec is None:
            writer.add_tokens(docids, lengths, np.asarray(seg.vectors[positions]), kept,
                              salience=np.asarray(seg.salience[positions]), fields=fields)
        elif not retrain:
            writer.add_tokens(docids, lengths, None, kept, codes=(np.asarray(seg.centroid_ids[positions]),
                                                                   np.asarray(seg.residuals[positions])),
                              fields=fields)
        else:
            decoded = codec.decode(seg.centroid_ids[positions], seg.residuals[positions])
            writer.add_tokens(docids, lengths, decoded.numpy(), kept, fields=fields)
